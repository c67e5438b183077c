"""Measured memory: each rank's peak, to hold a plan against (`loom.memory_summary()`).

On CUDA the caching allocator's own counters (`max_memory_allocated`, `max_memory_reserved`). On CPU, where no
allocator keeps counts, the peak of the bytes held by live tensor storages: every storage an operation creates is
counted once (views share it) until it is freed, and FSDP's storage resizes (how it frees and re-gathers
parameters) move the count too. This counter shares no code with the planner (`torchloom.planning.tracker`), so
the two can be held against each other. Process memory (RSS) is not used: it holds the allocator's history.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from torchloom import _torch_compat
from torchloom.errors import TorchloomError


def _storages(value: Any, into: list[torch.UntypedStorage]) -> None:
    if not isinstance(value, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(value):  # DTensor and friends hold their memory in inner tensors
        names, _ = value.__tensor_flatten__()
        for name in names:
            _storages(getattr(value, name), into)
        return
    if value.device.type == "meta":
        return
    try:
        into.append(value.untyped_storage())
    except (NotImplementedError, RuntimeError):  # tensors without a storage (sparse, nested)
        pass


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages on this thread's operations, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        # Re-entrant: a garbage-collection pass may start at any allocation inside `_add` (weakref.finalize, a
        # dict insert) and run `_free` for another storage on this same thread, which must not wait for itself
        # (seen as a hang of the docs' track_memory block in the suite).
        self._lock = threading.RLock()
        self._original_resize: Any = None

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            if key in self.live:
                self.current += nbytes - self.live[key]
                self.live[key] = nbytes
            else:
                self.live[key] = nbytes
                self.current += nbytes
                weakref.finalize(storage, self._free, key)
            self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        found: list[torch.UntypedStorage] = []
        for value in tree_flatten(out)[0]:
            _storages(value, found)
        if func._overloadpacket.__name__.endswith(
            "_"
        ):  # in place: a resize_ or set_ may have grown a storage
            for value in tree_flatten((args, kwargs))[0]:
                _storages(value, found)
        for storage in found:
            self._add(storage)
        return out

    def start(self) -> None:
        # What exists already (a model built before tracking started) is counted from the start.
        with warnings.catch_warnings():  # isinstance() wakes deprecated lazy names in some modules
            warnings.simplefilter("ignore")
            existing = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        found: list[torch.UntypedStorage] = []
        for obj in existing:
            _storages(obj, found)
        for storage in found:
            self._add(storage)
        self._original_resize = _torch_compat.storage_resize()
        original, tracker = self._original_resize, self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            if storage.device.type != "meta":
                tracker._add(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]


@dataclass
class MemoryTracking:
    """The tracking `track_memory()` started; `peak_bytes()` is the peak so far."""

    device: torch.device
    _counter: _LiveBytes | None = field(default=None, repr=False)

    def peak_bytes(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {
                "peak_bytes": torch.cuda.max_memory_allocated(self.device),
                "reserved_bytes": torch.cuda.max_memory_reserved(self.device),
            }
        if self._counter is None:  # under the planner
            return {"peak_bytes": 0, "reserved_bytes": 0}
        return {"peak_bytes": self._counter.peak, "reserved_bytes": 0}

    def stop(self) -> None:
        global _ACTIVE
        if self._counter is not None:
            self._counter.stop()
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self) -> MemoryTracking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_ACTIVE: MemoryTracking | None = None
_PLANNING = False  # set by the planner's simulated ranks


def track_memory(device: torch.device | str | None = None) -> MemoryTracking:
    """Start measuring this process' peak memory; `loom.memory_summary()` reports it. Use it as a context around
    the training (`with track_memory(): ...`) or keep the returned object and call `stop()`.

    `device`: the device the training runs on (default: CUDA's current device when CUDA is available, else the
    CPU). On CUDA the allocator's peak counters are reset; on CPU the live tensor storages are counted from
    here on (those that exist already included), on this thread."""
    global _ACTIVE
    if _PLANNING:  # under `torchloom plan` the planner counts; a second count of fake tensors means nothing
        return MemoryTracking(torch.device("meta"))
    if _ACTIVE is not None:
        raise TorchloomError(
            "Memory tracking is already on in this process. Stop the first tracking (leave its `with` block or "
            "call its stop()) before starting another."
        )
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        tracking = MemoryTracking(device)
    else:
        counter = _LiveBytes()
        counter.start()
        tracking = MemoryTracking(device, counter)
    _ACTIVE = tracking
    return tracking


def active_tracking() -> MemoryTracking | None:
    return _ACTIVE


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@dataclass
class MemorySummary:
    """Each rank's measured peak (`ranks[r]["peak_bytes"]`, and on CUDA `reserved_bytes`), with the plan's
    prediction beside it where a plan was given (`ranks[r]["predicted_bytes"]`)."""

    device: str
    ranks: list[dict[str, int]]

    def __str__(self) -> str:
        predicted = any("predicted_bytes" in row for row in self.ranks)
        head = f"{'rank':>5}  {'measured peak':>14}"
        head += f"  {'reserved':>12}" if self.device == "cuda" else ""
        head += f"  {'planned':>12}  {'planned/measured':>16}" if predicted else ""
        lines = [
            f"memory ({'CUDA max_memory_allocated' if self.device == 'cuda' else 'live tensor bytes'})",
            head,
        ]
        for rank, row in enumerate(self.ranks):
            line = f"{rank:>5}  {_gib(row['peak_bytes']):>14}"
            line += f"  {_gib(row['reserved_bytes']):>12}" if self.device == "cuda" else ""
            if "predicted_bytes" in row:
                ratio = row["predicted_bytes"] / max(row["peak_bytes"], 1)
                line += f"  {_gib(row['predicted_bytes']):>12}  {ratio:>16.3f}"
            lines.append(line)
        return "\n".join(lines)


def _predicted(plan: str | dict[str, Any], world_size: int) -> list[int | None]:
    if isinstance(plan, str):
        import json

        with open(plan) as f:
            loaded: dict[str, Any] = json.load(f)
    else:
        loaded = plan
    by_rank: dict[int, int] = {}
    for entry in loaded["ranks"]:
        for rank in entry["ranks"]:
            by_rank[int(rank)] = int(entry["peak_bytes"])
    return [by_rank.get(rank) for rank in range(world_size)]


def memory_summary(loom: Any, plan: str | dict[str, Any] | None = None) -> MemorySummary:
    """Every rank's measured peak (a collective: every rank calls it); see `Loom.memory_summary`."""
    tracking = _ACTIVE
    if tracking is None:
        raise TorchloomError(
            "loom.memory_summary() has no measurements: memory tracking is off. Start it before the training, "
            "`with torchloom.planning.track_memory(): ...` around the steps (or `tracking = track_memory()` "
            "and later `tracking.stop()`)."
        )
    own = tracking.peak_bytes()
    values = torch.tensor([own["peak_bytes"], own["reserved_bytes"]], dtype=torch.int64, device=loom.device)
    gathered = loom.all_gather(values).reshape(-1, 2).tolist()
    ranks = [{"peak_bytes": int(peak), "reserved_bytes": int(reserved)} for peak, reserved in gathered]
    if plan is not None:
        for row, predicted in zip(ranks, _predicted(plan, len(ranks)), strict=True):
            if predicted is not None:
                row["predicted_bytes"] = predicted
    return MemorySummary(tracking.device.type, ranks)


