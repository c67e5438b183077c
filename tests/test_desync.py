"""A hang explains itself: when ranks stop agreeing, one `torchloom desync report` names the culprit and where it is.

Each case runs a real 2-rank job (gloo, `Loom(timeout=3 s)`) of the script below, where rank 1 (or rank 0) breaks
step at step 2 in the way the mode says. The job must end non-zero within timeout + 30 s of that step (start-up
not counted) with no process left, and its output must hold exactly one report whose `culprit:` line names the
right rank, reason and call sites.

The short timeouts start at step 2, where the ranks part: before it the group waits 60 s, so a warm-up that is
slow under load (a rank's first collective waiting seconds for a peer still importing lazily) is never taken
for a desync.
"""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
import time

import pytest
from harness import PYTHON, TOKEN_ENV, free_port, kill_token, run_job, wait_no_strays

TIMEOUT_S = 3

SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import time
    from datetime import timedelta

    import torch
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from torchloom import Loom


    def slow_loader():
        time.sleep(300)  # LOADER: rank 1's data loader hangs
        return torch.ones(4)


    def main(mode, size, watch):
        loom = Loom(accelerator="cpu", devices=2, timeout=timedelta(seconds=TIMEOUT_S))
        loom.launch()
        _set_pg_timeout(timedelta(seconds=60))  # the warm-up may be slow under load: no short timeout yet
        rank = loom.global_rank
        x = torch.ones(4)
        for step in range(4):
            if step == 2:  # where the ranks part: the short timeouts and the test's clock start here
                _set_pg_timeout(timedelta(seconds=TIMEOUT_S))
                if watch:
                    os.environ["TORCHLOOM_DESYNC_REPORT_AFTER"] = "1"
                print(f"PARTING {time.time()}", flush=True)
            if mode == "stuck" and rank == 1 and step == 2:
                x = slow_loader()  # CALLS_LOADER
            loom.all_reduce(x)  # A
            if mode == "shapes" and rank == 1 and step == 2:
                x = torch.ones(size)  # a short last batch on one rank
            if not (mode == "skip" and rank == 1 and step == 2):
                loom.all_reduce(x * 2)  # B
            if mode == "extra" and rank == 0 and step == 2:
                loom.all_gather(x)  # X
            loom.barrier()  # C
        print("FINISHED", rank, flush=True)


    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0, "watch" in sys.argv)
    """
).replace("TIMEOUT_S", str(TIMEOUT_S))


def _line(marker: str) -> int:
    """The script's line number of the line that ends in `# marker`."""
    for number, line in enumerate(SCRIPT.splitlines(), start=1):
        if line.rstrip().endswith(f"# {marker}") or f"# {marker}:" in line:
            return number
    raise AssertionError(marker)


def _report(output: str) -> str:
    """The one desync report in a job's output, from its first line to its culprit line."""
    assert output.count("torchloom desync report") == 1, output
    start = output.index("torchloom desync report")
    end = output.index("\nculprit:", start)
    return output[start : output.index("\n", end + 1)]


