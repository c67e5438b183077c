"""The collective record and the desync report: when ranks stop agreeing, say which rank is at fault and where.

Every collective a rank enters through `Loom` is recorded (name, sequence number, tensor shapes and dtypes, and
the user's call site): a few attribute writes and set look-ups, always on. When a collective fails (it timed
out, or a peer died in it), the failing rank asks every rank, through the job's TCP store (which outlives a
wedged process group), for its last collective and its main thread's Python stack. A watchdog thread per rank
answers, so a rank stuck in user code or in another collective answers too. The first rank to ask prints one
report, `torchloom desync report`, ending in a `culprit:` line, which its exception repeats.

A rank can also die in a mismatched collective before it can answer (gloo aborts a rank that receives more bytes
than it expects). So the first time a rank takes a new path through its collectives (a call site after another
it never followed, or new shapes at a call site), it writes that record to the store before entering: rare
after the first step, and enough for the report to name the shapes a dead rank passed.

On NCCL a collective returns as soon as it is queued on the GPU, and the process group's own watchdog aborts the
process when one does not complete in time, before any Python exception could ask for a report. There the
record follows each collective with a CUDA event, and the rank's watchdog thread starts the report itself once a
collective has been pending for the job's timeout; the process group's timeout is set a little longer
(`NCCL_REPORT_GRACE`), so the report is out before NCCL aborts the rank.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Generator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

_TORCHLOOM_DIR = str(Path(__file__).resolve().parent) + os.sep
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
# A call site is the first frame outside these: the user's line, not the library code that serves it.
_INTERNAL = (_TORCHLOOM_DIR, _TORCH_DIR)
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep

# How often a watchdog looks for a report request (one store round trip, ~40 us), and how long the asking
# rank waits for the answers. A live rank answers within one poll; the wait is for a rank that never will.
_POLL_SECONDS = 0.5
_ANSWER_SECONDS = 3.0
# A rank publishes at most this many new paths: code whose shapes change every call must not talk to the
# store every call.
_MAX_PUBLISHED = 1000
# On NCCL the process group times out this much later than the job's timeout, when torchloom's own watchdog
# starts the report: the answers take at most `_ANSWER_SECONDS`, the printing well under a second.
NCCL_REPORT_GRACE = timedelta(seconds=15)


class CollectiveRecord:
    """What this rank last asked of the others. `with record("all_reduce", data):` around a collective."""

    def __init__(self) -> None:
        self.seq = 0
        # One tuple, replaced whole, so the watchdog thread never reads half an update:
        # (seq, name, shapes, detail, file, line, function, new_path, new_site, new_shape).
        self.last: tuple[Any, ...] | None = None
        self.inside = False
        self.entered = 0.0  # time.monotonic() when the last collective was entered
        # Collectives that return before they complete (NCCL): (record, event, entered) of each one whose event
        # has not been seen complete, oldest first. `device_event` makes and records the event.
        self.device_event: Callable[[], Any] | None = None
        self._pending: collections.deque[tuple[tuple[Any, ...], Any, float]] = collections.deque()
        self._pending_lock = threading.Lock()
        self._site: tuple[str, int] | None = None
        self._seen: set[Any] = set()
        self._published = 0
        self.store: Any = None
        self.namespace = "torchloom"
        # `meet`: how many times this rank entered each call that every rank must make, and the one it is in.
        self.meetings: dict[str, int] = {}
        self.meeting: tuple[str, int] | None = None
        # Set during `loom.backward` when the backward synchronises gradients across ranks (DDP).
        self.backward_syncs = False
        self.rank = 0
        self.world_size = 1
        #: The strategy's device mesh, (dim names, sizes), for the report to place each rank on it
        #: ("model_parallel": which tensor-parallel group a stuck rank belongs to). None: no named mesh.
        self.mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None

    def __call__(self, name: str, data: Any = None, detail: str = "") -> CollectiveRecord:
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
            frame = frame.f_back
        code = frame.f_code
        site = (code.co_filename, frame.f_lineno)
        shapes = _shapes(data)
        # New paths are what a desync looks like from one rank: a call site it never reached right after the
        # previous one (a skipped or extra collective), or shapes it never passed at this site.
        seen = self._seen
        path, shape = (self._site, site), (site, shapes, detail)
        new_path, new_site, new_shape = path not in seen, site not in seen, shape not in seen
        self.seq += 1
        self._site = site
        self.last = (self.seq, name, shapes, detail, *site, code.co_name, new_path, new_site, new_shape)
        self.entered = time.monotonic()
        self.inside = True
        # Past the cap the set stops growing: such a rank's later paths all count as new, but are not published.
        if (new_path or new_shape) and self._published < _MAX_PUBLISHED:
            seen.update((path, site, shape))
            self._published += 1
            self._publish(frame)
        return self

    def __enter__(self) -> CollectiveRecord:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.device_event is not None and exc_type is None and self.last is not None:
            # Queued, not done: the collective stays this rank's current one until its event completes.
            pending = (self.last, self.device_event(), self.entered)
            if len(self._pending) >= 16:
                self._oldest_pending()  # completed ones go; no watchdog may be polling
            with self._pending_lock:
                self._pending.append(pending)
        self.inside = False

    def _oldest_pending(self) -> tuple[tuple[Any, ...], Any, float] | None:
        """The oldest collective queued on the device that has not completed (forgetting those that have)."""
        if not self._pending:
            return None
        with self._pending_lock:
            while self._pending and self._pending[0][1].query():
                self._pending.popleft()
            return self._pending[0] if self._pending else None

    def overdue(self, seconds: float) -> bool:
        """Whether this rank's current collective has waited longer than `seconds` (in it, or queued)."""
        now = time.monotonic()
        pending = self._oldest_pending()
        if pending is not None:
            return now - pending[2] > seconds
        entered = self.entered
        return self.inside and now - entered > seconds

    def _publish(self, frame: Any) -> None:
        if self.store is None:
            return
        try:
            self.store.set(_key(f"published/{self.rank}"), json.dumps(self.snapshot(frame, "published")))
        except Exception:  # noqa: BLE001 - a diagnostic must never break training
            self.store = None

    def snapshot(self, frame: Any, how: str) -> dict[str, Any]:
        """This rank's last collective and the user's stack from `frame`, as the report needs it."""
        pending = self._oldest_pending()
        last, inside = (pending[0], True) if pending is not None else (self.last, self.inside)
        out: dict[str, Any] = {"rank": self.rank, "how": how, "inside": inside, "pid": os.getpid()}
        out["queued"] = pending is not None
        if last is not None:
            seq, name, shapes, detail, file, line, function, new_path, new_site, new_shape = last
            out.update(seq=seq, name=name, shapes=_describe_shapes(shapes), detail=detail, file=file)
            out.update(
                line=line, function=function, new_path=new_path, new_site=new_site, new_shape=new_shape
            )
        else:
            out.update(seq=0, name=None)
        out["stack"] = _user_stack(frame)
        # Inside one of the Loom's own calls (save, load), which runs torchloom's collectives: where in them. A rank
        # that failed in a collective is in one; another is when its innermost frame is torch.distributed's.
        out["internal"] = _library_frames(frame)
        out["in_distributed"] = how == "failed" or _in_distributed(frame)
        return out


