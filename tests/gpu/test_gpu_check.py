"""benchmarks/gpu_check.sh and the benchmarks' `--device cuda`: what can be checked without a GPU is checked
here (the plan of a dry run; a clear refusal, and nothing run, without CUDA); with CUDA the benchmarks run
at smoke-test size on 1 GPU and on 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from harness import PYTHON, REPO, run_job, wait_no_strays

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
VENV = str(os.path.dirname(os.path.dirname(sys.executable)))  # the environment running these tests
NO_CUDA = not torch.cuda.is_available()


def _run(*args: str, out: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VENV": VENV, "OUT": out}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    result = _run("--dry-run", out=str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert f"{VENV} exists, used as it is" in result.stdout
    assert "pytest -q -m cuda" in result.stdout
    assert "then SIGINT: pytest prints what ran" in result.stdout  # a timed-out run still reports its counts
    assert "step_overhead.py --device cuda" in result.stdout and "memory.py --device cuda" in result.stdout
    assert "examples/train_lm.py --accelerator cuda" in result.stdout and "--resume" in result.stdout
    assert not (tmp_path / "out").exists()


def test_missing_environment_is_created_only_when_absent(tmp_path):
    env = {**os.environ, "VENV": str(tmp_path / "no-venv"), "OUT": str(tmp_path / "out")}
    result = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "is missing: would create it and install 'torch==2.13.0'" in result.stdout
    assert not (tmp_path / "no-venv").exists()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA: the refusal is for machines without")
def test_refuses_without_cuda_with_the_reason(tmp_path):
    result = _run(out=str(tmp_path / "out"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(r"is a CPU build|no CUDA GPU", result.stderr), result.stderr
    assert "nothing was run" in result.stderr
    assert "passed" not in result.stdout
    assert not (tmp_path / "out").exists()


def test_unknown_argument_is_refused(tmp_path):
    result = _run("--fast", out=str(tmp_path / "out"))
    assert result.returncode == 2 and "unknown argument '--fast'" in result.stderr


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["step_overhead", "memory"])
def test_benchmark_refuses_cuda_without_gpus(name):
    result, _ = run_job(
        [PYTHON, str(REPO / "benchmarks" / f"{name}.py"), "--tiny", "--device", "cuda"], timeout=60
    )
    assert result.returncode == 2, result.stdout
    assert "--device cuda needs 2 GPUs" in result.stdout


@pytest.mark.parametrize("name", ["step_overhead", "memory"])
def test_one_rank_is_for_gpus_only(name):
    result, _ = run_job(
        [PYTHON, str(REPO / "benchmarks" / f"{name}.py"), "--tiny", "--world", "1"], timeout=60
    )
    assert result.returncode == 2, result.stdout
    assert "--world applies to --device cuda" in result.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["step_overhead", "memory"])
@pytest.mark.parametrize(
    "world", [pytest.param(1, marks=pytest.mark.cuda), pytest.param(2, marks=pytest.mark.cuda(min_devices=2))]
)
def test_cuda_benchmarks_tiny(name, world):
    result, token = run_job(
        [
            PYTHON,
            str(REPO / "benchmarks" / f"{name}.py"),
            "--tiny",
            "--device",
            "cuda",
            "--world",
            str(world),
        ],
        timeout=240,
    )
    assert result.returncode == 0, result.stdout
    assert re.search(r"^ratio  \S.* \d+\.\d{3} \[", result.stdout, re.M), result.stdout
    if name == "memory":
        assert "ratio  memory cuda (a)/floor(a)" in result.stdout
    assert wait_no_strays(token) == []
