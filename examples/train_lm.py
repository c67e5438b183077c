"""Train a small character-level transformer language model with hand-sharded blocks.

    python examples/train_lm.py                                 # 2 CPU processes, fsdp2 (what `make demo` runs)
    python examples/train_lm.py --flavour fsdp --precision bf16-mixed
    python examples/train_lm.py --devices 1 --resume            # continue the latest checkpoint, on 1 process
    python examples/train_lm.py --devices 4 --tp 2              # 2-D: tensor parallel 2 x data parallel 2

Every transformer block is one FSDP unit, made by hand (`shard()` below): `fully_shard(block)` for fsdp2,
`wrap(block)` for fsdp. The token embedding and the output head stay outside every unit, so torchloom replicates
them on every rank and keeps their gradients in sync, like DDP. The text is the Python standard library's own
source code, which every machine with Python has; nothing is downloaded.

--tp N adds tensor parallelism (torchloom's ModelParallelStrategy): `parallelize()` below splits every block's
attention and MLP over N ranks (Megatron-style: q/k/v and the MLP's first layer by output features, the
projections after them by input features), then makes each block an FSDP2 unit over the data-parallel ranks
(--devices / N of them). The ranks of one tensor-parallel group read the same batch.

--batch-size is the global batch (sequences per micro-batch, summed over ranks), so a run resumed with another
--devices reads exactly the global batches the uninterrupted run would have read.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import wrap
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset

import torchloom
from torchloom import Loom
from torchloom.loggers import CSVLogger, TensorBoardLogger
from torchloom.strategies import ModelParallelStrategy
from torchloom.throughput import ThroughputMonitor, count_flops

# ---- settings -------------------------------------------------------------------------------------------------
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", default="2", help="processes (CPU) or GPUs")
parser.add_argument("--accelerator", default="cpu")
parser.add_argument(
    "--flavour", choices=("fsdp2", "fsdp"), default="fsdp2", help="which FSDP shards the blocks"
)
parser.add_argument(
    "--tp", type=int, default=None, help="tensor-parallel size (2-D parallelism; --devices must divide by it)"
)
parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed")
parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
parser.add_argument(
    "--batch-size", type=int, default=32, help="sequences per micro-batch over all ranks (the global batch)"
)
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--block-size", type=int, default=64, help="context length in characters")
parser.add_argument("--n-layer", type=int, default=4)
parser.add_argument("--n-embd", type=int, default=128)
parser.add_argument("--n-head", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--max-norm", type=float, default=1.0)
parser.add_argument("--log-every", type=int, default=10, help="steps between logged training metrics")
parser.add_argument("--eval-every", type=int, default=50)
parser.add_argument("--eval-batches", type=int, default=8)
parser.add_argument("--checkpoint-every", type=int, default=100)
parser.add_argument("--out-dir", default="runs/lm")
parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
parser.add_argument("--stop-at", type=int, default=None, help="stop after this step, as if interrupted")
parser.add_argument(
    "--text-bytes", type=int, default=400_000, help="how much standard-library source to read"
)
parser.add_argument("--sample-bytes", type=int, default=200, help="length of the sample generated at the end")
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


class Windows(Dataset):
    """Window i is tokens [i * block_size, (i + 1) * block_size]: the input is its first block_size tokens, the
    target the same shifted by one. Neighbouring windows share one token, so each token is a target once per
    epoch."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return window[:-1], window[1:]


