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
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torchloom import _torch_compat
from torchloom.errors import ConfigurationError, LaunchError, MisuseError, MisuseTypeError

# Set in every process this module starts, so a rank knows it has a torchloom agent as parent.
LAUNCHED_ENV = "TORCHLOOM_LAUNCHED"
# The agent's pid, so a rank's first code can tell whether its launcher is still the one waiting for it.
AGENT_PID_ENV = "TORCHLOOM_AGENT_PID"
# Each rank starts here (see that file): it dies with the launcher from its first instant, not only from
# `loom.launch()` on. Linux only: elsewhere there is no parent-death signal to ask for.
_BOOT = str(Path(__file__).with_name("_rank_boot.py"))
_BOOTS = sys.platform.startswith("linux")
# Ports drawn for the rendezvous store before the launch gives up (each draw taken by another process first).
_PORT_DRAWS = 5

_T = TypeVar("_T")


def shutdown_timeout() -> int:
    """Seconds the agent waits after SIGTERM before SIGKILL when it stops the ranks (a failed rank, Ctrl-C,
    SIGTERM): TORCHLOOM_SHUTDOWN_TIMEOUT, default 5. Raise it to give `loom.on_preempt()` time to checkpoint."""
    return int(os.environ.get("TORCHLOOM_SHUTDOWN_TIMEOUT", "5"))


# Rendezvous backends of torch's elastic agent. Static: fixed node count, node 0's agent holds the store. The
# others let nodes join and leave between attempts.
_RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


@dataclass(frozen=True)
class Elastic:
    """torchrun's elastic options for a job that torchloom's own launcher starts (`loom.launch()`), as
    `torchloom run` takes them on its command line. Pass it as `Loom(..., elastic=Elastic(...))`.

    Args:
        max_restarts: how often the agent restarts all local ranks after one fails (torchrun `--max-restarts`).
            Each restart is a new attempt: the script runs again from its start, so it must resume from its
            newest checkpoint (`torchloom.latest_checkpoint`).
        nnodes: the node count, `N` or `"MIN:MAX"` (torchrun `--nnodes`). A range needs a rendezvous other than
            "static"; the job then starts with MIN to MAX nodes and restarts at the new count when one is lost or
            joins. Default: `Loom(num_nodes=...)`.
        rdzv_backend: "static" (torchrun's default without `--rdzv-backend`) or "c10d" (torch's elastic
            rendezvous, whose store the agent at `rdzv_endpoint` holds), or etcd's.
        rdzv_endpoint: `HOST:PORT` of the rendezvous store. Default: the job's main address and port
            (MASTER_ADDR, MASTER_PORT, or 127.0.0.1 and a free port on one node).
        rdzv_id: the job's id, the same on every node (torchrun `--rdzv-id`). Default: a fresh one on one node,
            "torchloom" with several.
        rdzv_configs: the rendezvous' settings (torchrun `--rdzv-conf`), e.g. for c10d `join_timeout` (seconds
            every attempt waits for MIN nodes, default 600), `last_call_timeout` (how long it waits for more nodes
            once MIN are there, default 30), `close_timeout` (default 30).
        monitor_interval: seconds between the agent's checks of its ranks (torchrun `--monitor-interval`): the
            delay before a failed rank is noticed.
    """

    max_restarts: int = 0
    nnodes: int | str | None = None
    rdzv_backend: str = "static"
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_configs: dict[str, Any] | None = None
    monitor_interval: float = 0.1

    def __post_init__(self) -> None:
        if (
            not isinstance(self.max_restarts, int)
            or isinstance(self.max_restarts, bool)
            or self.max_restarts < 0
        ):
            raise ConfigurationError(
                f"Elastic(max_restarts={self.max_restarts!r}) is not valid: pass a whole number >= 0."
            )
        if self.rdzv_backend not in _RDZV_BACKENDS:
            raise ConfigurationError(
                f"Elastic(rdzv_backend={self.rdzv_backend!r}) is not one of torch's rendezvous backends "
                f"{_RDZV_BACKENDS}. Use 'c10d' for an elastic job, 'static' for a fixed one."
            )
        if self.nnodes is not None:
            low, high = node_range(self.nnodes)
            if low != high and self.rdzv_backend == "static":
                raise ConfigurationError(
                    f"Elastic(nnodes={self.nnodes!r}) is a range, which the static rendezvous cannot do (its node "
                    "count is fixed). Pass rdzv_backend='c10d' with an rdzv_endpoint every node reaches."
                )
        if self.rdzv_endpoint is not None:
            _split_endpoint(self.rdzv_endpoint)
        if not self.monitor_interval > 0:
            raise ConfigurationError(
                f"Elastic(monitor_interval={self.monitor_interval!r}) is not valid: pass seconds > 0."
            )


