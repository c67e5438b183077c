"""The training script that benchmarks/startup.py starts in different ways (2 CPU ranks, DDP, one step).

Rank 0 prints `FIRST_STEP_DONE <unix time>` once the first optimizer step has finished on it; the launcher that
started the command measures from its own clock, taken just before the command started.
"""

import time

import torch
from torch import nn

from torchloom import Loom

loom = Loom(accelerator="cpu", devices=2, strategy="ddp")
loom.launch()
torch.set_num_threads(1)
torch.manual_seed(0)
model = loom.setup_module(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)))
optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
x, y = torch.randn(16, 32), torch.randn(16, 1)
loss = nn.functional.mse_loss(model(x), y)
loom.backward(loss)
optimizer.step()
if loom.is_global_zero:
    print(f"FIRST_STEP_DONE {time.time():.6f}", flush=True)
