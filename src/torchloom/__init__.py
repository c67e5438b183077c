"""torchloom: run your own PyTorch training loop on one process, many processes, GPUs and nodes.

    from torchloom import Loom
    loom = Loom(accelerator="cpu", devices=2, strategy="fsdp2")
    loom.launch()
"""

from torchloom._describe import describe
from torchloom.errors import CheckpointError, ConfigurationError, LaunchError, MisuseError, TorchloomError
from torchloom.loom import Loom
from torchloom.seed import seed_everything
from torchloom.wrappers import LoomDataLoader, LoomModule, LoomOptimizer

__version__ = "0.1.0"

__all__ = [
    "Loom",
    "describe",
    "LoomModule",
    "LoomOptimizer",
    "LoomDataLoader",
    "seed_everything",
    "TorchloomError",
    "ConfigurationError",
    "MisuseError",
    "CheckpointError",
    "LaunchError",
    "__version__",
]
