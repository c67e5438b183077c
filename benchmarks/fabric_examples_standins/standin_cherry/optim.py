"""`Distributed(params, opt, sync=1)`: rank 0's parameters broadcast by `sync_parameters()`, gradients averaged over
the ranks with torch.distributed before every `step()` (cherry's behaviour for sync=1)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def _world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("stand-in cherry.optim.Distributed: WORLD_SIZE > 1 but no process group is joined")
    return 1


class Distributed:
    def __init__(self, params: Any, opt: torch.optim.Optimizer, sync: int = 1) -> None:
        self.params = [p for p in params]
        self.opt = opt
        self.param_groups = opt.param_groups

    def sync_parameters(self, root: int = 0) -> None:
        if _world() > 1:
            for p in self.params:
                dist.broadcast(p.data, src=root)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        world = _world()
        if world > 1:
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad.data)
                    p.grad.data.div_(world)
        self.opt.step()