# ---- the model ------------------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 256


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.ln1 = nn.LayerNorm(config.n_embd)
        # Separate projections (not one fused qkv): tensor parallelism splits each by output features, giving
        # every rank whole heads of q, k and v alike.
        self.q = nn.Linear(config.n_embd, config.n_embd)
        self.k = nn.Linear(config.n_embd, config.n_embd)
        self.v = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 heads: under tensor parallelism a rank's q, k and v hold only its own heads.
        q, k, v = (z(h).view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def parallelize(model: GPT, device_mesh) -> GPT:
    """--tp's `parallelize_fn`: `loom.setup_module` calls it with the 2-D mesh ("data_parallel",
    "tensor_parallel"). Each block's attention needs one all-reduce over its tensor-parallel group (after proj),
    its MLP another (after mlp.2). tok, pos, ln_f and head stay plain: torchloom replicates them."""
    plan = {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, device_mesh["tensor_parallel"], plan)
        fully_shard(block, **loom.strategy.unit_kwargs())  # the data-parallel mesh and the precision's policy
    return model


def make_strategy():
    """--flavour's strategy name; with --tp, the model-parallel strategy with `parallelize` on a (devices / tp) x
    tp mesh."""
    if args.tp is None:
        return args.flavour
    if args.flavour != "fsdp2":
        parser.error("--tp shards the blocks with FSDP2: leave --flavour at fsdp2")
    if not args.devices.isdigit() or int(args.devices) % args.tp:
        parser.error(f"--devices {args.devices} must be a number of processes divisible by --tp {args.tp}")
    if args.n_head % args.tp:
        parser.error(
            f"--n-head {args.n_head} must be divisible by --tp {args.tp}: each rank takes whole heads"
        )
    return ModelParallelStrategy(
        parallelize_fn=parallelize,
        data_parallel_size=int(args.devices) // args.tp,
        tensor_parallel_size=args.tp,
    )


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
    strategy=make_strategy(),
    precision=args.precision,
    loggers=loggers,
)
data_parallel = loom.world_size // (args.tp or 1)  # the ranks of a tensor-parallel group read the same batch
if args.batch_size % data_parallel:
    parser.error(
        f"--batch-size {args.batch_size} (the global batch) must be divisible by {data_parallel} ranks"
        + (" (the data-parallel ones: --devices / --tp)" if args.tp else "")
    )
loom.launch()
torchloom.seed_everything(args.seed)  # the same initial weights on every rank, and the data order


def shard(block: nn.Module) -> nn.Module:
    """Make `block` one FSDP unit. Both run inside `loom.init_module()`, where `wrap()` gets torchloom's unit
    configuration by itself; `fully_shard` takes it as arguments (the mesh, and the precision's
    MixedPrecisionPolicy)."""
    if args.flavour == "fsdp":
        return wrap(block)
    return fully_shard(block, **loom.strategy.unit_kwargs())


config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
with loom.init_module():
    model = GPT(config)
    if args.tp is None:  # under --tp, setup_module calls parallelize()
        for i, block in enumerate(model.blocks):
            model.blocks[i] = shard(block)
# The root stays unwrapped: tok, pos, ln_f and head are outside every unit, so torchloom replicates them.
# setup_module logs the sharding summary (the same text as torchloom.describe(model)).
model = loom.setup_module(model)
optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer,
    lambda step: 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps)),  # cosine
)

text = load_text(args.text_bytes)
split = int(0.9 * len(text))
# Each rank reads batch_size / data_parallel sequences of every global batch. drop_last: every global batch is full,
# so they are the same batches at any world size.
per_rank = args.batch_size // data_parallel
train_loader, val_loader = loom.setup_dataloaders(
    DataLoader(Windows(text[:split], args.block_size), batch_size=per_rank, shuffle=True, drop_last=True),
    DataLoader(Windows(text[split:], args.block_size), batch_size=per_rank, drop_last=True),
)

# What a checkpoint holds. The loader records where it is in its epoch's global order, so a resumed run (on any
# number of ranks) continues after the last batch it handed out; loom.save adds every rank's random generators,
# which loom.load restores when the world size is the same.
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": train_loader, "step": 0}
latest = out_dir / "checkpoint"
if args.resume and latest.exists():
    loom.load(latest, state)  # objects are restored in place, the plain "step" replaced
    loom.print(f"resumed from {latest} at step {state['step']}")
step = state["step"]


def batches(loader):
    while True:
        yield from loader  # each pass is a new epoch, shuffled: the same global order at every world size


@torch.no_grad()
def evaluate() -> float:
    model.eval()
    losses = []
    for x, y in itertools.islice(val_loader, args.eval_batches):
        logits = model(x)
        losses.append(F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)))
    model.train()
    return loom.all_reduce(torch.stack(losses).mean()).item()


# ---- throughput ---------------------------------------------------------------------------------------------------
# The FLOPs of one micro-batch on one device, counted by torch's FlopCounterMode on a meta-device copy of the model
# (nothing allocated): the model FLOPs (forward and backward; a checkpointed model's recomputation would be
# counted apart), per device: tensor parallelism splits the blocks' matmuls over --tp ranks (the embedding and
# head, replicated, are counted split too: a slight undercount under --tp).
with torch.device("meta"):
    meta_model = GPT(config)
    meta_x = torch.zeros(per_rank, args.block_size, dtype=torch.long)
