"""The measured side: `track_memory()` counts live tensor storages exactly (views once, resizes, frees) and
`loom.memory_summary()` refuses to answer without it."""

from __future__ import annotations

import gc

import pytest
import torch

from torchloom import Loom
from torchloom.errors import TorchloomError
from torchloom.planning import track_memory

MB = 1_000_000


def test_live_storage_bytes_peak():
    before = torch.zeros(250_000)  # made before tracking starts: counted from the start
    # Tensors other tests left alive in this process count too; collect the unreachable ones first so none is
    # freed in the middle, and judge the growth from what was live at the start.
    gc.collect()
    with track_memory("cpu") as tracking:
        at_start = tracking.peak_bytes()["peak_bytes"]
        a = torch.empty(250_000)  # 1 MB
        view = a.view(500, 500)  # a view: no new memory
        b = view * 2  # 1 MB more: 3 MB live with `before`
        del b
        c = torch.empty(10)
        c.untyped_storage().resize_(2 * MB)  # FSDP's way of gathering: 4 MB live
        c.untyped_storage().resize_(0)
        del a, view, c
        peak = tracking.peak_bytes()["peak_bytes"]
    assert at_start >= MB, at_start  # `before` is counted from the start
    assert peak - at_start == 3 * MB, (peak, at_start)  # a + c grown to 2 MB (its 40 bytes replaced)
    del before


def test_summary_needs_tracking():
    loom = Loom(accelerator="cpu", devices=1)
    with pytest.raises(TorchloomError, match="track_memory"):
        loom.memory_summary()
    with track_memory("cpu"):
        x = torch.empty(1000)
        summary = loom.memory_summary()
        beside = loom.memory_summary(plan={"ranks": [{"ranks": [0], "peak_bytes": 8000}]})
    del x
    assert len(summary.ranks) == 1 and summary.ranks[0]["peak_bytes"] >= 4000
    assert "measured peak" in str(summary)
    # A plan's prediction (a `torchloom plan --json` dict or file) beside the measurement.
    assert beside.ranks[0]["predicted_bytes"] == 8000 and "planned/measured" in str(beside)


def test_a_collection_inside_the_count_does_not_wait_for_itself(monkeypatch):
    """A garbage-collection pass can start at any allocation inside the count (here: where it registers a new
    storage's finalizer) and free another counted storage on the same thread: its release must not wait for the
    count's own lock (it hung the docs' track_memory block once in the suite)."""
    import threading
    import weakref

    from torchloom.planning import measure

    mode = measure._LiveBytes()
    gone = torch.zeros(1000)
    cycle: list = [gone.untyped_storage()]
    cycle.append(cycle)  # freed by a collection only
    mode._add(cycle[0])
    del gone
    cycle = []  # the old list is unreachable now, kept alive by its own reference
    real = weakref.finalize

    def collecting(*args, **kwargs):
        gc.collect()  # the pass frees the storage above and runs its finalizer here
        return real(*args, **kwargs)

    monkeypatch.setattr(measure.weakref, "finalize", collecting)
    kept = torch.ones(10)
    worker = threading.Thread(target=mode._add, args=(kept.untyped_storage(),), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the count waited for its own lock"
    assert mode.current == 40  # the collected 4,000 bytes released, the 40 new ones counted