def _job(tmp_path, mode: str, *args: str) -> str:
    """Run the script as `python train.py MODE` (loom.launch() starts the ranks); check how the job ended."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result, token = run_job([PYTHON, str(script), mode, *args], timeout=90, cwd=tmp_path)
    ended = time.time()
    assert result.returncode != 0, result.stdout
    assert "FINISHED" not in result.stdout, result.stdout
    assert wait_no_strays(token) == []
    # From the step where the ranks part to the end of the job: the timeout, the report, stopping the ranks.
    # Start-up is not counted: at a load average of 10 on 2 cores it alone took 18 s (importing torch thrice).
    # A job that waited for the stuck rank's 300 s sleep, or hung, would reach run_job's 90 s timeout. Ending
    # took 18.9 s once at a load of 10-20 (the report's answers and stopping the ranks wait for cores).
    parted = min(float(t) for t in re.findall(r"PARTING (\d+\.\d+)", result.stdout))
    assert ended - parted < TIMEOUT_S + 30, (ended - parted, result.stdout)
    return result.stdout


@pytest.mark.timeout(120)
def test_a_rank_skips_a_collective(tmp_path):
    report = _report(_job(tmp_path, "skip"))
    b, c = _line("B"), _line("C")
    assert "rank 0 (pid " in report and f"in all_reduce #8 ((4,) float32) at train.py:{b}" in report
    assert f"in barrier #8 at train.py:{c}" in report
    assert report.splitlines()[-1] == (
        f"culprit: rank 1 never reached all_reduce #8 (train.py:{b}); it is in barrier #8 at train.py:{c}"
    )
    # The user's stack of each rank, without torchloom's or torch's frames.
    assert f'train.py", line {b}, in main' in report and f'train.py", line {c}, in main' in report
    assert "torchloom/" not in report and "torch/" not in report


@pytest.mark.timeout(120)
def test_a_rank_takes_a_branch_with_an_extra_collective(tmp_path):
    report = _report(_job(tmp_path, "extra"))
    x, c = _line("X"), _line("C")
    assert f"in all_gather #9 ((4,) float32) at train.py:{x}" in report
    assert report.splitlines()[-1] == (
        f"culprit: rank 0 called an extra all_gather #9 at train.py:{x}, which rank 1 did not call "
        f"(it is in barrier #9 at train.py:{c})"
    )


@pytest.mark.timeout(120)
def test_two_ranks_pass_different_shapes(tmp_path):
    # Rank 1's 3 elements against rank 0's 4: gloo completes the all-reduce on rank 1 only, which goes on to
    # the barrier; rank 0 waits. Rank 1 took a new path (new shapes at B), so its call was written to the store.
    report = _report(_job(tmp_path, "shapes", "3"))
    b = _line("B")
    assert report.splitlines()[-1] == (
        f"culprit: rank 1 passed (3,) float32 to all_reduce #8 at train.py:{b}, "
        f"where rank 0 passed (4,) float32 (train.py:{b})"
    )


@pytest.mark.timeout(120)
def test_a_rank_stuck_in_user_code_shows_its_stack(tmp_path):
    report = _report(_job(tmp_path, "stuck"))
    a, c, loader = _line("A"), _line("C"), _line("LOADER")
    assert f"in user code at train.py:{loader} in slow_loader" in report
    assert f"line {_line('CALLS_LOADER')}, in main" in report and "time.sleep(300)" in report
    assert report.splitlines()[-1] == (
        f"culprit: rank 1 never reached all_reduce #7 (train.py:{a}); it is in user code at "
        f"train.py:{loader} in slow_loader (its last collective was barrier #6 at train.py:{c})"
    )


# On NCCL no Python exception comes before the process group's watchdog aborts a rank whose collective timed out,
# so there each rank's torchloom watchdog starts the report itself once a collective has waited for the timeout
# (the group's own timeout is set 15 s later). TORCHLOOM_DESYNC_REPORT_AFTER takes that path on gloo: the report
# starts after 1 s, from the watchdog thread, long before gloo's 3 s timeout raises in the main thread. The
# script sets it at step 2 ("watch"), where the ranks part. "skip" is the case where both ranks' watchdogs see
# an overdue collective and one report must come out; the culprit of "stuck" (one rank in user code) is the same
# whoever starts the report, and test_a_rank_stuck_in_user_code_shows_its_stack checks it (a job each costs
# three interpreters importing torch: the suite's time).
@pytest.mark.timeout(120)
def test_the_watchdog_reports_a_collective_that_waits_too_long(tmp_path):
    output = _job(tmp_path, "skip", "0", "watch")
    report = _report(output)
    b, c = _line("B"), _line("C")
    # The header is the watchdog's: the collective still waiting after 1 s, not gloo's timeout after 3 s.
    assert re.search(
        r"torchloom desync report \(rank \d: loom\.\w+\(\) #\d+ on rank \d is still waiting after 0:00:01\)",
        report,
    )
    culprit = (
        f"culprit: rank 1 never reached all_reduce #8 (train.py:{b}); it is in barrier #8 at train.py:{c}"
    )
    assert report.splitlines()[-1] == culprit
    # When gloo's timeout then raises on rank 0, its error repeats the same culprit (no second report).
    assert "CollectiveTimeoutError" in output and output.count(culprit) >= 2, output


class _Event:
    """A device event as the record sees one: `query()` says whether the collective completed."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_collective_queued_on_the_device_stays_current_until_its_event_completes():
    import torch

    from torchloom.diagnostics import CollectiveRecord

    record = CollectiveRecord()
    events: list[_Event] = []
    record.device_event = lambda: events.append(_Event()) or events[-1]
    with record("all_reduce", torch.ones(2)):
        pass
    with record("barrier"):
        pass
    # Both returned at once (queued); the first is still the rank's current collective, and is overdue.
    first = record.snapshot(None, "answered")
    assert (first["name"], first["seq"], first["inside"], first["queued"]) == ("all_reduce", 1, True, True)
    assert record.overdue(0.0) and not record.overdue(60.0)
    events[0].done = True
    second = record.snapshot(None, "answered")
    assert (second["name"], second["seq"], second["inside"], second["queued"]) == ("barrier", 2, True, True)
    events[1].done = True
    done = record.snapshot(None, "answered")
    assert (done["name"], done["seq"], done["inside"], done["queued"]) == ("barrier", 2, False, False)
    assert not record.overdue(0.0)


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_shape_mismatch_is_named(tmp_path):
    """Rank 1's 8 elements against rank 0's 4: gloo aborts rank 0 (it receives more than it expects), which
    cannot answer; rank 1 reports from its own record and what rank 0 last wrote to the store. The ranks are
    started by hand in a torchrun-style environment, with the store in this process as torchrun's agent holds
    it (rank 0's store would die with rank 0), and no agent that would stop rank 1 as soon as rank 0 dies."""
    import torch.distributed as dist

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    token, port = f"desync-{os.getpid()}-{time.monotonic_ns()}", free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 - kept alive
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID",)}
    env.update(
        {TOKEN_ENV: token, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    env.update({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    procs = [
        subprocess.Popen(
            [PYTHON, str(script), "shapes", "8"],
            cwd=tmp_path,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        kill_token(token)
    assert procs[0].returncode == -6 and procs[1].returncode == 1, outputs
    report = _report("".join(outputs))
    b, a = _line("B"), _line("A")
    assert re.search(r"^rank 0: no answer .*; last new call: all_reduce #4 \(\(4,\) float32\)", report, re.M)
    assert report.splitlines()[-1] == (
        f"culprit: rank 1 passed (8,) float32 to all_reduce #8 at train.py:{b}, shapes it never passed there "
        f"before; rank 0 died in that collective (it repeated earlier calls since all_reduce #4 at train.py:{a})"
    )
    assert "CollectiveMismatchError" in outputs[1]


def test_the_record_notes_the_users_call_site_shapes_and_new_paths():
    import sys

    import torch

    from torchloom.diagnostics import CollectiveRecord

    record = CollectiveRecord()
    here = sys._getframe().f_lineno + 3
    flags = []
    for size in (2, 2, 2, 5):
        with record("all_reduce", {"loss": torch.ones(size), "step": 1}):
            flags.append(record.last[-3:])
    seq, name, shapes, _, file, line, function, *_ = record.last
    assert (seq, name, file, line, function) == (4, "all_reduce", __file__, here, record.last[6])
    assert function == "test_the_record_notes_the_users_call_site_shapes_and_new_paths"
    assert shapes == ((torch.Size([5]), torch.float32),) and not record.inside
    # (new path, new site, new shapes): the first call, the first repeat of the site, a repeat, new shapes.
    assert flags == [(True, True, True), (True, False, False), (False, False, False), (False, False, True)]


def _answer(rank: int, name: str, seq: int, shapes: str = "", inside: bool = True, **extra) -> dict:
    return {
        "rank": rank,
        "how": "answered",
        "inside": inside,
        "pid": 1,
        "seq": seq,
        "name": name,
        "shapes": shapes,
        "detail": "",
        "file": "/x/train.py",
        "line": {"all_reduce": 10, "barrier": 20}[name],
        "function": "main",
        "new_path": False,
        "new_site": False,
        "new_shape": False,
        "stack": [],
        **extra,
    }


def test_with_more_ranks_the_minority_is_the_culprit():
    from torchloom.diagnostics.report import _culprit

    answers = {0: _answer(0, "all_reduce", 7), 1: _answer(1, "barrier", 7), 2: _answer(2, "all_reduce", 7)}
    assert _culprit(answers, {}, 3, evidence_only=False) == (
        "culprit: rank 1 never reached all_reduce #7 (train.py:10); it is in barrier #7 at train.py:20"
    )
    # A peer that died without a record of a mismatch died for reasons of its own: no report.
    del answers[1]
    assert _culprit(answers, {}, 3, evidence_only=True) is None


def test_ranks_parted_inside_a_loom_call_are_torchlooms_fault_not_the_users():
    """Every rank inside the same loom.save(): none skipped it, so the culprit is where they wait inside it."""
    from torchloom.diagnostics.report import _culprit

    def inside(rank: int, internal: list[str], in_distributed: bool = True) -> dict:
        # At line 20 of train.py, as the helper places a barrier.
        return {
            **_answer(rank, "barrier", 3),
            "name": "save",
            "internal": internal,
            "in_distributed": in_distributed,
        }

    gather = ["loom.py:766 in save", "checkpointer.py:143 in _record", "parallel.py:345 in all_gather_object"]
    broadcast = ["loom.py:766 in save", "full.py:111 in save", "parallel.py:336 in broadcast"]
    answers = {0: inside(0, gather), 1: inside(1, broadcast)}
    for evidence_only in (False, True):  # a peer that closed its connection first: all answered, so evidence
        assert _culprit(answers, {}, 2, evidence_only=evidence_only) == (
            "culprit: torchloom itself, not your code: every rank is inside the same loom.save() #3 (train.py:20), "
            "but they wait in different collectives inside it (rank 0 in checkpointer.py:143 in _record > "
            "parallel.py:345 in all_gather_object; rank 1 in full.py:111 in save > parallel.py:336 in broadcast). "
            "Please report this as a torchloom bug, with this report"
        )
    # Inside loom.load, which does not check that the ranks were given the same state: either may be at fault.
    answers = {r: {**a, "name": "load"} for r, a in answers.items()}
    culprit = _culprit(answers, {}, 2, evidence_only=False)
    assert culprit.startswith(
        "culprit: every rank is inside the same loom.load() #3 (train.py:20), but they wait"
    )
    assert "were given different arguments (`state` must name" in culprit and "torchloom bug" in culprit
    # A failed rank's innermost line is its `with` around the collective: the same place all the same.
    failed = [*gather[:-1], "parallel.py:343 in all_gather_object"]
    assert "in the same collective" in _culprit({0: inside(0, gather), 1: inside(1, failed)}, {}, 2, False)
    # A rank still writing (not in torch.distributed) while the other waits: a timeout too short, said so.
    writing = ["loom.py:766 in save", "full.py:130 in save", "full.py:45 in write_file"]
    answers = {0: inside(0, writing, in_distributed=False), 1: inside(1, broadcast)}
    culprit = _culprit(answers, {}, 2, evidence_only=False)
    assert culprit.startswith(
        "culprit: rank 0 is still working inside loom.save() #3 (train.py:20), at full.py:130"
    )
    assert "raise the timeout" in culprit


def _parted_save(rank: int, world_size: int) -> str:
    """A torchloom defect on purpose: rank 0 alone records the run's state (a collective) in a save."""
    from datetime import timedelta

    from torch import nn

    from torchloom import Loom
    from torchloom.checkpointing import full

    if rank == 0:
        full.needs_record = lambda entries: True
    loom = Loom(accelerator="cpu", devices=2, strategy="ddp", timeout=timedelta(seconds=TIMEOUT_S))
    loom.launch()
    model = loom.setup_module(nn.Linear(2, 2))
    import tempfile

    try:
        loom.save(f"{tempfile.mkdtemp()}/x.pt", {"weights": dict(model.state_dict())})
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.timeout(120)
def test_a_hang_inside_loom_save_does_not_blame_the_user():
    from harness import run_ranks

    for out in run_ranks(_parted_save, 2, timeout=90):
        assert out.startswith(
            ("CollectiveTimeoutError: loom.save()", "CollectiveMismatchError: loom.save()")
        ), out
        assert "every rank entered this loom.save() together" in out, out
        assert "culprit: torchloom itself, not your code" in out and "parallel.py" in out, out
        assert "is_global_zero" not in out, out
