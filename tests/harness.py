"""Run test bodies on several real CPU ranks (gloo), and scripts as real jobs, never hanging the suite.

`run_ranks(body, world_size)` spawns one process per rank with the torchrun-style environment set, so the body's
`Loom(...).launch()` joins a real process group. A rank's exception comes back as an AssertionError naming the
rank, with its traceback; a rank that dies without reporting, or a job past its timeout, kills every rank.

`run_job(cmd)` runs a command in its own session with a unique token in its environment, so a test can prove
that no process of the job is left afterwards (`stray_processes`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchloom import testing
from torchloom.testing import free_port  # noqa: F401 - re-exported for the tests

REPO = Path(__file__).resolve().parents[1]
TOKEN_ENV = "TORCHLOOM_TEST_TOKEN"


def run_ranks(body: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 120) -> list[Any]:
    """Run `body(rank, world_size, *args)` on `world_size` spawned ranks; return the per-rank results in rank
    order (`torchloom.testing.run_ranks`)."""
    return testing.run_ranks(body, *args, world_size=world_size, timeout=timeout)


def run_job(
    cmd: list[str], timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run `cmd` in a new session; on timeout kill it all. Returns the result and the job's token."""
    token = uuid.uuid4().hex
    # PYTHONFAULTHANDLER: a job past its timeout is asked (SIGABRT) for every process's Python stacks first.
    full_env = {
        **os.environ,
        TOKEN_ENV: token,
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
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
        _dump_stacks(token)
        kill_token(token)
        out, _ = proc.communicate()
        raise AssertionError(
            f"{cmd} did not finish within {timeout}s; output (each process's stacks at the end):\n{out}"
        ) from None
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


def _dump_stacks(token: str) -> None:
    """Ask every process of the job for its Python stacks (faulthandler writes them to the job's output on
    SIGABRT), so a hang says where each process was."""
    for pid in stray_processes(token):
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    time.sleep(2)


def kill_token(token: str) -> None:
    for pid in stray_processes(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


PYTHON = sys.executable
