"""Starting the local ranks with PyTorch's elastic launcher (the machinery behind `torchrun`).

Two ways in: `launch_script` re-runs the user's own command line once per rank (a plain `python train.py`
becomes N ranks), and `launch_function` runs a picklable function on every rank. In both the launching process
becomes the elastic agent: it watches the ranks, stops all of them as soon as one fails, and reports the failing
rank with its traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from torchloom import _torch_compat
from torchloom.errors import LaunchError, MisuseError

# Set in every process this module starts, so a rank knows it has a torchloom agent as parent.
LAUNCHED_ENV = "TORCHLOOM_LAUNCHED"
# The agent's pid, so a rank's first code can tell whether its launcher is still the one waiting for it.
AGENT_PID_ENV = "TORCHLOOM_AGENT_PID"
# Each rank starts here (see that file): it dies with the launcher from its first instant, not only from
# `loom.launch()` on. Linux only: elsewhere there is no parent-death signal to ask for.
_BOOT = str(Path(__file__).with_name("_rank_boot.py"))
_BOOTS = sys.platform.startswith("linux")


def shutdown_timeout() -> int:
    """Seconds the agent waits after SIGTERM before SIGKILL when it stops the ranks (a failed rank, Ctrl-C,
    SIGTERM): TORCHLOOM_SHUTDOWN_TIMEOUT, default 5. Raise it to give `loom.on_preempt()` time to checkpoint."""
    return int(os.environ.get("TORCHLOOM_SHUTDOWN_TIMEOUT", "5"))


def _launch_config(num_processes: int, num_nodes: int, node_rank: int, address: str, port: int) -> Any:
    return _torch_compat.launch_config(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        run_id=f"torchloom-{uuid.uuid4().hex[:8]}" if num_nodes == 1 else "torchloom",
        rdzv_backend="static",
        rdzv_endpoint=f"{address}:{port}",
        rdzv_configs={"rank": node_rank, "timeout": 900},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=shutdown_timeout(),
    )


def script_command() -> list[str]:
    """The interpreter arguments that re-run this process's script, e.g. ["-u", "train.py", "--lr", "3"]."""
    if not sys.argv or sys.argv[0] in ("", "-c"):
        raise MisuseError(
            "loom.launch() cannot re-run this program once per rank: it was not started from a script "
            "(interactive session or `python -c`). Use `loom.launch(fn)` with a function defined in a module, "
            "or `torchloom run script.py`."
        )
    # orig_argv keeps interpreter options and `-m module`, so each rank starts exactly as this process did.
    return list(sys.orig_argv[1:])


def launch_script(num_processes: int, num_nodes: int, node_rank: int, address: str, port: int) -> None:
    """Run this script once per local rank and exit with the job's status; never returns."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    command = script_command()
    config = _launch_config(num_processes, num_nodes, node_rank, address, port)
    os.environ[LAUNCHED_ENV] = "1"
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    if _BOOTS:
        command = ["-S", _BOOT, *command]
    try:
        elastic_launch(config, sys.executable)(*command)
    except ChildFailedError as error:
        print(_describe_failure(error), file=sys.stderr, flush=True)
        raise SystemExit(_exit_status(error)) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as error:  # SignalException and rendezvous errors: the agent stopped the ranks already
        if type(error).__name__ == "SignalException":
            raise SystemExit(128 + int(getattr(error, "sigval", signal.SIGTERM))) from None
        raise
    raise SystemExit(0)


# Seconds a rank whose collective broke because a peer died waits before failing itself. Under launch(fn) the
# agent reports only the first failed rank it sees, so the rank that really failed must get there first.
_PEER_FAILURE_GRACE = 3.0


def _run_function(loom: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    # Runs in each spawned rank: the pickled Loom learns its rank from the agent's environment.
    loom._setup_rank()
    try:
        result = fn(loom, *args)
    except BaseException as error:
        loom.strategy.failed = True
        if _is_peer_failure(f"{type(error).__name__}: {error}"):
            # The agent stops this rank meanwhile, as soon as it sees the peer's failure.
            time.sleep(_PEER_FAILURE_GRACE)
        raise
    loom.close()  # every rank finished: end the job together, not at interpreter exit
    return result


def launch_function(
    loom: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    num_processes: int,
    num_nodes: int,
    node_rank: int,
    address: str,
    port: int,
) -> Any:
    """Run `fn(loom, *args)` on every local rank; return rank 0's result or raise `LaunchError`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = _launch_config(num_processes, num_nodes, node_rank, address, port)
    previous = {key: os.environ.get(key) for key in (LAUNCHED_ENV, AGENT_PID_ENV)}
    os.environ[LAUNCHED_ENV] = "1"
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    try:
        with _spawned_ranks_boot():
            results = elastic_launch(config, _run_function)(loom, fn, args)
    except ChildFailedError as error:
        rank, failure = _root_failure(error)
        message = _describe_failure(error, with_traceback=True)
        raise LaunchError(message, rank=rank, exitcode=failure.exitcode) from None
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results.get(0) if results else None


