"""Every benchmark script runs at its --tiny size, exits 0 and prints its result lines (`ratio  NAME  ...`).

The numbers at this size mean nothing; the full-size runs and their results are in benchmarks/README.md. All the
scripts run in one job (benchmarks/_smoke.py: one process that imports torch once and calls each script's main
with --tiny, its ranks forked from it), and each test reads its script's output from that run."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from harness import PYTHON, REPO, run_job, wait_no_strays


def _smoke_scripts() -> tuple[str, ...]:
    """The scripts the smoke run runs by default: its own list, so that a benchmark added there is tested."""
    spec = importlib.util.spec_from_file_location("_smoke", REPO / "benchmarks" / "_smoke.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.SCRIPTS)


SCRIPTS = _smoke_scripts()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    out = tmp_path_factory.mktemp("smoke")
    # A bound against a hang, not a speed check: about 60 CPU seconds in all, 3-5 min of wall time once under
    # make test's three workers.
    result, token = run_job([PYTHON, str(REPO / "benchmarks" / "_smoke.py"), str(out), *SCRIPTS], timeout=840)
    return out, token, result.stdout


@pytest.mark.timeout(900)  # the first test waits for the whole smoke run
@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_tiny(name, smoke_run):
    out, token, job_output = smoke_run
    rc_file, log_file = out / f"{name}.rc", out / f"{name}.txt"
    assert rc_file.exists(), f"{name} did not finish; the smoke run's output:\n{job_output}"
    output = log_file.read_text()
    assert rc_file.read_text() == "0", f"{name} exited with {rc_file.read_text()}:\n{output}"
    assert re.search(r"^ratio  \S.* \d+\.\d{3} \[", output, re.M), f"{name}:\n{output}"
    assert wait_no_strays(token) == []