def node_range(nnodes: int | str) -> tuple[int, int]:
    """(MIN, MAX) of torchrun's `--nnodes` value: `N` or `"MIN:MAX"`, 1 <= MIN <= MAX."""
    text = str(nnodes)
    parts = text.split(":")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        low, high = int(parts[0]), int(parts[-1])
        if 1 <= low <= high:
            return low, high
    raise ConfigurationError(
        f"nnodes={nnodes!r} is not a node count: pass N or 'MIN:MAX' with 1 <= MIN <= MAX (e.g. '1:4')."
    )


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigurationError(
            f"rdzv_endpoint={endpoint!r} is not HOST:PORT (e.g. 'node0:29400'): the address of the rendezvous "
            "store, reachable from every node."
        )
    return host, int(port)


def _launch_config(
    num_processes: int,
    num_nodes: int,
    node_rank: int,
    address: str,
    port: int,
    elastic: Elastic | None = None,
    start_method: str = "spawn",
) -> Any:
    elastic = elastic or Elastic()
    min_nodes, max_nodes = (
        node_range(elastic.nnodes) if elastic.nnodes is not None else (num_nodes, num_nodes)
    )
    run_id = elastic.rdzv_id or (f"torchloom-{uuid.uuid4().hex[:8]}" if max_nodes == 1 else "torchloom")
    if elastic.rdzv_backend == "static":
        configs: dict[str, Any] = {"rank": node_rank, "timeout": 900}
    else:
        configs = {}
    configs.update(elastic.rdzv_configs or {})
    return _torch_compat.launch_config(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=num_processes,
        run_id=run_id,
        rdzv_backend=elastic.rdzv_backend,
        rdzv_endpoint=elastic.rdzv_endpoint or f"{address}:{port}",
        rdzv_configs=configs,
        max_restarts=elastic.max_restarts,
        monitor_interval=elastic.monitor_interval,
        start_method=start_method,
        shutdown_timeout=shutdown_timeout(),
    )


# Signals the agent passes on to its ranks instead of dying of them: SLURM's `--signal=USR1@SECONDS` warning
# before the time limit reaches every process of the step, the agent included, and `kill -USR1 <agent>` (or
# `sbatch --signal=B:USR1@...` to a batch script that execs the launcher) reaches only the agent. SIGTERM and
# SIGINT stay torch's: its agent stops the ranks (SIGTERM, then SIGKILL after `shutdown_timeout()`).
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# Helper processes multiprocessing starts beside the ranks: never signalled.
_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


@contextlib.contextmanager
def forwarding_signals_to_ranks() -> Generator[None, None, None]:
    """While the agent runs, SIGUSR1/SIGUSR2 sent to it go to its ranks (`loom.on_preempt()` catches them) and
    do not kill it. Linux only (children are found in /proc); elsewhere the signals keep their default."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _child_pids() -> list[int]:
    """This process's children (the ranks), multiprocessing's helpers left out."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")".
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if not any(helper in cmdline for helper in _HELPERS):
            found.append(int(entry))
    return found


def avoid_shared_rendezvous_store(rdzv_backend: str | None) -> None:
    """Before an elastic rendezvous (c10d, etcd), have torch's agents give the ranks a store of their own each
    attempt instead of sharing the rendezvous' TCPStore (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, unless set).

    With the shared store (torch 2.4 and later), a node joining a running job hangs: the agent that stays rank 0
    reuses the store address it published in an earlier round and never publishes it in the new round, where
    the joining agent waits for it (`DistStoreError: wait timeout ... MASTER_ADDR`, torch 2.13,
    DynamicRendezvousHandler.next_rendezvous). The ranks then start on a fresh store on node 0 each attempt."""
    if rdzv_backend not in (None, "static"):
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def script_command() -> list[str]:
    """The interpreter arguments that re-run this process's script, e.g. ["-u", "train.py", "--lr", "3"]."""
    if not sys.argv or sys.argv[0] in ("", "-c"):
        # A TypeError too, as Fabric refuses launch() without a function where it cannot start ranks without one.
        raise MisuseTypeError(
            "loom.launch() cannot re-run this program once per rank: it was not started from a script "
            "(interactive session or `python -c`). Use `loom.launch(fn)` with a function defined in a module, "
            "or `torchloom run script.py`."
        )
    # orig_argv keeps interpreter options and `-m module`, so each rank starts exactly as this process did.
    return list(sys.orig_argv[1:])