micro_flops = count_flops(
    meta_model, lambda: meta_model(meta_x), lambda y: y.sum(), tensor_parallel_size=args.tp or 1
)
# MFU needs the device's peak FLOPs: known for data-centre GPUs (dense, in the precision's dtype), not for a CPU.
monitor = ThroughputMonitor(
    loom,
    window_size=2,
    using_sparse_model=False,
    **({"available_flops": None} if loom.device.type == "cpu" else {}),
)
t_start, start_step, throughput = time.perf_counter(), step, {}


def measure(step: int) -> dict:
    """Throughput since the last log, from the running totals of this rank (a GPU is synchronised first)."""
    if loom.device.type == "cuda":
        torch.cuda.synchronize()
    micro = (step - start_step) * args.accumulate
    monitor.update(
        time=time.perf_counter() - t_start,
        batches=micro,
        samples=micro * per_rank,
        lengths=micro * per_rank * args.block_size,
        flops=micro_flops.model * args.accumulate * steps_since_log,
    )
    return monitor.compute()


# ---- training loop --------------------------------------------------------------------------------------------
if step == 0:
    val_loss = evaluate()
    loom.print(f"step 0: validation loss {val_loss:.4f}")
    loom.log("val_loss", val_loss, step=0)
train_batches = batches(train_loader)
tokens_per_step = args.batch_size * args.block_size * args.accumulate
loss_sum = torch.zeros((), device=loom.device)  # summed on the device: no host sync until the next log
steps_since_log = 0
bar = loom.progress(range(step + 1, args.steps + 1), total=args.steps - step, desc="training")
measure(step)
for step in bar:
    for micro in range(args.accumulate):
        x, y = next(train_batches)
        # Skip gradient sync on all but the last micro-batch: every unit and the replicated layers accumulate
        # locally, and the last backward averages everything once.
        with loom.no_backward_sync(model, enabled=micro < args.accumulate - 1):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loom.backward(loss / args.accumulate)
        loss_sum += loss.detach()
    grad_norm = loom.clip_gradients(model, optimizer, max_norm=args.max_norm)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    steps_since_log += 1
    bar.count(tokens_per_step)  # the bar shows tokens/s

    if step % args.log_every == 0 or step == args.steps:
        # The mean loss over every micro-batch of every rank since the last log: one all-reduce, one host sync.
        train_loss = loom.all_reduce(loss_sum).item() / (args.accumulate * steps_since_log)
        # Rank 0's monitor (the others get {}): its tokens per second times the data-parallel ranks (the ranks of
        # a tensor-parallel group read the same tokens), and on a GPU its MFU.
        throughput = measure(step)
        metrics = {"train_loss": train_loss, "grad_norm": grad_norm.item(), "lr": scheduler.get_last_lr()[0]}
        if "device/items_per_sec" in throughput:
            metrics["tokens_per_s"] = throughput["device/items_per_sec"] * data_parallel
        if "device/mfu" in throughput:
            metrics["mfu"] = throughput["device/mfu"]
            bar.set_postfix(mfu=f"{throughput['device/mfu']:.1%}")
        loom.log_dict(metrics, step=step)
        bar.set_postfix(loss=train_loss)
        loss_sum.zero_()
        steps_since_log = 0
    if step % args.eval_every == 0 or step == args.steps:
        val_loss = evaluate()
        loom.log("val_loss", val_loss, step=step)
        bar.write(f"step {step}: validation loss {val_loss:.4f}")
    if step % args.checkpoint_every == 0 or step == args.steps:
        # Sharded: every rank writes its own shards; swapped into place only when complete.
        state["step"] = step
        loom.save(latest, state)
    if args.stop_at is not None and step >= args.stop_at:
        break
bar.close()
loom.finalize_loggers()
if throughput.get("time"):
    tokens = throughput["lengths"] * data_parallel
    mfu = f", MFU {throughput['device/mfu']:.1%} of the dense peak" if "device/mfu" in throughput else ""
    loom.print(
        f"throughput: {tokens / throughput['time']:,.0f} tokens/s over the run{mfu}", rank_zero="global"
    )


# ---- a sample ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate(prompt: bytes, length: int) -> bytes:
    model.eval()
    idx = torch.tensor([list(prompt)], device=loom.device)
    g = torch.Generator(device=loom.device).manual_seed(args.seed)
    for _ in range(length):
        logits = model(idx[:, -config.block_size :])[:, -1, :] / 0.8
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)], dim=1)
    return bytes(idx[0].tolist())


sample = generate(
    b"def ", args.sample_bytes
)  # every rank runs the forward: the sharded blocks need all of them
loom.print("sample:\n" + sample.decode("utf-8", errors="replace"))
