"""`profile_steps`: one call that profiles a window of training steps on every rank.

    profile_steps(loom, optimizer, "runs/profile", start=2, steps=3)

`torch.profiler` starts at once, skips the steps before `start` (the last of them as warm-up), records `steps`
steps (a step ends when `optimizer.step()` returns, as in `TimeBreakdown`), then writes one Chrome/Perfetto trace
per rank (`rank<r>.trace.json`) and, on CUDA, a memory snapshot per rank (`rank<r>.memory.pickle`, every
allocation of the window with its stack) into the folder, and prints on rank 0 how to open them. Every rank
writes into the same folder: without `folder`, rank 0's logger decides it and tells the others.

What the profiler does inside a step (advancing its schedule, writing the trace) is its own time: a
`TimeBreakdown` of the same Loom leaves it out of the step and reports it apart (`breakdown.set_aside`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torchloom._torch_compat import cuda_memory_history, cuda_memory_snapshot
from torchloom.errors import MisuseError
from torchloom.throughput.breakdown import set_aside


class StepProfiler:
    """What `profile_steps` returns: `.files` (this rank's, once written), `.done`, and `stop()` to end early."""

    def __init__(
        self, loom: Any, optimizer: Any, folder: str, start: int, steps: int, **options: Any
    ) -> None:
        if start < 0 or steps < 1:
            raise MisuseError(f"start={start}, steps={steps}: profile at least 1 step, from step 0 or later.")
        self.folder = folder
        self.files: list[str] = []
        self.done = False
        self._loom = loom
        self._rank = loom.global_rank
        self._cuda = loom.device.type == "cuda"
        self._memory = self._cuda and options.pop("memory_snapshot", True)
        self._left = start + steps
        self._start, self._seen = start, 0
        os.makedirs(folder, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        warmup = 1 if start >= 1 else 0
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=start - warmup, warmup=warmup, active=steps, repeat=1),
            on_trace_ready=self._write_trace,
            record_shapes=options.pop("record_shapes", True),
            profile_memory=options.pop("profile_memory", True),
            with_stack=options.pop("with_stack", False),
            **options,
        )
        self._profiler.start()
        if self._memory and start == 0:
            cuda_memory_history(True)
        inner = getattr(optimizer, "optimizer", optimizer)
        self._handle = inner.register_step_post_hook(self._after_step)

    def _after_step(self, *_: Any) -> None:
        with set_aside(self._loom):
            self._seen += 1
            self._profiler.step()
            if self._memory and self._seen == self._start:
                cuda_memory_history(True)
            if self._seen >= self._left:
                self._stop()

    def _write_trace(self, profiler: Any) -> None:
        path = os.path.join(self.folder, f"rank{self._rank}.trace.json")
        profiler.export_chrome_trace(path)
        self.files.append(path)

    def stop(self) -> list[str]:
        """End the profile now (writing what the window recorded so far) and return this rank's files."""
        with set_aside(self._loom):
            return self._stop()

    def _stop(self) -> list[str]:
        if self.done:
            return self.files
        self.done = True
        self._handle.remove()
        self._profiler.stop()
        if not any(f.endswith(".trace.json") for f in self.files):  # stopped before the window ended
            self._write_trace(self._profiler)
        if self._memory:
            path = os.path.join(self.folder, f"rank{self._rank}.memory.pickle")
            cuda_memory_snapshot(path)
            cuda_memory_history(False)
            self.files.append(path)
        if self._loom.is_global_zero:
            print(self.how_to_open(), flush=True)
        return self.files

    def how_to_open(self) -> str:
        lines = [
            f"[torchloom] profile of steps {self._start}..{self._left - 1} written to {self.folder}/ (one file per rank):",
            f"  traces: open https://ui.perfetto.dev (or chrome://tracing) and load {self.folder}/rank0.trace.json",
        ]
        if self._memory:
            lines.append(
                f"  memory: drag {self.folder}/rank0.memory.pickle onto https://pytorch.org/memory_viz, or offline: "
                f"python -m torch.cuda._memory_viz trace_plot {self.folder}/rank0.memory.pickle -o memory.html"
            )
        return "\n".join(lines)


def profile_steps(
    loom: Any, optimizer: Any, folder: str | None = None, *, start: int = 1, steps: int = 3, **options: Any
) -> StepProfiler:
    """Profile steps `start` .. `start + steps - 1` (counted from 0 by `optimizer.step()` calls) on every rank.

    `folder` defaults to `<first logger's log_dir>/profile` (rank 0's logger's, for every rank), else `./profile`.
    `options` go to `torch.profiler.profile` (`record_shapes=True`, `profile_memory=True`, `with_stack=False` by
    default); `memory_snapshot=False` skips the CUDA memory snapshot."""
    if folder is None:
        # Each rank's logger finds its version on the disk by itself (CSVLogger: one past the highest
        # version_N), so ranks asking at different moments get different folders: rank 0's logger decides.
        if loom.is_global_zero:
            log_dir = getattr(loom.logger, "log_dir", None) if getattr(loom, "loggers", None) else None
            folder = os.path.join(log_dir or ".", "profile")
        folder = loom.broadcast(folder) if loom.world_size > 1 else folder
    assert folder is not None
    return StepProfiler(loom, optimizer, folder, start, steps, **options)
