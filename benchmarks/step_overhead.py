"""Step overhead: a torchloom training step against the same step written with raw PyTorch, on 2 CPU ranks
(or, with `--device cuda`, on 2 GPUs over NCCL).

The model is a stack of blocks, each its own FSDP unit made by hand, and a head outside every unit:

    fsdp2  torchloom strategy="fsdp2", fully_shard(block) by hand, head kept in sync by torchloom
           vs raw fully_shard(block, reshard_after_forward=True) + one hand-written all-reduce of the head's
           gradients after backward (torchloom makes hand-made units reshard after forward as under a root
           unit; raw FSDP2 would keep every block, each a root here, unsharded until backward)
    fsdp   torchloom strategy="fsdp", wrap(block) inside loom.init_module(), head kept in sync by torchloom
           vs raw FullyShardedDataParallel(block) + the same hand-written all-reduce for the head
    ddp    torchloom strategy="ddp" vs raw DistributedDataParallel(model)
    fsdp2-accum-clip
           the fsdp2 pair with `--accumulate` micro-batches per step and gradient clipping, the two places where
           torchloom does work of its own: loom.no_backward_sync + loom.clip_gradients(max_norm=1) vs
           set_requires_gradient_sync(False) on every block for all but the last micro-batch, the head's
           all-reduce after the last, and a hand-written global norm (the blocks' sharded norm via
           `get_total_norm(...).full_tensor()`, combined with the head's) + `clip_grads_with_norm_`. The two
           sides' norms are checked to agree before timing.
    fsdp2-many-tensors
           the fsdp2 pair on a model of many small parameter tensors, as mixture-of-experts models have:
           `--many-blocks` units made by hand, each of `--many-experts` small experts (2 tensors each), and
           outside every unit a LayerNorm and `--many-adapters` small linear layers per block (replicated
           leftovers), 3,106 parameter tensors by default; one AdamW group over all of them on the torchloom side
           (it mixes DTensors and plain tensors), one per kind on the raw side. Torch's own per-tensor work (the
           optimizer, FSDP2's copies) grows with the count too: the ratio shows whether torchloom's grows faster.
    model-parallel
           2-D parallelism with one `parallelize_fn` on both sides (`_parallelize_net`: tensor parallel 2 inside
           every block, fc1 split by output features and fc2 by input features, then `fully_shard(block)` over
           the data-parallel ranks: world / 2 of them, so 1 on 2 ranks); the head stays plain. torchloom
           ModelParallelStrategy(parallelize_fn) vs raw init_device_mesh + the same function + the head's
           all-reduce over the data-parallel group (none at 1). The ranks of a tensor-parallel group read the
           same batch.
    model-parallel-accum-clip
           the model-parallel pair with `--accumulate` micro-batches and clipping, as fsdp2-accum-clip; the raw
           norm groups the gradients by mesh (the blocks' weights live on the 2-D mesh, their LayerNorms on the
           data-parallel one) and makes each group's norm whole with `full_tensor()`.

The desync record (what `Loom`'s collectives note for the desync report) is timed on its own, per call, against
each pair's torchloom step, as if the step made RECORDED_PER_STEP Loom collectives (a loss all-reduce and
`should_stop`): goal <= 1% of the step. The steps above make none, so their ratios exclude it.

A step is forward, MSE loss, backward (with gradient sync), AdamW step, zero_grad. Both sides of a pair live in
the same two processes and run alternately (ABBA), `--steps` steps per measurement after warm-up; the ratio
torchloom/raw is taken per repeat, of the wall time, of the CPU time of both processes and of the CPU time of
their main threads (where the Python of both sides runs: the least disturbed by other jobs). Goal: median ratio <= 1.03. By default a measurement is one step and there
are 80 of them per side: each torchloom step is compared with the raw step right next to it, so the other jobs
on a shared machine disturb both sides of a ratio alike (blocks of 7 steps per measurement moved the medians
by +-5% between runs).

    python benchmarks/step_overhead.py                  # default size
    python benchmarks/step_overhead.py --tiny           # smoke test, a few seconds
    python benchmarks/step_overhead.py --device cuda    # 2 GPUs: each step's time includes waiting for the GPU
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    Net,
    add_device_argument,
    alternate,
    batch,
    check_device,
    header,
    median,
    model_numel,
    ratio_line,
    ratios,
    run_ranks,
    summary,
    synchronize,
    table,
    write_json,
)
from torch import nn  # noqa: E402

ACCUM = "fsdp2-accum-clip"
MANY = "fsdp2-many-tensors"
MP = "model-parallel"
MP_ACCUM = "model-parallel-accum-clip"
PAIRS = ("fsdp2", "fsdp", "ddp", ACCUM, MANY, MP, MP_ACCUM)
MANY_DIM = 16


class _Experts(nn.Module):
    """Small experts, every one applied to every row (a unit whose every parameter gets a gradient)."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(expert(x) for expert in self.experts) / len(self.experts)


