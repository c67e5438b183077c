"""The oracle of a fault-tolerant job: its record (`torchloom.fault_tolerance.record`) replayed in one process.

Each committed step's gradient is the mean over its participants of the gradient of the loss on the batch each
used; the same optimizer then steps. A run whose groups died, healed and rejoined must end with the parameters of
this replay (fp32: within about 1e-5), which is how torchloom's tests judge fault tolerance, and how a user
checks a run of their own (`torchloom replay`, or this function).

Where the record holds the fingerprints of the gradients the groups sent, every step is also checked: each
participant's gradient, recomputed here on the batch it read, must match the fingerprint it sent, and the
applied average the mean of those (`record.partial_steps`). A mismatch raises at the first step it shows, naming
the group and the batch, so a wrong batch function, a group counted with a gradient it did not compute, or a
partial average is found where it happened rather than as a difference at the end.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom.errors import TorchloomError
from torchloom.fault_tolerance import buffers, record


def replay(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Optimizer,
    batch: Callable[[int, int, int], Any],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    before_step: Callable[[nn.Module], Any] | None = None,
    *,
    after_step: Callable[[nn.Module], Any] | None = None,
    check: bool = True,
) -> int:
    """Replay the record at `path` on `model` (as it was before the job's first step) and `optimizer`; return the
    number of steps replayed.

    Args:
        batch: `batch(group, epoch, index)`: the batch group `group` read as its `index`-th of epoch `epoch` (its
            own shard of the data: sample `i` of a group's shard is sample `i * groups + group` of the dataset
            when unshuffled, as torch's `DistributedSampler` splits it over groups x processes per group; with
            several processes per group, the group's batch is the union of its processes' batches).
        loss: `loss(model, batch)`: the scalar the script called `loom.backward` on.
        before_step: `before_step(model)`, called with the step's averaged gradients before the optimizer steps:
            what the script did between `loom.backward` and `optimizer.step()` (e.g. `loom.clip_gradients`,
            replayed as `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`).
        after_step: `after_step(model)`, called after each step: what the script did after a committed
            `optimizer.step()` (e.g. `scheduler.step()` of a scheduler of `optimizer`).
        check: check each step against the fingerprints in the record (see the module docstring); raises
            `TorchloomError` at the first step that differs.
    """
    steps = record.read(path)
    partial = record.partial_steps(steps)
    if check and partial:
        raise TorchloomError(
            f"The record {str(path)!r} holds steps whose applied gradient was not the whole average of their "
            f"participants' gradients: {partial}."
        )
    params = [p for p in model.parameters() if p.requires_grad]
    own_buffers = buffers.persistent([model])
    for entry in steps:
        total = [torch.zeros_like(q) for q in params]
        had = [0] * len(params)
        # Each participant's forward starts from the step's buffers; the step leaves their mean (see `buffers`).
        start, ends = buffers.snapshot(own_buffers), []
        for p in entry.participants:
            buffers.restore(own_buffers, start)
            optimizer.zero_grad(set_to_none=True)
            # The run's loss scale (16-mixed), so that the fp16 backward rounds as the run's did; its gradients
            # divided by it (a power of two: exactly).
            (loss(model, batch(p.group, p.epoch, p.batch)) * entry.loss_scale).backward()
            if entry.loss_scale != 1.0:
                for q in params:
                    if q.grad is not None:
                        q.grad.div_(entry.loss_scale)
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
            if check and entry.whole:
                _check_participant(path, entry.step, p, grads)
            for k, q in enumerate(params):
                if q.grad is not None:
                    total[k] += q.grad
                    had[k] += 1
            ends.append(buffers.snapshot(own_buffers))
        with torch.no_grad():
            for k, buffer in enumerate(own_buffers):
                buffer.copy_(buffers.mean([end[k] for end in ends]))
        if not record.skipped(entry):
            # The groups' average: the sum of their gradients over their number, as the all-reduce computes it;
            # a parameter that no participant had a gradient for keeps none, as in the run.
            for q, t, n in zip(params, total, had, strict=True):
                q.grad = t / len(entry.participants) if n else None
            if before_step is not None:
                before_step(model)
            optimizer.step()
        if after_step is not None:
            after_step(model)
    return len(steps)


def _check_participant(
    path: str | os.PathLike[str], step: int, participant: record.Participant, grads: list[torch.Tensor]
) -> None:
    if participant.grad is None or participant.scale is None or not math.isfinite(participant.grad):
        return
    value, scale = record.fingerprint(grads)
    bound = record.TOLERANCE * max(scale, participant.scale) + 1e-30
    if not abs(value - participant.grad) <= bound:
        raise TorchloomError(
            f"Replaying {str(path)!r}: at step {step}, group {participant.group}'s gradient on its batch "
            f"{participant.batch} of epoch {participant.epoch} is not the gradient it sent (fingerprint "
            f"{value:.6e} here, {participant.grad:.6e} in the record). The batch function may not give that "
            "group's batch (its shard, its batch size, its processes' parts), the model or loss may differ from "
            "the run's, or the run averaged a gradient that batch did not produce."
        )
