"""Planned versus measured peak memory: `torchloom plan` against the same script run on real CPU ranks.

Every configuration of `benchmarks/_plan_script.py` (4 blocks of width 128 over 64-token samples, AdamW, 2
optimizer steps, 2 ranks) is first planned (`torchloom.planning.plan`: fake tensors, fake process group) and
then run with `torchloom run`, each rank measuring its peak of live tensor bytes (`track_memory()`,
`loom.memory_summary()`). Goal: every rank of every configuration within 10% of its measured peak.

    python benchmarks/planning.py            # all configurations, writes the table into docs/performance.md
    python benchmarks/planning.py --tiny     # two configurations, nothing written

CPU offload is CUDA only in torchloom (`cpu_offload=`), so it is not in the CPU table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "_plan_script.py"
sys.path.insert(0, str(REPO / "src"))

from torchloom.planning.plan import PlanError, human, plan  # noqa: E402

CONFIGS = [
    ("ddp", "32-true", False, 1),
    ("ddp", "32-true", False, 4),
    ("ddp", "bf16-mixed", False, 4),
    ("ddp", "32-true", True, 4),
    ("fsdp", "32-true", False, 1),
    ("fsdp", "32-true", True, 4),
    ("fsdp", "bf16-mixed", False, 4),
    ("fsdp2-units", "32-true", False, 1),
    ("fsdp2-units", "32-true", False, 4),
    ("fsdp2-units", "32-true", True, 4),
    ("fsdp2-units", "bf16-mixed", False, 4),
    ("tp", "32-true", False, 1),
    ("tp", "32-true", True, 4),
    ("tp", "bf16-mixed", False, 4),
]
BEGIN = "<!-- planning table: begin (benchmarks/planning.py writes it) -->"
END = "<!-- planning table: end -->"


def _args(layout: str, precision: str, ac: bool, micro: int) -> list[str]:
    return [
        "--layout",
        layout,
        "--precision",
        precision,
        "--micro-batch",
        str(micro),
        *(["--ac"] if ac else []),
    ]


def measure(args: list[str], devices: int = 2) -> list[int]:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "measured.json")
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torchloom", "run", "--devices", str(devices), str(SCRIPT), *args]
        done = subprocess.run([*command, "--out", out], env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        with open(out) as f:
            return [rank["peak_bytes"] for rank in json.load(f)["ranks"]]


def planned(args: list[str], devices: int = 2) -> list[int]:
    result = plan(str(SCRIPT), args, devices=devices)
    by_rank = {r: entry["peak_bytes"] for entry in result["ranks"] for r in entry["ranks"]}
    return [by_rank[r] for r in range(devices)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    options = parser.parse_args()
    configs = CONFIGS[:1] + CONFIGS[7:8] if options.tiny else CONFIGS
    rows = []
    for layout, precision, ac, micro in configs:
        args = _args(layout, precision, ac, micro)
        start = time.perf_counter()
        try:
            predicted = planned(args)
            plan_s = time.perf_counter() - start
            measured = measure(args)
        except (PlanError, RuntimeError) as error:
            print(
                f"FAILED  {layout} {precision} ac={ac} micro={micro}: {str(error).splitlines()[0]}",
                flush=True,
            )
            rows.append((layout, precision, ac, micro, None, None, 0.0))
            continue
        rows.append((layout, precision, ac, micro, predicted, measured, plan_s))
        worst = max(abs(p / m - 1) for p, m in zip(predicted, measured, strict=True))
        print(
            f"ratio  {layout:<11} {precision:<10} ac={'on ' if ac else 'off'} micro={micro}  "
            f"planned {[human(p) for p in predicted]}  measured {[human(m) for m in measured]}  "
            f"worst {worst:.3f} [|planned/measured - 1|]",
            flush=True,
        )
    if not options.tiny:
        _write_table(rows)


def _write_table(rows: list[tuple]) -> None:
    lines = [
        BEGIN,
        "",
        "| strategy | precision | AC | micro-batch | rank | planned | measured | planned/measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout, precision, ac, micro, predicted, measured, _ in rows:
        if predicted is None:
            lines.append(f"| {layout} | {precision} | {'on' if ac else 'off'} | {micro} | - | failed | | |")
            continue
        for rank, (p, m) in enumerate(zip(predicted, measured, strict=True)):
            lines.append(
                f"| {layout} | {precision} | {'on' if ac else 'off'} | {micro} | {rank} | {p:,} | {m:,} | "
                f"{p / m:.3f} |"
            )
    lines += ["", END]
    page = REPO / "docs" / "performance.md"
    text = page.read_text()
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + "\n".join(lines) + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    page.write_text(text)
    print(f"wrote the table into {page}")


if __name__ == "__main__":
    main()
