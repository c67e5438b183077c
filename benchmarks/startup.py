"""Start-up: time from the command to the first finished training step, 2 CPU ranks, the same script each way.

    torchrun        python -m torch.distributed.run --nproc-per-node 2 ... benchmarks/_startup_script.py
    loom.launch()   python benchmarks/_startup_script.py      (torchloom re-runs it through torch's elastic agent)
    torchloom run   python -m torchloom run --accelerator cpu --devices 2 benchmarks/_startup_script.py
                    (measured when this torchloom has the `run` command; see TORCHLOOM_RUN below)

The clock starts just before the command is started and stops at the time rank 0 prints after its first
optimizer step (the script: DDP, a small MLP, one step). The commands run alternately (ABBA), several times
each; ratios are per repeat against torchrun. Goal: `torchloom run` <= 1.1x torchrun (loom.launch() is held to
the same goal here).

Start-up on a shared 2-core machine is mostly waiting for a core: single wall times vary by +-30%. The CPU
seconds of the whole command (launcher and ranks, start to exit, from the kernel's accounting of the processes
it waited for) are printed beside them as the steadier second opinion.

    python benchmarks/startup.py            # 10 repeats
    python benchmarks/startup.py --tiny     # 1 repeat of torchrun and loom.launch(); `torchloom run`'s command
                                            # line is only checked against its parser (tests/test_run.py runs it)
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate, free_port, header, ratio_line, ratios, summary, table, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_startup_script.py"
MARKER = "FIRST_STEP_DONE"
GOAL = "<= 1.1"


def torchloom_run_available() -> bool:
    """TORCHLOOM_RUN hook: whether this torchloom has the `torchloom run` command. Until it does, its row is
    left out; once it does, it is measured against torchrun with no change here."""
    try:
        from torchloom.cli import _parser

        return any("run" in (getattr(action, "choices", None) or {}) for action in _parser()._actions)
    except Exception:  # noqa: BLE001 - an older torchloom, or no CLI at all
        return False


def commands() -> dict[str, list[str]]:
    python = sys.executable
    out = {
        "torchrun": [
            python,
            *"-m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port {port}".split(),
            str(SCRIPT),
        ],
        "loom.launch()": [python, str(SCRIPT)],
    }
    if torchloom_run_available():
        out["torchloom run"] = [
            python,
            *"-m torchloom run --accelerator cpu --devices 2 --main-port {port}".split(),
            str(SCRIPT),
        ]
    return out


def _clean_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "GROUP_RANK",
        "NODE_RANK",
    ):
        env.pop(key, None)
    return env


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_to_first_step(command: list[str], timeout: float, cpu_seconds: list[float] | None = None) -> float:
    """Seconds from starting `command` to rank 0's first finished step; the command must then exit with 0. The
    command's CPU seconds (it and every process it waited for) are appended to `cpu_seconds`."""
    command = [part.replace("{port}", str(free_port())) for part in command]
    cpu_before = _children_cpu_seconds()
    start = time.time()
    proc = subprocess.Popen(
        command,
        cwd=HERE.parent,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this call started: the launcher and its ranks
        proc.communicate()
        raise RuntimeError(f"{' '.join(command)} did not finish within {timeout:.0f} s") from None
    if cpu_seconds is not None:
        cpu_seconds.append(_children_cpu_seconds() - cpu_before)
    done = [line for line in out.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not done:
        raise RuntimeError(f"{' '.join(command)} failed (exit code {proc.returncode}):\n{out}")
    return float(done[0].split()[1]) - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="smoke test: one repeat of torchrun and loom.launch(); torchloom run's command line is parsed, not run",
    )
    parser.add_argument("--repeats", type=int, default=10, help="runs per command (alternating)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds one command may take")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.repeats = 1
    header("Start-up: command to first finished step, 2 CPU ranks (DDP, one step)", args)
    cmds = commands()
    if "torchloom run" not in cmds:
        print("# torchloom run: not available in this torchloom; its row is left out", flush=True)
    for name, cmd in cmds.items():
        print(f"# {name}: {' '.join(cmd)}", flush=True)
    if args.tiny and "torchloom run" in cmds:
        # Each command costs a launcher and two ranks that import torch; the smoke test starts the two that one
        # ratio needs. `torchloom run` jobs are run by tests/test_run.py; here its command line must still parse.
        from torchloom.cli import _parser

        _parser().parse_args([p.replace("{port}", "0") for p in cmds.pop("torchloom run")[3:]])
        print("# torchloom run: --tiny checks its command line only (not run)", flush=True)
    cpu: dict[str, list[float]] = {name: [] for name in cmds}
    times = alternate(
        {
            name: (lambda cmd=cmd, name=name: time_to_first_step(cmd, args.timeout, cpu[name]))
            for name, cmd in cmds.items()
        },
        args.repeats,
    )
    base, cpu_base = times["torchrun"], cpu["torchrun"]
    rows = [
        [
            name,
            summary(t, "{:.2f}"),
            summary(ratios(t, base)),
            summary(cpu[name], "{:.2f}"),
            summary(ratios(cpu[name], cpu_base)),
        ]
        for name, t in times.items()
    ]
    print()
    print(
        table(
            ["command", "seconds to first step", "ratio to torchrun", "CPU s (whole run)", "CPU ratio"],
            rows,
        )
    )
    print()
    results = [
        ratio_line(f"startup {name}/torchrun", ratios(t, base), GOAL)
        for name, t in times.items()
        if name != "torchrun"
    ]
    results += [
        ratio_line(f"startup CPU seconds {name}/torchrun", ratios(cpu[name], cpu_base))
        for name in cmds
        if name != "torchrun"
    ]
    write_json(
        args.json,
        {
            "benchmark": "startup",
            "settings": vars(args),
            "seconds": times,
            "cpu_seconds": cpu,
            "ratios": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
