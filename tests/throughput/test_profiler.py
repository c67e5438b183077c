"""`profile_steps` on 2 gloo ranks: one call writes one trace per rank holding exactly the chosen window of steps
(counted by `optimizer.step()`), removes its hook afterwards, and rank 0 prints how to open the files. Without a
folder, every rank writes into rank 0's logger's folder (a CSVLogger's version_N, which each rank would find on
the disk by itself), and a `TimeBreakdown` of the same run leaves the profiler's time out of the step and logs
each step in the row where `ThroughputMonitor.compute_and_log(step=i)` logs it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from harness import run_ranks

from torchloom import Loom
from torchloom.errors import MisuseError
from torchloom.loggers import CSVLogger, Logger
from torchloom.throughput import ThroughputMonitor, TimeBreakdown
from torchloom.throughput.breakdown import PARTS
from torchloom.throughput.profiler import profile_steps


class _Capture(Logger):
    def __init__(self) -> None:
        self.rows: list[tuple[int | None, dict]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


def _profile_body(rank: int, world_size: int, folder: str) -> dict:
    import contextlib
    import io

    capture = _Capture()
    loom = Loom(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp",
        loggers=[CSVLogger(os.path.join(folder, "logs")), capture],
    )
    loom.launch()
    net = torch.nn.Linear(16, 16)
    model, optimizer = loom.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        profiler = profile_steps(loom, optimizer, folder, start=2, steps=2)
        for step in range(6):
            with torch.profiler.record_function(f"user_step_{step}"):
                loom.backward(model(torch.randn(4, 16)).sum())
                optimizer.step()
                optimizer.zero_grad()
    with pytest.raises(MisuseError, match="at least 1 step"):
        profile_steps(loom, optimizer, folder, steps=0)
    hooks = len(optimizer.optimizer._optimizer_step_post_hooks)
    logged = _profile_into_the_loggers_folder(loom, model, optimizer)
    loom.close()
    events = json.load(open(profiler.files[0]))["traceEvents"]
    steps = sorted({e["name"] for e in events if str(e.get("name", "")).startswith("user_step_")})
    return {
        "files": profiler.files,
        "steps": steps,
        "printed": printed.getvalue(),
        "hooks": hooks,
        "log_dir": loom.logger.log_dir if rank == 0 else None,
        "rows": capture.rows,
        **logged,
    }


_WRITE_COST = 0.25


def _profile_into_the_loggers_folder(loom, model, optimizer) -> dict:
    import contextlib
    import io
    import time

    # Rank 0's run has a folder before the profile (its hparams.yaml): another rank asking the disk for the
    # next version then found version_1, and wrote its trace there.
    loom.logger.log_hyperparams({"lr": 0.1})
    loom.barrier()
    breakdown = TimeBreakdown(loom, model, optimizer)
    monitor = ThroughputMonitor(loom, available_flops=1e12, using_sparse_model=False)
    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        profiler = profile_steps(loom, optimizer, start=1, steps=1)
        # Writing a trace of 2 steps takes about a millisecond, as long as torchloom's own work in a loaded
        # step: a known cost tells which side the writing was counted on.
        write = profiler._profiler.on_trace_ready
        profiler._profiler.on_trace_ready = lambda p: (time.sleep(_WRITE_COST), write(p))
        for i in range(1, 4):  # Fabric's loop: the i-th update logs at step=i
            loom.backward(model(torch.randn(4, 16)).sum())
            optimizer.step()
            optimizer.zero_grad()
            monitor.update(time=time.perf_counter() - start, batches=i, samples=4 * i)
            monitor.compute_and_log(step=i)
    summary = breakdown.close(print_table=False)
    return {
        "default_files": profiler.files,
        "default_printed": printed.getvalue(),
        "per_rank": summary.per_rank,
    }


def test_profile_window_per_rank(tmp_path):
    results = run_ranks(_profile_body, 2, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        assert result["files"] == [os.path.join(str(tmp_path), f"rank{rank}.trace.json")]
        assert result["steps"] == ["user_step_2", "user_step_3"]
        assert result["hooks"] == 0
    assert "https://ui.perfetto.dev" in results[0]["printed"] and "rank0.trace.json" in results[0]["printed"]
    assert results[1]["printed"] == ""

    # without a folder: both ranks' traces in rank 0's log_dir/profile, which rank 0 names
    folder = os.path.join(results[0]["log_dir"], "profile")
    assert results[0]["log_dir"].endswith("version_0")
    for rank, result in enumerate(results):
        assert result["default_files"] == [os.path.join(folder, f"rank{rank}.trace.json")]
    assert f"written to {folder}/" in results[0]["default_printed"]
    # the breakdown's rows share the monitor's steps
    rows = results[0]["rows"]
    timed = [step for step, metrics in rows if "time/step" in metrics]
    monitored = [step for step, metrics in rows if "batches" in metrics]
    assert timed == monitored == [1, 2, 3], rows
    # the trace is written in step 2 (1-based): its time is the profiler's, in no part and not in the step
    for steps in results[0]["per_rank"]:
        exported = steps[1]
        assert exported["profiler"] >= _WRITE_COST and exported["torchloom"] < _WRITE_COST, exported
        assert sum(exported[p] for p in PARTS) == pytest.approx(exported["step"], rel=1e-9)
        assert steps[0]["profiler"] == 0.0 or steps[0]["profiler"] < exported["profiler"]
    profiled = [metrics for step, metrics in rows if step == 2 and "time/step" in metrics][0]
    assert profiled["time/profiler"] == results[0]["per_rank"][0][1]["profiler"]


def test_the_private_memory_snapshot_apis_are_checked(monkeypatch):
    from torchloom import _torch_compat

    assert callable(torch.cuda.memory._record_memory_history) and callable(torch.cuda.memory._dump_snapshot)
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    monkeypatch.delattr(torch.cuda.memory, "_dump_snapshot")
    with pytest.raises(_torch_compat.TorchAPIMissing, match="_record_memory_history"):
        _torch_compat.cuda_memory_history(True)
    with pytest.raises(_torch_compat.TorchAPIMissing, match="_dump_snapshot"):
        _torch_compat.cuda_memory_snapshot("x.pickle")
