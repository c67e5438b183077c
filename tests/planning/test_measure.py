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
