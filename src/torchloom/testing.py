"""What tests and benchmarks need to run code on several local CPU ranks without a launcher: a free port, the
environment torchrun would give each rank, the end of a rank, and `run_ranks`, which runs a function on fresh
rank processes and brings back each rank's result. Not part of the training API."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import queue as queue_module
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: How long a finished rank of a test job waits for its peers before it tears its process group down anyway.
END_TIMEOUT = timedelta(seconds=30)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a job that binds it itself (torchrun's
    `--master-port`): drawn below the kernel's ephemeral range (`environments.find_free_port`)."""
    from torchloom.environments import find_free_port

    return find_free_port("127.0.0.1")


def rank_environment(rank: int, world_size: int, port: int, agent_store: bool = False) -> dict[str, str]:
    """The variables torchrun sets for a rank of a one-node job, so `Loom(...).launch()` (or
    `init_process_group("gloo")`) joins the job's process group. `agent_store`: the store at `port` is hosted
    by the launcher (as torchrun's agent does), so every rank connects to it as a client."""
    return {
        **({"TORCHELASTIC_USE_AGENT_STORE": "True"} if agent_store else {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def end_rank(world_size: int, failed: bool) -> None:
    """Destroy this rank's process group, if any. A rank that finished waits for its peers first (as
    `Loom.close()` does), so no peer is cut off inside a collective; a failed one does not wait."""
    import torch.distributed as dist

    from torchloom.strategies.parallel import shutdown_process_group

    if not dist.is_initialized():
        return
    if failed:
        dist.destroy_process_group()
    else:
        shutdown_process_group(world_size, END_TIMEOUT)


def _stacks_of(procs: dict[int, Any], folder: str) -> str:
    """Every thread's Python stack of each live rank (asked for with SIGUSR1, written to its file)."""
    for p in procs.values():
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = []
    for r in procs:
        try:
            with open(f"{folder}/rank{r}.txt") as f:
                out.append(f"--- rank {r} ---\n{f.read().strip() or '(no stack written)'}")
        except OSError:
            out.append(f"--- rank {r} ---\n(no stack written)")
    return "\n".join(out)


class RanksFailed(AssertionError):
    """A rank of `run_ranks` raised, or died without reporting, or the ranks ran past their timeout. Every rank
    has been stopped. An AssertionError, so a test that runs ranks fails (rather than errors) on it."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    environ: dict[str, str],
    stacks: str,
) -> None:
    import multiprocessing

    import torch

    # A forkserver child inherits the server's environment, not the caller's: take the caller's as it is now
    # (what a spawned child would see), then add the environment torchrun gives a rank, so `Loom(...).launch()`
    # inside `fn` joins this job's process group.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(rank_environment(rank, world_size, port, agent_store=True))
    # multiprocessing makes the method that started this rank its default; a rank that torchrun starts has the
    # platform's, with which its DataLoader workers start: fork on Linux, not a fork server of the rank's own or
    # an interpreter each (seconds per worker).
    multiprocessing.set_start_method(None, force=True)
    # A rank past the job's timeout is asked (SIGUSR1) for every thread's stack before it is killed: where it
    # waited is what a hang's report needs. (To a file: a fork server's stderr is not the caller's.)
    stack_file = open(stacks, "w")  # noqa: SIM115 - open until the process ends, for the signal handler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(1)  # the ranks share the machine's cores: more threads per rank only add contention
    failed = True
    try:
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put((rank, True, buffer.getvalue()))
        failed = False
    except BaseException:  # noqa: BLE001 - everything goes back to the caller
        results.put((rank, False, traceback.format_exc()))
    finally:
        end_rank(world_size, failed)


#: What the fork server imports once, so that a rank started from it has them already. torch imports dynamo
#: lazily on a rank's first optimizer and DTensor on its first FSDP call: seconds per rank on a busy machine.
_FORKSERVER_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torchloom",
]


def preload(*modules: str) -> None:
    """Have the fork server that starts `run_ranks`'s ranks import `modules` too (e.g. the model library the
    ranks' code imports), so no rank imports them again. Call it before the first `run_ranks` of the process:
    the server reads the list when it starts. A module that cannot be imported is skipped there."""
    _FORKSERVER_PRELOAD.extend(m for m in modules if m not in _FORKSERVER_PRELOAD)


def _default_start_method(mp: Any) -> str:
    """`TORCHLOOM_TEST_START_METHOD` if set; else the fork server, except where this process sees a GPU: there
    ranks are spawned fresh, since whether the server's imports leave CUDA usable in forked ranks has been
    checked on CPU-only machines only."""
    import torch

    chosen = os.environ.get("TORCHLOOM_TEST_START_METHOD")
    if chosen:
        return chosen
    if torch.cuda.is_available() or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    return "forkserver"


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh local processes (a process group's environment
    set, one thread each) and return their results in rank order. A rank that raises (its traceback is in the
    message), dies without reporting, or a job past `timeout` seconds stops every rank and raises `RanksFailed`.

    By default the ranks start from a fork server that imported torch and torchloom once (where the platform
    has one and no GPU is visible; spawn elsewhere, or as `TORCHLOOM_TEST_START_METHOD` says): a rank starts in a fraction of a second instead of importing torch again, and
    since the server never runs a torch op nor touches CUDA, the ranks may use CUDA whatever the caller did.
    Each rank gets the caller's environment as it is at the call and, as under torchrun, the platform's default
    start method for the processes it starts itself (DataLoader workers). `start_method="spawn"` gives a completely
    fresh interpreter; `"fork"` starts ranks from the caller itself, where the caller never touched CUDA."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method or _default_start_method(mp))
    if ctx.get_start_method() == "forkserver":
        # Read when the server starts (once per caller process); later calls change nothing.
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    results = ctx.Queue()
    # The job's store is hosted here, on a port the kernel picks and that stays bound for the whole job, as
    # torchrun's agent does: a port picked, released and bound again by rank 0 could be taken in between.
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    environ = dict(os.environ)
    stacks = tempfile.mkdtemp(prefix="torchloom-stacks-")
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, r, world_size, port, args, results, environ, f"{stacks}/rank{r}.txt")
        )
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
                raise RanksFailed(
                    f"ranks {missing} did not finish within {timeout:.0f}s (killed). Where they were:\n"
                    + _stacks_of({r: procs[r] for r in missing}, stacks)
                )
            try:
                rank, ok, payload = results.get(timeout=min(0.2, remaining))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if not dead:
                    continue
                try:  # it may have reported just before exiting
                    rank, ok, payload = results.get(timeout=1.0)
                except queue_module.Empty:
                    code = procs[dead[0]].exitcode
                    raise RanksFailed(
                        f"rank {dead[0]} died with exit code {code} without reporting"
                    ) from None
            if not ok:
                raise RanksFailed(f"rank {rank} failed:\n{payload}")
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=10 if len(done) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(stacks, ignore_errors=True)
    return [done[r] for r in range(world_size)]
