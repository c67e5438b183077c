"""`torchloom.describe(model)`: the sharding summary as a string, before or after setup."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from torchloom._layout import describe_layout
from torchloom.wrappers import LoomModule


def describe(model: nn.Module, world_size: int | None = None) -> str:
    """The FSDP units of `model` (path, parameter count), the parameters outside every unit (replicated on every
    rank), and the estimated per-rank memory for parameters, gradients and Adam state.

    Works on a plain model, on one sharded by hand, and on the module returned by `loom.setup_module`.
    `world_size` defaults to the current process group's size (1 without one).
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    # A set-up model's forward module includes a wrapped root, which the user's original module does not.
    module = model.forward_module if isinstance(model, LoomModule) else model
    return describe_layout(module, world_size)
