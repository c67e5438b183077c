"""Gradient norms and clipping, the one implementation every strategy calls (`Strategy.clip_gradients_norm` and
`clip_gradients_value`): the norm of all gradients as if the model were on one process, then the local pieces
scaled, or clamped by value.

What a strategy tells it (`NormGroups`): the groups over which a plain gradient is sharded (FSDP1's flat
parameters), and the groups whose ranks hold different parts of the model (the pipeline's stages). Everything
else is read from the gradients: a DTensor gradient's placements say over which mesh dims its local pieces are
split (`Shard`, and the `_StridedShard` that `fully_shard` puts over a tensor-parallel `Shard`) and which hold
pending partial sums (`Partial`, reduced first); a plain gradient outside every shard group is the same on every
rank that holds it (DDP's, or a leftover averaged by torchloom) and counts once.

The contract for copies of one parameter on several ranks (tied weights across pipeline stages, Megatron's way:
each end stage holds a copy, and their gradients are summed so the copies stay equal): a parameter carrying the
attribute `_torchloom_counted_elsewhere = True` holds a gradient already counted on another rank. The norm skips
it; scaling and clamping still apply to it, with the same factor, so the copies stay equal.

Every rank issues the same collectives in the same order, even one that holds no gradient: the groups come from
the strategy and from the optimizer's parameters (the same on every rank that shares a group), in parameter
order, and the groups across parts are always reduced."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from torchloom._layout import COUNTED_ELSEWHERE

#: id(parameter) -> the groups over which its gradient is sharded, one per mesh dim; absent: replicated.
ShardGroups = dict[int, tuple[dist.ProcessGroup, ...]]


@dataclass(frozen=True)
class NormGroups:
    """Where the pieces of the norm meet, beyond what the gradients' own placements say.

    Attributes:
        shards: id(parameter) -> the groups over which its plain gradient is sharded (FSDP1's flat parameters,
            `as_shard_groups`); DTensor gradients need no entry.
        across: groups whose ranks hold different parts of the model (the pipeline's stages): the norms of the
            parts are combined over each, after everything else.
    """

    shards: ShardGroups = field(default_factory=dict)
    across: tuple[dist.ProcessGroup, ...] = ()


def as_shard_groups(groups: dict[int, Any]) -> ShardGroups:
    """A flavour's `_shard_groups` (a group or a tuple of groups per parameter) as one tuple per parameter: a
    gradient sharded over several mesh dims (tensor parallel inside FSDP2) has one group per dim, and its local
    norm summed over each in turn is summed over all the ranks that hold a piece of it."""
    return {pid: g if isinstance(g, tuple) else (g,) for pid, g in groups.items()}


def clip_by_norm(
    precision: Any,
    optimizer: Optimizer,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    device: torch.device,
    groups: NormGroups | None = None,
) -> torch.Tensor:
    """Scale every gradient of `optimizer` so that their global norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does on one process; return the norm before clipping.

    A non-finite norm under loss scaling marks the step for the scaler to skip
    (`precision.skip_step_for_nonfinite_norm`); without one it raises where `error_if_nonfinite`. The norm is
    the same on every rank, so every rank takes the same branch."""
    precision.unscale_gradients(optimizer)
    reduce_pending_grads(optimizer)
    total = total_norm(optimizer, float(norm_type), device, groups or NormGroups())
    if not torch.isfinite(total):
        if precision.skip_step_for_nonfinite_norm(optimizer):
            return total  # fp16 overflow: the loss scaler skips this step on every rank
        if error_if_nonfinite:
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so "
                "they cannot be clipped. Pass error_if_nonfinite=False to clip anyway."
            )
    _scale_grads(_grads(optimizer), torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def clip_by_value(precision: Any, optimizer: Optimizer, clip_val: float) -> None:
    """Clamp every gradient element to [-clip_val, clip_val]: elementwise, so each rank clamps its own local
    pieces (torch's `clip_grad_value_` hands DTensor and plain gradients to one foreach kernel, which refuses the
    mix). A gradient whose pieces are pending partial sums is reduced first: clamping each addend is not
    clamping their sum."""
    precision.unscale_gradients(optimizer)
    reduce_pending_grads(optimizer)
    with torch.no_grad():
        for grad in _grads(optimizer):
            _local(grad).clamp_(min=-clip_val, max=clip_val)


def _dtensor_type() -> Any:
    # No DTensor exists unless its module was imported (about a second): one process never imports it here.
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else None


def _grads(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def reduce_pending_grads(optimizer: Optimizer) -> None:
    """Reduce every gradient that holds pending partial sums (a DTensor with a `Partial` placement), in place of
    the gradient. Tensor parallel leaves them where a replicated parameter meets sharded activations: the norm
    weights of a `SequenceParallel` plan each see one rank's share of the sequence, so their gradients are the
    sum over the tensor-parallel ranks of what each holds. A norm or a clamp of the local pieces is then wrong.
    The optimizer would reduce them itself (DTensor does, for every torch optimizer): reducing them here, once,
    to the parameter's own placements, gives it the same values."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    from torch.distributed.tensor import Replicate

    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if not isinstance(grad, dtensor) or not any(pl.is_partial() for pl in grad.placements):
                continue
            if (
                isinstance(p, dtensor)
                and p.device_mesh == grad.device_mesh
                and not any(pl.is_partial() for pl in p.placements)
            ):
                placements = p.placements  # e.g. a reduce-scatter straight into a sharded parameter's layout
            else:
                placements = tuple(Replicate() if pl.is_partial() else pl for pl in grad.placements)
            with torch.no_grad():
                p.grad = grad.redistribute(grad.device_mesh, placements)


def _split_groups(t: Any) -> tuple[dist.ProcessGroup, ...]:
    """The groups of the mesh dims a DTensor's local pieces are split over (anything but Replicate), in mesh
    order."""
    mesh = t.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(t.placements) if not pl.is_replicate())