class ManyTensorNet(nn.Module):
    """`blocks` expert blocks (made units by hand), each followed by a LayerNorm and `adapters` small linear
    layers that stay outside every unit, and a head: 2 * (blocks * (experts + adapters + 1) + 1) tensors."""

    def __init__(self, dim: int, blocks: int, experts: int, adapters: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Experts(dim, experts) for _ in range(blocks))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(blocks))
        self.adapters = nn.ModuleList(
            nn.ModuleList(nn.Linear(dim, dim) for _ in range(adapters)) for _ in range(blocks)
        )
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, norm, adapters in zip(self.blocks, self.norms, self.adapters, strict=True):
            x = norm(block(x))
            for adapter in adapters:
                x = x + torch.tanh(adapter(x))
        return self.head(x)


def _model(pair: str, cfg: dict[str, Any], **kwargs: Any) -> nn.Module:
    if pair == MANY:
        return ManyTensorNet(MANY_DIM, cfg["many_blocks"], cfg["many_experts"], cfg["many_adapters"])
    return Net(cfg["dim"], cfg["blocks"], **kwargs)


def _many_tensors(cfg: dict[str, Any]) -> int:
    return 2 * (cfg["many_blocks"] * (cfg["many_experts"] + cfg["many_adapters"] + 1) + 1)


GOAL = "<= 1.03"
RECORDED_PER_STEP = 2
RECORD_GOAL = "<= 1.0"  # percent of the step


def _tp_size(world: int) -> int:
    """The model-parallel pairs' tensor-parallel size (they are skipped on a single GPU)."""
    return 2


def _parallelize_net(model: nn.Module, device_mesh: Any) -> nn.Module:
    """The model-parallel pairs' `parallelize_fn`, the same on both sides."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, device_mesh["tensor_parallel"], plan)
        # Explicit, as in the fsdp2 pair: every block is a root here (no unit on the model).
        fully_shard(block, mesh=device_mesh["data_parallel"], reshard_after_forward=True)
    return model


def _allreduce_grads(params: list[nn.Parameter], world: int, group: Any = None) -> None:
    """The raw loop's replicated-gradient sync: one flat all-reduce of every gradient over `group` (of `world`
    ranks), then average."""
    if world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _clip_by_global_norm(sharded: list[nn.Parameter], replicated: list[nn.Parameter], max_norm: float) -> Any:
    """The raw loop's clipping for sharded blocks plus a replicated head: the blocks' norm is a DTensor (each
    rank holds a partial sum) made whole with one all-reduce per mesh (2-D parallelism puts the blocks'
    parameters on two); the head's gradient is the same on every rank."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for p in sharded:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for params in by_mesh.values():
        norm = get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    head_norm = get_total_norm([p.grad for p in replicated if p.grad is not None])
    total = torch.sqrt(sum(squares) + head_norm**2)
    for params in by_mesh.values():
        clip_grads_with_norm_(params, max_norm, total)
    clip_grads_with_norm_(replicated, max_norm, total)
    return total


