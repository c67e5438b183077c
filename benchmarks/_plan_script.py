"""The training script that `benchmarks/planning.py` and `tests/planning/` plan (`torchloom plan`) and then run
(`torchloom run`), measuring each rank's peak with `track_memory()` (gathered from every rank).

    torchloom run --devices 2 benchmarks/_plan_script.py --layout fsdp2-units --out measured.json
    torchloom plan --devices 2 benchmarks/_plan_script.py --layout fsdp2-units

Layouts: ddp; fsdp (FSDP1, every block a hand-made unit, the head a leftover); fsdp2-units (the same with
`fully_shard(block)`); tp (ModelParallelStrategy, tensor parallel 2: each block's first layer split by columns,
its second by rows); pp (PipelineStrategy, one stage per rank, 1F1B over as many micro-batches as stages, at
least 2). Options: --ac
(activation checkpointing of every block), --positions (a position embedding indexed by `torch.arange` in the
forward), --offload (fsdp2-units: torch's CPUOffloadPolicy), --precision,
--micro-batch, --accumulate (micro-batches per optimizer step) and --more "OPTIONS" (another configuration
measured after this one in the same launched ranks; `--out` then lists each under `configs`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

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
    def __init__(self, dim: int, blocks: int, ac: bool, positions: int = 0) -> None:
        super().__init__()
        # A GPT-style position embedding whose indices the forward builds (`torch.arange`), with --positions.
        self.pos = nn.Embedding(positions, dim) if positions else None
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 16)
        self.ac = ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pos is not None:
            x = x + self.pos(torch.arange(x.shape[1], device=x.device))
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="ddp", choices=("ddp", "fsdp", "fsdp2-units", "tp", "pp"))
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--ac", action="store_true")
    parser.add_argument(
        "--positions", action="store_true", help="a position embedding indexed by torch.arange"
    )
    parser.add_argument("--offload", action="store_true", help="fsdp, fsdp2-units: CPU offload of the shards")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the measured peaks (JSON) here")
    parser.add_argument(
        "--more",
        action="append",
        default=[],
        metavar="ARGS",
        help="another configuration measured after this one in the same processes (its options as one string)",
    )
    return parser


def _measure(args: argparse.Namespace, baseline: list[int]) -> list[dict[str, int]]:
    """Train one configuration; every rank's measured peak. `baseline`: the live bytes when the first
    configuration started (filled by it); a later configuration's peak is counted above the same baseline, so
    what an earlier one left alive (FSDP2 keeps its last model's shards referenced) does not count."""
    gc.collect()  # what an earlier configuration left is freed before the count starts
    tracking = track_memory("cpu")
    at_start = tracking.peak_bytes()["peak_bytes"]
    baseline.append(at_start)
    strategy: object = {"ddp": "ddp", "fsdp": "fsdp", "fsdp2-units": "fsdp2"}.get(args.layout)
    if args.offload and args.layout != "fsdp2-units":
        # torchloom's cpu_offload= is refused on CPU ranks (there is no device memory to offload from).
        raise SystemExit("--offload: fsdp2-units only (hand-made units with torch's CPUOffloadPolicy)")
    if args.layout == "tp":
        from torchloom.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(_parallelize, data_parallel_size=1, tensor_parallel_size=2)
    if args.layout == "pp":
        from torchloom.strategies import PipelineStrategy

        # One stage per rank (the blocks cut evenly, the head on the last), 1F1B over as many micro-batches as
        # stages (2 at pp 2).
        world = int(os.environ.get("WORLD_SIZE", "2"))
        per_stage = max(args.blocks // world, 1)
        micro_batches = max(world, 2) if args.micro_batch >= max(world, 2) else 1
        strategy = PipelineStrategy(
            pipeline_parallel_size=world,
            split_points=[f"blocks.{per_stage * s}" for s in range(1, world)],
            example_input=torch.zeros(args.micro_batch // micro_batches, args.seq, args.dim),
            schedule="1f1b" if micro_batches >= world else "gpipe",
            n_microbatches=micro_batches,
        )
    loom = Loom(accelerator="cpu", strategy=strategy, precision=args.precision)
    torch.manual_seed(0)
    if args.layout == "fsdp":
        from torch.distributed.fsdp.wrap import wrap

        with loom.init_module():
            model = Net(args.dim, args.blocks, args.ac, args.seq if args.positions else 0)
            model.blocks = nn.ModuleList(wrap(block) for block in model.blocks)
    elif args.layout == "pp":
        with loom.init_module(empty_init=True):  # each rank allocates only its stage
            model = Net(args.dim, args.blocks, args.ac, args.seq if args.positions else 0)
        torch.manual_seed(0)
    else:
        model = Net(args.dim, args.blocks, args.ac, args.seq if args.positions else 0)
        if args.layout == "fsdp2-units":
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

            # Pinned memory needs an accelerator; on CPU ranks the offloaded shards stay where they are.
            offload = CPUOffloadPolicy(pin_memory=False) if args.offload else OffloadPolicy()
            for block in model.blocks:
                fully_shard(block, offload_policy=offload)
    if args.layout == "pp":
        model = loom.setup_module(model)
        optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = loom.setup(model, optimizer)

    def loss_fn(output: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return output.float().pow(2).mean() / args.accumulate

    for _ in range(args.steps):
        for micro in range(args.accumulate):
            x = torch.randn(args.micro_batch, args.seq, args.dim)
            with loom.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loom.forward_backward(model, x, torch.zeros(args.micro_batch), loss_fn)
        optimizer.step()
        optimizer.zero_grad()
    own = tracking.peak_bytes()["peak_bytes"] - (at_start - baseline[0])
    tracking.stop()
    peaks = loom.all_gather(torch.tensor(own, dtype=torch.int64)).reshape(-1).tolist()
    return [{"peak_bytes": int(peak), "reserved_bytes": 0} for peak in peaks]


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    # Several configurations in one launched group (the tests and the benchmark pay for starting ranks once);
    # each is measured from what is live when it starts, after the previous one's model and optimizer are gone.
    baseline: list[int] = []
    results = [{"args": [], "ranks": _measure(args, baseline)}]
    for more in args.more:
        results.append({"args": more.split(), "ranks": _measure(parser.parse_args(more.split()), baseline)})
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": results[0]["ranks"], "configs": results}, f)


if __name__ == "__main__":
    main()
