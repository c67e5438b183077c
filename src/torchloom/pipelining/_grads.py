"""Gradients across a pipeline: the norm over every stage and shard, plain gradients averaged over the
data-parallel ranks, and the check that those are the same on every tensor-parallel rank."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer


def total_norm(
    optimizer: Optimizer, norm_type: float, device: torch.device, pp_group: dist.ProcessGroup
) -> torch.Tensor:
    """The norm over every stage and shard: each gradient's local piece combined over the mesh dims it is split
    on, plain (replicated) gradients once per stage, then the stages summed over the pipeline ranks."""
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    by_groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if hasattr(g, "to_local"):
                dims = [i for i, pl in enumerate(g.placements) if not pl.is_replicate()]
                key = tuple(g.device_mesh.get_group(i) for i in dims)
                by_groups.setdefault(key, []).append(g.to_local().detach())
            else:
                by_groups.setdefault((), []).append(g.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    # Every rank of a stage holds the same kinds of gradients, so the all-reduces pair up; sorted by the groups'
    # ranks for the same order on each rank.
    for key in sorted(by_groups, key=lambda k: [dist.get_process_group_ranks(g) for g in k]):
        tensors = [t for t in by_groups[key] if t.numel()]
        value = (
            torch.nn.utils.get_total_norm(tensors, norm_type).to(device, torch.float64)
            if tensors
            else torch.zeros((), dtype=torch.float64, device=device)
        )
        value = value if inf else value**norm_type
        for g in key:
            dist.all_reduce(value, op=op, group=g)
        total = torch.maximum(total, value) if inf else total + value
    dist.all_reduce(total, op=op, group=pp_group)
    return (total if inf else total ** (1.0 / norm_type)).to(torch.float32)


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
