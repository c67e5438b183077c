"""Pipeline parallelism on 2 CPU ranks (pp 2): the bubble each schedule leaves, against the theory, and the step
time of `PipelineStrategy` against the same schedule written with raw `torch.distributed.pipelining`.

    bubble   per schedule and micro-batch count m, of the raw schedule: 1 - (compute time) / (schedule time) on
             each rank, averaged over the ranks. The schedule time is the wall time of one `schedule.step`; the
             compute time is the wall time of the same rank running its stage's forward and backward over the same
             m micro-batches with no pipeline (no p2p, no waiting), measured right after it, both ranks at once.
             Medians over the steps. The theory, for GPipe and 1F1B alike, is (p - 1) / (m + p - 1).
             (The first version divided the main thread's CPU time by the wall time: on a loaded machine that
             measures the share of a core the rank got, not the pipeline's idle time, and read 0.6-0.9.)
    ratio    torchloom (PipelineStrategy with a split_fn, `loom.forward_backward`, `loom.clip_gradients`, AdamW)
             against raw torch (the same stage modules in a PipelineStage, the same schedule, a hand-written
             global norm over both stages, AdamW), alternating step by step in the same two processes.
             Goal: median <= 1.03.

    python benchmarks/pipeline.py           # default size
    python benchmarks/pipeline.py --tiny    # smoke test, seconds
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import header, median, ratio_line, ratios, run_ranks, summary, table, write_json  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Stage(nn.Module):
    """One stage: the model's blocks of this stage, at their paths in the model."""

    def __init__(self, model: Net, index: int, num_stages: int) -> None:
        super().__init__()
        per = len(model.layers) // num_stages
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(index * per, (index + 1) * per)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _split(model: nn.Module, index: int, num_stages: int) -> nn.Module:
    return Stage(model, index, num_stages)  # type: ignore[arg-type]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _raw_norm_clip(params: list[torch.Tensor], max_norm: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads, 2.0) ** 2
    dist.all_reduce(local)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, local.sqrt())


