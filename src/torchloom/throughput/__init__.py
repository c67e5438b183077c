"""Throughput, FLOPs and MFU, with the names and metric keys of Fabric's `lightning.fabric.utilities.throughput`
(a Fabric script that uses them runs with only its import changed), plus model vs hardware FLOPs.

from torchloom.throughput import ThroughputMonitor, measure_flops, get_available_flops
"""

from torchloom.throughput.breakdown import BreakdownSummary, TimeBreakdown
from torchloom.throughput.flops import FlopCount, count_flops, get_available_flops, measure_flops
from torchloom.throughput.monitor import Throughput, ThroughputMonitor
from torchloom.throughput.profiler import StepProfiler, profile_steps

__all__ = [
    "Throughput",
    "ThroughputMonitor",
    "measure_flops",
    "get_available_flops",
    "count_flops",
    "FlopCount",
    "TimeBreakdown",
    "BreakdownSummary",
    "profile_steps",
    "StepProfiler",
]
