"""`torchloom plan`: the plan of a script is within 10% of the peak the same script measures on real CPU ranks
(memory accounting is deterministic: no timing), and bad input is named, with what was planned until then."""

from __future__ import annotations

import json
import textwrap

import pytest
from harness import PYTHON, REPO, run_job

SCRIPT = REPO / "benchmarks" / "_plan_script.py"


def _measured(tmp_path, args):
    out = tmp_path / "measured.json"
    result, _ = run_job(
        [PYTHON, "-m", "torchloom", "run", "--devices", "2", str(SCRIPT), *args, "--out", str(out)],
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return [rank["peak_bytes"] for rank in json.loads(out.read_text())["ranks"]]


def _planned(tmp_path, args, devices="2"):
    out, page = tmp_path / "plan.json", tmp_path / "plan.html"
    command = ["plan", "--devices", devices, "--json", str(out), "--plot", str(page), str(SCRIPT), *args]
    result, _ = run_job([PYTHON, "-m", "torchloom", *command], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    plan = json.loads(out.read_text())
    # --plot: one chart per simulated rank, the kinds stacked, the peak marked.
    assert page.read_text().count("<svg") == len(plan["ranks"]) and "<polygon" in page.read_text()
    return plan, result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--layout", "ddp", "--micro-batch", "4"],
        ["--layout", "fsdp2-units", "--micro-batch", "4", "--ac"],
        ["--layout", "tp"],
    ],
    ids=["ddp", "fsdp2-units-ac", "tp2"],
)
def test_plan_within_10_percent_of_measured(tmp_path, args):
    plan, text = _planned(tmp_path, args)
    measured = _measured(tmp_path, args)
    by_rank = {rank: entry["peak_bytes"] for entry in plan["ranks"] for rank in entry["ranks"]}
    for rank, peak in enumerate(measured):
        assert abs(by_rank[rank] / peak - 1) <= 0.10, (rank, by_rank[rank], peak, text)
    # The report says when and what: a phase and every kind of memory that was held.
    assert plan["ranks"][0]["phase"] in ("forward", "backward", "optimizer step"), text
    assert plan["ranks"][0]["breakdown"]["parameters"] > 0 and "parameters" in text


def _plan_raw(tmp_path, body):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    out = tmp_path / "plan.json"
    result, _ = run_job(
        [PYTHON, "-m", "torchloom", "plan", "--json", str(out), str(script)], timeout=300, cwd=tmp_path
    )
    return result, (json.loads(out.read_text()) if out.exists() else None)


def test_script_that_never_trains(tmp_path):
    result, _ = _plan_raw(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(64, 64)
        print(model(torch.randn(2, 64)).sum())
        """,
    )
    assert result.returncode == 2, result.stdout
    assert "without reaching a training step" in result.stdout, result.stdout


def test_operation_fake_tensors_cannot_run(tmp_path):
    result, plan = _plan_raw(
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
    )
    assert result.returncode == 2, result.stdout
    assert "aten.nonzero" in result.stdout and "cannot run on fake tensors" in result.stdout, result.stdout
    assert "what was planned until then" in result.stdout, result.stdout
    # The weight, its gradient and the batch's activations were planned before the failure.
    assert plan is not None and plan["ranks"][0]["peak_bytes"] >= 2 * 256 * 256 * 4, plan
