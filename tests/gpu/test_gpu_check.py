"""benchmarks/gpu_check.sh and the benchmarks' `--device cuda`: what can be checked without a GPU is checked
here (the plan of a dry run; a clear refusal, and nothing run, without CUDA); with CUDA the benchmarks run
at smoke-test size on 1 GPU and on 2."""

from __future__ import annotations

import importlib.util
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
    assert "plan_vs_gpu.py --layers 1" in result.stdout  # the planner against the GPU
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


def _refusal(
    name: str, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> str:
    """The script's main(args), called here (a refusal needs no process of its own): it must exit with 2 before
    any rank starts. Returns what it wrote to stderr."""
    # The script puts benchmarks/ first on sys.path to import _common: undone after the import, so that no later
    # test in this process imports a benchmark (memory, pipeline, ...) by mistake.
    monkeypatch.setattr(sys, "path", list(sys.path))
    had_common = "_common" in sys.modules
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not had_common:
        sys.modules.pop("_common", None)  # benchmarks/_common.py, which the module keeps a reference to

    def no_ranks(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{name} {args} started ranks instead of refusing")

    monkeypatch.setattr(module, "run_ranks", no_ranks)
    with pytest.raises(SystemExit) as exited:
        module.main(["--tiny", *args])
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["step_overhead", "memory"])
def test_benchmark_refuses_cuda_without_gpus(name, monkeypatch, capsys):
    assert "--device cuda needs 2 GPUs" in _refusal(name, ["--device", "cuda"], monkeypatch, capsys)


@pytest.mark.parametrize("name", ["step_overhead", "memory"])
def test_one_rank_is_for_gpus_only(name, monkeypatch, capsys):
    assert "--world applies to --device cuda" in _refusal(name, ["--world", "1"], monkeypatch, capsys)


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


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_plan_against_the_gpu_refuses_without_cuda(tmp_path):
    result = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / "plan_vs_gpu.py"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing planned or run
