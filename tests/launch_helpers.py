"""What the launcher tests run on each rank. A module of its own, so ranks started with the spawn method (by
`loom.launch(fn)`) can import it, and scripts written by the tests share the very same code."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
from torch import nn

RESULT_TAG = "TORCHLOOM_RESULT "
READY_TAG = "TORCHLOOM_READY "
FAILING_TAG = "TORCHLOOM_FAILING_AT "
LATE_TIMEOUT_S = 3  # Loom(timeout=...) of mode "late"

# The script every launch path runs; `{tests}` is this directory. argv[1] picks what the ranks do.
SCRIPT = """\
import sys
sys.path.insert(0, {tests!r})
from launch_helpers import script_main
script_main(sys.argv[1])
"""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))


def train_and_report(loom: Any) -> dict[str, Any]:
    """One DDP step on rank-dependent data; report where this rank is and what it computed."""
    model = _model()
    model, opt = loom.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    loom.backward(model(_batch(loom.global_rank)).pow(2).mean())
    opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "rank": loom.global_rank,
        "local_rank": loom.local_rank,
        "node_rank": loom.node_rank,
        "world_size": loom.world_size,
        "environment": type(loom.strategy.cluster_environment).__name__,
        "strategy": loom.strategy.name,
        "pid": os.getpid(),
        "ranks_seen": loom.all_gather(torch.tensor([loom.global_rank])).flatten().tolist(),
        "pids": loom.all_gather(torch.tensor([os.getpid()])).flatten().tolist(),
        "params": flat.tolist(),
        "params_sum_over_ranks": loom.all_reduce(flat, reduce_op="sum").tolist(),
    }


def reference_params(world_size: int = 2) -> list[float]:
    """Plain torch: the same step on the concatenated batches of all ranks."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.cat([_batch(r) for r in range(world_size)])
    model(batch).pow(2).mean().backward()
    opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def misbehave(loom: Any, mode: str) -> None:
    """Rank 1 fails in the way `mode` says once the process group is up; rank 0 waits in a collective."""
    loom.barrier()  # both ranks have joined the process group
    if loom.global_rank == 1:
        time.sleep(0.5)  # let rank 0 enter the collective first
        _say(f"{FAILING_TAG}{time.time()}")
        if mode == "raise":
            raise RuntimeError("deliberate failure on rank 1")
        if mode == "exit":
            os._exit(3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "segv":
            import ctypes

            ctypes.string_at(0)  # a real segmentation fault, as from a broken extension
        if mode == "oom":
            torch.empty(2**42, dtype=torch.uint8)  # 4 TiB: the allocator refuses, as when one rank runs out
        raise ValueError(f"unknown mode {mode!r}")
    loom.all_reduce(torch.ones(1))  # rank 1 never joins this
    time.sleep(120)


def run_forever(loom: Any) -> None:
    """Announce readiness, then keep talking to the other rank until stopped from outside."""
    _say(f"{READY_TAG}{loom.global_rank}")
    for _ in range(1200):
        loom.all_reduce(torch.ones(1))
        time.sleep(0.1)


def fn_ok(loom: Any) -> dict[str, Any]:
    return train_and_report(loom)


def fn_fail(loom: Any, mode: str) -> None:
    misbehave(loom, mode)


def _say(line: str) -> None:
    # One write per line: ranks share the job's stdout, and a pipe keeps writes below PIPE_BUF whole.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def script_main(mode: str) -> None:
    from datetime import timedelta

    from torchloom import Loom

    if mode == "late":
        # Rank 1 reaches Loom(...) 3 s after rank 0's timeout has run out (a slow import, a slow node).
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == "1":
            time.sleep(LATE_TIMEOUT_S + 3)
        loom = Loom(accelerator="cpu", devices=2, timeout=timedelta(seconds=LATE_TIMEOUT_S))
    else:
        loom = Loom(accelerator="cpu", devices=2)
    loom.launch()
    if mode in ("ok", "late"):
        _say(RESULT_TAG + json.dumps(train_and_report(loom)))
    elif mode == "forever":
        run_forever(loom)
    else:
        misbehave(loom, mode)
    sys.stdout.flush()


def failing_at(output: str) -> float:
    """When rank 1 announced its failure (wall clock), from a job's output."""
    stamps = [float(line[len(FAILING_TAG) :]) for line in output.splitlines() if line.startswith(FAILING_TAG)]
    assert len(stamps) == 1, output
    return stamps[0]


def results(output: str) -> list[dict[str, Any]]:
    """The per-rank reports in a job's output, in rank order."""
    found = [
        json.loads(line[len(RESULT_TAG) :]) for line in output.splitlines() if line.startswith(RESULT_TAG)
    ]
    return sorted(found, key=lambda r: r["rank"])
