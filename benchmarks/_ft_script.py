"""The training job `benchmarks/fault_tolerance.py` times, under `torchloom run --replica-groups 2 --devices 1`
(fault tolerance) or `torchloom run --devices 2` (a plain DDP job, restarted by its elastic agent).

    _ft_script.py OUT STEPS DIM KILL_AT CKPT_EVERY

Every rank 0 appends one JSON line per finished step to OUT/steps.jsonl: the wall time, the step (the job's
committed step under replica groups), the group, the attempt and the groups that took part. The victim (group 1
under replica groups, rank 1 of the plain job) SIGKILLs itself in backward at its step KILL_AT of its first
attempt, after writing the time to OUT/kill.json. Under replica groups the job ends at the first step at or
after STEPS that both groups committed. The plain job saves a checkpoint every CKPT_EVERY steps
(0: never) and resumes from it after the restart, as a job without fault tolerance does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchloom import Loom
from torchloom import fault_tolerance as ft


def _log(path: str, entry: dict[str, object]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    out, steps, dim, kill_at, ckpt_every = sys.argv[1], *map(int, sys.argv[2:6])
    torch.manual_seed(0)
    tokens = 128
    data = TensorDataset(torch.randn(tokens * 16, dim), torch.randn(tokens * 16, dim))
    net = nn.Sequential(
        *(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(4))
    )
    # `fault_tolerance.py --strategy`: "ddp" (the default), or "fsdp2" (sharded inside a group; one unit, the root).
    loom = Loom(accelerator="cpu", strategy=os.environ.get("TORCHLOOM_BENCH_STRATEGY", "ddp"))
    model, opt = loom.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    loader = loom.setup_dataloaders(DataLoader(data, batch_size=tokens))
    replicas = ft.current()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    group = replicas.group if replicas is not None else 0
    victim = (replicas.group == 1) if replicas is not None else (loom.global_rank == 1)
    checkpoint = os.path.join(out, "checkpoint")
    done = 0
    if replicas is None and ckpt_every and os.path.exists(checkpoint):
        state = {"model": model, "optimizer": opt, "done": 0}
        loom.load(checkpoint, state)
        done = int(state["done"])

    def die(*_: object) -> None:
        _log(os.path.join(out, "kill.json"), {"t": time.time(), "step": done})
        os.kill(os.getpid(), signal.SIGKILL)

    finished = False
    while not finished:  # epochs
        for x, y in loader:
            if victim and attempt == 0 and done == kill_at:
                net[0][0].weight.register_hook(die)
            before = replicas.step if replicas is not None else done
            loss = nn.functional.mse_loss(model(x), y)
            loom.backward(loss)
            opt.step()
            opt.zero_grad()
            if replicas is not None:
                if replicas.step == before:
                    continue  # not committed: the same step again
                done = replicas.step
                participants = list(replicas.participants)
            else:
                done += 1
                participants = [0]
                if ckpt_every and done % ckpt_every == 0:
                    loom.save(checkpoint, {"model": model, "optimizer": opt, "done": done})
            if loom.global_rank == 0:
                entry = {
                    "t": time.time(),
                    "step": done,
                    "group": group,
                    "attempt": attempt,
                    "with": participants,
                }
                _log(os.path.join(out, "steps.jsonl"), entry)
            # Under replica groups, the job ends with both groups in the step: a survivor alone waits for the
            # other to heal rather than finish without it.
            if done >= steps and (replicas is None or len(participants) == replicas.groups):
                finished = True
                break


if __name__ == "__main__":
    main()
