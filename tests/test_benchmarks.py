"""Every benchmark script runs at its --tiny size, exits 0 and prints its result lines (`ratio  NAME  ...`).

The numbers at this size mean nothing; the full-size runs and their results are in benchmarks/README.md."""

from __future__ import annotations

import re

import pytest
from harness import PYTHON, REPO, run_job, wait_no_strays

SCRIPTS = (
    "step_overhead",
    "memory",
    "checkpoint_io",
    "startup",
    "scaling",
    "hf_load",
    "throughput_overhead",
    "pipeline",
)


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_tiny(name):
    # A bound against a hang, not a speed check: `memory` alone starts 8 fresh ranks (13 s on an idle machine,
    # over 90 s once under make test's three workers).
    result, token = run_job([PYTHON, str(REPO / "benchmarks" / f"{name}.py"), "--tiny"], timeout=240)
    assert result.returncode == 0, result.stdout
    assert re.search(r"^ratio  \S.* \d+\.\d{3} \[", result.stdout, re.M), result.stdout
    assert wait_no_strays(token) == []
