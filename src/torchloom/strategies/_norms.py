"""Gradient norms and clipping over sharded gradients: pending partial sums reduced first, the global norm
combined over every shard group (replicated gradients counted once), and the local pieces scaled or clamped in
place."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

#: id(parameter) -> the groups over which its gradient is sharded, one per mesh dim; absent: replicated.
ShardGroups = dict[int, tuple[dist.ProcessGroup, ...]]


def reduce_pending_grads(optimizer: Optimizer) -> None:
    """Reduce every gradient that holds pending partial sums (a DTensor with a `Partial` placement), in place of
    the gradient. Tensor parallel leaves them where a replicated parameter meets sharded activations: the norm
    weights of a `SequenceParallel` plan each see one rank's share of the sequence, so their gradients are the
    sum over the tensor-parallel ranks of what each holds. A norm or a clamp of the local pieces is then wrong.
    The optimizer would reduce them itself (DTensor does, for every torch optimizer): reducing them here, once,
    to the parameter's own placements, gives it the same values."""
    from torch.distributed.tensor import DTensor, Replicate

    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if not isinstance(grad, DTensor) or not any(pl.is_partial() for pl in grad.placements):
                continue
            if (
                isinstance(p, DTensor)
                and p.device_mesh == grad.device_mesh
                and not any(pl.is_partial() for pl in p.placements)
            ):
                placements = p.placements  # e.g. a reduce-scatter straight into a sharded parameter's layout
            else:
                placements = tuple(Replicate() if pl.is_partial() else pl for pl in grad.placements)
            with torch.no_grad():
                p.grad = grad.redistribute(grad.device_mesh, placements)


def _split_groups(grad: Any) -> tuple[dist.ProcessGroup, ...]:
    """The groups of the mesh dims a DTensor gradient's local pieces are split over (anything but Replicate:
    Shard, and the _StridedShard that fully_shard puts over a tensor-parallel Shard), in mesh order."""
    mesh = grad.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(grad.placements) if not pl.is_replicate())


def as_shard_groups(groups: dict[int, Any]) -> ShardGroups:
    """A flavour's `_shard_groups` (a group or a tuple of groups per parameter) as one tuple per parameter: a
    gradient sharded over several mesh dims (tensor parallel inside FSDP2) has one group per dim, and its local
    norm summed over each in turn is summed over all the ranks that hold a piece of it."""
    return {pid: g if isinstance(g, tuple) else (g,) for pid, g in groups.items()}


def total_norm(
    groups: ShardGroups, optimizer: Optimizer, norm_type: float, device: torch.device
) -> torch.Tensor:
    """The norm of all gradients as if the model were not sharded: each sharded gradient's local pieces are
    combined over its shard group, and replicated gradients (the same on every rank) are counted once.

    Where a gradient's pieces meet is read from the gradient's own placements, which need not be its
    parameter's: tensor parallel leaves e.g. a Replicate gradient on an embedding sharded by rows. Pending
    partial sums must have been reduced (`reduce_pending_grads`)."""
    # Every rank must issue the same collectives in the same order, even where it holds no gradient: the
    # parameters' groups (the same on every rank) first, then any other group a gradient's placements name
    # (placements are the same on every rank: they come from the same program).
    order = {tuple(map(id, g)): g for g in groups.values()}  # first seen first, in parameter order
    # The local gradient pieces, by where their norms meet: each shard group, or None for the replicated.
    pieces: dict[tuple[int, ...] | None, list[torch.Tensor]] = {None: [], **{k: [] for k in order}}
    split: dict[tuple[int, Any], tuple[dist.ProcessGroup, ...]] = {}  # (mesh, placements) -> groups
    shard_groups: tuple[dist.ProcessGroup, ...] | None
    key: tuple[int, ...] | None
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if hasattr(p.grad, "to_local"):
                layout = (id(p.grad.device_mesh), p.grad.placements)
                if layout not in split:
                    split[layout] = _split_groups(p.grad)
                grad, shard_groups = p.grad.to_local(), split[layout]
            else:
                grad, shard_groups = p.grad, groups.get(id(p))
            if grad.numel() == 0:
                continue
            if shard_groups:
                key = tuple(map(id, shard_groups))
                if key not in order:
                    order[key] = shard_groups
                    pieces[key] = []
            else:
                key = None
            pieces[key].append(grad.detach())
    inf = math.isinf(norm_type)

    def contribution(tensors: list[torch.Tensor]) -> torch.Tensor:
        # torch's own fused per-tensor norms, as clip_grad_norm_ computes them; combined in float64.
        if not tensors:
            return torch.zeros((), dtype=torch.float64, device=device)
        norm = torch.nn.utils.get_total_norm(tensors, norm_type).to(device, torch.float64)
        return norm if inf else norm**norm_type

    total = contribution(pieces[None])  # replicated: the same on every rank, counted once
    for ids, shard_groups in order.items():
        value = contribution(pieces[ids])
        for g in shard_groups:
            dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=g)
        total = torch.maximum(total, value) if inf else total + value
    return (total if inf else total ** (1.0 / norm_type)).to(torch.float32)


def clip_to_norm(
    precision: Any,
    optimizer: Optimizer,
    grads: list[torch.Tensor],
    total: torch.Tensor,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> None:
    """Scale `grads` (their local pieces) so that their norm `total` (already combined over every rank that holds
    a piece) is at most `max_norm`, as `torch.nn.utils.clip_grads_with_norm_` does. A non-finite norm under
    loss scaling marks the step for the scaler to skip (`precision.skip_step_for_nonfinite_norm`); without one
    it raises where `error_if_nonfinite`. The norm is the same on every rank, so every rank takes the same
    branch."""
    if not torch.isfinite(total):
        if precision.skip_step_for_nonfinite_norm(optimizer):
            return  # fp16 overflow: the loss scaler skips this step on every rank
        if error_if_nonfinite:
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so "
                "they cannot be clipped. Pass error_if_nonfinite=False to clip anyway."
            )
    scale_grads(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


def scale_grads(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply the gradients' local pieces by `coef`: one fused multiply per device and dtype (what
    torch.nn.utils.clip_grads_with_norm_ does)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for (device, dtype), tensors in by_kind.items():
            torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))


def clamp_grads(optimizer: Optimizer, clip_val: float) -> None:
    """Clamp every gradient element to [-clip_val, clip_val], each rank its own local pieces."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    local.clamp_(min=-clip_val, max=clip_val)