RECORD = CollectiveRecord()


def _shapes(data: Any) -> tuple[Any, ...]:
    if isinstance(data, torch.Tensor):
        return ((data.shape, data.dtype),)
    if data is None:
        return ()
    leaves = torch.utils._pytree.tree_leaves(data)
    return tuple((t.shape, t.dtype) for t in leaves if isinstance(t, torch.Tensor))


def _describe_shapes(shapes: tuple[Any, ...]) -> str:
    return ", ".join(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in shapes)


def _user_stack(frame: Any) -> list[str]:
    """The frames of `frame`'s stack that are the user's: not torchloom's or torch's, and not the interpreter's
    start-up (runpy, multiprocessing) before the user's first frame."""
    if frame is None:
        return []
    frames, in_library = [], True  # the start-up frames count as library code
    for f in traceback.extract_stack(frame):
        if f.filename.startswith(_INTERNAL):
            in_library = True
        elif not (
            in_library and f.filename.startswith(_STDLIB)
        ):  # contextlib under torchloom is not the user's
            frames.append(f)
            in_library = False
    return [line.rstrip("\n") for line in traceback.format_list(frames)]


def _library_frames(frame: Any) -> list[str]:
    """`frame`'s frames in torchloom below the user's last frame, outermost first (`full.py:126 in save`),
    without the wrapper that turns a collective's failure into an error (not a place of its own)."""
    if frame is None:
        return []
    out: list[str] = []
    for f in traceback.extract_stack(frame):
        if f.filename.startswith(_TORCHLOOM_DIR):
            if f.name not in _WRAPPERS:
                out.append(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}")
        elif not f.filename.startswith((_TORCH_DIR, _STDLIB)):
            out = []  # the user's frame: what torchloom ran before it (launch, the rank's start) does not count
    return out


