"""Run many finished 2-rank jobs and count the ones that did not exit 0.

A job that finished its work must exit 0. Before torchloom's ranks agreed on the end of the job, about 1 run in
5 died of SIGABRT at interpreter exit ("terminate called without an active exception"). Each run here trains
a few steps, ends with a collective (the last thing before exit is what used to race), and exits. Runs cycle
through every strategy and every way of starting a job:

    script     python job.py            (the script calls loom.launch(), which re-runs it once per rank)
    function   python job.py --fn       (loom.launch(fn))
    torchrun   python -m torch.distributed.run --nproc-per-node 2 job.py
    run        python -m torchloom run --accelerator cpu --devices 2 job.py

    python benchmarks/exit_stress.py --runs 200          # the count docs/launching.md quotes (~22 min)
    python benchmarks/exit_stress.py --runs 12 --modes torchrun

Runs take the (mode, strategy) pairs in turn, so `--runs` a multiple of their number runs each pair equally
often. The test suite finishes a job on every strategy and mode at least once (tests/test_exit.py runs
`--runs 1 --modes torchrun --strategies fsdp2`): a path that fails at every exit fails there; the repetitions that catch a rare race are this
script's job.

Prints one line per failed run (its mode, strategy, exit code and the tail of its output) and a summary line
`exit_stress: N of M runs failed`; exits 1 when any run failed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

STRATEGIES = ("ddp", "fsdp", "fsdp2")
MODES = ("script", "function", "torchrun", "run")

JOB = textwrap.dedent(
    """
    import sys

    import torch

    from torchloom import Loom


    def train(loom):
        torch.manual_seed(loom.global_rank)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        if loom.strategy.name == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model[0])  # a unit by hand, the rest replicated leftovers
        model = loom.setup_module(model)
        opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            loom.backward(model(torch.randn(4, 8)).pow(2).mean())
            opt.step()
            opt.zero_grad()
        return loom.all_reduce(torch.ones(1)).item()


    if __name__ == "__main__":
        strategy = sys.argv[1]
        loom = Loom(accelerator="cpu", devices=2, strategy=strategy)
        if "--fn" in sys.argv:
            print("result", loom.launch(train), flush=True)
        else:
            loom.launch()
            loom.print("result", train(loom), flush=True)
    """
)


def _command(mode: str, job: Path, strategy: str) -> list[str]:
    python = sys.executable
    if mode == "script":
        return [python, str(job), strategy]
    if mode == "function":
        return [python, str(job), strategy, "--fn"]
    if mode == "torchrun":
        return [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(job), strategy]
    if mode == "run":
        return [python, *"-m torchloom run --accelerator cpu --devices 2".split(), str(job), strategy]
    raise ValueError(mode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take")
    args = parser.parse_args(argv)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    combos = itertools.cycle(itertools.product(args.modes, args.strategies))
    failed = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(JOB)
        for i in range(args.runs):
            mode, strategy = next(combos)
            try:
                proc = subprocess.run(
                    _command(mode, job, strategy),
                    env=env,
                    cwd=tmp,
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
                code, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as error:
                code, output = "timeout", f"{error.stdout or ''}{error.stderr or ''}"
            if code != 0 or "result 1.0" not in output:
                failed += 1
                tail = "\n    ".join(str(output).strip().splitlines()[-8:])
                print(f"run {i}: {mode} {strategy}: exit code {code}\n    {tail}", flush=True)
    seconds = time.monotonic() - start
    print(
        f"exit_stress: {failed} of {args.runs} runs failed "
        f"(modes {', '.join(args.modes)}; strategies {', '.join(args.strategies)}; {seconds:.0f} s)",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
