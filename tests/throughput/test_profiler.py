"""`profile_steps` on 2 gloo ranks: one call writes one trace per rank holding exactly the chosen window of steps
(counted by `optimizer.step()`), removes its hook afterwards, and rank 0 prints how to open the files."""

from __future__ import annotations

import json
import os

import pytest
import torch
from harness import run_ranks

from torchloom import Loom
from torchloom.errors import MisuseError
from torchloom.throughput.profiler import profile_steps


def _profile_body(rank: int, world_size: int, folder: str) -> dict:
    import contextlib
    import io

    loom = Loom(accelerator="cpu", devices=world_size, strategy="ddp")
    loom.launch()
    net = torch.nn.Linear(16, 16)
    model, optimizer = loom.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        profiler = profile_steps(loom, optimizer, folder, start=2, steps=2)
        for step in range(6):
            with torch.profiler.record_function(f"user_step_{step}"):
                loom.backward(model(torch.randn(4, 16)).sum())
                optimizer.step()
                optimizer.zero_grad()
    with pytest.raises(MisuseError, match="at least 1 step"):
        profile_steps(loom, optimizer, folder, steps=0)
    hooks = len(optimizer.optimizer._optimizer_step_post_hooks)
    loom.close()
    events = json.load(open(profiler.files[0]))["traceEvents"]
    steps = sorted({e["name"] for e in events if str(e.get("name", "")).startswith("user_step_")})
    return {"files": profiler.files, "steps": steps, "printed": printed.getvalue(), "hooks": hooks}


def test_profile_window_per_rank(tmp_path):
    results = run_ranks(_profile_body, 2, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        assert result["files"] == [os.path.join(str(tmp_path), f"rank{rank}.trace.json")]
        assert result["steps"] == ["user_step_2", "user_step_3"]
        assert result["hooks"] == 0
    assert "https://ui.perfetto.dev" in results[0]["printed"] and "rank0.trace.json" in results[0]["printed"]
    assert results[1]["printed"] == ""


def test_the_private_memory_snapshot_apis_are_checked(monkeypatch):
    from torchloom import _torch_compat

    assert callable(torch.cuda.memory._record_memory_history) and callable(torch.cuda.memory._dump_snapshot)
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    monkeypatch.delattr(torch.cuda.memory, "_dump_snapshot")
    with pytest.raises(_torch_compat.TorchAPIMissing, match="_record_memory_history"):
        _torch_compat.cuda_memory_history(True)
    with pytest.raises(_torch_compat.TorchAPIMissing, match="_dump_snapshot"):
        _torch_compat.cuda_memory_snapshot("x.pickle")