def _broadcast(params: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p in params:
            dist.broadcast(p, src=0)


def _strategy(pair: str, world: int) -> Any:
    from torchloom.strategies import ModelParallelStrategy

    if pair in (MP, MP_ACCUM):
        tp = _tp_size(world)
        return ModelParallelStrategy(
            parallelize_fn=_parallelize_net, data_parallel_size=world // tp, tensor_parallel_size=tp
        )
    return "fsdp2" if pair in (ACCUM, MANY) else pair


def _torchloom_side(pair: str, cfg: dict[str, Any], world: int) -> tuple[Any, Any, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import wrap

    from torchloom import Loom

    loom = Loom(accelerator=cfg["device"], devices="auto", strategy=_strategy(pair, world))
    loom.launch()
    torch.manual_seed(0)
    if pair == "fsdp":
        with loom.init_module():
            model = _model(pair, cfg, wrap=wrap)
    else:
        model = _model(pair, cfg)
        if pair in ("fsdp2", ACCUM, MANY):
            for block in model.blocks:
                fully_shard(block)
    model = loom.setup_module(model)
    optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    return loom, model, optimizer


def _raw_side(pair: str, cfg: dict[str, Any], world: int) -> tuple[nn.Module, Any, list[nn.Parameter], Any]:
    """The raw model, its optimizer, the parameters outside every unit (whose gradients the raw loop averages)
    and the data-parallel group they are averaged over (None: every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    device = _device(cfg)
    torch.manual_seed(0)
    model = _model(pair, cfg).to(device)
    replicated: list[nn.Parameter] = []
    dp_mesh = None
    if pair in (MP, MP_ACCUM):
        tp = _tp_size(world)
        mesh = init_device_mesh(
            device.type, (world // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel")
        )
        forward = _parallelize_net(model, mesh)
        replicated = [p for p in model.parameters() if not isinstance(p, DTensor)]
        _broadcast(replicated)
        dp_mesh = mesh["data_parallel"]
    elif pair in ("fsdp2", ACCUM, MANY):
        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            # Explicit: left at its default, a unit that is a root (no root unit here) keeps its parameters
            # unsharded from forward to backward; torchloom gives hand-made units non-root behaviour.
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        in_units = {id(p) for p in model.blocks.parameters()}
        replicated = [p for p in model.parameters() if id(p) not in in_units]
        _broadcast(replicated)
        forward = model
    elif pair == "fsdp":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FullyShardedDataParallel(block, device_id=device, use_orig_params=True)
        replicated = list(model.head.parameters())
        _broadcast(replicated)
        forward = model
    else:
        forward = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    # Replicated (plain) parameters in a group of their own: torch's foreach AdamW, the default on CUDA, refuses a
    # group that mixes them with FSDP2's DTensors (torchloom splits mixed groups for each step).
    kept = {id(p) for p in replicated}
    rest = [p for p in forward.parameters() if id(p) not in kept]
    optimizer = torch.optim.AdamW([{"params": rest}, {"params": replicated}] if replicated else rest, lr=1e-4)
    return forward, optimizer, replicated, dp_mesh


def _measure_pair(
    pair: str, cfg: dict[str, Any], world: int, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Any]:
    loom, lmodel, lopt = _torchloom_side(pair, cfg, world)
    rmodel, ropt, replicated, dp_mesh = _raw_side(pair, cfg, world)
    device = _device(cfg)
    # The head's gradients are averaged over the data-parallel ranks: every rank, or one mesh dimension's.
    sync = (world, None) if dp_mesh is None else (dp_mesh.size(), dp_mesh.get_group())

    def loom_step() -> None:
        loss = nn.functional.mse_loss(lmodel(x), y)
        loom.backward(loss)
        lopt.step()
        lopt.zero_grad()

    def raw_step() -> None:
        loss = nn.functional.mse_loss(rmodel(x), y)
        loss.backward()
        if replicated:
            _allreduce_grads(replicated, *sync)
        ropt.step()
        ropt.zero_grad()

    if pair in (ACCUM, MP_ACCUM):
        loom_step, raw_step = _accumulating_steps(
            cfg["accumulate"], lmodel, lopt, loom, rmodel, ropt, replicated, sync, x, y
        )

    def timed(step: Any) -> Any:
        def measure() -> tuple[float, float, float]:
            # The median of single steps: a step that another job on the machine preempted is dropped.
            dist.barrier()
            wall, cpu, thread = [], [], []
            synchronize(device)
            for _ in range(cfg["steps"]):
                start, start_cpu, start_thread = time.perf_counter(), time.process_time(), time.thread_time()
                step()
                synchronize(device)  # a GPU step is done when its kernels are
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
                thread.append(time.thread_time() - start_thread)
            return median(wall), median(cpu), median(thread)

        return measure

    for _ in range(cfg["warmup"]):
        loom_step()
        raw_step()
    out: dict[str, Any] = alternate({"torchloom": timed(loom_step), "raw": timed(raw_step)}, cfg["repeats"])
    out["own_python"] = _own_python_time(loom_step, cfg["profile_steps"])
    return out


def _accumulating_steps(
    accumulate: int,
    lmodel: Any,
    lopt: Any,
    loom: Any,
    rmodel: nn.Module,
    ropt: Any,
    replicated: list[nn.Parameter],
    sync: tuple[int, Any],
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[Any, Any]:
    """The accumulating pairs' two steps: `accumulate` micro-batches, sync on the last, clip to norm 1, AdamW."""
    micro = list(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True))
    head = {id(p) for p in replicated}
    sharded = [p for p in rmodel.parameters() if id(p) not in head]
    norms: dict[str, torch.Tensor] = {}

    def loom_step() -> None:
        for i, (xi, yi) in enumerate(micro):
            with loom.no_backward_sync(lmodel, enabled=i < accumulate - 1):
                loom.backward(nn.functional.mse_loss(lmodel(xi), yi) / accumulate)
        norms["torchloom"] = loom.clip_gradients(lmodel, lopt, max_norm=1.0)
        lopt.step()
        lopt.zero_grad()

    def raw_step() -> None:
        for i, (xi, yi) in enumerate(micro):
            last = i == accumulate - 1
            for block in rmodel.blocks:
                block.set_requires_gradient_sync(last)
            (nn.functional.mse_loss(rmodel(xi), yi) / accumulate).backward()
        _allreduce_grads(replicated, *sync)
        norms["raw"] = _clip_by_global_norm(sharded, replicated, 1.0)
        ropt.step()
        ropt.zero_grad()

    # Both sides start from the same weights: their first norms must agree, or the comparison is not fair.
    loom_step()
    raw_step()
    if not torch.allclose(norms["torchloom"], norms["raw"], rtol=1e-4):
        raise RuntimeError(f"the two sides disagree on the gradient norm: {norms}")
    return loom_step, raw_step


def _own_python_time(step: Any, steps: int) -> float:
    """Seconds per step spent in torchloom's own Python code (cProfile's tottime of functions in torchloom's
    files: not the torch calls they make, which the raw loop makes too), timed by the thread's CPU clock so that
    other jobs on the machine do not count; cProfile inflates it, so it is an upper bound."""
    import torchloom

    package = str(Path(torchloom.__file__).resolve().parent)
    profile = cProfile.Profile(time.thread_time)
    dist.barrier()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(v[2] for key, v in stats.items() if key[0].startswith(package)) / steps


def _record_cost(repeats: int, calls: int = 2000) -> list[float]:
    """Seconds per recorded collective: `diagnostics.RECORD` entered and left around nothing, with a scalar loss
    as the data, `calls` times per repeat (the path is known after the first call, so nothing is published)."""
    from torchloom.diagnostics import RECORD

    loss = torch.zeros(())
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            with RECORD("all_reduce", loss):
                pass
        out.append((time.perf_counter() - start) / calls)
    return out


def _device(cfg: dict[str, Any]) -> torch.device:
    """This rank's device: the CPU, or GPU `LOCAL_RANK` (what Loom picks for the rank)."""
    if cfg["device"] == "cuda":
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torchloom  # noqa: F401 - sets up its logger, which is quietened next

    logging.getLogger("torchloom").setLevel(logging.WARNING)  # no sharding summaries between the tables
    device = _device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    x, y = (t.to(device) for t in batch(rank, cfg["tokens"], cfg["dim"]))
    many = tuple(t.to(device) for t in batch(rank, cfg["tokens"], MANY_DIM))
    # A tensor-parallel group reads its data-parallel rank's batch.
    same_in_tp_group = tuple(t.to(device) for t in batch(rank // _tp_size(world), cfg["tokens"], cfg["dim"]))
    inputs = {MANY: many, MP: same_in_tp_group, MP_ACCUM: same_in_tp_group}
    results: dict[str, Any] = {}
    for pair in cfg["pairs"]:
        results[pair] = _measure_pair(pair, cfg, world, *inputs.get(pair, (x, y)))
        dist.barrier()
    results["record"] = _record_cost(min(cfg["repeats"], 20), cfg["record_calls"])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="smoke-test size (seconds)")
    parser.add_argument(
        "--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {','.join(PAIRS)}"
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=1, help="steps per measurement (their median counts)")
    parser.add_argument("--repeats", type=int, default=80, help="measurements per side (alternating)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--accumulate", type=int, default=4, help=f"micro-batches per step in the {ACCUM} pair"
    )
    parser.add_argument("--many-blocks", type=int, default=16, help=f"units in the {MANY} pair")
    parser.add_argument("--many-experts", type=int, default=82, help=f"experts per unit in the {MANY} pair")
    parser.add_argument(
        "--many-adapters", type=int, default=14, help=f"leftover linear layers per block in the {MANY} pair"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    check_device(parser, args.device, args.world)
    if args.tiny:
        # One of everything: every pair, the accumulating steps' norm check, a timed step per side, one profiled
        # step and a few recorded collectives.
        args.dim, args.blocks, args.tokens, args.steps, args.repeats, args.warmup = 64, 2, 32, 1, 1, 0
        args.many_blocks, args.many_experts, args.many_adapters = 2, 4, 2
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        parser.error(f"unknown pairs {unknown}; choose from {PAIRS}")
    skipped = [p for p in pairs if p in (MP, MP_ACCUM) and args.world < 2]
    pairs = [p for p in pairs if p not in skipped]
    where = "2 CPU ranks (gloo), 1 thread each" if args.device == "cpu" else f"{args.world} GPU(s) (NCCL)"
    header(f"Step overhead: torchloom vs raw PyTorch, {where}", args)
    print(
        f"# model: {args.blocks} blocks of width {args.dim} (each its own unit under fsdp/fsdp2) + a replicated "
        f"head, {model_numel(args.dim, args.blocks) / 1e6:.1f}M parameters; {args.tokens} rows per rank; AdamW",
        flush=True,
    )
    keys = ("dim", "blocks", "tokens", "steps", "repeats", "warmup", "accumulate")
    cfg = {k: getattr(args, k) for k in (*keys, "many_blocks", "many_experts", "many_adapters")}
    if MANY in pairs:
        print(
            f"# {MANY}: {cfg['many_blocks']} units of {cfg['many_experts']} experts + {cfg['many_adapters']} "
            f"leftover layers per block, width {MANY_DIM}: {_many_tensors(cfg)} parameter tensors",
            flush=True,
        )
    if skipped:
        print(f"# skipped {', '.join(skipped)}: tensor parallelism needs 2 ranks, this run has 1", flush=True)
    cfg["pairs"] = pairs
    cfg["device"] = args.device
    cfg["profile_steps"] = 1 if args.tiny else 5
    cfg["record_calls"] = 10 if args.tiny else 2000
    per_rank = run_ranks(_rank, cfg, world_size=args.world, device=args.device)
    record = [max(costs) for costs in zip(*(r["record"] for r in per_rank), strict=True)]
    rows, out, record_rows = [], [], []
    for pair in pairs:
        # A repeat's wall time is the slower rank's (the step is done when both are); CPU time (all threads of
        # the process) is summed over ranks: it counts work done and is less disturbed by other jobs. The main
        # thread's CPU time leaves out the communication threads (gloo's, NCCL's): the Python and the compute
        # each side issues itself.
        def series(side: str, index: int, combine: Any, pair: str = pair) -> list[float]:
            return [combine(r[pair][side][i][index] for r in per_rank) for i in range(args.repeats)]

        loom_t, raw_t = series("torchloom", 0, max), series("raw", 0, max)
        loom_c, raw_c = series("torchloom", 1, sum), series("raw", 1, sum)
        loom_m, raw_m = series("torchloom", 2, sum), series("raw", 2, sum)
        own = max(r[pair]["own_python"] for r in per_rank)
        rows.append(
            [
                pair,
                summary([t * 1e3 for t in loom_t], "{:.1f}"),
                summary([t * 1e3 for t in raw_t], "{:.1f}"),
                summary(ratios(loom_t, raw_t)),
                summary(ratios(loom_c, raw_c)),
                summary(ratios(loom_m, raw_m)),
                f"{own * 1e6:.0f} ({own / median(loom_t) * 100:.2f}%)",
            ]
        )
        out.append((pair, ratios(loom_t, raw_t), ratios(loom_c, raw_c), ratios(loom_m, raw_m)))
        record_rows.append((pair, [100 * RECORDED_PER_STEP * c / median(loom_t) for c in record]))
    print()
    print(
        table(
            [
                "pair",
                "torchloom ms/step",
                "raw ms/step",
                "wall ratio",
                "cpu-time ratio",
                "main-thread cpu ratio",
                "torchloom's own Python us/step",
            ],
            rows,
        )
    )
    print(
        f"\n# desync record: {summary([c * 1e6 for c in record], '{:.2f}')} us per Loom collective; below, "
        f"{RECORDED_PER_STEP} of them in percent of each pair's torchloom step"
    )
    print()
    results = []
    for pair, wall, cpu, thread in out:
        results.append(ratio_line(f"step_time {pair} torchloom/raw", wall, GOAL))
        results.append(ratio_line(f"step_cpu_time {pair} torchloom/raw", cpu, GOAL))
        results.append(ratio_line(f"step_thread_cpu_time {pair} torchloom/raw", thread, GOAL))
    for pair, fractions in record_rows:
        results.append(ratio_line(f"desync_record {pair} percent_of_step", fractions, RECORD_GOAL))
    write_json(args.json, {"benchmark": "step_overhead", "settings": vars(args), "ratios": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
