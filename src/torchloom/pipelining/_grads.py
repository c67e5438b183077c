"""Gradients across a pipeline: plain gradients averaged over the data-parallel ranks, and the check that those
are the same on every tensor-parallel rank. (Their norm is `strategies._clipping`'s, as under every strategy.)"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def average(params: Sequence[nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """Average the gradients of `params` over `group` (a missing gradient counts as zeros, so every rank issues
    the same all-reduces). A frozen parameter (`requires_grad=False`) is left without a gradient, as DDP and one
    process leave it: a zero gradient would let the optimizer create state for it and weight decay move it. Every
    rank of the group holds the same model, so all skip the same ones."""
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(size)


def differing(
    named: Sequence[tuple[str, nn.Parameter]], group: dist.ProcessGroup, device: torch.device
) -> list[str]:
    """The names of the parameters whose gradients are not the same on every rank of `group` (compared by
    their sums, relative to their size)."""
    if not named:
        return []
    sums = torch.stack(
        [
            p.grad.detach().double().sum() if p.grad is not None else p.new_zeros((), dtype=torch.float64)
            for _, p in named
        ]
    ).to(device)
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    spread = ((high - low) / torch.maximum(high.abs(), low.abs()).clamp(min=1e-12)).tolist()
    return [name for (name, _), d in zip(named, spread, strict=True) if d > 1e-4]
