"""Planned versus measured peak memory: `torchloom plan` against the same script run on real CPU ranks.

Every configuration of `benchmarks/_plan_script.py` (4 blocks of width 128 over 64-token samples, AdamW, 2
optimizer steps, 2 ranks) is first planned (`torchloom.planning.plan`: fake tensors, fake process group) and
then run with `torchloom run`, each rank measuring its peak of live tensor bytes (`track_memory()`,
`loom.memory_summary()`). Goal: every rank of every configuration within 10% of its measured peak.

    python benchmarks/planning.py            # all configurations, writes the table into docs/performance.md
    python benchmarks/planning.py --tiny     # two configurations, nothing written

    python benchmarks/planning.py --offload  # only the CPU-offload rows, merged into the table

CPU offload: torchloom's `cpu_offload=` is refused on CPU ranks (there is no device memory to move shards away
from), so the offload rows use hand-made FSDP2 units with torch's `CPUOffloadPolicy(pin_memory=False)` (pinned
memory needs an accelerator). On CPU ranks the offloaded shards and the "device" are the same memory: the rows
hold the planner to the same live-bytes total, they do not measure a device/host split.
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
OFFLOAD = [("fsdp2-units", "32-true", False, 4), ("fsdp2-units", "bf16-mixed", False, 4)]
BEGIN = "<!-- planning table: begin (benchmarks/planning.py writes it) -->"
END = "<!-- planning table: end -->"


def _args(layout: str, precision: str, ac: bool, micro: int, offload: bool = False) -> list[str]:
    return [
        *(["--offload"] if offload else []),
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
    parser.add_argument("--offload", action="store_true", help="only the CPU-offload rows")
    options = parser.parse_args()
    configs = [(*c, False) for c in (CONFIGS[:1] + CONFIGS[7:8] if options.tiny else CONFIGS)]
    if options.offload:
        configs = [(*c, True) for c in OFFLOAD]
    elif not options.tiny:
        configs += [(*c, True) for c in OFFLOAD]
    rows = []
    for layout, precision, ac, micro, offload in configs:
        args = _args(layout, precision, ac, micro, offload)
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
            rows.append((layout, precision, ac, micro, offload, None, None, 0.0))
            continue
        rows.append((layout, precision, ac, micro, offload, predicted, measured, plan_s))
        worst = max(abs(p / m - 1) for p, m in zip(predicted, measured, strict=True))
        print(
            f"ratio  {layout:<11} {precision:<10} ac={'on ' if ac else 'off'} micro={micro} "
            f"offload={'on ' if offload else 'off'}  "
            f"planned {[human(p) for p in predicted]}  measured {[human(m) for m in measured]}  "
            f"worst {worst:.3f} [|planned/measured - 1|]",
            flush=True,
        )
    if not options.tiny:
        _write_table(rows, merge=options.offload)


HEAD = (
    "| strategy | precision | AC | CPU offload | micro-batch | rank | planned | measured | planned/measured |"
)


def _row_lines(row: tuple) -> list[str]:
    layout, precision, ac, micro, offload, predicted, measured, _ = row
    first = f"| {layout} | {precision} | {'on' if ac else 'off'} | {'on' if offload else 'off'} | {micro} |"
    if predicted is None:
        return [f"{first} - | failed | | |"]
    return [
        f"{first} {rank} | {p:,} | {m:,} | {p / m:.3f} |"
        for rank, (p, m) in enumerate(zip(predicted, measured, strict=True))
    ]


def _kept_rows(text: str) -> list[str]:
    """The table's rows as they are (merge: only the rows run now are replaced); rows of the older table, without
    the CPU offload column, get it ("off")."""
    if BEGIN not in text:
        return []
    rows = [line for line in text[text.index(BEGIN) : text.index(END)].splitlines() if line.startswith("| ")]
    kept = []
    for line in rows[1:]:
        cells = line.split(" | ")
        if len(cells) == 8:  # the older table: no CPU offload column
            cells.insert(3, "off")
        kept.append(" | ".join(cells))
    return kept


def _write_table(rows: list[tuple], merge: bool = False) -> None:
    page = REPO / "docs" / "performance.md"
    text = page.read_text()
    new = [line for row in rows for line in _row_lines(row)]
    if merge:
        keys = {line.rsplit(" | ", 4)[0] for line in new}
        new = [line for line in _kept_rows(text) if line.rsplit(" | ", 4)[0] not in keys] + new
    lines = [BEGIN, "", HEAD, "|---|---|---|---|---|---|---|---|---|", *new, "", END]
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + "\n".join(lines) + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    page.write_text(text)
    print(f"wrote the table into {page}")


if __name__ == "__main__":
    main()
