"""`TimeBreakdown`: where each training step's time goes, opt in, from hooks registered from outside.

    breakdown = TimeBreakdown(loom, model, optimizer)
    for batch in breakdown.loader(train_loader):
        loss = model(batch).sum()
        loom.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    summary = breakdown.close()  # every rank: gathers every rank's steps, prints the table on rank 0

A step ends when `optimizer.step()` returns (gradient accumulation: its micro-batches are one step). The parts:

| part | measured as |
|---|---|
| `data` | time inside the loader's `next()` (the loader returned by `breakdown.loader`) |
| `forward` | the forward of the module torchloom runs (DDP, FSDP, the model): forward pre/post hooks |
| `backward` | `loom.backward`'s autograd run through the strategy, minus `communication` |
| `communication` | with several processes and unsharded parameters (DDP), the exposed tail of the gradient reduction: from the last gradient the backward accumulated (`register_post_accumulate_grad_hook`) to the end of the backward; 0 in one process and under FSDP/tensor parallelism (see below) |
| `optimizer` | the optimizer's own `step` (step pre/post hooks of the torch optimizer) and `zero_grad` |
| `torchloom` | torchloom's own host time: the set-up module's, `loom.backward`'s and the set-up optimizer's time around the parts above |
| `other` | the rest of the step: the user's code between the calls (loss, logging, metrics) |

On a CPU every part is wall clock. On CUDA `data`, `forward`, `backward`, `communication`, `optimizer` and the
step are CUDA events on the current stream, read when the metrics are logged (one synchronisation per logged step,
none in between); `torchloom` stays host wall clock. What `communication` can see: the reduction a backward still
waits for after its last gradient (DDP's last buckets). Under FSDP1 (flat parameters), FSDP2 and tensor
parallelism (DTensor parameters) a parameter receives its gradient only after the reduction, so no hook marks the
end of the compute: the reduction counts in `backward` there. Collectives inside the
forward or the backward (FSDP's all-gathers and reduce-scatters, tensor-parallel all-reduces) count in `forward`
and `backward`: on CPU/gloo a collective blocks the thread that computes, so its time cannot be told apart from
compute from outside; the profiler (`torchloom.throughput.profile_steps`) shows each collective.

Time that a tool observing the run spends inside a step (`profile_steps` recording and writing its trace) is the
tool's, not the step's: it counts in no part, is left out of `step`, and is reported apart as `profiler`
(`set_aside`).

Step k (counted from 1, as `optimizer.step()` calls) is logged at `step=k`: the count Fabric's loop gives
`ThroughputMonitor.compute_and_log(step=i)` after its i-th update, so both land in the same row.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from torchloom.errors import MisuseError

PARTS = ("data", "forward", "backward", "communication", "optimizer", "torchloom", "other")
#: Seconds set aside inside a step (`set_aside`): in no part and not in `step`.
APART = "profiler"
_COLUMNS = (*PARTS, "step", APART)

#: id(loom) -> the TimeBreakdown timing it (one at a time: see TimeBreakdown's check).
_TIMING: dict[int, TimeBreakdown] = {}


@contextmanager
def set_aside(loom: Any) -> Iterator[None]:
    """The time of the block is not the step's: a `TimeBreakdown` timing `loom` leaves it out of every part and of
    `step`, and reports it as `profiler`. What `profile_steps` wraps its work inside a step in (recording,
    writing its trace: 250 ms on a step of 16 ms counted as torchloom's own time before)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        breakdown = _TIMING.get(id(loom))
        if breakdown is not None:
            breakdown._step.aside.append((start, time.perf_counter()))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class _Mark:
    """A moment: host wall clock always, and a CUDA event on the current stream on a GPU."""

    __slots__ = ("wall", "event")

    def __init__(self, cuda: bool) -> None:
        self.wall = time.perf_counter()
        self.event: Any = None
        if cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    def until(self, later: _Mark) -> float:
        """Seconds from this mark to `later`: device time on a GPU (`later` must have completed)."""
        if self.event is not None:
            return float(self.event.elapsed_time(later.event)) / 1000.0
        return later.wall - self.wall


@dataclass
class _Step:
    start: _Mark
    intervals: dict[str, list[tuple[_Mark, _Mark]]] = field(default_factory=dict)
    host: float = 0.0  # torchloom's own host seconds
    end: _Mark | None = None
    aside: list[tuple[float, float]] = field(default_factory=list)  # wall spans of `set_aside`

    def add(self, part: str, start: _Mark, end: _Mark) -> None:
        self.intervals.setdefault(part, []).append((start, end))

    def aside_within(self, start: float, end: float) -> float:
        """Seconds set aside between the wall times `start` and `end`."""
        return sum(max(min(end, b) - max(start, a), 0.0) for a, b in self.aside)

    def seconds(self) -> dict[str, float]:
        assert self.end is not None
        if self.end.event is not None:
            self.end.event.synchronize()
        out = {part: 0.0 for part in _COLUMNS}
        for part, spans in self.intervals.items():
            # a span the set-aside time fell in (the profiler's post-step hook inside `optimizer`) loses it
            out[part] = sum(max(a.until(b) - self.aside_within(a.wall, b.wall), 0.0) for a, b in spans)
        # the backward's exposed communication is inside its span: count it once
        out["backward"] = max(out["backward"] - out["communication"], 0.0)
        out["torchloom"] = self.host
        out[APART] = self.aside_within(self.start.wall, self.end.wall)
        out["step"] = max(self.start.until(self.end) - out[APART], 0.0)
        out["other"] = max(out["step"] - sum(out[p] for p in PARTS if p != "other"), 0.0)
        return out


class TimeBreakdown:
    """Times every training step in parts (see the module's table), logs them with `loom.log_dict` every
    `log_every` steps (keys `time/<part>` and `time/step`, seconds) and summarises them at `close()`.

    `model` and `optimizer` are what `loom.setup(...)` returned. The breakdown registers hooks on them (and wraps
    `loom.backward`, the strategy's backward and the optimizer's `step` and `zero_grad` on these instances) and removes them all
    at `close()`. The loader's wait is measured on the iterator `breakdown.loader(loader)` returns."""

    def __init__(
        self, loom: Any, model: Any, optimizer: Any, *, log_every: int = 1, prefix: str = "time/"
    ) -> None:
        if "backward" in vars(loom):
            raise MisuseError(
                "This Loom is already timed by a TimeBreakdown: close() the first one before creating another."
            )
        if log_every < 1:
            raise MisuseError(f"log_every={log_every}: log every 1 or more steps.")
        self._loom = loom
        self._cuda = loom.device.type == "cuda"
        self._many = loom.world_size > 1
        self._log_every = log_every
        self._prefix = prefix
        self.steps: list[dict[str, float]] = []
        self._pending: list[_Step] = []
        self._step = _Step(self._mark())
        self._last_grad: _Mark | None = None
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str]] = []
        self._closed = False
        self._hook_model(model)
        self._hook_optimizer(optimizer)
        self._hook_backward(loom)
        _TIMING[id(loom)] = self

    # ---- the hooks --------------------------------------------------------------------------------------------
    def _mark(self) -> _Mark:
        return _Mark(self._cuda)

    def _hook_model(self, model: Any) -> None:
        inner = getattr(model, "forward_module", model)
        outer_starts: list[float] = []
        inner_starts: list[_Mark] = []
        inner_wall = [0.0]

        def outer_pre(*_: Any) -> None:
            outer_starts.append(time.perf_counter())
            inner_wall[0] = 0.0

        def inner_pre(*_: Any) -> None:
            inner_starts.append(self._mark())

        def inner_post(*_: Any) -> None:
            end, start = self._mark(), inner_starts.pop()
            self._step.add("forward", start, end)
            inner_wall[0] += end.wall - start.wall

        def outer_post(*_: Any) -> None:
            self._step.host += max(time.perf_counter() - outer_starts.pop() - inner_wall[0], 0.0)

        if inner is not model:  # the set-up module around the strategy's: its own time is torchloom's
            self._handles += [
                model.register_forward_pre_hook(outer_pre),
                model.register_forward_hook(outer_post),
            ]
        # first in and last out of the module's own hooks: FSDP's all-gathers in its forward hooks count as forward
        self._handles += [
            inner.register_forward_pre_hook(inner_pre, prepend=True),
            inner.register_forward_hook(inner_post),
        ]

        def grad_done(_: torch.Tensor) -> None:
            self._last_grad = self._mark()

        parameters = [p for p in model.parameters() if p.requires_grad]
        # Sharded parameters (FSDP2, tensor parallel: DTensors) receive their gradient only after the reduction,
        # so their hooks cannot mark the end of the compute: there the reduction stays in `backward`.
        self._split_communication = self._many and not any(_is_dtensor(p) for p in parameters)
        if self._split_communication:
            self._handles += [p.register_post_accumulate_grad_hook(grad_done) for p in parameters]

    def _hook_optimizer(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        started: list[_Mark] = []

        def pre(*_: Any) -> None:
            started.append(self._mark())

        def post(*_: Any) -> None:
            end = self._mark()
            self._inner_step_span = (started[-1].wall, end.wall)
            self._step.add("optimizer", started.pop(), end)

        self._handles += [inner.register_step_pre_hook(pre), inner.register_step_post_hook(post)]
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            wall = time.perf_counter()
            self._inner_step_span = (wall, wall)
            output = original(*args, **kwargs)
            now, (inner_start, inner_end) = time.perf_counter(), self._inner_step_span
            # what was set aside around the optimizer's own step (a later post-step hook) is not torchloom's
            aside = self._step.aside_within(wall, now) - self._step.aside_within(inner_start, inner_end)
            self._step.host += max(now - wall - (inner_end - inner_start) - aside, 0.0)
            self._end_step()
            return output

        self._patch(optimizer, "step", step)
        original_zero_grad = optimizer.zero_grad

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            start = self._mark()
            output = original_zero_grad(*args, **kwargs)
            self._step.add("optimizer", start, self._mark())
            return output

        self._patch(optimizer, "zero_grad", zero_grad)

    def _hook_backward(self, loom: Any) -> None:
        strategy = loom.strategy
        inner_backward = strategy.backward
        outer_backward = loom.backward

        def timed_strategy_backward(*args: Any, **kwargs: Any) -> Any:
            self._last_grad = None
            start = self._mark()
            output = inner_backward(*args, **kwargs)
            end = self._mark()
            self._inner_backward_wall = end.wall - start.wall
            self._step.add("backward", start, end)
            if self._split_communication and self._last_grad is not None:
                self._step.add("communication", self._last_grad, end)
            return output

        def timed_backward(*args: Any, **kwargs: Any) -> Any:
            wall = time.perf_counter()
            self._inner_backward_wall = 0.0
            output = outer_backward(*args, **kwargs)
            self._step.host += max(time.perf_counter() - wall - self._inner_backward_wall, 0.0)
            return output

        self._patch(strategy, "backward", timed_strategy_backward)
        self._patch(loom, "backward", timed_backward)

    def _patch(self, obj: Any, name: str, function: Any) -> None:
        obj.__dict__[name] = function
        self._patched.append((obj, name))

    # ---- steps ------------------------------------------------------------------------------------------------
    def loader(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Iterate `iterable`, timing each wait for the next batch as `data`."""
        iterator = iter(iterable)
        while True:
            start = self._mark()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._step.add("data", start, self._mark())
            yield batch

    def _end_step(self) -> None:
        step = self._step
        step.end = self._mark()
        self._step = _Step(step.end)
        self._pending.append(step)
        done = len(self.steps) + len(self._pending)
        if done == 1 or done % self._log_every == 0:
            self._resolve()
            latest = {f"{self._prefix}{k}": v for k, v in self.steps[-1].items() if k != APART or v}
            # step k at k (counted from 1): the row ThroughputMonitor.compute_and_log(step=k) logs to
            self._loom.log_dict(latest, step=len(self.steps))
            # the logging is the breakdown's own time, in the next step: torchloom's
            self._step.host += time.perf_counter() - step.end.wall

    def _resolve(self) -> None:
        self.steps += [step.seconds() for step in self._pending]
        self._pending.clear()

    # ---- the end ----------------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Remove every hook and wrapper (no collective; `close()` also gathers and prints)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for obj, name in self._patched:
            obj.__dict__.pop(name, None)
        self._patched.clear()
        if _TIMING.get(id(self._loom)) is self:
            del _TIMING[id(self._loom)]
        self._resolve()

    def summary(self) -> BreakdownSummary:
        """Every rank's steps, gathered (a collective: call it on every rank)."""
        self._resolve()
        local = torch.tensor([[s[c] for c in _COLUMNS] for s in self.steps], dtype=torch.float64).reshape(
            -1, len(_COLUMNS)
        )
        counts = self._loom.all_gather(torch.tensor(local.shape[0], device=self._loom.device)).reshape(-1)
        longest = int(counts.max())
        padded = torch.full((longest, len(_COLUMNS)), float("nan"), dtype=torch.float64)
        padded[: local.shape[0]] = local
        gathered = (
            self._loom.all_gather(padded.to(self._loom.device)).reshape(-1, longest, len(_COLUMNS)).cpu()
        )
        per_rank = [
            [dict(zip(_COLUMNS, row.tolist(), strict=True)) for row in rank[: int(n)]]
            for rank, n in zip(gathered, counts.tolist(), strict=True)
        ]
        return BreakdownSummary(per_rank=per_rank, device=self._loom.device.type)

    def close(self, print_table: bool = True) -> BreakdownSummary:
        """Remove the hooks, gather every rank's steps (a collective) and print the summary on rank 0."""
        if not self._closed:
            self.remove()
            self._closed = True
        result = self.summary()
        if print_table and self._loom.is_global_zero:
            print(result.table(), flush=True)
        return result


@dataclass
class BreakdownSummary:
    """Every rank's step times: `per_rank[rank][step][part]` in seconds (parts of `PARTS`, `step`, and
    `profiler`: the time set aside, in no part and not in `step`)."""

    per_rank: list[list[dict[str, float]]]
    device: str = "cpu"
    parts: tuple[str, ...] = PARTS

    def mean(self, skip: int = 1) -> dict[str, float]:
        """Seconds per step of each part, over every rank's steps after the first `skip` (the first steps pay for
        warm-up: allocation, compilation, the first collectives)."""
        rows = [row for rank in self.per_rank for row in rank[skip:]] or [
            row for rank in self.per_rank for row in rank
        ]
        if not rows:
            return {c: 0.0 for c in _COLUMNS}
        return {c: sum(r[c] for r in rows) / len(rows) for c in _COLUMNS}

    def table(self, skip: int = 1) -> str:
        """The mean step, part by part, as text."""
        mean = self.mean(skip)
        ranks, steps = len(self.per_rank), max((len(r) for r in self.per_rank), default=0)
        lines = [f"time per step ({steps} steps x {ranks} rank(s), first {skip} skipped, {self.device}):"]
        for part in PARTS:
            share = mean[part] / mean["step"] if mean["step"] else 0.0
            lines.append(f"  {part:<14} {mean[part] * 1e3:10.3f} ms  {share:6.1%}")
        lines.append(f"  {'step':<14} {mean['step'] * 1e3:10.3f} ms")
        apart = sum(row.get(APART, 0.0) for rank in self.per_rank for row in rank)
        if apart:
            lines.append(
                f"  (the profiler took {apart * 1e3:.3f} ms over all steps and ranks, left out of the steps)"
            )
        return "\n".join(lines)

    def write_html(self, path: str) -> str:
        """Draw every rank's steps as a self-contained HTML page (inline SVG); returns the path."""
        from torchloom.throughput.report import write_html

        return write_html(self, path)

    def write_png(self, path: str) -> str:
        """Draw every rank's steps as a PNG (needs matplotlib: `pip install torchloom[plot]`); returns the path."""
        from torchloom.throughput.report import write_png

        return write_png(self, path)
