"""The demo example (`make demo`) runs as a real 2-rank job, trains, and leaves a checkpoint plain torch reads."""

from __future__ import annotations

import re

import torch
from harness import PYTHON, REPO, run_job, wait_no_strays
from torch import nn

STEPS = 150


def test_train_ddp_example(tmp_path):
    out = tmp_path / "demo.pt"
    cmd = [PYTHON, str(REPO / "examples" / "train_ddp.py"), "--devices", "2", "--steps", str(STEPS),
           "--log-every", "50", "--samples", "4096", "--hidden", "32", "--out", str(out)]  # fmt: skip
    proc, token = run_job(cmd, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert wait_no_strays(token) == []
    assert "2 rank(s), strategy ddp" in proc.stdout
    logged = [
        (int(s), float(loss)) for s, loss in re.findall(r"^step +(\d+) \| loss ([\d.]+)", proc.stdout, re.M)
    ]
    # Printed by rank 0 only: each logged step appears once.
    assert [s for s, _ in logged] == [1, 50, 100, 150], proc.stdout
    assert logged[-1][1] < 0.25 * logged[0][1], "the example should learn the synthetic function"
    # The checkpoint is a plain torch file with the model under its own parameter names.
    checkpoint = torch.load(out, weights_only=False)
    assert checkpoint["step"] == STEPS
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    model.load_state_dict(checkpoint["model"])
    assert list(checkpoint["optimizer"]["state"]) == [n for n, _ in model.named_parameters()]
    assert f"saved {out}" in proc.stdout


def test_readme_example_runs(tmp_path):
    """The training loop shown in README.md runs as written, on 2 ranks, and saves its checkpoint."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## A training loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "train.py").write_text(code)
    proc, token = run_job([PYTHON, "train.py"], timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert wait_no_strays(token) == []
    losses = [float(x) for x in re.findall(r"^epoch \d: loss ([\d.]+)$", proc.stdout, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["epoch"] == 2


def test_readme_fsdp_example_runs(tmp_path):
    """The FSDP example in README.md runs as written on 2 ranks and writes a sharded checkpoint."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## FSDP", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "train.py").write_text(code)
    proc, token = run_job([PYTHON, "train.py"], timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert wait_no_strays(token) == []
    assert "done, last gradient norm" in proc.stdout
    assert "the root is not a unit" in proc.stdout and "replicated on every rank" in proc.stdout
    assert (tmp_path / "ckpt" / ".metadata").exists()