def _body(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from torchloom import Loom
    from torchloom.strategies import PipelineStrategy

    torch.set_num_threads(1)
    dim, blocks, mb_rows = cfg["dim"], cfg["blocks"], cfg["rows"]
    out: dict[str, Any] = {"bubble": {}, "busy": {}, "times": {}}
    g = torch.Generator().manual_seed(0)
    for schedule in ("gpipe", "1f1b"):
        for m in cfg["microbatches"]:
            strategy = PipelineStrategy(
                pipeline_parallel_size=world, split_fn=_split, schedule=schedule, n_microbatches=m
            )
            loom = Loom(strategy=strategy, accelerator="cpu", devices=world)
            loom.launch()
            torch.manual_seed(0)
            model = loom.setup_module(Net(dim, blocks))
            opt = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
            xb, yb = torch.randn(m * mb_rows, dim, generator=g), torch.randn(m * mb_rows, dim, generator=g)

            loom_step = functools.partial(_loom_step, loom, model, opt, xb, yb)
            # The raw side: the same stage (its own copy of the weights), the same schedule, by hand.
            torch.manual_seed(0)
            raw_module = Stage(Net(dim, blocks), rank, world)
            raw_opt = torch.optim.AdamW(raw_module.parameters(), lr=1e-4)
            pp_group = dist.new_group(list(range(world)))
            raw_stage = PipelineStage(raw_module, rank, world, torch.device("cpu"), group=pp_group)
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            raw = cls(raw_stage, m, loss_fn=_loss)
            raw_step = functools.partial(_raw_step, rank, raw, raw_module, raw_opt, xb, yb)

            for _ in range(2):
                loom_step()
                raw_step()
            loom_times, raw_times = [], []
            for i in range(cfg["steps"]):
                for side in ("loom", "raw") if i % 2 == 0 else ("raw", "loom"):
                    (loom_times if side == "loom" else raw_times).append(
                        loom_step() if side == "loom" else raw_step()
                    )
            schedule_walls, compute_walls = [], []
            for _ in range(cfg["steps"]):
                schedule_walls.append(_raw_schedule_wall(rank, raw, xb, yb))
                raw_opt.zero_grad()
                compute_walls.append(_compute_wall(rank, world, raw_module, xb, yb, m))
                raw_opt.zero_grad()
            busy = _all_gather_float(median(compute_walls) / median(schedule_walls), loom)
            out["bubble"][(schedule, m)] = 1 - sum(busy) / len(busy)
            out["busy"][(schedule, m)] = busy
            out["times"][(schedule, m)] = (loom_times, raw_times)
            loom.close()
    return out


def _raw_schedule_wall(rank: int, raw: Any, xb: torch.Tensor, yb: torch.Tensor) -> float:
    dist.barrier()
    t = time.perf_counter()
    if rank == 0:
        raw.step(xb)
    else:
        raw.step(target=yb, losses=[])
    return time.perf_counter() - t


def _compute_wall(
    rank: int, world: int, module: nn.Module, xb: torch.Tensor, yb: torch.Tensor, m: int
) -> float:
    """The wall time of this rank's stage work in the schedule without the pipeline: the forward and backward of
    its m micro-batches back to back (a stage that is not the last receives random output gradients, one that is
    not the first random inputs; the shapes are the schedule's), with every rank doing so at the same time."""
    xs, ys = xb.chunk(m), yb.chunk(m)
    inputs = xs if rank == 0 else [torch.randn_like(x).requires_grad_() for x in xs]
    with torch.no_grad():
        grads = [torch.randn_like(module(x)) for x in inputs] if rank < world - 1 else []
    dist.barrier()
    t = time.perf_counter()
    for i in range(m):
        out = module(inputs[i])
        if rank == world - 1:
            (_loss(out, ys[i]) / m).backward()
        else:
            out.backward(grads[i])
    return time.perf_counter() - t


def _loom_step(loom: Any, model: Any, opt: Any, xb: torch.Tensor, yb: torch.Tensor) -> float:
    dist.barrier()
    t = time.perf_counter()
    loom.forward_backward(model, xb, yb, _loss)
    loom.clip_gradients(model, opt, max_norm=1.0)
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t


def _raw_step(rank: int, raw: Any, module: nn.Module, opt: Any, xb: torch.Tensor, yb: torch.Tensor) -> float:
    elapsed = _raw_schedule_wall(rank, raw, xb, yb)
    t = time.perf_counter()
    _raw_norm_clip(list(module.parameters()), 1.0)
    opt.step()
    opt.zero_grad()
    return elapsed + time.perf_counter() - t


def _all_gather_float(value: float, loom: Any) -> list[float]:
    if loom is None:
        return [value]
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return [float(v) for v in got]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="smoke-test size (seconds)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.dim, args.rows, args.microbatches, args.steps = 32, 4, [2], 1
    header("pipeline parallelism: bubble and step time vs raw torch.distributed.pipelining (pp 2, CPU)", args)
    cfg = {k: getattr(args, k) for k in ("dim", "blocks", "rows", "microbatches", "steps")}
    load_before = os.getloadavg()
    results = run_ranks(_body, cfg, world_size=2)
    load = (
        f"load average (1, 5, 15 min) {_load(load_before)} at the start, {_load(os.getloadavg())} at the end"
    )
    p = 2
    rows, payload = [], []
    for (schedule, m), bubble in results[0]["bubble"].items():
        theory = (p - 1) / (m + p - 1)
        loom_times, raw_times = results[0]["times"][(schedule, m)]
        rows.append(
            [
                schedule,
                m,
                f"{bubble:.3f}",
                f"{theory:.3f}",
                " ".join(f"{b:.2f}" for b in results[0]["busy"][(schedule, m)]),
                summary(loom_times, "{:.4f}"),
                summary(raw_times, "{:.4f}"),
            ]
        )
        payload.append(
            {
                "schedule": schedule,
                "m": m,
                "bubble": bubble,
                "theory": theory,
                "busy": results[0]["busy"][(schedule, m)],
                "torchloom_median_s": median(loom_times),
                "raw_median_s": median(raw_times),
            }
        )
    print(
        table(
            [
                "schedule",
                "m",
                "bubble (raw)",
                "(p-1)/(m+p-1)",
                "busy per rank",
                "torchloom step s",
                "raw step s",
            ],
            rows,
        )
    )
    lines = []
    for schedule in ("gpipe", "1f1b"):
        values = []
        for (s, _m), (loom_times, raw_times) in results[0]["times"].items():
            if s == schedule:
                values += ratios(loom_times, raw_times)
        lines.append(ratio_line(f"pipeline-{schedule}-step", values, "<= 1.03"))
    print(f"# {load}")
    write_json(args.json, {"bubble": payload, "ratios": lines, "load": load})


def _load(values: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


if __name__ == "__main__":
    main()
