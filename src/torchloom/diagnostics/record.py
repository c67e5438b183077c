"""The collective record: what this rank last asked of the others (`RECORD`), and the store keys through which
the ranks exchange it. See `torchloom.diagnostics`."""

from __future__ import annotations

import collections
import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# torchloom's own directory (this file is in torchloom/diagnostics/).
TORCHLOOM_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
# A call site is the first frame outside these: the user's line, not the library code that serves it.
_INTERNAL = (TORCHLOOM_DIR, _TORCH_DIR)
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep

# How often a watchdog looks for a report request (one store round trip, ~40 us).
POLL_SECONDS = 0.5
# A rank publishes at most this many new paths: code whose shapes change every call must not talk to the
# store every call.
_MAX_PUBLISHED = 1000


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
            self.store.set(store_key(f"published/{self.rank}"), json.dumps(self.snapshot(frame, "published")))
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
        out["stack"] = user_stack(frame)
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


def user_stack(frame: Any) -> list[str]:
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
        if f.filename.startswith(TORCHLOOM_DIR):
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


def store_key(name: str) -> str:
    # A restarted elastic job shares the agent's store with its failed attempt: the group's namespace, which no
    # other group has, keeps their keys apart (`parallel.agree_on_namespace`).
    return f"{RECORD.namespace}/desync/{name}"
