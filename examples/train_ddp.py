"""Train a small MLP on synthetic regression data with DDP, top to bottom.

    python examples/train_ddp.py --devices 2          # 2 CPU processes (what `make demo` runs)
    python examples/train_ddp.py --devices 1          # one process, same script
    torchrun --nproc-per-node 2 examples/train_ddp.py # under torchrun (or srun): torchloom launches nothing

`loom.launch()` re-runs this script once per rank, so everything below runs on every rank.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchloom import Loom

# ---- settings ------------------------------------------------------------------------------------------------
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--accelerator", default="cpu", help="cpu, cuda or auto")
parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs per node")
parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, ... (see README)")
parser.add_argument("--samples", type=int, default=8192, help="size of the synthetic dataset")
parser.add_argument("--features", type=int, default=16)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=64, help="micro-batch size per rank")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
parser.add_argument("--lr", type=float, default=3e-2)
parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping by global norm")
parser.add_argument("--log-every", type=int, default=25)
parser.add_argument("--out", default="checkpoints/train_ddp.pt", help="where the final checkpoint goes")
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()

# ---- start the ranks -----------------------------------------------------------------------------------------
loom = Loom(accelerator=args.accelerator, devices=args.devices, precision=args.precision)
loom.launch()
loom.seed_everything(args.seed)  # same model init and same dataset on every rank
loom.print(
    f"{loom.world_size} rank(s), strategy {loom.strategy.name}, device {loom.device}, {args.precision}"
)

# ---- data: y = sin(2 x.w) + x.v / 2 + noise, the same tensors on every rank; the sampler splits them -------------
g = torch.Generator().manual_seed(args.seed)
x = torch.randn(args.samples, args.features, generator=g)
w, v = torch.randn(2, args.features, 1, generator=g) / args.features**0.5
y = torch.sin(2 * x @ w) + 0.5 * x @ v + 0.05 * torch.randn(args.samples, 1, generator=g)
loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True)
loader = loom.setup_dataloaders(loader)  # each rank reads its own shuffled part, batches land on loom.device

# ---- model and optimizer -------------------------------------------------------------------------------------
with loom.init_module():
    model = nn.Sequential(
        nn.Linear(args.features, args.hidden), nn.GELU(),
        nn.Linear(args.hidden, args.hidden), nn.GELU(),
        nn.Linear(args.hidden, 1),
    )  # fmt: skip
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
model, optimizer = loom.setup(model, optimizer)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

# ---- training loop -------------------------------------------------------------------------------------------
step, micro, start = 0, 0, time.time()
while step < args.steps:
    for xb, yb in loader:  # a new pass is a new epoch: the sampler reshuffles
        is_accumulating = (micro + 1) % args.accumulate != 0
        # Inside no_backward_sync, gradients pile up locally; the last micro-batch's backward syncs them all.
        with loom.no_backward_sync(model, enabled=is_accumulating):
            loss = F.mse_loss(model(xb), yb)
            loom.backward(loss / args.accumulate)
        micro += 1
        if is_accumulating:
            continue
        grad_norm = loom.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        step += 1
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            # Every rank must join the collective.
            mean_loss = loom.all_reduce(loss.detach(), reduce_op="mean").item()
            loom.print(
                f"step {step:5d} | loss {mean_loss:.4f} | grad norm {grad_norm.item():.3f} "
                f"| lr {scheduler.get_last_lr()[0]:.2e} | {time.time() - start:.1f}s"
            )
        if step == args.steps:
            break

# ---- save: rank 0 writes one file that plain torch can read ----------------------------------------------------
loom.save(args.out, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step})
loom.print(f"saved {args.out}")