#: `TORCHLOOM_MEMORY_REPORT=N`: after the first N optimizer steps, print every rank's measured peak (rank 0
#: prints); with `TORCHLOOM_MEMORY_PLAN=plan.json` (a `torchloom plan --json` file) the prediction beside it.
REPORT_VARIABLE = "TORCHLOOM_MEMORY_REPORT"
PLAN_VARIABLE = "TORCHLOOM_MEMORY_PLAN"


def report_after_steps(loom: Any, optimizers: list[Any]) -> None:
    """The opt-in memory line of the setup summary: start tracking (if it is not on) and, after the first N steps
    of the first optimizer set up, print `memory_summary` on rank 0 (a collective: every rank steps)."""
    global _REPORT_ARMED
    import os

    text = os.environ.get(REPORT_VARIABLE, "").strip()
    if not text or _PLANNING or not optimizers or _REPORT_ARMED:
        return
    after = int(text) if text.isdigit() else 0
    if after < 1:
        raise TorchloomError(
            f"{REPORT_VARIABLE}={text!r}: give the number of optimizer steps after which each rank's measured "
            f"peak memory is printed, e.g. {REPORT_VARIABLE}=2."
        )
    plan = os.environ.get(PLAN_VARIABLE) or None
    if plan is not None and not os.path.isfile(plan):
        raise TorchloomError(f"{PLAN_VARIABLE}={plan!r} is not a file: give a `torchloom plan --json` file.")
    started = _ACTIVE is None
    tracking = track_memory(loom.device) if started else _ACTIVE
    optimizer = getattr(optimizers[0], "optimizer", optimizers[0])
    steps = [0]

    def after_step(*_: Any) -> None:
        steps[0] += 1
        if steps[0] < after:
            return
        handle.remove()
        summary = memory_summary(loom, plan)
        loom.print(f"torchloom: peak memory of the first {after} step{'s' if after > 1 else ''}, {summary}")
        if started and tracking is not None:
            tracking.stop()  # the user's own tracking, if any, goes on

    handle = optimizer.register_step_post_hook(after_step)
    _REPORT_ARMED = True


_REPORT_ARMED = False  # one report per process: the first optimizer set up
