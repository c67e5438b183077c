"""Run test bodies on several real CPU ranks (gloo), and scripts as real jobs, never hanging the suite.

`run_ranks(body, world_size)` spawns one process per rank with the torchrun-style environment set, so the body's
`Loom(...).launch()` joins a real process group. A rank's exception comes back as an AssertionError naming the
rank, with its traceback; a rank that dies without reporting, or a job past its timeout, kills every rank.

`run_job(cmd)` runs a command in its own session with a unique token in its environment, so a test can prove
that no process of the job is left afterwards (`stray_processes`).
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from torchloom.testing import end_rank, free_port, rank_environment  # noqa: F401 - free_port is re-exported

REPO = Path(__file__).resolve().parents[1]
TOKEN_ENV = "TORCHLOOM_TEST_TOKEN"


def _rank_main(
    body: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any
) -> None:
    os.environ.update(rank_environment(rank, world_size, port))
    # Ranks share 2 cores: more threads per rank only adds contention.
    torch.set_num_threads(1)
    failed = True
    try:
        result = body(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put((rank, True, buffer.getvalue()))
        failed = False
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        end_rank(world_size, failed)


def run_ranks(body: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 120) -> list[Any]:
    """Run `body(rank, world_size, *args)` on `world_size` ranks; return the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(body, r, world_size, port, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s (killed)")
            try:
                rank, ok, payload = results.get(timeout=min(0.2, remaining))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if dead:
                    try:  # it may have reported just before exiting
                        rank, ok, payload = results.get(timeout=1.0)
                    except queue_module.Empty:
                        r = dead[0]
                        raise AssertionError(
                            f"rank {r} died with exit code {procs[r].exitcode} without reporting"
                        ) from None
                else:
                    continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if len(done) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [done[r] for r in range(world_size)]


def run_job(
    cmd: list[str], timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run `cmd` in a new session; on timeout kill it all. Returns the result and the job's token."""
    token = uuid.uuid4().hex
    full_env = {**os.environ, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        if env is None or key not in env:
            full_env.pop(key, None)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd or REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_token(token)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} did not finish within {timeout}s; output:\n{out}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None), token


def stray_processes(token: str) -> list[int]:
    """PIDs of live processes that carry `token` in their environment (ranks start in sessions of their own)."""
    found = []
    needle = f"{TOKEN_ENV}={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_no_strays(token: str, within: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within
    while (left := stray_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_token(token: str) -> None:
    for pid in stray_processes(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


PYTHON = sys.executable