# The context manager torchloom puts around each of its collectives: a rank whose collective failed reports
# from inside it, a rank still waiting does not; left out, both show the same place.
_WRAPPERS = ("_collective",)


def _in_distributed(frame: Any) -> bool:
    """Whether the innermost Python frame is torch.distributed's (a collective, FSDP's or DCP's, waiting below
    it), but not DCP writing or reading its files (working, not waiting)."""
    if frame is None:
        return False
    file = frame.f_code.co_filename
    in_torch_distributed = os.sep + os.path.join("torch", "distributed") + os.sep in file
    return in_torch_distributed and not file.endswith(os.path.join("checkpoint", "filesystem.py"))


def _key(name: str) -> str:
    # A restarted elastic job shares the agent's store with its failed attempt: the group's namespace, which no
    # other group has, keeps their keys apart (`parallel.agree_on_namespace`).
    return f"{RECORD.namespace}/desync/{name}"


# ---- the watchdog --------------------------------------------------------------------------------------------
_watchdog: _Watchdog | None = None


class _Watchdog(threading.Thread):
    """Answers a report request with this rank's record and its main thread's stack, whatever the main thread
    is doing: a blocking collective releases the GIL, and pure-Python code yields it every few milliseconds.

    With `report_after` (NCCL), it also starts the report itself when this rank's current collective has waited
    that long: there no exception reaches Python before the process group's watchdog aborts the process."""

    def __init__(self, main_thread_id: int, report_after: float | None, device: Any = None) -> None:
        super().__init__(name="torchloom-desync-watchdog", daemon=True)
        self._main = main_thread_id
        self._device = device
        self._report_after = report_after
        self._stop_event = threading.Event()

    def run(self) -> None:
        import torch.distributed as dist

        if self._device is not None and self._device.type == "cuda":
            import torch

            # The current CUDA device is per thread: querying the collectives' events from device 0 would make
            # every rank of a node create a context on GPU 0.
            torch.cuda.set_device(self._device)
        store = RECORD.store
        request, answer = _key("requests"), _key(f"answer/{RECORD.rank}")
        where_answered = 0
        while not self._stop_event.wait(_POLL_SECONDS):
            try:
                if not dist.is_initialized() or RECORD.store is None:
                    return
                asked = store.add(_key("where"), 0)
                if asked > where_answered:  # a rank in `meet` asks where this one is
                    where_answered = asked
                    where = _where_now(sys._current_frames().get(self._main), asked)
                    store.set(_key(f"where/{RECORD.rank}"), json.dumps(where))
                if store.check([request]):
                    # A main thread that failed itself has answered already, more precisely.
                    if not store.check([answer]):
                        frame = sys._current_frames().get(self._main)
                        store.set(answer, json.dumps(RECORD.snapshot(frame, "answered")))
                    return
                if self._report_after is not None and RECORD.overdue(self._report_after):
                    snapshot = RECORD.snapshot(None, "failed")
                    what = f"loom.{snapshot['name']}() #{snapshot['seq']} on rank {RECORD.rank}"
                    state = "is still queued on the device" if snapshot["queued"] else "is still waiting"
                    explain(
                        f"{what} {state} after {timedelta(seconds=self._report_after)}",
                        timed_out=True,
                        frame=sys._current_frames().get(self._main),
                    )
                    return
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=2 * _POLL_SECONDS)


def start(
    rank: int,
    world_size: int,
    namespace: str | None,
    report_after: timedelta | None = None,
    device: Any = None,
) -> None:
    """Connect this rank to the job's store and start its watchdog (once per process). Its keys go under
    `namespace`, the process group's own; without one there is no report, as an earlier group's keys could
    answer it. With `report_after`, the watchdog starts the desync report when a collective has waited that long
    (for backends whose collectives do not raise in Python when they time out: NCCL)."""
    global _watchdog
    RECORD.rank, RECORD.world_size = rank, world_size
    if _watchdog is not None and _watchdog.is_alive() or namespace is None:
        return
    RECORD.namespace = namespace
    RECORD.store = _connect()
    if RECORD.store is None:
        return
    # Tests set this to take, on gloo, the path NCCL takes: the report started by the watchdog, not by an error.
    forced = os.environ.get("TORCHLOOM_DESYNC_REPORT_AFTER")
    seconds = float(forced) if forced else report_after.total_seconds() if report_after else None
    _watchdog = _Watchdog(threading.main_thread().ident or 0, seconds, device)
    _watchdog.start()
    # Registered after the process group's own exit hook, so it runs first: the watchdog stops polling a store
    # before the group (and, on rank 0, the store's server) goes away.
    atexit.register(stop)


