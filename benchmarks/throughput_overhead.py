"""Throughput overhead: what `ThroughputMonitor` and `TimeBreakdown` add to a training step, on 2 CPU ranks.

    python benchmarks/throughput_overhead.py            # ~2 min on an idle 2-core machine
    python benchmarks/throughput_overhead.py --tiny     # smoke test, seconds

Three sides in the same two processes, on the same DDP model (the blocks of `_common.Net` and a head), one
measurement = `--steps` steps, alternating ABBA:

    plain      forward, MSE loss, loom.backward, optimizer.step, zero_grad
    monitor    the same + `ThroughputMonitor.update(...)` and `compute_and_log()` (a CSVLogger) after every
               step: the worst case (litgpt logs every few steps)
    breakdown  the same as plain with a `TimeBreakdown` attached (every hook, `loom.backward` timed, the batch
               read through `breakdown.loader`) logging its parts after every step

The ratio monitor/plain and breakdown/plain is taken per repeat (the slower rank's wall time of each side);
goal: median <= 1.01. The monitor's calls are also timed alone (rank 0, where they do the work), as
microseconds per step and in percent of the plain step: a steadier number than a 1% ratio on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import Net, batch, header, model_numel, ratio_line, ratios, run_ranks, summary, table  # noqa: E402

GOAL = "<= 1.01"
SIDES = ("plain", "monitor", "breakdown")


def _rank(rank: int, world_size: int, cfg: dict) -> dict:
    from torchloom import Loom
    from torchloom.loggers import CSVLogger
    from torchloom.throughput import ThroughputMonitor, TimeBreakdown

    torch.set_num_threads(1)
    logdir = tempfile.mkdtemp(prefix="throughput_overhead_")
    loom = Loom(accelerator="cpu", devices=world_size, strategy="ddp", loggers=CSVLogger(logdir))
    loom.launch()
    torch.manual_seed(0)
    net = Net(cfg["dim"], cfg["blocks"])
    model, optimizer = loom.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    x, y = batch(rank, cfg["tokens"], cfg["dim"])
    monitor = ThroughputMonitor(loom, available_flops=1e12, using_sparse_model=False, window_size=5)
    counters = {"t0": time.perf_counter(), "batches": 0}

    def step(inputs: torch.Tensor) -> None:
        loss = torch.nn.functional.mse_loss(model(inputs), y)
        loom.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def monitor_update() -> None:
        counters["batches"] += 1
        n = counters["batches"]
        monitor.update(
            time=time.perf_counter() - counters["t0"], batches=n, samples=n * cfg["tokens"], flops=1_000_000
        )
        monitor.compute_and_log()

    def measure(side: str) -> float:
        breakdown = TimeBreakdown(loom, model, optimizer) if side == "breakdown" else None
        loom.barrier()
        start = time.perf_counter()
        for _ in range(cfg["steps"]):
            if breakdown is not None:
                for inputs in breakdown.loader([x]):
                    step(inputs)
            else:
                step(x)
                if side == "monitor":
                    monitor_update()
        elapsed = (time.perf_counter() - start) / cfg["steps"]
        if breakdown is not None:
            breakdown.remove()
        return elapsed

    for side in SIDES * cfg["warmup"]:
        measure(side)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(cfg["repeats"]):
        for side in SIDES if i % 2 == 0 else tuple(reversed(SIDES)):
            times[side].append(measure(side))
    # the monitor's calls alone, as many as the run made, on this rank (rank 0 does the work; others return)
    calls = max(cfg["repeats"] * cfg["steps"], 20)
    start = time.perf_counter()
    for _ in range(calls):
        monitor_update()
    monitor_call = (time.perf_counter() - start) / calls
    loom.close()
    return {"times": times, "monitor_call": monitor_call}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="smoke-test size (seconds)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=1, help="steps per measurement")
    parser.add_argument("--repeats", type=int, default=60, help="measurements per side (alternating)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.dim, args.blocks, args.tokens, args.repeats, args.warmup = 32, 1, 16, 3, 1
    header("Throughput overhead: ThroughputMonitor and TimeBreakdown on a DDP step, 2 CPU ranks (gloo)", args)
    print(
        f"# model: {args.blocks} blocks of width {args.dim} + a head, "
        f"{model_numel(args.dim, args.blocks) / 1e6:.2f}M parameters; {args.tokens} rows per rank; AdamW",
        flush=True,
    )
    cfg = {k: getattr(args, k) for k in ("dim", "blocks", "tokens", "steps", "repeats", "warmup")}
    per_rank = run_ranks(_rank, cfg, world_size=2)

    def series(side: str) -> list[float]:
        return [max(r["times"][side][i] for r in per_rank) for i in range(args.repeats)]

    plain = series("plain")
    rows = [[side, summary([t * 1e3 for t in series(side)], "{:.2f}")] for side in SIDES]
    print()
    print(table(["side", "ms/step (slower rank)"], rows))
    call = per_rank[0]["monitor_call"]
    print(
        f"\n# ThroughputMonitor.update + compute_and_log alone on rank 0: {call * 1e6:.1f} us per step, "
        f"{call / statistics.median(plain) * 100:.3f}% of the plain step"
    )
    print()
    results = [
        ratio_line("step_time monitor/plain", ratios(series("monitor"), plain), GOAL),
        ratio_line("step_time breakdown/plain", ratios(series("breakdown"), plain), GOAL),
    ]
    if args.json:
        from _common import write_json

        write_json(args.json, {"results": results, "monitor_call_s": call, "config": cfg})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
