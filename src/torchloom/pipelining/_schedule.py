"""Schedules over `torch.distributed.pipelining`: which stages each rank holds, and one batch's forward and
backward through them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchloom.errors import ConfigurationError, MisuseError, MisuseValueError, TorchloomError

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
        # Stages whose next forward is torch's metadata inference, and the buffers kept aside around it.
        self._inferring: set[int] = set()
        self._kept_buffers: dict[int, list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]] = {}
        self._forwards: dict[int, int] = {}
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
        for i, module in self.stages.items():
            module.register_forward_pre_hook(functools.partial(self._before_forward, i))
            if i != self.num_stages - 1:
                # torch's receive needs a contiguous buffer, which it shapes after the sender's output (its
                # strides too): a stage ending in a transpose would fail the next stage's receive.
                module.register_forward_hook(_contiguous_output)
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
        if not train and len(self.stages) == self.num_stages:
            return self._evaluate_in_order(inputs, target, loss_fn)
        if self._torch_schedule is None:
            self._torch_schedule = self._build()
        # At its first batch and at each switch between training and evaluation, torch infers the stages'
        # metadata with a real forward (and backward), then clears the gradients of FSDP units: those a loop has
        # accumulated so far (gradient accumulation, an evaluation between micro-batches) are kept aside and
        # added back after.
        # Its forward runs on the first micro-batch (stage 0 would count it twice) and on uninitialised tensors
        # (later stages): every stage's buffers (BatchNorm's running statistics) are kept aside around it too.
        inferring = self._last_train is not train
        kept = self._take_grads() if inferring else {}
        self._inferring = set(self.stages) if inferring else set()
        self._forwards = dict.fromkeys(self.stages, 0)
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
            self._restore_buffers()
            self._reshard()
        if inferring:
            self._check_inference_seen()
        if self.holds_last:
            loss = torch.stack([self._losses[id(t)] for t in reported]).sum().to(self.device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self._losses = {}
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        return loss

    def _evaluate_in_order(
        self, inputs: tuple[Any, ...], target: Any, loss_fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """An evaluation on a rank that holds every stage (pipeline degree 1): each micro-batch through the
        stages' forwards in order, as torch's schedule would pass it on. torch 2.13's `schedule.eval` of a
        multi-stage schedule fails where two stages of a rank meet ("can't steal_bwd_input if this stage doesn't
        have backward"); with no peer to wait for, no schedule is needed, and the stages' metadata (inferred per
        mode) is left as the training batches need it."""
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

        n = self.n_microbatches
        chunks, _ = split_args_kwargs_into_chunks(inputs, {}, n)
        targets = split_args_kwargs_into_chunks((target,), {}, n)[0] if target is not None else [(None,)] * n
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for args, (tgt,) in zip(chunks, targets, strict=True):
                output: Any = args
                for i in sorted(self.stages):
                    output = self.stages[i](*(output if isinstance(output, tuple) else (output,)))
                total += (loss_fn(output, tgt) / n).detach().float()
        self._reshard()
        return total

    def _before_forward(self, stage: int, module: nn.Module, args: Any) -> None:
        """Kept aside before the inference's forward; put back before the stage's first real forward (not at the
        end of the inference's forward: its backward follows, and autograd refuses a buffer written after the
        forward that saved it)."""
        self._forwards[stage] = self._forwards.get(stage, 0) + 1
        if stage in self._inferring:
            self._inferring.discard(stage)
            self._kept_buffers[stage] = [
                (owner, name, b, b.detach().clone())
                for owner in module.modules()
                for name, b in owner._buffers.items()
                if b is not None
            ]
        elif stage in self._kept_buffers:
            self._restore_buffers(stage)

    def _restore_buffers(self, stage: int | None = None) -> None:
        """Put the buffers kept before the metadata inference's forward back (the same tensors, their values)."""
        for i in [stage] if stage is not None else list(self._kept_buffers):
            with torch.no_grad():
                for owner, name, buffer, value in self._kept_buffers.pop(i, []):
                    owner._buffers[name] = buffer
                    buffer.copy_(value)

    def _check_inference_seen(self) -> None:
        """At a batch that re-infers the metadata, each stage ran one forward more than its micro-batches: torch's
        inference. Where it did not (a torch that infers without a forward), the first micro-batch's buffer
        updates were undone above: refused loudly instead of training on wrong statistics."""
        expected = self.n_microbatches + 1
        if any(count != expected for count in self._forwards.values()):
            raise TorchloomError(
                f"torch {torch.__version__} ran {sorted(set(self._forwards.values()))} forward(s) per stage at the "
                f"batch that infers the stages' metadata, not {expected} ({self.n_microbatches} micro-batches and "
                "its inference): torchloom cannot tell its metadata inference apart from a micro-batch and would "
                "undo a real buffer update. Use a torch version the README lists as tested, or report it."
            )

    def _reshard(self) -> None:
        """Every `fully_shard` unit of the stages back to its sharded parameters. Each unit of a stage is a root of
        its own, which FSDP keeps unsharded after the forward and reshards in the backward's final callback; a
        unit no gradient reaches (frozen, before any parameter that trains) and every unit after an evaluation
        would otherwise stay unsharded, its full parameters registered in place of the DTensors the optimizer
        and the checkpoints know."""
        from torch.distributed.fsdp import FSDPModule

        for stage in self.stages.values():
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

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


def _contiguous_output(module: nn.Module, args: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.contiguous()
    if isinstance(output, (tuple, list)):
        return type(output)(t.contiguous() if isinstance(t, torch.Tensor) else t for t in output)
    return output


def _identity(loss: torch.Tensor) -> torch.Tensor:
    return loss


def _batch_size(inputs: tuple[Any, ...], target: Any) -> int | None:
    for value in (*inputs, target):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None
