"""Hangs become errors, and preemption (SIGTERM) can write a final checkpoint before the job ends."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import threading
import time
from datetime import timedelta

from harness import PYTHON, REPO, TOKEN_ENV, run_ranks, wait_no_strays

from torchloom import Loom


def _stuck_peer(rank: int, world_size: int) -> str:
    import torch

    from torchloom import CollectiveTimeoutError

    loom = Loom(accelerator="cpu", devices=world_size, timeout=timedelta(seconds=3))
    loom.launch()
    if rank == 1:
        time.sleep(8)  # stuck outside any collective (an endless loop in user code)
        return "slept"
    start = time.monotonic()
    try:
        loom.all_reduce(torch.ones(1))
    except CollectiveTimeoutError as error:
        return f"{time.monotonic() - start:.1f}s {error}"
    return "no error"


def test_rank_stuck_outside_a_collective_becomes_an_error():
    message, slept = run_ranks(_stuck_peer, 2, timeout=60)
    assert slept == "slept"
    seconds, text = message.split("s ", 1)
    assert float(seconds) < 8, message
    assert "loom.all_reduce() on rank 0 timed out after 0:00:03" in text
    assert "Loom(timeout=...)" in text


PREEMPT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from torchloom import Loom

    path = sys.argv[1]
    loom = Loom(accelerator="cpu", devices=2, strategy="fsdp2")
    loom.launch()
    loom.on_preempt()
    model = loom.setup_module(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    step = 0
    while True:
        loom.backward(model(torch.randn(2, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            loom.print("RUNNING", flush=True)
        if loom.should_stop():
            loom.save(path, {"model": model, "optimizer": opt, "step": step})
            loom.print(f"SAVED {step}", flush=True)
            break
        time.sleep(0.05)
    """
)


def test_sigterm_writes_a_final_checkpoint_and_stops_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PREEMPT_SCRIPT)
    token = f"preempt-{os.getpid()}-{time.monotonic_ns()}"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    }
    env.update({TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen(
        [PYTHON, str(script), str(tmp_path / "final")],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "RUNNING" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(90), "".join(lines)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # what a cluster sends before preempting the job
        proc.wait(timeout=30)
        stopped = time.monotonic() - sent
    finally:
        proc.kill()
    assert wait_no_strays(token) == []
    assert stopped < 10, stopped
    saved = [line for line in lines if line.startswith("SAVED")]
    assert saved, "".join(lines)
    step = int(saved[0].split()[1])
    loom = Loom(accelerator="cpu")
    import torch

    model = loom.setup_module(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    assert loom.load(tmp_path / "final", {"model": model})["step"] == step