def stop() -> None:
    """Stop the watchdog and let go of the store (process-group teardown, and the end of the process)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    RECORD.store = None
    RECORD.device_event = None


def _connect() -> Any:
    """A client of the store the process group was made with (`env://`: MASTER_ADDR and MASTER_PORT; under an
    elastic agent, the agent's own store). A client of our own, through public API, rather than the group's
    private default store: its requests never queue behind the group's."""
    import torch.distributed as dist

    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        return None
    try:
        return dist.TCPStore(address, int(port), is_master=False, timeout=timedelta(seconds=10))
    except Exception:  # noqa: BLE001 - no report then, but training goes on
        return None


# ---- calls every rank must make together ----------------------------------------------------------------------
class PeersElsewhere(Exception):
    """`meet`: other ranks are in another call and will not come (see `ranks`, rank -> where)."""

    def __init__(self, ranks: dict[int, str]) -> None:
        super().__init__(", ".join(f"rank {r} is {where}" for r, where in sorted(ranks.items())))
        self.ranks = ranks


class PeersLate(TimeoutError):
    """`meet`: some ranks did not arrive within the timeout (`ranks`: rank -> where, where known)."""

    def __init__(self, ranks: dict[int, str]) -> None:
        super().__init__(", ".join(f"rank {r} is {where}" for r, where in sorted(ranks.items())))
        self.ranks = ranks


# How long a rank waits in `meet` before it first asks where the others are, and between asks.
_MEET_ASK_AFTER = 0.5
_MEET_ASK_EVERY = 1.0


def meet(call: str, timeout: timedelta) -> bool:
    """Wait, through the job's store, until every rank has entered its same `call` (its n-th one on each rank), so
    that a call every rank must make does not start its collectives on some ranks only: those would pair with
    whatever collectives the others are in, which gloo answers by aborting the process (SIGABRT) and NCCL by
    hanging. Costs two store round trips when the ranks arrive together.

    While it waits, it asks the other ranks' watchdogs where they are. A rank that is blocked in a collective
    (or in the job's exit), or in another such call, cannot come here: `PeersElsewhere` names them once two asks
    a second apart agree. After `timeout`, `PeersLate`. Returns True once every rank is in it; without a store (no
    process group) it returns False at once."""
    store, world_size = RECORD.store, RECORD.world_size
    if store is None or world_size < 2:
        return False
    n = RECORD.meetings.get(call, 0) + 1
    RECORD.meetings[call] = n
    RECORD.meeting = (call, n)
    arrived, everyone = _key(f"meet/{call}/{n}"), _key(f"meet/{call}/{n}/all")
    try:
        if store.add(arrived, 1) >= world_size:
            store.set(everyone, "1")
            return True
        start = time.monotonic()
        next_ask, pause = start + _MEET_ASK_AFTER, 0.001
        blocked_before: dict[int, str] = {}
        while not store.check([everyone]):
            now = time.monotonic()
            if now - start > timeout.total_seconds():
                raise PeersLate(_where_others(store, call, n)[1])
            if now >= next_ask:
                blocked, elsewhere = _where_others(store, call, n)
                # Blocked twice in the same place: not a collective among other ranks that is about to finish.
                settled = {r: w for r, w in blocked.items() if blocked_before.get(r) == w}
                if settled:
                    # For the ranks that skipped the call: their collective fails once this rank's process ends
                    # (or at its timeout), and `skipped_call` then names what they missed.
                    store.set(_key("skipped"), json.dumps({"rank": RECORD.rank, "call": call, "n": n}))
                    raise PeersElsewhere({**settled, **{r: w for r, w in elsewhere.items() if r in settled}})
                blocked_before = blocked
                next_ask = time.monotonic() + _MEET_ASK_EVERY
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return True
    finally:
        RECORD.meeting = None


def skipped_call() -> str | None:
    """On a rank whose collective failed: if another rank gave up waiting for it in a call every rank must make
    (`meet`), say so (one store round trip, on the failure path only); else None."""
    store = RECORD.store
    if store is None:
        return None
    try:
        if not store.check([_key("skipped")]):
            return None
        skipped = json.loads(store.get(_key("skipped")))
    except Exception:  # noqa: BLE001 - the store is gone with the job: no better message then
        return None
    call, rank, n = skipped["call"], skipped["rank"], skipped["n"]
    if RECORD.meetings.get(call, 0) >= n:
        return None
    return (
        f"rank {rank} waited in loom.{call}() (its call #{n}), which rank {RECORD.rank} did not make: rank "
        f"{RECORD.rank} went on to other collectives instead. Call loom.{call} on every rank at the same point "
        f"(drop any `if loom.is_global_zero:` around it)."
    )


def _where_others(store: Any, call: str, n: int) -> tuple[dict[int, str], dict[int, str]]:
    """Ask every other rank's watchdog where its main thread is. Returns (the ranks that cannot come to `call`
    #`n`: blocked in a collective, in the job's exit, or in another such call; every rank not in it, with where
    it is)."""
    asked = store.add(_key("where"), 1)
    answers: dict[int, dict[str, Any]] = {}
    others = [r for r in range(RECORD.world_size) if r != RECORD.rank]
    deadline = time.monotonic() + _POLL_SECONDS * 3
    while len(answers) < len(others) and time.monotonic() < deadline:
        for r in others:
            key = _key(f"where/{r}")
            if r not in answers and store.check([key]):
                answer = json.loads(store.get(key))
                if answer["asked"] >= asked:
                    answers[r] = answer
        time.sleep(0.02)
    blocked, elsewhere = {}, {}
    for r in others:
        answer = answers.get(r)
        if answer is None:
            elsewhere[r] = "not answering"
            continue
        meeting = answer.get("meeting")
        if meeting == [call, n]:
            continue
        where = answer["at"]
        if meeting:
            where = f"in loom.{meeting[0]}() #{meeting[1]} (this rank is in #{n}), at {where}"
            blocked[r] = where
        elif answer["blocked"]:
            blocked[r] = where
        elsewhere[r] = where
    return blocked, elsewhere


# Where a rank's main thread waits for the others when it is inside these (torchloom's end of the job).
_EXIT_FUNCTIONS = ("agree_to_exit", "shutdown_process_group")


def _where_now(frame: Any, asked: int) -> dict[str, Any]:
    """Where the main thread is, for `meet`: its innermost user line, whether it is blocked in a collective
    (its innermost Python frame is in torch.distributed) or in the job's exit, and the `meet` it is in."""
    innermost = frame.f_code if frame is not None else None
    # torch.distributed's collectives, and DDP's own (its bucket and buffer broadcasts in forward), wait in C++
    # below their Python frame.
    in_collective = innermost is not None and any(
        os.sep + os.path.join("torch", *package) + os.sep in innermost.co_filename
        for package in (("distributed",), ("nn", "parallel"))
    )
    # DDP all-reduces gradients inside autograd's C++ engine: its frame is the innermost Python one.
    in_backward = (
        RECORD.backward_syncs
        and innermost is not None
        and os.sep + os.path.join("torch", "autograd") + os.sep in innermost.co_filename
    )
    exiting = False
    f = frame
    while f is not None:
        if f.f_code.co_name in _EXIT_FUNCTIONS and f.f_code.co_filename.startswith(_TORCHLOOM_DIR):
            exiting = True
            break
        f = f.f_back
    stack = _user_stack(frame)
    at = _line_of(stack[-1]) if stack else "outside your code"
    if exiting:
        at = f"ending the job (loom.close() or the end of the script), last in your code at {at}"
    elif in_collective:
        at = f"in a collective ({innermost.co_name} in {os.path.basename(innermost.co_filename)}) called from {at}"
    elif in_backward:
        at = f"in a backward that synchronises gradients with the other ranks, called from {at}"
    else:
        at = f"at {at}"
    meeting = list(RECORD.meeting) if RECORD.meeting else None
    return {"asked": asked, "blocked": in_collective or exiting or in_backward, "at": at, "meeting": meeting}


def _line_of(frame_text: str) -> str:
    """`train.py:42 in main` from a formatted stack entry."""
    head = frame_text.strip().splitlines()[0]
    try:
        file, rest = head[len('File "') :].split('", line ', 1)
        line, function = rest.split(", in ", 1)
        return f"{os.path.basename(file)}:{line} in {function}"
    except ValueError:
        return head


# ---- the report ----------------------------------------------------------------------------------------------
def explain(failed: str, timed_out: bool, frame: Any = None) -> str | None:
    """On a rank whose collective `failed` (timed out, or a peer died in it): gather every rank's record through
    the store and print one desync report on the first rank to ask. Returns the `culprit:` line, or None when
    the failure is no desync (a peer that died for its own reasons). `frame`: where the rank's main thread is
    (by default, the caller's)."""
    store, rank, world_size = RECORD.store, RECORD.rank, RECORD.world_size
    if store is None:
        return None
    with _deferring_sigterm():
        try:
            mine = RECORD.snapshot(frame or sys._getframe(1), "failed")
            store.set(_key(f"answer/{rank}"), json.dumps(mine))
            if store.add(_key("requests"), 1) != 1:
                return _wait_for(store, _key("culprit"), _ANSWER_SECONDS + 2.0)
            answers, published = _collect(
                store, world_size, _ANSWER_SECONDS if timed_out else _ANSWER_SECONDS / 2
            )
            culprit = _culprit(answers, published, world_size, evidence_only=not timed_out)
            if culprit is None and not timed_out:
                store.set(_key("culprit"), "")
                return None
            culprit = culprit or "culprit: none found: every rank that answered is in the same collective"
            report = _report(answers, published, world_size, rank, failed, culprit)
            print(report, file=sys.stderr, flush=True)
            store.set(_key("culprit"), culprit)
            return culprit
        except Exception:  # noqa: BLE001 - the store went away meanwhile: fail with PyTorch's own error
            return None


@contextlib.contextmanager
def _deferring_sigterm() -> Generator[None, None, None]:
    """Hold off SIGTERM while the report is gathered and printed: the agent stops every rank as soon as one
    fails, and the report is worth the few seconds. Delivered (to the previous handler) afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    if previous is None:  # a handler installed outside Python: the default is the closest we can restore
        previous = signal.SIG_DFL
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if caught:
            os.kill(os.getpid(), signal.SIGTERM)


def _wait_for(store: Any, key: str, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if store.check([key]):
            return store.get(key).decode() or None
        time.sleep(0.05)
    return None


def _collect(store: Any, world_size: int, seconds: float) -> tuple[dict[int, Any], dict[int, Any]]:
    """Every rank's answer, and what every rank last published."""
    answers: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + seconds
    while True:
        for r in range(world_size):
            if r not in answers and store.check([_key(f"answer/{r}")]):
                answers[r] = json.loads(store.get(_key(f"answer/{r}")))
        if len(answers) == world_size or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    published = {}
    for r in range(world_size):
        if store.check([_key(f"published/{r}")]):
            published[r] = json.loads(store.get(_key(f"published/{r}")))
    return answers, published


def _where(rec: dict[str, Any]) -> str:
    return f"{os.path.basename(rec['file'])}:{rec['line']}" if rec.get("file") else "?"


def _call(rec: dict[str, Any]) -> str:
    """`all_reduce #7 ((4,) float32)` or `barrier #7`."""
    if not rec.get("name"):
        return "no collective yet"
    extra = ", ".join(x for x in (rec.get("shapes"), rec.get("detail")) if x)
    return f"{rec['name']} #{rec['seq']}" + (f" ({extra})" if extra else "")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _current_line(rec: dict[str, Any]) -> str:
    """Where a rank's main thread is, from its innermost user frame: `train.py:42 in load_batch`."""
    for line in reversed(rec.get("stack") or []):
        head = line.strip().splitlines()[0]
        if head.startswith("File "):
            file, rest = head[len('File "') :].split('", line ', 1)
            number, function = rest.split(", in ", 1)
            return f"{os.path.basename(file)}:{number} in {function}"
    return "an unknown place"


def _culprit(
    answers: dict[int, Any], published: dict[int, Any], world_size: int, evidence_only: bool
) -> str | None:
    """The `culprit:` line: which rank(s) broke step with the others, and how. With `evidence_only`, only a
    mismatch the records prove (a peer that died may have died for reasons of its own)."""
    silent = [r for r in range(world_size) if r not in answers]
    waiting = {r: a for r, a in answers.items() if a["inside"]}
    if not waiting:
        return None
    # The first collective that did not complete everywhere.
    target = min(a["seq"] for a in waiting.values())
    ref = waiting[min(r for r, a in waiting.items() if a["seq"] == target)]
    # A live rank outside every collective, behind the others: stuck in its own code.
    behind = sorted(r for r, a in answers.items() if not a["inside"] and a["seq"] < target)
    if behind and not evidence_only:
        r = behind[0]
        last = (
            f"its last collective was {_call(answers[r])} at {_where(answers[r])}"
            if answers[r]["name"]
            else ""
        )
        return (
            f"culprit: {_ranks(behind)} never reached {ref['name']} #{target} ({_where(ref)}); "
            f"{'it is' if len(behind) == 1 else f'rank {r} is'} in user code at {_current_line(answers[r])}"
            + (f" ({last})" if last else "")
        )
    # What each rank did at `target`: its answer, or, for a rank past it or dead, what it published then (a
    # mismatched call is a new path for at least one rank, so it was published).
    at = {r: a for r, a in answers.items() if a["seq"] == target}
    at.update({r: p for r, p in published.items() if r not in at and p["seq"] == target})
    mismatch = _mismatch(at)
    if mismatch:
        return mismatch
    # Every rank answered (none died), from inside the same Loom call: evidence enough, whatever failed.
    inside = _inside_library_call(answers, world_size)
    if inside:
        return inside
    for r in silent:
        clue = _dead_clue(published[r], ref) if r in published else None
        if clue:
            return clue
    if evidence_only:
        return None
    ahead = sorted(r for r, a in answers.items() if a["seq"] > target)
    if ahead:
        a = answers[ahead[0]]
        return (
            f"culprit: {_ranks(ahead)} went past {ref['name']} #{target} ({_where(ref)}) without the others "
            f"(their collectives no longer line up); {'it is' if len(ahead) == 1 else f'rank {ahead[0]} is'} "
            f"in {_call(a)} at {_where(a)}"
        )
    if silent:
        r = silent[0]
        gone = "its process died, or it is blocked in native code holding the GIL"
        if r in published:
            gone += f"; it last recorded {_call(published[r])} at {_where(published[r])}"
        return f"culprit: {_ranks(silent)} did not answer ({gone})"
    return None


#: The Loom's calls that run collectives of torchloom's own inside them (the record sees the call, not those).
_LIBRARY_CALLS = ("save", "load", "load_raw", "save_raw")


def _inside_library_call(answers: dict[int, Any], world_size: int) -> str | None:
    """Every rank answered from inside the same loom.save() (or load...): none skipped it or called it alone, so
    what parted them is inside torchloom. Either a rank is still working there (not in a collective: writing a
    large file) while the others wait, or the ranks wait in different collectives of torchloom's (a defect)."""
    if len(answers) < world_size or not all(a["inside"] for a in answers.values()):
        return None
    calls = {(a["name"], a["seq"]) for a in answers.values()}
    name, seq = next(iter(calls))
    if len(calls) != 1 or name not in _LIBRARY_CALLS:
        return None
    call = f"loom.{name}() #{seq} ({_where(answers[min(answers)])})"
    working = sorted(r for r, a in answers.items() if not a.get("in_distributed", True))
    if working and len(working) < len(answers):
        return (
            f"culprit: {_ranks(working)} {'is' if len(working) == 1 else 'are'} still working inside {call}, at "
            f"{_internal(answers[working[0]])}, while the others wait for it in a collective: the checkpoint takes "
            "longer to write or read than Loom(timeout=...) allows; raise the timeout"
        )
    places: dict[tuple[str, ...], list[int]] = {}
    for r, a in sorted(answers.items()):
        places.setdefault(_place(a.get("internal") or []), []).append(r)
    if len(places) < 2:
        return (
            f"culprit: none found: every rank is inside {call}, in the same collective "
            f"({_internal(answers[min(answers)])}), so none skipped the call or made it alone"
        )
    parts = "; ".join(f"{_ranks(ranks)} in {_internal(answers[ranks[0]])}" for ranks in places.values())
    if name == "save":
        # loom.save checks that every rank entered it and was given the same entries and filter.
        return (
            f"culprit: torchloom itself, not your code: every rank is inside the same {call}, but they wait in "
            f"different collectives inside it ({parts}). Please report this as a torchloom bug, with this report"
        )
    return (
        f"culprit: every rank is inside the same {call}, but they wait in different collectives inside it "
        f"({parts}): the ranks were given different arguments (`state` must name the same modules and "
        "optimizers on every rank), or this is a torchloom bug: please report it, with this report"
    )


def _place(internal: list[str]) -> tuple[str, ...]:
    """Where a rank waits inside torchloom, to compare ranks: its frames, the innermost without its line (a
    failed collective's frame is at its `with` statement, a waiting one's at the call inside)."""
    if not internal:
        return ()
    *outer, innermost = internal
    file, _, function = innermost.partition(" in ")
    return (*outer, file.rsplit(":", 1)[0], function)


def _internal(rec: dict[str, Any]) -> str:
    """Where inside the Loom's call a rank is: `full.py:126 in save > parallel.py:318 in broadcast`."""
    frames = (rec.get("internal") or [])[1:]  # the first is the Loom method the user called
    return " > ".join(frames[-4:]) or "an unknown place"


def _mismatch(ahead: dict[int, dict[str, Any]]) -> str | None:
    """Ranks at the same sequence number in different collectives, or with different shapes."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, a in sorted(ahead.items()):
        groups.setdefault((a["name"], a["shapes"], a["detail"]), []).append(r)
    if len(groups) < 2:
        return None
    # The odd one out: the minority when there is one; otherwise the ranks that took a path they never took
    # before (a skipped or extra call, or new shapes), while the others repeat what they did every step.
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    if sizes[0] > sizes[1]:
        majority = max(groups.values(), key=len)
        odd = sorted(r for r in ahead if r not in majority)
    else:
        odd = sorted(r for r, a in ahead.items() if a["new_path"] or a["new_shape"])
        if not odd or len(odd) == len(ahead):
            odd = sorted(ahead)[1:]
        majority = [r for r in ahead if r not in odd]
    ref = ahead[majority[0]] if majority else ahead[min(ahead)]
    r = odd[0]
    a = ahead[r]
    if a["name"] != ref["name"]:
        if a["new_site"]:
            return (
                f"culprit: {_ranks(odd)} called an extra {a['name']} #{a['seq']} at {_where(a)}, which "
                f"{_ranks(majority)} did not call (it is in {_call(ref)} at {_where(ref)})"
            )
        return (
            f"culprit: {_ranks(odd)} never reached {ref['name']} #{ref['seq']} ({_where(ref)}); "
            f"{'it is' if len(odd) == 1 else f'rank {r} is'} in {_call(a)} at {_where(a)}"
        )
    return (
        f"culprit: {_ranks(odd)} passed {a['shapes'] or a['detail']} to {a['name']} #{a['seq']} at {_where(a)}, "
        f"where {_ranks(majority)} passed {ref['shapes'] or ref['detail']} ({_where(ref)})"
    )


def _dead_clue(pub: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """A rank that died without answering, seen through what it last published (`pub`) and a live rank
    (`ref`)."""
    # The dead rank published nothing since: it repeated paths it had taken before. The live rank took a new
    # one, with shapes it never passed there: gloo aborts the peer that receives more than it expects.
    if pub["seq"] < ref["seq"] and ref["new_shape"] and not ref["new_site"]:
        return (
            f"culprit: rank {ref['rank']} passed {ref['shapes']} to {ref['name']} #{ref['seq']} at {_where(ref)}, "
            f"shapes it never passed there before; rank {pub['rank']} died in that collective (it repeated "
            f"earlier calls since {pub['name']} #{pub['seq']} at {_where(pub)})"
        )
    return None


def _report(
    answers: dict[int, Any], published: dict[int, Any], world_size: int, me: int, failed: str, culprit: str
) -> str:
    lines = [f"torchloom desync report (rank {me}: {failed})"]
    mesh = RECORD.mesh if RECORD.mesh is not None and math.prod(RECORD.mesh[1]) == world_size else None
    if mesh is not None:
        lines.append("device mesh: " + " x ".join(f"{n} {s}" for n, s in zip(*mesh, strict=True)))
    for r in range(world_size):
        a = answers.get(r)
        rank = f"rank {r}{_mesh_position(r, mesh)}"
        if a is None:
            pub = published.get(r)
            last = f"; last new call: {_call(pub)} at {_where(pub)}" if pub else ""
            lines.append(f"{rank}: no answer (its process died, or it is blocked in native code){last}")
            a = pub or {"stack": []}
        elif a.get("queued"):
            lines.append(
                f"{rank} (pid {a['pid']}): in {_call(a)} at {_where(a)}, queued on the device and not completed; "
                f"its main thread is at {_current_line(a)}"
            )
        elif a["inside"]:
            inner = (
                f", inside it at {_internal(a)}" if a["name"] in _LIBRARY_CALLS and a.get("internal") else ""
            )
            lines.append(f"{rank} (pid {a['pid']}): in {_call(a)} at {_where(a)}{inner}")
        else:
            last = f"; last collective: {_call(a)} at {_where(a)}" if a["name"] else ""
            lines.append(f"{rank} (pid {a['pid']}): in user code at {_current_line(a)}{last}")
        lines.extend("    " + line for block in a["stack"] for line in block.splitlines())
    lines.append(culprit)
    return "\n".join(lines)


def _mesh_position(rank: int, mesh: tuple[tuple[str, ...], tuple[int, ...]] | None) -> str:
    """` [data_parallel 1, tensor_parallel 0]`: where `rank` sits on a row-major mesh (as init_device_mesh lays
    ranks out); empty without a mesh."""
    if mesh is None:
        return ""
    names, sizes = mesh
    coords = []
    for size in reversed(sizes):
        coords.append(rank % size)
        rank //= size
    return " [" + ", ".join(f"{n} {c}" for n, c in zip(names, reversed(coords), strict=True)) + "]"
