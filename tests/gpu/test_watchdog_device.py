"""The desync watchdog thread under NCCL works on its rank's GPU.

The current CUDA device is per thread: a thread starts on device 0. The watchdog queries each collective's CUDA
event; from device 0, every rank of a node would create a CUDA context (hundreds of MiB) on GPU 0.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from harness import run_ranks

from torchloom import Loom


def _watchdog_device_body(rank: int, world_size: int) -> dict:
    from torchloom import diagnostics

    seen: list[int] = []
    polled = diagnostics.RECORD.overdue

    def spy(seconds: float) -> bool:
        if threading.current_thread().name == "torchloom-desync-watchdog":
            seen.append(torch.cuda.current_device())
        return polled(seconds)

    diagnostics.RECORD.overdue = spy  # what the watchdog calls on every poll under NCCL
    loom = Loom(accelerator="cuda", devices=world_size, strategy="ddp")
    loom.launch()
    for _ in range(3):
        loom.all_reduce(torch.ones(1, device=loom.device))
    torch.cuda.synchronize()
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"device": loom.device.index, "seen": sorted(set(seen))}


@pytest.mark.cuda(min_devices=2)
def test_the_watchdog_thread_uses_its_ranks_gpu():
    for result in run_ranks(_watchdog_device_body, 2, timeout=180):
        assert result["seen"] == [result["device"]], result
