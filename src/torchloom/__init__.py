"""torchloom: run your own PyTorch training loop on one process, many processes, GPUs and nodes.

from torchloom import Loom
loom = Loom(accelerator="cpu", devices=2, strategy="fsdp2")
loom.launch()
"""

import logging as _logging

from torchloom._describe import describe
from torchloom.checkpointing.resume import latest_checkpoint, rotate_checkpoints
from torchloom.errors import (
    CheckpointError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigurationError,
    LaunchError,
    MisuseError,
    TorchloomError,
)
from torchloom.launcher import Elastic
from torchloom.loom import Loom
from torchloom.seed import seed_everything
from torchloom.throughput import ThroughputMonitor, measure_flops
from torchloom.wrappers import LoomDataLoader, LoomModule, LoomOptimizer, is_wrapped, unwrap

__version__ = "0.1.0"

# torchloom reports (sharding summaries) on its own logger; rank 0 only. Silence with
# logging.getLogger("torchloom").setLevel(logging.WARNING).
_log = _logging.getLogger("torchloom")
if not _log.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("[torchloom] %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(_logging.INFO)
    _log.propagate = False

__all__ = [
    "Loom",
    "Elastic",
    "latest_checkpoint",
    "rotate_checkpoints",
    "describe",
    "LoomModule",
    "LoomOptimizer",
    "LoomDataLoader",
    "seed_everything",
    "ThroughputMonitor",
    "measure_flops",
    "is_wrapped",
    "unwrap",
    "TorchloomError",
    "ConfigurationError",
    "MisuseError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "CollectiveMismatchError",
    "LaunchError",
    "__version__",
]
