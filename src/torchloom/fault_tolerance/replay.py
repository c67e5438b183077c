"""The oracle of a fault-tolerant job: its record (`torchloom.fault_tolerance.record`) replayed in one process.

Each committed step's gradient is the mean over its participants of the gradient of the loss on the batch each
used; the same optimizer then steps. A run whose groups died, healed and rejoined must end with the parameters of
this replay (fp32: within about 1e-5), which is how torchloom's tests judge fault tolerance, and how a user
checks a run of their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom.fault_tolerance import record


def replay(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Optimizer,
    batch: Callable[[int, int, int], Any],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    before_step: Callable[[nn.Module], Any] | None = None,
) -> int:
    """Replay the record at `path` on `model` (as it was before the job's first step) and `optimizer`; return the
    number of steps replayed.

    Args:
        batch: `batch(group, epoch, index)`: the batch group `group` read as its `index`-th of epoch `epoch` (its
            own shard of the data: sample `i` of a group's shard is sample `i * groups + group` of the dataset
            when unshuffled, as torch's `DistributedSampler` splits it over groups x processes per group).
        loss: `loss(model, batch)`: the scalar the script called `loom.backward` on.
        before_step: `before_step(model)`, called with the step's averaged gradients before the optimizer steps:
            what the script did between `loom.backward` and `optimizer.step()` (e.g. `loom.clip_gradients`,
            replayed as `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`).
    """
    steps = record.read(path)
    for entry in steps:
        optimizer.zero_grad(set_to_none=True)
        share = 1.0 / len(entry.participants)
        for p in entry.participants:
            (loss(model, batch(p.group, p.epoch, p.batch)) * share).backward()
        if before_step is not None:
            before_step(model)
        optimizer.step()
    return len(steps)
