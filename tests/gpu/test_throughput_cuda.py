"""The throughput tools on a GPU (skipped without CUDA; never run yet: no GPU was available when they were
written). On one GPU:

- `TimeBreakdown` measures with CUDA events: the parts make up the step within 5%, communication is 0;
- `profile_steps` writes a trace and a CUDA memory snapshot;
- `get_available_flops` knows the GPU when it is a current data-centre part, and the MFU `ThroughputMonitor`
  reports for a bf16 matmul-heavy model equals the MFU of the same loop in plain PyTorch timed by hand
  (CUDA events, `measure_flops` on a meta copy) within 10%; both are printed.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from torchloom import Loom
from torchloom.throughput import (
    ThroughputMonitor,
    TimeBreakdown,
    get_available_flops,
    measure_flops,
    profile_steps,
)

pytestmark = pytest.mark.cuda

KNOWN = ("h100", "h200", "b200", "a100", "l40", "l4", "a10g")


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Linear(8192, 2048))


def test_breakdown_and_profile_on_one_gpu(tmp_path):
    loom = Loom(accelerator="cuda", devices=1)
    loom.launch()
    net = _net()
    model, optimizer = loom.setup(net, torch.optim.AdamW(net.parameters()))
    batches = [torch.randn(512, 2048, device=loom.device) for _ in range(12)]
    breakdown = TimeBreakdown(loom, model, optimizer)
    profiler = profile_steps(loom, optimizer, str(tmp_path / "profile"), start=8, steps=2)
    for x in breakdown.loader(batches):
        loom.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    summary = breakdown.close()
    steps = summary.per_rank[0][2:]
    assert sum(s["other"] for s in steps) / sum(s["step"] for s in steps) < 0.05, summary.table()
    assert all(s["communication"] == 0.0 and s["forward"] > 0 and s["backward"] > 0 for s in steps)
    assert profiler.done
    assert sorted(os.path.basename(f) for f in profiler.files) == ["rank0.memory.pickle", "rank0.trace.json"]
    loom.close()


def test_mfu_matches_plain_pytorch_timed_by_hand():
    name = torch.cuda.get_device_name(0).lower()
    peak = get_available_flops(torch.device("cuda", 0), torch.bfloat16)
    if any(chip in name for chip in KNOWN):
        assert peak is not None
    if peak is None:
        pytest.skip(f"no peak FLOPs known for {name!r}")
    with torch.device("meta"):
        meta = _net()
        meta_x = torch.randn(4096, 2048)
    step_flops = measure_flops(meta, lambda: meta(meta_x), lambda y: y.float().square().mean())
    steps = 20

    # plain PyTorch, timed with CUDA events
    torch.manual_seed(0)
    raw = _net().cuda()
    raw_opt = torch.optim.AdamW(raw.parameters())
    x = torch.randn(4096, 2048, device="cuda")
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            raw(x).float().square().mean().backward()
        raw_opt.step()
        raw_opt.zero_grad()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            raw(x).float().square().mean().backward()
        raw_opt.step()
        raw_opt.zero_grad()
    end.record()
    end.synchronize()
    raw_mfu = step_flops * steps / (start.elapsed_time(end) / 1000) / peak

    # the same loop under torchloom, measured by the monitor
    loom = Loom(accelerator="cuda", devices=1, precision="bf16-mixed")
    loom.launch()
    net = _net()
    model, optimizer = loom.setup(net, torch.optim.AdamW(net.parameters()))
    monitor = ThroughputMonitor(loom, window_size=steps + 1, using_sparse_model=False)
    for _ in range(3):
        loom.backward(model(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    monitor.update(time=1e-9, batches=0, samples=0)
    for i in range(1, steps + 1):
        loom.backward(model(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        monitor.update(time=time.perf_counter() - t0, batches=i, samples=4096 * i, flops=step_flops)
    mfu = monitor.compute()["device/mfu"]
    print(
        f"\nMFU on {name}: torchloom {mfu:.1%}, plain PyTorch {raw_mfu:.1%} (peak {peak / 1e12:.0f} TFLOPs bf16)"
    )
    assert mfu == pytest.approx(raw_mfu, rel=0.10)
    assert 0 < mfu < 1
    loom.close()