def on_a_free_port(
    start: Callable[[int | None], _T], port: int | None, redraw: Callable[[], int] | None
) -> _T:
    """`start(port)`, which runs torch's agent with its rendezvous store at `port`.

    Where torchloom drew the port itself (`redraw` given), another process can bind it between the draw and the
    agent's bind. The agent then fails to listen before it starts any rank, so the launch is tried again on a
    new draw. A port the user chose is the user's: its failure is raised as it is."""
    for draw in range(1, _PORT_DRAWS + 1):
        try:
            return start(port)
        except Exception as error:
            if redraw is None or draw == _PORT_DRAWS or not port_taken(error):
                raise
            taken, port = port, redraw()
            print(
                f"torchloom: port {taken}, drawn for the rendezvous, was taken before the agent could listen on "
                f"it; starting again on port {port}.",
                file=sys.stderr,
                flush=True,
            )
    raise AssertionError("unreachable")


def port_taken(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from: the c10d rendezvous wraps the store's) is a store's
    failure to listen on a port another process holds. A rank's failure (ChildFailedError) never is, whatever
    its message says: its job ran, and is not started again."""
    import torch.distributed as dist

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, dist.DistNetworkError) and "EADDRINUSE" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def launch_script(
    num_processes: int,
    num_nodes: int,
    node_rank: int,
    address: str,
    port: int,
    elastic: Elastic | None = None,
    redraw: Callable[[], int] | None = None,
) -> None:
    """Run this script once per local rank and exit with the job's status; never returns. `redraw`: where
    torchloom drew `port` itself, how to draw another if it was taken (`on_a_free_port`)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    command = script_command()
    os.environ[LAUNCHED_ENV] = "1"
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    if _BOOTS:
        command = ["-S", _BOOT, *command]

    def start(port: int | None) -> None:
        assert port is not None
        config = _launch_config(num_processes, num_nodes, node_rank, address, port, elastic)
        avoid_shared_rendezvous_store(config.rdzv_backend)
        elastic_launch(config, sys.executable)(*command)

    try:
        with forwarding_signals_to_ranks():
            on_a_free_port(start, port, redraw)
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


def check_fork_is_safe(fn: Callable[..., Any] | None) -> None:
    """Refuse a forked launch (strategy "ddp_fork" / "ddp_notebook") where the ranks could not work: without a
    function to run, after CUDA was initialised in this process (a forked child cannot use it, as torch
    documents), or while this process holds a process group (each rank would inherit a copy of it)."""
    import torch
    import torch.distributed as dist

    if fn is None:
        raise MisuseError(
            "strategy='ddp_notebook' (or 'ddp_fork') forks ranks that run a function: call loom.launch(train) "
            "with train(loom, ...) defined anywhere, even in a notebook cell."
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise MisuseError(
            "CUDA was initialised in this process before loom.launch(), so forked ranks cannot use it (a CUDA "
            "context does not survive fork). Restart the kernel and call loom.launch(fn) before anything touches "
            "the GPU, or run a script with strategy='ddp'."
        )
    if dist.is_available() and dist.is_initialized():
        raise MisuseError(
            "This process still holds a process group (an earlier Loom or init_process_group), which forked ranks "
            "would inherit. Call close() on the earlier Loom (or destroy_process_group()) before loom.launch(fn)."
        )


def _die_with_agent() -> None:
    """A forked rank starts without `_rank_boot`: ask here to be killed when the agent (its parent) dies."""
    if not _BOOTS:
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    agent = os.environ.get(AGENT_PID_ENV)
    if agent and os.getppid() != int(agent):
        os._exit(1)  # the agent died before the request above took effect


def _run_function(loom: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    # Runs in each rank (spawned, or forked for "ddp_notebook"): the Loom learns its rank from the agent's
    # environment.
    _die_with_agent()
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
    elastic: Elastic | None = None,
    start_method: str = "spawn",
    redraw: Callable[[], int] | None = None,
) -> Any:
    """Run `fn(loom, *args)` on every local rank, started with `start_method` ("spawn", or "fork" for
    notebooks); return rank 0's result or raise `LaunchError`. `redraw`: as for `launch_script`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    def start(port: int | None) -> Any:
        assert port is not None
        config = _launch_config(num_processes, num_nodes, node_rank, address, port, elastic, start_method)
        avoid_shared_rendezvous_store(config.rdzv_backend)
        return elastic_launch(config, _run_function)(loom, fn, args)

    previous = {key: os.environ.get(key) for key in (LAUNCHED_ENV, AGENT_PID_ENV)}
    os.environ[LAUNCHED_ENV] = "1"
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    try:
        with _spawned_ranks_boot(), forwarding_signals_to_ranks():
            results = on_a_free_port(start, port, redraw)
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
            # Written aside and renamed into place: the agent reads the file as soon as it sees the rank fail (a
            # peer's death may come first), and an empty file it opened between our open and write crashed it
            # (torchelastic's JSONDecodeError), ending the whole replica group for good.
            partial = f"{error_file}.{os.getpid()}.partial"
            try:
                with open(partial, "w") as f:
                    json.dump(data, f)
                os.replace(partial, error_file)
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
