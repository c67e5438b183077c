"""Buffers (BatchNorm's running statistics, counters a model keeps) across replica groups.

Nothing but the gradients crosses the groups in a step, so without this each group's buffers follow its own
batches, and the groups part silently: their evaluations differ, and a checkpoint depends on which group wrote
it. torchloom keeps them equal with the rule that the gradients follow: after each committed step, every
group's buffers are **the mean over the step's participants of the buffers each participant's forward left**,
from the buffers they shared at the step's start. A step that does not commit leaves the buffers as they were at
its start (its forward never happened, for the record and for the replay).

The mean is computed the same way in every group and in the replay (`mean`): each participant's values are
gathered (a slot per group, summed over the groups), then `first + sum(x - first) / n` over the participants in
group order, so a buffer no forward changes (a constant) stays bit for bit what it was, and the groups end bit
identical. Integer buffers (`num_batches_tracked`) take the floor of that mean (a counter that every participant
advanced alike stays exact).

Only persistent buffers, those a checkpoint holds: non-persistent ones (a rotary cache, a causal mask) are
derived by the model and never averaged. With several processes in a group, rank r averages its buffers with
rank r of the other groups (under DDP the group's forward starts from rank 0's, which DDP broadcasts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torchloom.fault_tolerance.exchange import local


def persistent(modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The local pieces of the persistent buffers of `modules`, each once, in module order (the same in every
    group's rank r)."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is None or name in sub._non_persistent_buffers_set or id(buffer) in seen:
                    continue
                if buffer.dtype == torch.bool:
                    continue  # a mask: nothing to average (and no sum for it in gloo)
                seen.add(id(buffer))
                out.append(local(buffer))
    return out


def snapshot(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [b.detach().clone() for b in buffers]


def restore(buffers: Sequence[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for buffer, value in zip(buffers, saved, strict=True):
            buffer.copy_(value)


def slots(buffers: Sequence[torch.Tensor], groups: int, group: int, send: bool) -> list[torch.Tensor]:
    """This group's addends to the sums that gather every group's buffers: one tensor per dtype, a slot per group
    (`groups` rows), this group's values in its own row (zeros when it does not `send`: a group not counted in
    the step)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer.detach().reshape(-1))
    out = []
    for parts in by_dtype.values():
        flat = torch.cat(parts)
        rows = torch.zeros(groups, flat.numel(), dtype=flat.dtype, device=flat.device)
        if send:
            rows[group] = flat
        out.append(rows)
    return out


def write_mean(
    buffers: Sequence[torch.Tensor], gathered: Sequence[torch.Tensor], participants: list[int]
) -> None:
    """Set `buffers` to the mean over `participants` of the gathered rows (the summed `slots`)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    with torch.no_grad():
        for rows, group in zip(gathered, by_dtype.values(), strict=True):
            flat = mean([rows[g] for g in participants])
            offset = 0
            for buffer in group:
                buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()


def mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """`first + sum(x - first) / n` in the given order: exact for values that are all equal (see the module
    docstring); the floor of the mean for integers."""
    first = values[0]
    total = torch.zeros_like(first)
    for value in values[1:]:
        total += value - first
    if first.is_floating_point() or first.is_complex():
        return first + total / len(values)
    return first + torch.div(total, len(values), rounding_mode="floor")
