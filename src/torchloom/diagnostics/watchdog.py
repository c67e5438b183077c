"""The watchdog thread of each rank: it answers the desync report's requests and `meet`'s "where are you" with
this rank's record and its main thread's stack, and on NCCL starts the report itself when a collective has waited
too long. `start` connects a rank to the job's store and starts it. See `torchloom.diagnostics`."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from datetime import timedelta
from typing import Any

from torchloom.diagnostics.meeting import where_now
from torchloom.diagnostics.record import POLL_SECONDS, RECORD, store_key
from torchloom.diagnostics.report import explain

# On NCCL the process group times out this much later than the job's timeout, when torchloom's own watchdog
# starts the report: the answers take at most `report._ANSWER_SECONDS`, the printing well under a second.
NCCL_REPORT_GRACE = timedelta(seconds=15)


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
        request, answer = store_key("requests"), store_key(f"answer/{RECORD.rank}")
        where_answered = 0
        while not self._stop_event.wait(POLL_SECONDS):
            try:
                if not dist.is_initialized() or RECORD.store is None:
                    return
                asked = store.add(store_key("where"), 0)
                if asked > where_answered:  # a rank in `meet` asks where this one is
                    where_answered = asked
                    where = where_now(sys._current_frames().get(self._main), asked)
                    store.set(store_key(f"where/{RECORD.rank}"), json.dumps(where))
                if store.check([request]):
                    # A main thread that failed itself has answered already, more precisely.
                    if not store.check([answer]):
                        frame = sys._current_frames().get(self._main)
                        store.set(answer, json.dumps(RECORD.snapshot(frame, "answered")))
                    return
                report_after = _forced_report_after() or self._report_after
                if report_after is not None and RECORD.overdue(report_after):
                    snapshot = RECORD.snapshot(None, "failed")
                    what = f"loom.{snapshot['name']}() #{snapshot['seq']} on rank {RECORD.rank}"
                    state = "is still queued on the device" if snapshot["queued"] else "is still waiting"
                    explain(
                        f"{what} {state} after {timedelta(seconds=report_after)}",
                        timed_out=True,
                        frame=sys._current_frames().get(self._main),
                    )
                    return
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=2 * POLL_SECONDS)


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
    if namespace != RECORD.namespace:
        # A new process group counts its calls that every rank must make afresh (`meet`): an earlier group in this
        # process may have made them a different number of times on different ranks (a replica group's ranks
        # save, the others' do not), and its counts would pair this group's n-th call with another rank's m-th.
        RECORD.meetings, RECORD.meeting = {}, None
    if _watchdog is not None and _watchdog.is_alive() or namespace is None:
        return
    RECORD.namespace = namespace
    RECORD.store = _connect()
    if RECORD.store is None:
        return
    seconds = report_after.total_seconds() if report_after else None
    _watchdog = _Watchdog(threading.main_thread().ident or 0, seconds, device)
    _watchdog.start()
    # Registered after the process group's own exit hook, so it runs first: the watchdog stops polling a store
    # before the group (and, on rank 0, the store's server) goes away.
    atexit.register(stop)


def _forced_report_after() -> float | None:
    """TORCHLOOM_DESYNC_REPORT_AFTER (seconds): tests set it to take, on gloo, the path NCCL takes (the report
    started by the watchdog, not by an error). Read at every poll, so a test script can set it at the step where
    its ranks part ways: a slow start under load must not count as a desync."""
    forced = os.environ.get("TORCHLOOM_DESYNC_REPORT_AFTER")
    return float(forced) if forced else None


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