@contextlib.contextmanager
def _spawned_ranks_boot() -> Generator[None, None, None]:
    """Inside, processes started with multiprocessing's spawn method (how the agent starts `launch(fn)`'s
    ranks) begin in `_rank_boot.py`. multiprocessing takes one executable path and no extra arguments, so
    the path is a two-line shell script in a temporary directory."""
    if not _BOOTS:
        yield
        return
    import multiprocessing.spawn as mp_spawn

    with tempfile.TemporaryDirectory(prefix="torchloom-") as tmp:
        wrapper = Path(tmp) / "python"
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S {shlex.quote(_BOOT)} "$@"\n')
        wrapper.chmod(0o755)
        previous = mp_spawn.get_executable()
        mp_spawn.set_executable(str(wrapper))
        try:
            yield
        finally:
            mp_spawn.set_executable(previous)


# What a rank reports when a collective broke because another rank died: a consequence, not the cause.
_PEER_FAILURE_SIGNS = (
    "closed by peer",
    "reset by peer",
    "remote worker crashing",
    "broken pipe",
    "communicator was aborted",
)


def _root_failure(error: Any) -> tuple[int, Any]:
    """The rank whose failure started it all.

    torchelastic's `get_first_failure` orders failures by timestamps in whole seconds, so when rank 1 dies and
    rank 0's collective fails because of it in the same second, it names rank 0. Rank these instead: a rank that
    failed on its own (its own exception, exit code or signal) comes before one whose collective broke because a
    peer vanished, which comes before one the agent terminated while stopping the job; then by time and rank.
    """

    def kind(failure: Any) -> int:
        if failure.exitcode == -signal.SIGTERM:
            return 2
        return 1 if _is_peer_failure(_failure_text(failure)) else 0

    return min(error.failures.items(), key=lambda item: (kind(item[1]), item[1].timestamp, item[0]))


def _is_peer_failure(text: str) -> bool:
    text = text.lower()
    return any(sign in text for sign in _PEER_FAILURE_SIGNS)


def _failure_text(failure: Any) -> str:
    message = (failure.error_file_data or {}).get("message")
    if isinstance(message, dict):
        return f"{message.get('message', '')}\n{message.get('extraInfo', {}).get('py_callstack', '')}"
    return str(message or "")


def _exit_status(error: Any) -> int:
    _, failure = _root_failure(error)
    return failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1


def _describe_failure(error: Any, with_traceback: bool = False) -> str:
    """Name the first failing rank and its error (from the error file the rank wrote). The rank printed its own
    traceback already (its output goes to the launcher's terminal), so by default the summary points there instead
    of printing it a second time; `with_traceback` adds it (for a `LaunchError`, whose message may be read apart
    from that output)."""
    rank, failure = _root_failure(error)
    lines = [f"torchloom: rank {rank} failed (exit code {failure.exitcode}, pid {failure.pid})."]
    if failure.exitcode is not None and failure.exitcode < 0:
        try:
            lines.append(f"It was killed by signal {signal.Signals(-failure.exitcode).name}.")
        except ValueError:
            pass
    data = failure.error_file_data or {}
    message = data.get("message")
    if isinstance(message, dict):
        trace = message.get("extraInfo", {}).get("py_callstack")
        if trace and with_traceback:
            lines.append(f"Traceback of rank {rank}:\n{trace}")
        else:
            lines.append(f"{message.get('message', '')}\n(its traceback is in rank {rank}'s output above)")
    elif message and message != _NO_ERROR_FILE:
        lines.append(str(message))
    else:
        # The rank ended without writing its error (a signal, os._exit, a crash in native code): torch elastic
        # would show "<NONE>" here.
        lines.append(f"No Python traceback was recorded; rank {rank}'s output above shows what it printed.")
    others = sorted(r for r in error.failures if r != rank)
    if others:
        lines.append(f"{_plural(len(others), 'Rank', 'Ranks')} {', '.join(map(str, others))} also stopped.")
    return "\n".join(lines)


# torch elastic's placeholder message for a rank that wrote no error file.
_NO_ERROR_FILE = "<NONE>"


def _plural(count: int, one: str, many: str) -> str:
    return one if count == 1 else many


def record_errors_in_rank() -> None:
    """Under an elastic agent, write an uncaught exception to the agent's error file, so the agent can show
    which rank failed and why. Also die with the agent: a rank must not outlive a killed launcher."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        previous = sys.excepthook

        def hook(exc_type: Any, exc: Any, tb: Any) -> None:
            # The JSON layout torchelastic's agent reads back (what its @record decorator writes).
            data = {
                "message": {
                    "message": f"{exc_type.__name__}: {exc}",
                    "extraInfo": {
                        "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
                        "timestamp": str(int(time.time())),
                    },
                }
            }
            try:
                with open(error_file, "w") as f:
                    json.dump(data, f)
            except OSError:
                pass
            previous(exc_type, exc, tb)

        sys.excepthook = hook
    if os.environ.get(LAUNCHED_ENV) == "1":
        _die_with_parent()


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass
