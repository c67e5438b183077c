"""Run a large seeded random sample of scenarios (or the pairwise set) and write a report.

    python tests/scenarios/run_many.py --count 300 --seed 1 --report report.md
    python tests/scenarios/run_many.py --pairwise --report pairwise.md
    python tests/scenarios/run_many.py --rerun report.json --report again.md   # its unexpected results again
    python tests/scenarios/run_many.py --count 60 --seed 3 --strategy pipeline --report pp.md  # one strategy
    python tests/scenarios/run_many.py --count 50 --seed 21 22 23 --strategy pipeline --report pp.md  # 150
    python tests/scenarios/run_many.py --count 60 --seed 51 --replicas 2 --report rg.md  # replica groups only

With several seeds, each draws `--count` scenarios (a scenario two seeds draw runs once).

The report (markdown, and JSON beside it with the same name and .json) lists every scenario with its result,
the measured errors and seconds, and each failure with its problems. Exit status 1 if a scenario failed that is
not a declared known failure. Scenarios whose known failure kills the rank group are not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, so `scenarios` imports as a package

from scenarios.axes import Scenario  # noqa: E402
from scenarios.engine import run_scenarios  # noqa: E402
from scenarios.generator import PAIRWISE_SEED, make_test_set, random_sample  # noqa: E402
from scenarios.refusals import known_failure  # noqa: E402


def _status(outcome) -> str:
    known = known_failure(outcome.scenario)
    if known is not None:
        return "known failure (passed now!)" if outcome.passed else "known failure"
    if outcome.passed:
        return f"refused as declared ({outcome.refused})" if outcome.refused else "passed"
    return "FAILED"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=200, help="scenarios in the random sample")
    parser.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=None,
        help="of the random sample (default 0; several: --count scenarios each), or of the pairwise set",
    )
    parser.add_argument(
        "--strategy", default=None, help="draw the random sample of this strategy only (e.g. pipeline)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="draw the random sample with this many replica groups only (the `replicas` axis)",
    )
    parser.add_argument(
        "--pairwise", action="store_true", help="run the set of `make test` (pairwise + baselines) instead"
    )
    parser.add_argument(
        "--report", required=True, help="where to write the markdown report (.json beside it)"
    )
    parser.add_argument(
        "--rerun",
        default=None,
        help="run again the unexpected results of this earlier report's .json instead",
    )
    parser.add_argument(
        "--workdir", default=None, help="keep results and checkpoints here (default: a temp dir)"
    )
    args = parser.parse_args(argv)

    if args.rerun:
        rows = json.loads(Path(args.rerun).read_text())["scenarios"]
        again = [r for r in rows if r["status"] == "FAILED" or r["status"].endswith("(passed now!)")]
        scenarios = [Scenario.of(**r["scenario"]) for r in again]
    elif args.pairwise:
        args.seed = [PAIRWISE_SEED] if args.seed is None else args.seed[:1]
        scenarios = make_test_set(args.seed[0])
    else:
        args.seed = args.seed or [0]
        drawn = {
            s.id: s
            for seed in args.seed
            for s in random_sample(
                args.count,
                seed,
                strategy=args.strategy,
                fixed=None if args.replicas is None else {"replicas": args.replicas},
            )
        }
        scenarios = list(drawn.values())
    skipped = [s for s in scenarios if (k := known_failure(s)) is not None and not k.runs]
    runnable = [s for s in scenarios if s not in skipped]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = run_scenarios(runnable, args.workdir or tmp, log=lambda line: print(line, flush=True))
    seconds = time.monotonic() - started

    rows = [
        {
            "id": o.scenario.id,
            "scenario": o.scenario.as_dict(),
            "status": _status(o),
            "problems": o.problems,
            "metrics": o.metrics,
        }
        for o in outcomes
    ]
    rows += [
        {
            "id": s.id,
            "scenario": s.as_dict(),
            "status": "known failure, not run",
            "problems": [],
            "metrics": {},
        }
        for s in skipped
    ]
    failed = [r for r in rows if r["status"] == "FAILED" or r["status"].endswith("(passed now!)")]
    counts: dict[str, int] = {}
    for r in rows:
        key = r["status"].split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    title = (
        f"rerun of {args.rerun}"
        if args.rerun
        else "pairwise set"
        if args.pairwise
        else f"random sample of {args.count}"
        + (" per seed" if len(args.seed or ()) > 1 else "")
        + (f" ({args.strategy})" if args.strategy else "")
        + (f" ({args.replicas} replica groups)" if args.replicas else "")
    )
    seeds = " ".join(map(str, args.seed or []))
    lines = [
        f"# Scenario engine report: {title}, seed{'s' if len(args.seed or ()) > 1 else ''} {seeds}",
        "",
        f"{len(rows)} scenarios in {seconds:.0f} s: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + f". Unexpected results: {len(failed)}.",
        "",
        "| scenario | result | error vs reference | resume error | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["metrics"]
        lines.append(
            f"| `{r['id']}` | {r['status']} | {m.get('train_error', '')} | {m.get('resume_error', '')} "
            f"| {m.get('seconds', 0):.2f} |"
        )
    if failed:
        lines += ["", "## Unexpected results", ""]
        for r in failed:
            lines += [f"### `{r['id']}`", "", "```", *r["problems"], "```", ""]
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines) + "\n")
    report.with_suffix(".json").write_text(json.dumps({"seconds": seconds, "scenarios": rows}, indent=1))
    print(f"{len(rows)} scenarios, {len(failed)} unexpected, {seconds:.0f} s; report: {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