def total_norm(
    optimizer: Optimizer, norm_type: float, device: torch.device, groups: NormGroups
) -> torch.Tensor:
    """The norm of all gradients as if the model were on one process: each sharded gradient's local pieces
    combined over its shard groups, replicated gradients counted once, copies counted elsewhere skipped, then
    the parts combined over `groups.across`. Pending partial sums must have been reduced
    (`reduce_pending_grads`).

    Where a gradient's pieces meet is read from the gradient's own placements, which need not be its
    parameter's: tensor parallel leaves e.g. a Replicate gradient on an embedding sharded by rows. Where nothing
    meets across ranks (one process, DDP), the norm is torch's own `get_total_norm`, bit for bit."""
    dtensor = _dtensor_type()
    # The groups every rank that shares them knows before looking at gradients, in parameter order: the
    # strategy's, then the splits of the DTensor parameters (a rank without a gradient still all-reduces).
    order: dict[tuple[int, ...], tuple[dist.ProcessGroup, ...]] = {
        tuple(map(id, g)): g for g in groups.shards.values() if g
    }
    params = [p for group in optimizer.param_groups for p in group["params"]]
    layouts: dict[tuple[int, Any], tuple[dist.ProcessGroup, ...]] = {}  # (mesh, placements) -> groups

    def split(t: Any) -> tuple[dist.ProcessGroup, ...]:
        layout = (id(t.device_mesh), t.placements)
        if layout not in layouts:
            layouts[layout] = _split_groups(t)
        return layouts[layout]

    for p in params if dtensor is not None else ():
        if isinstance(p, dtensor) and split(p):
            order.setdefault(tuple(map(id, split(p))), split(p))
    # The local gradient pieces, by where their norms meet: each shard group, or () for the replicated.
    pieces: dict[tuple[int, ...], list[torch.Tensor]] = {(): [], **{k: [] for k in order}}
    for p in params:
        grad = p.grad
        if grad is None or getattr(p, COUNTED_ELSEWHERE, False):
            continue
        if dtensor is not None and isinstance(grad, dtensor):
            shard_groups, grad = split(grad), grad.to_local()
        else:
            shard_groups = groups.shards.get(id(p), ())
        key = tuple(map(id, shard_groups))
        if key not in pieces:
            # Split over groups no parameter is split over (placements come from the same program on every
            # rank, so every rank that holds this gradient meets the others there).
            order[key] = shard_groups
            pieces[key] = []
        pieces[key].append(grad.detach())
    if not order and not groups.across:
        return torch.nn.utils.get_total_norm(pieces[()], norm_type)
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

    def contribution(tensors: list[torch.Tensor]) -> torch.Tensor:
        # torch's own fused per-tensor norms, as clip_grad_norm_ computes them; combined in float64. An empty
        # local piece (a shard past the end of a small tensor) has no inf norm: left out.
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return torch.zeros((), dtype=torch.float64, device=device)
        norm = torch.nn.utils.get_total_norm(tensors, norm_type).to(device, torch.float64)
        return norm if inf else norm**norm_type

    total = contribution(pieces[()])  # replicated: the same on every rank, counted once
    for key, shard_groups in order.items():
        value = contribution(pieces[key])
        for g in shard_groups:
            dist.all_reduce(value, op=op, group=g)
        total = torch.maximum(total, value) if inf else total + value
    for g in groups.across:
        dist.all_reduce(total, op=op, group=g)
    return (total if inf else total ** (1.0 / norm_type)).to(torch.float32)


def _scale_grads(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply the gradients' local pieces by `coef`: one fused multiply per device and dtype (what
    torch.nn.utils.clip_grads_with_norm_ does)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = _local(g)
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for (device, dtype), tensors in by_kind.items():
            torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))
