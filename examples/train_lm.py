"""Train a small character-level transformer language model with hand-sharded blocks.

    python examples/train_lm.py                                 # 2 CPU processes, fsdp2 (what `make demo` runs)
    python examples/train_lm.py --flavour fsdp --precision bf16-mixed
    torchloom run --devices 2 examples/train_lm.py --resume     # continue from the latest checkpoint

Every transformer block is one FSDP unit, made by hand: `fully_shard(block)` for fsdp2, `wrap(block)` inside
`loom.init_module()` for fsdp. The token embedding and the output head stay outside every unit, so torchloom
replicates them on every rank and keeps their gradients in sync, like DDP. The text is the Python standard
library's own source code, which every machine with Python has; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import wrap

import torchloom
from torchloom import Loom
from torchloom.loggers import CSVLogger, TensorBoardLogger

# ---- settings -------------------------------------------------------------------------------------------------
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", default="2", help="processes (CPU) or GPUs")
parser.add_argument("--accelerator", default="cpu")
parser.add_argument(
    "--flavour", choices=("fsdp2", "fsdp"), default="fsdp2", help="which FSDP shards the blocks"
)
parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per micro-batch")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--block-size", type=int, default=64, help="context length in characters")
parser.add_argument("--n-layer", type=int, default=4)
parser.add_argument("--n-embd", type=int, default=128)
parser.add_argument("--n-head", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--max-norm", type=float, default=1.0)
parser.add_argument("--eval-every", type=int, default=50)
parser.add_argument("--eval-batches", type=int, default=8)
parser.add_argument("--checkpoint-every", type=int, default=100)
parser.add_argument("--out-dir", default="runs/lm")
parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
parser.add_argument("--stop-at", type=int, default=None, help="stop after this step, as if interrupted")
parser.add_argument(
    "--text-bytes", type=int, default=400_000, help="how much standard-library source to read"
)
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()


# ---- data: the standard library's source, as bytes (vocabulary of 256) --------------------------------------
def load_text(limit: int) -> torch.Tensor:
    stdlib = Path(os.__file__).parent
    data = bytearray()
    for path in sorted(stdlib.glob("*.py")):  # sorted: the same text, in the same order, on every rank
        data += path.read_bytes()
        if len(data) >= limit:
            break
    return torch.tensor(list(data[:limit]), dtype=torch.long)


def get_batch(
    data: torch.Tensor, step: int, micro: int, rank: int, batch_size: int
) -> tuple[torch.Tensor, ...]:
    # The batch depends only on (step, micro-batch, rank), so a resumed run reads exactly what the
    # uninterrupted one would have read.
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + micro * 101 + rank)
    starts = torch.randint(len(data) - args.block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[s : s + args.block_size] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + args.block_size] for s in starts])
    return x, y


# ---- the model ------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, shard_block=lambda block: block) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, args.n_embd)  # replicated: outside every unit
        self.pos = nn.Embedding(args.block_size, args.n_embd)  # replicated too
        self.blocks = nn.ModuleList(shard_block(Block(args.n_embd, args.n_head)) for _ in range(args.n_layer))
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.head = nn.Linear(args.n_embd, 256, bias=False)  # replicated

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---- setup ----------------------------------------------------------------------------------------------------
out_dir = Path(args.out_dir)
loggers = [CSVLogger(out_dir, name="logs", append=args.resume)]
try:
    loggers.append(TensorBoardLogger(out_dir, name="tensorboard"))
except ImportError:
    pass  # TensorBoard is optional: pip install 'torchloom[tensorboard]'
loom = Loom(
    accelerator=args.accelerator,
    devices=args.devices,
    strategy=args.flavour,
    precision=args.precision,
    loggers=loggers,
)
loom.launch()
torchloom.seed_everything(args.seed)  # the same initial weights on every rank

if args.flavour == "fsdp":
    with loom.init_module():  # wrap() makes a unit only inside init_module
        model = GPT(shard_block=wrap)
else:
    model = GPT()
    for block in model.blocks:
        # unit_kwargs(): the mesh and the precision's MixedPrecisionPolicy, as torchloom's own units get them.
        fully_shard(block, **loom.strategy.unit_kwargs())
# The root stays unwrapped; tok, pos, ln_f and head are replicated. setup_module logs the sharding summary
# (the same text as torchloom.describe(model)).
model = loom.setup_module(model)
optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer,
    lambda step: 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps)),  # cosine
)

text = load_text(args.text_bytes)
split = int(0.9 * len(text))
train_data, val_data = text[:split], text[split:]

start_step = 0
latest = out_dir / "checkpoint"
if args.resume and latest.exists():
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    start_step = loom.load(latest, state)["step"]
    loom.print(f"resumed from {latest} at step {start_step}")


@torch.no_grad()
def evaluate() -> float:
    model.eval()
    losses = []
    for i in range(args.eval_batches):
        x, y = get_batch(val_data, step=-1, micro=i, rank=loom.global_rank, batch_size=args.batch_size)
        logits = model(x.to(loom.device))
        losses.append(F.cross_entropy(logits.view(-1, 256), y.to(loom.device).view(-1)))
    model.train()
    return float(loom.all_reduce(torch.stack(losses).mean()))


# ---- training loop --------------------------------------------------------------------------------------------
if start_step == 0:
    first_val = evaluate()
    loom.print(f"step 0: validation loss {first_val:.4f}")
    loom.log("val_loss", first_val, step=0)
bar = loom.progress(range(start_step, args.steps), total=args.steps - start_step, desc="training")
tokens_per_step = args.batch_size * args.block_size * args.accumulate * loom.world_size
for step in bar:
    t0 = time.perf_counter()
    for micro in range(args.accumulate):
        x, y = get_batch(train_data, step, micro, loom.global_rank, args.batch_size)
        # Skip gradient sync on all but the last micro-batch: every unit and the replicated layers accumulate
        # locally, and the last backward averages everything once.
        with loom.no_backward_sync(model, enabled=micro < args.accumulate - 1):
            logits = model(x.to(loom.device))
            loss = F.cross_entropy(logits.view(-1, 256), y.to(loom.device).view(-1)) / args.accumulate
            loom.backward(loss)
    grad_norm = loom.clip_gradients(model, optimizer, max_norm=args.max_norm)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()

    train_loss = float(loom.all_reduce(loss.detach())) * args.accumulate
    throughput = tokens_per_step / (time.perf_counter() - t0)
    loom.log_dict(
        {
            "train_loss": train_loss,
            "grad_norm": grad_norm,
            "lr": scheduler.get_last_lr()[0],
            "tokens_per_s": throughput,
        },
        step=step + 1,
    )
    bar.set_postfix(loss=train_loss, tok_s=f"{throughput:,.0f}")
    if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
        val = evaluate()
        loom.log("val_loss", val, step=step + 1)
        bar.write(f"step {step + 1}: train loss {train_loss:.4f}, validation loss {val:.4f}")
    if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
        # Sharded: every rank writes its own shards; swapped into place only when complete.
        loom.save(latest, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step + 1})
    if args.stop_at is not None and step + 1 >= args.stop_at:
        break
bar.close()
loom.finalize_loggers()


# ---- a sample ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate(prompt: bytes, length: int) -> bytes:
    model.eval()
    idx = torch.tensor([list(prompt)], device=loom.device)
    g = torch.Generator(device=loom.device).manual_seed(args.seed)
    for _ in range(length):
        logits = model(idx[:, -args.block_size :])[:, -1, :] / 0.8
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)], dim=1)
    return bytes(idx[0].tolist())


sample = generate(b"def ", 200)  # every rank runs the forward: the sharded blocks need all of them
loom.print("sample:\n" + sample.decode("utf-8", errors="replace"))
