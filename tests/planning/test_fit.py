"""`torchloom plan --budget`: the changes that fit a budget, their predicted peaks (planned changes within 10% of
the peak measured with the change applied for real), their costs and order, and the floor when nothing fits."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from harness import REPO, run_ranks

from torchloom import cli
from torchloom.planning.fit import fit_budget, format_fits
from torchloom.planning.plan import PlanError

SCRIPT = REPO / "benchmarks" / "_plan_script.py"
DIM, BLOCKS, SEQ, BATCH = 128, 4, 64, 8
ARGS = ["--layout", "ddp", "--dim", str(DIM), "--blocks", str(BLOCKS), "--seq", str(SEQ)]
ARGS += ["--micro-batch", str(BATCH)]
CHANGES = "checkpointing,micro-batch,offload"


@pytest.fixture(scope="module")
def impossible(tmp_path_factory):
    """One plan over a budget nothing can meet (1 MiB): the base plan, the planned change, the floor. The command
    runs in this process (`torchloom.cli.main`, what `python -m torchloom` calls): its simulated ranks are the
    processes that matter, and one interpreter fewer to start is a few CPU seconds."""
    out = tmp_path_factory.mktemp("fit") / "plan.json"
    command = ["plan", "--devices", "2", "--budget", "1MiB", "--fit-changes", CHANGES, "--json", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main([*command, str(SCRIPT), *ARGS])
    return status, printed.getvalue(), json.loads(out.read_text())


def _checkpointing(entries):
    return next(e for e in entries if e["change"].startswith("activation checkpointing (full) of every"))


@pytest.mark.timeout(420)  # the fixture: two rounds of simulated ranks (the base plan, then checkpointing)
def test_floor_when_nothing_fits(impossible):
    status, text, plan = impossible
    assert status == 1, text  # over the budget: the plan as given does not fit
    floor = plan["fitting"]["floor"]
    assert plan["fits"] == [] and floor["peak_bytes"] > 2**20, plan["fitting"]
    # The floor took every change that lowers the peak: checkpointing (planned) and the smallest micro-batch
    # (derived); CPU offload is not a change for DDP.
    assert any(c.startswith("activation checkpointing (full)") for c in floor["changes"]), floor
    assert "micro-batch 1 (from 8) with 8x the accumulation" in floor["changes"], floor
    assert not any("offload" in c for c in floor["changes"]), floor
    checkpointed = _checkpointing(plan["fitting"]["tried"])
    assert floor["peak_bytes"] < checkpointed["peak_bytes"] < plan["peak_bytes"], (floor, checkpointed)
    # The floor took a derived change (the micro-batch): it is derived, and says so.
    assert floor["how"] == "derived", floor
    assert "no change the planner knows fits the budget of 1.00 MiB per rank: the floor is" in text, text
    assert "MiB (derived), with" in text, text
    assert "activation checkpointing (full) of every Block (4 blocks)" in text, text


def _fitted(plan):
    """The same base plan fitted to a budget between the checkpointed and the plain peak: each planned change
    replayed from what the planner returned for it (a change not planned above fails as a re-plan would)."""
    checkpointed = _checkpointing(plan["fitting"]["tried"])

    def replan(fit, precision):
        if fit.get("checkpointing") == {"count": None, "selective": False} and precision is None:
            return {"ranks": checkpointed["ranks"], "peak_bytes": checkpointed["peak_bytes"]}
        raise PlanError("not planned in this test", {"ranks": []})

    budget = (checkpointed["peak_bytes"] + plan["peak_bytes"]) // 2
    return budget, fit_budget(plan, budget, replan, changes=tuple(CHANGES.split(",")))


@pytest.mark.timeout(420)  # the fixture, when this test is the first to ask for it
def test_fits_ordered_with_costs(impossible):
    plan = impossible[2]
    tried = [e for e in plan["fitting"]["tried"] if e["how"] == "planned"]
    assert tried, plan["fitting"]
    budget, fit = _fitted(plan)
    fits = fit["fits"]
    assert len(fits) >= 2, fit
    assert [e["added_seconds"] for e in fits] == sorted(e["added_seconds"] for e in fits), fits
    for entry in fits:
        assert entry["peak_bytes"] <= budget and entry["fits"], entry
        assert {
            "change",
            "apply",
            "how",
            "peak_bytes",
            "ranks",
            "recompute_flops",
            "extra_comm_bytes",
        } <= set(entry)
        assert {r for p in entry["ranks"] for r in p["ranks"]} == {0, 1}, entry
    by_kind = {e["how"]: e for e in fits}
    # Recomputation: every block's forward once more per step, each block 2 matmuls of (tokens x d) @ (d x 4d).
    assert _checkpointing(fits)["recompute_flops"] == BLOCKS * 2 * (2 * BATCH * SEQ * DIM * 4 * DIM)
    assert "apply_activation_checkpointing" in _checkpointing(fits)["apply"]
    # The micro-batch is the script's: derived from the plan's activations, and said so.
    assert by_kind["derived"]["change"].startswith("micro-batch") and "derived" in by_kind["derived"]["note"]
    text = format_fits(fit)
    assert "fastest first" in text and "(derived)" in text and "(planned)" in text, text
    # The floor takes the smallest micro-batch (not the one listed as a fit): derived, with its code.
    assert any(c.startswith("micro-batch 1 (from 8)") for c in fit["floor"]["changes"]), fit["floor"]
    assert fit["floor"]["how"] == "derived", fit["floor"]
    assert "(derived)" in text.split("floor (every change together)")[1], text
    json.dumps(fit)  # what --json writes


def _run_script(rank: int, world_size: int, argv: list[str]) -> None:
    """One rank of `torchloom run --devices 2 _plan_script.py ARGV`: the script as its own `__main__`, in a rank
    the harness starts (the process group's environment set, as the launcher sets it)."""
    import runpy
    import sys

    sys.argv = [str(SCRIPT), *argv]
    runpy.run_path(str(SCRIPT), run_name="__main__")


@pytest.mark.timeout(600)  # the fixture (when first), then the group of 2 ranks (240 s at most)
def test_applied_changes_measured_within_10_percent(impossible, tmp_path):
    """The fits applied for real on 2 gloo ranks and measured, both in ONE group of ranks (the script's `--more`):
    the planned checkpointing (the script's `--ac` checkpoints every block) and the derived micro-batch
    (`--micro-batch b --accumulate B/b`)."""
    plan = impossible[2]
    smaller = next(e for e in _fitted(plan)[1]["fits"] if e["change"].startswith("micro-batch"))
    size = int(smaller["change"].split()[1])
    out = tmp_path / "measured.json"
    applied = " ".join([*ARGS, "--micro-batch", str(size), "--accumulate", str(BATCH // size)])
    run_ranks(_run_script, 2, [*ARGS, "--ac", "--more", applied, "--out", str(out)], timeout=240)
    configs = json.loads(out.read_text())["configs"]
    for entry, measured in zip((_checkpointing(plan["fitting"]["tried"]), smaller), configs, strict=True):
        predicted = {r: p["peak_bytes"] for p in entry["ranks"] for r in p["ranks"]}
        for rank, peak in enumerate(rank["peak_bytes"] for rank in measured["ranks"]):
            assert abs(predicted[rank] / peak - 1) <= 0.10, (entry["change"], rank, predicted[rank], peak)


@pytest.mark.timeout(420)  # the fixture, when this test is the first to ask for it
def test_selective_apply_code_is_what_was_planned(impossible):
    """The `apply:` code of selective checkpointing names every operation the plan kept (the CPU attention
    kernel as well as CUDA's), so that applying it gives the planned peak."""
    import functools

    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from torchloom.planning import _fit_rank

    plan = impossible[2]
    checkpointed = _checkpointing(plan["fitting"]["tried"])

    def replan(fit, precision):  # the selective plan is not what this test checks: any peaks do
        return {"ranks": checkpointed["ranks"], "peak_bytes": checkpointed["peak_bytes"]}

    fit = fit_budget(plan, plan["peak_bytes"] - 1, replan, changes=("selective",))
    entry = next(e for e in fit["tried"] if "(selective)" in e["change"])
    printed = entry["apply"].split("create_selective_checkpoint_contexts, ")[1].split("]")[0] + "]"
    planned = _fit_rank._selective_context()
    assert planned.func is create_selective_checkpoint_contexts
    assert eval(printed, {"torch": torch}) == planned.args[0], entry["apply"]
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in planned.args[0]
    assert isinstance(planned, functools.partial)
