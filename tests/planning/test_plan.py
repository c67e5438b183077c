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
    # Each stage planned apart (pp 2, 1F1B), the model built on meta under init_module(empty_init=True), with a
    # position embedding whose indices the forward builds (`torch.arange(..., device=x.device)`).
    "pp2": ["--layout", "pp", "--micro-batch", "4", "--positions"],
}
# Planned only (the measured group has 2 ranks): 3 stages, each a role of its own, one simulated rank each.
PIPELINE_3 = ["--layout", "pp", "--micro-batch", "6"]


class _StdoutPerThread(io.TextIOBase):
    """sys.stdout (and sys.stderr) while plans run side by side in threads of this process: each plan's thread
    prints into its own buffer."""

    def __init__(self, fallback):
        self.fallback = fallback
        self.buffers: dict[int, io.StringIO] = {}

    def write(self, text: str) -> int:
        return self.buffers.get(threading.get_ident(), self.fallback).write(text)


def _planned(folder, name):
    """`torchloom plan` run in this process (`torchloom.cli.main`, what `python -m torchloom` calls): its simulated
    ranks are the processes that matter, and an interpreter fewer to start is a few CPU seconds a plan."""
    out, page = folder / f"{name}.json", folder / f"{name}.html"
    args, devices = (CONFIGS[name], "2") if name in CONFIGS else (PIPELINE_3, "3")
    command = ["plan", "--devices", devices, "--json", str(out), "--plot", str(page), str(SCRIPT), *args]
    printed = sys.stdout.buffers[threading.get_ident()] = sys.stderr.buffers[threading.get_ident()] = (
        io.StringIO()
    )
    status = cli.main(command)
    if status != 0:  # failed in its own tests (the fixture serves the others)
        return None, f"{name}: exit status {status}\n{printed.getvalue()[-3000:]}"
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
    names = [*CONFIGS, "pp3"]
    with (
        contextlib.redirect_stdout(_StdoutPerThread(sys.stdout)),
        contextlib.redirect_stderr(_StdoutPerThread(sys.stderr)),
        ThreadPoolExecutor(len(names)) as pool,
    ):
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
    assert plan is not None, text
    by_rank = {rank: entry["peak_bytes"] for entry in plan["ranks"] for rank in entry["ranks"]}
    for rank, peak in enumerate(measured[name]):
        assert abs(by_rank[rank] / peak - 1) <= 0.10, (rank, by_rank[rank], peak, text)
    # The report says when and what: a phase and every kind of memory that was held.
    assert plan["ranks"][0]["phase"] in ("forward", "backward", "optimizer step"), text
    assert plan["ranks"][0]["breakdown"]["parameters"] > 0 and "parameters" in text


@pytest.mark.timeout(600)  # the fixture, when first
@pytest.mark.parametrize("name", ["pp2", "pp3"])
def test_pipeline_stages_planned_apart(planned_and_measured, name):
    """A PipelineStrategy script (pp 2 and pp 3, 1F1B) runs to the end of its planned steps on fake tensors: the
    stages tell each other their shapes through the simulated ranks, one simulated rank per stage (the planner
    starts those of the middle stages when the pipeline says which ranks each stage has), each reported with
    its stage."""
    plan, text = planned_and_measured[0][name]
    assert plan is not None, text
    stages = 2 if name == "pp2" else 3
    assert [entry["stage"] for entry in plan["ranks"]] == list(range(stages)), text
    assert [entry["ranks"] for entry in plan["ranks"]] == [[s] for s in range(stages)], text
    for stage in range(stages):
        assert f"rank {stage}, pipeline stage {stage}: peak" in text, text
    for entry in plan["ranks"]:
        assert entry["steps"] == 2 and entry["phase"] in ("forward", "backward", "optimizer step"), text
        assert entry["breakdown"]["parameters"] > 0 and entry["breakdown"]["optimizer state"] > 0, text
    # Stage 0 holds the first blocks, the last stage the last blocks and the head.
    assert plan["ranks"][0]["module"].startswith("blocks.0"), text
    assert plan["ranks"][-1]["module"].startswith("blocks.3"), text


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
    """Boolean-mask indexing in a forward stops the plan: the message names the script's line (not only torch's
    frames) and the partial plan's peak is in that forward, where memory rose to it. `nonzero()` on the data's
    integers (which the plan runs for real) does not stop it."""
    status, text, plan = _plan_raw(
        tmp_path,
        """
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.wide = torch.nn.Linear(256, 4096)

            def forward(self, x):
                h = self.wide(x)
                return h[h > 0]  # its shape depends on the values: no fake tensor has them

        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        labels = torch.randint(0, 4, (64,))
        assert (labels > 0).nonzero().numel() <= 64  # the data's integers: real in the plan too
        loss = model(torch.randn(64, 256)).square().mean()
        loss.backward()
        optimizer.step()
        """,
        capsys,
        monkeypatch,
    )
    assert status == 2, text
    assert "aten.nonzero" in text and "cannot run on fake tensors" in text, text
    assert "script.py:11 (`return h[h > 0]" in text and 'File "' + str(tmp_path) in text, text
    assert "what was planned until then" in text, text
    assert text.count("DynamicOutputShapeException") == 1, text  # the error said once
    # The weight and the forward's activation were planned before the failure, in the forward.
    entry = plan["ranks"][0]
    assert entry["peak_bytes"] >= (256 + 64) * 4096 * 4, plan
    assert (entry["phase"], entry["module"]) == ("forward", "Net"), entry  # the mask, in Net.forward
    assert entry["user_line"]["line"] == 11, entry
    assert "at step 1, forward of Net" in text, text


