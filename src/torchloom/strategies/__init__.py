"""Strategies, one file each. `torchloom.connector` turns `strategy=` strings into instances."""

from torchloom.strategies.base import Strategy
from torchloom.strategies.ddp import DDPStrategy
from torchloom.strategies.fsdp import FSDPStrategy
from torchloom.strategies.fsdp2 import FSDP2Strategy
from torchloom.strategies.model_parallel import ModelParallelStrategy
from torchloom.strategies.parallel import ParallelStrategy
from torchloom.strategies.pipeline import PipelineStrategy
from torchloom.strategies.single_device import SingleDeviceStrategy

__all__ = [
    "Strategy",
    "ParallelStrategy",
    "SingleDeviceStrategy",
    "DDPStrategy",
    "FSDPStrategy",
    "FSDP2Strategy",
    "ModelParallelStrategy",
    "PipelineStrategy",
]
