"""The chaos run of issue 45 (`make chaos`): random kills of random replica groups every few steps, through a
real `torchloom run --replica-groups` job on CPU gloo, for at least `--steps` committed steps. Judged as every
fault test is (`_jobs.check_exact`: groups bit-identical, no step with partial gradients, the replay within
1e-5), and reported in markdown: each kill, the survivors' stall (from the kill to the next committed step) and
the time until the killed group committed again.

    python tests/fault_tolerance/chaos.py --steps 100 --seed 1 --report reports/ft-chaos.md
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _jobs import Job, check_exact, first_commit_after  # noqa: E402

WHERE = ("between", "forward", "backward", "allreduce", "optimizer")


def plan(rng: random.Random, groups: int, kills: int) -> list[dict[str, Any]]:
    """`kills` random kills, each of a random group at a random place after 1-3 steps that had every group;
    one kill in five is followed at once by a second group's loss (two groups down together)."""
    events: list[dict[str, Any]] = []
    while len(events) < kills:
        victim = rng.randrange(groups)
        events.append({"group": victim, "where": rng.choice(WHERE), "after": rng.randint(1, 3)})
        if groups > 2 and rng.random() < 0.2 and len(events) < kills:
            events.append({"group": rng.choice([g for g in range(groups) if g != victim]), "where": "lost"})
    return events


def report(job: Job, seconds: float, seed: int) -> str:
    steps = check_exact(job)
    rows, stalls, heals = [], [], []
    for k, event in enumerate(job.events):
        fired = job.fired(k)
        after = first_commit_after(steps, fired["time"])
        back = first_commit_after(steps, fired["time"], group=fired["group"])
        stall = None if after is None or after.time is None else after.time - fired["time"]
        heal = None if back is None or back.time is None else back.time - fired["time"]
        if stall is not None:
            stalls.append(stall)
        if heal is not None:
            heals.append(heal)
        rows.append(
            f"| {k} | {fired['group']} | {event['where']} | {fired['step']} | "
            f"{'-' if stall is None else f'{stall:.2f}'} | {'-' if heal is None else f'{heal:.2f}'} |"
        )
    together = sum(1 for s in steps if len(s.participants) == job.groups)
    lines = [
        f"# Chaos run: {job.groups} replica groups, {len(job.events)} kills (seed {seed})",
        "",
        f"`python tests/fault_tolerance/chaos.py --groups {job.groups} --kills {len(job.events)} --seed {seed}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, CPU gloo, 1 process per group.",
        "",
        f"- **{len(steps)} committed steps** in {seconds:.0f} s; {together} of them with every group.",
        "- groups bit-identical at the end; **no step committed with partial gradients** (each step's applied "
        "fingerprint equals the mean of its participants' fingerprints, and every participant's fingerprint "
        "equals its gradient recomputed on its batch in the replay);",
        "- **the one-process replay of the record equals the run within 1e-5** (fp32).",
        f"- survivors' stall, kill to next committed step: median {statistics.median(stalls):.2f} s, "
        f"max {max(stalls):.2f} s;",
        f"- killed group committing again: median {statistics.median(heals):.2f} s, max {max(heals):.2f} s "
        "(a restart: a new process imports torch, then heals from a peer).",
        "",
        "| kill | group | where | step | stall (s) | back after (s) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def _kept(folder: Path) -> Iterator[str]:
    folder.mkdir(parents=True)
    yield str(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="committed steps at least")
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument(
        "--keep", type=Path, default=None, help="run the job in this new folder and keep it (logs, record)"
    )
    args = parser.parse_args()
    events = plan(random.Random(args.seed), args.groups, args.kills)
    with (
        tempfile.TemporaryDirectory(prefix="torchloom-chaos-") if args.keep is None else _kept(args.keep)
    ) as folder:
        from _jobs import run_job

        started = time.perf_counter()
        try:
            job = run_job(
                Path(folder) / "job",
                groups=args.groups,
                events=events,
                min_steps=args.steps,
                timeout=args.timeout,
            )
            text = report(job, time.perf_counter() - started, args.seed)
        except BaseException:
            if args.keep is None:
                # A failure's evidence (the record, the event tokens, each group's log) outlives the temp dir.
                kept = Path(tempfile.mkdtemp(prefix=f"torchloom-chaos-failed-seed{args.seed}-"))
                shutil.copytree(folder, kept, dirs_exist_ok=True)
                print(f"chaos run failed; its folder is kept in {kept}", file=sys.stderr)
            raise
    print(text)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