_GUESSES = """
import torch
import torchloom.planning


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(256, 256)
        self.repair = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.Linear(2048, 256))

    def forward(self, x):
        h = self.body(x)
        if h.abs().max() > 1e6:  # never on real data; always on fake tensors, unless told
            h = self.repair(h)
        with torchloom.planning.assume(False):
            if torch.isnan(h).any():
                h = self.repair(h)
        if h.mean() > 1e6:
            h = h * 2
        return h


model = torch.compile(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    loss = model(torch.randn(64, 256)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.fixture(scope="module")
def guesses(tmp_path_factory):
    """A script whose plan guesses: reads of fake values (a branch told with --assume, one told with
    `torchloom.planning.assume`, one not told) and torch.compile."""
    folder = tmp_path_factory.mktemp("guesses")
    script, out = folder / "script.py", folder / "plan.json"
    script.write_text(_GUESSES)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(
            [
                "plan",
                "--assume",
                "script.py:14=false",
                "--assume",
                "script.py:99=1",
                "--json",
                str(out),
                str(script),
            ]
        )
    return status, printed.getvalue(), json.loads(out.read_text())


def test_fake_reads_warned_and_told(guesses):
    status, text, plan = guesses
    assert status == 0, text
    reads = {read["line"]: read for read in plan["ranks"][0]["fake_reads"]}
    # Each read of a fake value, at the script's line: told (--assume, assume()) or guessed.
    assert reads[14]["assumed"] == "--assume" and reads[14]["answers"] == [False], reads
    assert reads[17]["assumed"] == "assume()" and reads[17]["answers"] == [False], reads
    assert reads[19]["assumed"] is None and reads[19]["answers"] == [True], reads
    assert reads[19]["code"] == "if h.mean() > 1e6:" and reads[19]["count"] == 2, reads
    # The guess is a warning in the text, before the peaks, and in the JSON; what was told is listed.
    warned = [w for w in plan["warnings"] if "script.py:19 (`if h.mean() > 1e6:`)" in w]
    assert len(warned) == 1 and "--assume script.py:19=VALUE" in warned[0], plan["warnings"]
    assert text.index("WARNING: ") < text.index("rank 0: peak"), text
    assert "script.py:19" in text and "assumed (--assume)" in text and "script.py:14" in text, text
    # An --assume at a line that read nothing is said (a misspelt one would leave the guess in place).
    assert "--assume script.py:99: no read of a fake value happened at that line" in plan["warnings"], plan
    # Told False, the repair never ran: no gradient of its 4 MiB of weights.
    assert plan["ranks"][0]["breakdown"]["gradients"] < 2 * 256 * 256 * 4, plan["ranks"][0]


def test_compile_planned_as_eager_said(guesses):
    status, text, plan = guesses
    said = [w for w in plan["warnings"] if "torch.compile is planned as eager" in w]
    assert len(said) == 1 and "script.py:24" in said[0], plan["warnings"]
    assert "WARNING: " + said[0] in text, text


def test_unused_parameters_from_a_fake_read(tmp_path, capsys, monkeypatch):
    """DDP's reducer finds parameters unused in the plan (the fake read answered 0, so the branch that uses
    them did not run) that the real run uses: the plan says that a fake read caused it, and where."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torchloom import Loom

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.body = torch.nn.Linear(32, 32)
                    self.extra = torch.nn.Linear(32, 32)

                def forward(self, x):
                    h = self.body(x)
                    if h.square().sum().item() > 0:  # always on real data; 0 on fake tensors
                        h = self.extra(h)
                    return h

            loom = Loom(accelerator="cpu", strategy="ddp")
            net = Net()
            model, optimizer = loom.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            for _ in range(2):
                loom.backward(model(torch.randn(4, 32)).sum())
                optimizer.step()
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    status = cli.main(["plan", "--devices", "2", str(script)])
    text = capsys.readouterr().err
    assert status == 2, text
    assert "A read of a fake value caused it" in text and "script.py:13" in text, text
    # Each simulated rank's error is said once (the reducer names each rank's own unused parameters).
    assert text.count("Expected to have finished reduction") == 2, text
