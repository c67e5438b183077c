"""Pipeline parallelism over `torch.distributed.pipelining`: cutting a model into stages that keep its
parameter names (`_split`), the schedules (`_schedule`), and `forward_backward`, the one call a training loop
makes for a batch, with or without a pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchloom.pipelining._schedule import SCHEDULES

__all__ = ["SCHEDULES", "evaluate", "forward_backward"]


def forward_backward(
    strategy: Any,
    model: Any,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., torch.Tensor],
    backward: Callable[..., None],
) -> torch.Tensor:
    """The forward and backward of one batch; returns the loss, detached. A strategy that runs a pipeline
    (one with `forward_backward`) runs the batch through its schedule, cut into micro-batches; any other runs
    `loss_fn(model(*inputs), target)` and `backward(loss, model=model)`."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    run = getattr(strategy, "forward_backward", None)
    if run is not None:
        forward_module: nn.Module = model.forward_module
        return run(forward_module, inputs, target, loss_fn)
    loss = loss_fn(model(*inputs), target)
    backward(loss, model=model)
    return loss.detach()


def evaluate(
    strategy: Any, model: Any, inputs: Any, target: Any, loss_fn: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """The forward of one batch without a backward (evaluation); returns the loss, detached. Through the
    pipeline schedule (torch's `schedule.eval`) where the strategy runs one, else
    `loss_fn(model(*inputs), target)` under `torch.no_grad()`."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    run = getattr(strategy, "evaluate", None)
    if run is not None:
        forward_module: nn.Module = model.forward_module
        return run(forward_module, inputs, target, loss_fn)
    with torch.no_grad():
        return loss_fn(model(*inputs), target).detach()
