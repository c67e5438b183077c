"""Schedules over `torch.distributed.pipelining`: which stages each rank holds, and one batch's forward and
backward through them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchloom.errors import ConfigurationError, MisuseError, MisuseValueError

# name -> (torch class name, stages per rank it needs: 1, or None for several, placement style)
SCHEDULES: dict[str, tuple[str, bool, str]] = {
    "gpipe": ("ScheduleGPipe", False, "loop"),
    "1f1b": ("Schedule1F1B", False, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", True, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", True, "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", True, "v"),
}


def schedule_name(value: Any) -> str:
    key = str(value).lower().replace("-", "_").replace(" ", "_")
    key = {
        "interleaved1f1b": "interleaved_1f1b",
        "zbv": "zbv_zero_bubble",
        "zero_bubble": "zbv_zero_bubble",
    }.get(key, key)
    if key not in SCHEDULES:
        raise ConfigurationError(
            f"pipeline schedule={value!r} is not one torchloom knows: pick one of {sorted(SCHEDULES)}."
        )
    return key


def check_stages_per_rank(schedule: str, stages_per_rank: int) -> None:
    several = SCHEDULES[schedule][1]
    if several and stages_per_rank < 2:
        raise ConfigurationError(
            f"schedule={schedule!r} runs several stages per rank: pass stages_per_rank=2 (or more)."
        )
    if not several and stages_per_rank != 1:
        raise ConfigurationError(
            f"schedule={schedule!r} runs one stage per rank, got stages_per_rank={stages_per_rank}: use "
            "'interleaved_1f1b' (or another multi-stage schedule) for several."
        )
    if SCHEDULES[schedule][2] == "v" and stages_per_rank != 2:
        raise ConfigurationError(
            f"schedule={schedule!r} places exactly 2 stages per rank (a V): stages_per_rank=2."
        )


def stage_ids_of(pp_rank: int, pp_size: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stages pipeline rank `pp_rank` holds: round robin ("loop"), or down and back up ("v")."""
    if SCHEDULES[schedule][2] == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


class Runner:
    """One schedule over this rank's stages, built at the first batch and reused for every one after."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        num_stages: int,
        schedule: str,
        n_microbatches: int,
        device: torch.device,
        pp_group: dist.ProcessGroup,
        pp_ranks: Sequence[int],
    ) -> None:
        self.stages = stages
        self.num_stages = num_stages
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        self.device = device
        self.pp_group = pp_group
        self.pp_ranks = list(pp_ranks)  # global ranks, by pipeline rank
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._scale: Callable[[torch.Tensor], torch.Tensor] = _identity
        self._losses: dict[int, torch.Tensor] = {}
        self._last_train: bool | None = None  # what the last batch did: train, evaluate (None: none yet)
        self._torch_schedule: Any = None
        last_pp_rank = num_stages - 1 if SCHEDULES[schedule][2] == "loop" else 0
        self.last_rank = self.pp_ranks[last_pp_rank % len(self.pp_ranks)]

    @property
    def holds_first(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.stages

    def _build(self) -> Any:
        from torch.distributed import pipelining

        cls = getattr(pipelining, SCHEDULES[self.schedule][0])
        stages = [
            pipelining.PipelineStage(module, i, self.num_stages, self.device, group=self.pp_group)
            for i, module in sorted(self.stages.items())
        ]
        # The loss of each micro-batch is divided by their count (`_current_loss`), not by torch's scale_grads, which would
        # also divide gradients accumulated by earlier batches (gradient accumulation).
        n = self.n_microbatches
        if SCHEDULES[self.schedule][1]:
            return cls(stages, n, loss_fn=self._current_loss, scale_grads=False)
        return cls(stages[0], n, loss_fn=self._current_loss, scale_grads=False)

    def _current_loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        loss = self._loss_fn(output, target) / self.n_microbatches
        # The backward sees the loss scaled (fp16's loss scale: the identity otherwise); the batch's loss sums
        # the unscaled ones of the micro-batches torch reports (not those of its shape inference, which calls
        # this on uninitialised tensors), found by the scaled tensor it was handed.
        scaled = self._scale(loss)
        self._losses[id(scaled)] = loss.detach().float()
        return scaled

    def run(
        self,
        inputs: tuple[Any, ...],
        target: Any,
        loss_fn: Callable[..., torch.Tensor],
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        train: bool = True,
    ) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline (forward only with `train=False`, torch's
        `schedule.eval`, which keeps no activations for a backward and leaves the gradients alone); the batch's
        loss (the mean over micro-batches) on every pipeline rank. `scale` multiplies each micro-batch's loss
        before its backward (fp16's loss scale)."""
        batch = _batch_size(inputs, target)
        if batch is not None and batch % self.n_microbatches:
            raise MisuseValueError(
                f"The batch has {batch} samples, which {self.n_microbatches} micro-batches do not divide: pass a "
                f"batch size that is a multiple of n_microbatches={self.n_microbatches} (per data-parallel rank), "
                "or change n_microbatches."
            )
        if not train and SCHEDULES[self.schedule][2] == "v":
            # torch 2.13's schedule.eval still runs a V schedule's backward actions, and fails where the two
            # stages of a rank meet ("can't steal_bwd_input if this stage doesn't have backward").
            raise MisuseError(
                f"loom.evaluate cannot run through schedule={self.schedule!r}: torch's eval of a V-shaped schedule "
                "runs its backward actions. Evaluate with another schedule (e.g. 'interleaved_zero_bubble' or "
                "'interleaved_1f1b'), or save a checkpoint and evaluate it in a Loom of its own."
            )
        if self._torch_schedule is None:
            self._torch_schedule = self._build()
        # At its first batch and at each switch between training and evaluation, torch infers the stages'
        # metadata with a real forward (and backward), then clears the gradients of FSDP units: those a loop has
        # accumulated so far (gradient accumulation, an evaluation between micro-batches) are kept aside and
        # added back after.
        kept = self._take_grads() if self._last_train is not train else {}
        self._last_train = train
        self._loss_fn = loss_fn
        self._scale = scale if scale is not None else _identity
        self._losses = {}
        args = inputs if self.holds_first else ()
        kwargs: dict[str, Any] = {}
        reported: list[torch.Tensor] = []
        if self.holds_last:
            kwargs = {"target": target, "losses": reported}
        try:
            if train:
                self._torch_schedule.step(*args, **kwargs)
            else:
                with torch.no_grad():
                    self._torch_schedule.eval(*args, **kwargs)
        finally:
            self._loss_fn = None
            self._give_back(kept)
        if self.holds_last:
            loss = torch.stack([self._losses[id(t)] for t in reported]).sum().to(self.device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self._losses = {}
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        return loss

    def _take_grads(self) -> dict[nn.Parameter, torch.Tensor]:
        kept = {}
        for stage in self.stages.values():
            for p in stage.parameters():
                if p.grad is not None:
                    kept[p], p.grad = p.grad, None
        return kept

    def _give_back(self, kept: dict[nn.Parameter, torch.Tensor]) -> None:
        with torch.no_grad():
            for p, grad in kept.items():
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)


def _identity(loss: torch.Tensor) -> torch.Tensor:
    return loss


def _batch_size(inputs: tuple[Any, ...], target: Any) -> int | None:
    for value in (*inputs, target):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None
