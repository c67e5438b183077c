"""The examples on 2 ranks: examples/train_ddp.py, and README.md's script as written (train, stop, resume, compared
with an uninterrupted run) under each launch command the README shows, as real jobs.

train_ddp.py's ranks start from `run_ranks`'s fork server with the environment torchrun gives a rank (its
docstring's torchrun line: `loom.launch()` starts nothing); a script starting its own ranks with `python ...` is
the README script's first job here."""

from __future__ import annotations

import os
import re
import runpy
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from harness import PYTHON, REPO, run_job, run_ranks, wait_no_strays
from torch import nn

STEPS = 150


def _example_rank(rank: int, world_size: int, argv: list[str], log_dir: str) -> str:
    """One rank of examples/train_ddp.py; its stdout and stderr, from a file of its own."""
    log = Path(log_dir) / f"rank{rank}.txt"
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return log.read_text()


def test_train_ddp_example(tmp_path):
    out = tmp_path / "demo.pt"
    argv = [str(REPO / "examples" / "train_ddp.py"), "--devices", "2", "--steps", str(STEPS),
            "--log-every", "50", "--samples", "4096", "--hidden", "32", "--out", str(out)]  # fmt: skip
    stdout = "".join(run_ranks(_example_rank, 2, argv, str(tmp_path), timeout=120))  # rank 0's output first
    assert "2 rank(s), strategy ddp" in stdout
    logged = [(int(s), float(loss)) for s, loss in re.findall(r"^step +(\d+) \| loss ([\d.]+)", stdout, re.M)]
    # Printed by rank 0 only: each logged step appears once.
    assert [s for s, _ in logged] == [1, 50, 100, 150], stdout
    assert logged[-1][1] < 0.25 * logged[0][1], "the example should learn the synthetic function"
    # The checkpoint is a plain torch file with the model under its own parameter names.
    checkpoint = torch.load(out, weights_only=False)
    assert checkpoint["step"] == STEPS
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    model.load_state_dict(checkpoint["model"])
    assert list(checkpoint["optimizer"]["state"]) == [n for n, _ in model.named_parameters()]
    assert f"saved {out}" in stdout


def _readme_script() -> str:
    """The one Python block of README.md (test_docs.py checks that it names this test)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert len(blocks) == 1, "README.md should hold exactly one Python block, the complete script"
    return blocks[0]


def _losses(out: str) -> dict[int, str]:
    return dict((int(s), loss) for s, loss in re.findall(r"^step (\d+): loss ([\d.]+)$", out, re.M))


def test_readme_script_trains_and_resumes(tmp_path):
    """README.md's FSDP2 script, as written, under the three launch commands the README shows: stopped at step 20
    (mid-epoch: 16 steps an epoch) and resumed to step 40 (into the next epoch), it prints the losses of an
    uninterrupted run to every digit, and leaves a sharded checkpoint."""
    script = _readme_script()
    interrupted, whole = tmp_path / "interrupted", tmp_path / "whole"
    for folder in (interrupted, whole):
        folder.mkdir()
        (folder / "train.py").write_text(script)
    to_40 = ["--steps", "40"]
    jobs = [
        ([PYTHON, "train.py", "--steps", "20"], interrupted),
        (
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "train.py",
                *to_40,
            ],
            whole,
        ),
    ]
    # The stopped run and the uninterrupted reference are independent jobs: run them side by side.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda job: run_job(job[0], timeout=240, cwd=job[1]), jobs))
    for proc, token in results:
        assert proc.returncode == 0, proc.stdout
        assert wait_no_strays(token) == []
    first, reference = results[0][0].stdout, results[1][0].stdout
    assert "the root is not a unit" in first and "replicated on every rank" in first, first
    assert sorted(_losses(first)) == [10, 20] and sorted(_losses(reference)) == [10, 20, 30, 40]
    assert float(_losses(reference)[40]) < 0.5 * float(_losses(reference)[10]), "the script should learn"
    assert (interrupted / "checkpoint" / ".metadata").exists()

    proc, token = run_job(
        [PYTHON, "-m", "torchloom", "run", "--devices", "2", "train.py", *to_40], 240, cwd=interrupted
    )
    assert proc.returncode == 0, proc.stdout
    assert wait_no_strays(token) == []
    assert "resumed at step 20" in proc.stdout, proc.stdout
    resumed = _losses(proc.stdout)
    assert sorted(resumed) == [30, 40], proc.stdout
    assert resumed == {step: _losses(reference)[step] for step in (30, 40)}, (proc.stdout, reference)
