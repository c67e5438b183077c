"""Fault tolerance (`torchloom run --replica-groups`, torchft): what it costs every step, and what a fault costs,
against the same job without it. 2 CPU processes either way (gloo), the job in `_ft_script.py`: a stack of 4
MLP blocks (`--dim`), AdamW, 128 rows a batch per process.

    plain        torchloom run --devices 2                         one DDP job
    ft           torchloom run --replica-groups 2 --devices 1      two replica groups of one process

Measured (each side several times, alternately, ABBA):
- the step time of a healthy job, after a warm-up: median of a run's steps; the ratio ft / plain per repeat
  (goal: <= 1.03 for a step of 100 ms or more: the quorum and the commit vote are a few ms);
- one group SIGKILLed in backward at step `--kill-at`:
  * stall: from the kill to the survivor's next committed step (goal < 1 s);
  * heal: from the kill to the first committed step that the restarted group took part in again;
  * the job-steps the fault cost, the work not done in steps of the healthy job: the stall less one step, plus
    half of the time from then until the dead group is back (one group of two trained meanwhile);
- the plain job, saving a checkpoint every `--ckpt-every` steps, its rank 1 SIGKILLed at the same step and the
  whole job restarted by its elastic agent (`--max-restarts 1`): the time from the kill until the job passes
  that step again, less one step, in steps (the restart, and the steps since the last checkpoint trained again):
  the job-steps that fault cost.

    python benchmarks/fault_tolerance.py             # 5 repeats of each
    python benchmarks/fault_tolerance.py --strategy fsdp2 --healthy-only   # fsdp2's healthy step only
    python benchmarks/fault_tolerance.py --tiny      # one of each, a tiny model: the numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate, header, ratio_line, summary, table, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_ft_script.py"
WARMUP = 5


STRATEGY = "ddp"  # `--strategy`, handed to the script


def _env() -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        RUST_LOG="error",
        TORCHLOOM_BENCH_STRATEGY=STRATEGY,
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _job(
    ft: bool, steps: int, dim: int, kill_at: int, ckpt_every: int
) -> tuple[list[dict[str, Any]], float | None]:
    """Run one job; return rank 0's step lines and the kill's time (None without a kill)."""
    with tempfile.TemporaryDirectory(prefix="torchloom-ft-bench-") as out:
        launch = (
            ["--replica-groups", "2", "--devices", "1", "--ft-record", f"{out}/record.jsonl"]
            if ft
            else ["--devices", "2"]
        )
        command = [
            sys.executable, "-m", "torchloom", "run", "--accelerator", "cpu", *launch,
            "--max-restarts", "1" if kill_at >= 0 else "0",
            str(SCRIPT), out, str(steps), str(dim), str(kill_at), str(ckpt_every),
        ]  # fmt: skip
        done = subprocess.run(command, cwd=out, env=_env(), capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
        lines = [json.loads(line) for line in Path(out, "steps.jsonl").read_text().splitlines()]
        kill = Path(out, "kill.json")
        return lines, (json.loads(kill.read_text().splitlines()[0])["t"] if kill.exists() else None)


def _step_time(lines: list[dict[str, Any]]) -> float:
    """The median time between committed steps of group 0 after the warm-up."""
    times = [e["t"] for e in lines if e["group"] == 0 and e["step"] > WARMUP]
    return median(b - a for a, b in zip(times, times[1:], strict=False))


def _ft_fault(lines: list[dict[str, Any]], kill: float, step: float) -> dict[str, float]:
    """The survivor's stall, the dead group's way back, and the job-steps lost: the work the job did not do, in
    steps of the healthy job. Nothing was trained during the stall (less the step it would have taken anyway);
    from then until the dead group is back, one group of two trained (half the job's batches a step)."""
    after = [e for e in lines if e["group"] == 0 and e["t"] > kill]
    stall = after[0]["t"] - kill
    heal = next(e for e in after if 1 in e["with"])["t"] - kill
    without = sum(1 for e in after if e["t"] < kill + heal)
    lost = max(stall - step, 0.0) / step + max(heal - stall, 0.0) / step / 2
    return {"stall": stall, "heal": heal, "without": without, "lost": lost}


def _restart_fault(lines: list[dict[str, Any]], kill: float, kill_at: int, step: float) -> dict[str, float]:
    regained = [e for e in lines if e["attempt"] > 0 and e["step"] >= kill_at + 1]
    return {"regain": regained[0]["t"] - kill, "lost": (regained[0]["t"] - kill - step) / step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--strategy", default="ddp", choices=("ddp", "fsdp2"), help="inside the groups, and of the plain job"
    )
    parser.add_argument("--healthy-only", action="store_true", help="the healthy step only, no fault")
    args = parser.parse_args(argv)
    global STRATEGY
    STRATEGY = args.strategy
    if args.tiny:
        args.repeats, args.dim, args.steps, args.kill_at, args.ckpt_every = 1, 16, 12, 8, 4
    header("fault tolerance: per-step overhead, and what a fault costs, against a plain job restarted", args)

    healthy = alternate(
        {
            "plain": lambda: _step_time(_job(False, args.steps, args.dim, -1, 0)[0]),
            "ft": lambda: _step_time(_job(True, args.steps, args.dim, -1, 0)[0]),
        },
        args.repeats,
    )
    faults: dict[str, list[dict[str, float]]] = {"ft": [], "plain": []}
    if args.healthy_only:
        rows = [
            ["step time, plain (s)", summary(healthy["plain"])],
            ["step time, ft (s)", summary(healthy["ft"])],
        ]
        print(table(["measurement", "median [min..max]"], rows), flush=True)
        ratios = [f / p for f, p in zip(healthy["ft"], healthy["plain"], strict=True)]
        results = [ratio_line(f"ft-step-time-{args.strategy}", ratios, "<= 1.03")]
        write_json(args.json, {"healthy": healthy, "results": results})
        return 0

    def ft_fault() -> float:
        lines, kill = _job(True, args.steps, args.dim, args.kill_at, 0)
        assert kill is not None
        faults["ft"].append(_ft_fault(lines, kill, _step_time(lines)))
        return faults["ft"][-1]["lost"]

    def restart_fault() -> float:
        lines, kill = _job(False, args.steps, args.dim, args.kill_at, args.ckpt_every)
        assert kill is not None
        faults["plain"].append(_restart_fault(lines, kill, args.kill_at, _step_time(lines)))
        return faults["plain"][-1]["lost"]

    lost = alternate({"ft": ft_fault, "plain": restart_fault}, args.repeats)

    rows = [
        ["step time, plain (s)", summary(healthy["plain"])],
        ["step time, ft (s)", summary(healthy["ft"])],
        ["ft: stall of the survivor after a kill (s)", summary([f["stall"] for f in faults["ft"]])],
        ["ft: kill to the dead group's next committed step (s)", summary([f["heal"] for f in faults["ft"]])],
        ["ft: committed steps without the dead group", summary([f["without"] for f in faults["ft"]], "{:.0f}")],
        ["ft: job-steps lost to the fault", summary(lost["ft"], "{:.2f}")],
        [f"plain (checkpoint every {args.ckpt_every}): kill to the step regained (s)",
         summary([f["regain"] for f in faults["plain"]])],
        [f"plain (checkpoint every {args.ckpt_every}): job-steps lost to the fault", summary(lost["plain"], "{:.2f}")],
    ]  # fmt: skip
    print(table(["measurement", "median [min..max]"], rows), flush=True)
    results = [
        ratio_line(
            "ft-step-time", [f / p for f, p in zip(healthy["ft"], healthy["plain"], strict=True)], "<= 1.03"
        ),
        ratio_line("ft-stall-seconds", [f["stall"] for f in faults["ft"]], "< 1.0"),
        ratio_line(
            "ft-lost-over-restart-lost", [f / p for f, p in zip(lost["ft"], lost["plain"], strict=True)]
        ),
    ]
    write_json(args.json, {"healthy": healthy, "faults": faults, "lost": lost, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
