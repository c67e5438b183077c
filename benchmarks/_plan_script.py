"""The training script that `benchmarks/planning.py` and `tests/planning/` plan (`torchloom plan`) and then run
(`torchloom run`), measuring each rank's peak with `track_memory()` and `loom.memory_summary()`.

    torchloom run --devices 2 benchmarks/_plan_script.py --layout fsdp2-units --out measured.json
    torchloom plan --devices 2 benchmarks/_plan_script.py --layout fsdp2-units

Layouts: ddp; fsdp (FSDP1, every block a hand-made unit, the head a leftover); fsdp2-units (the same with
`fully_shard(block)`); tp (ModelParallelStrategy, tensor parallel 2: each block's first layer split by columns,
its second by rows). Options: --ac (activation checkpointing of every block), --precision, --micro-batch and
--accumulate (micro-batches per optimizer step).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchloom import Loom
from torchloom.planning import track_memory


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, dim: int, blocks: int, ac: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 16)
        self.ac = ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ac else block(x)
        return self.head(x)


def _parallelize(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(
            block, mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
        fully_shard(block, mesh=mesh["data_parallel"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="ddp", choices=("ddp", "fsdp", "fsdp2-units", "tp"))
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--ac", action="store_true")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the measured peaks (JSON) here")
    args = parser.parse_args()

    tracking = track_memory("cpu")
    strategy: object = {"ddp": "ddp", "fsdp": "fsdp", "fsdp2-units": "fsdp2"}.get(args.layout)
    if args.layout == "tp":
        from torchloom.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(_parallelize, data_parallel_size=1, tensor_parallel_size=2)
    loom = Loom(accelerator="cpu", strategy=strategy, precision=args.precision)
    torch.manual_seed(0)
    if args.layout == "fsdp":
        from torch.distributed.fsdp.wrap import wrap

        with loom.init_module():
            model = Net(args.dim, args.blocks, args.ac)
            model.blocks = nn.ModuleList(wrap(block) for block in model.blocks)
    else:
        model = Net(args.dim, args.blocks, args.ac)
        if args.layout == "fsdp2-units":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = loom.setup(model, optimizer)
    for _ in range(args.steps):
        for micro in range(args.accumulate):
            x = torch.randn(args.micro_batch, args.seq, args.dim)
            with loom.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = model(x).float().pow(2).mean()
                loom.backward(loss / args.accumulate)
        optimizer.step()
        optimizer.zero_grad()
    summary = loom.memory_summary()
    tracking.stop()
    if args.out and loom.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": summary.ranks}, f)


if __name__ == "__main__":
    main()
