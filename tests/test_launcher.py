"""Launch paths (plain `python script.py`, `loom.launch(fn)`, torchrun, SLURM) and failing well.

Every job runs with an explicit timeout through the harness; afterwards no process of the job may be left.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_tracker
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from harness import PYTHON, TOKEN_ENV, free_port, kill_token, run_job, wait_no_strays
from launch_helpers import READY_TAG, SCRIPT, failing_at, fn_fail, fn_ok, reference_params, results

from torchloom import LaunchError, Loom, launcher
from torchloom.errors import ConfigurationError

TESTS = Path(__file__).resolve().parent
# A guard against hangs, not a claim: at a load average of 50 (2026-12-03) a 2-rank job took 81 s to start.
JOB_TIMEOUT = 150


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(tests=str(TESTS)))
    return path


def _check_report(report: dict, environment: str) -> None:
    """One rank knows its place among two, and trained to the single-process reference."""
    expected = torch.tensor(reference_params(2))
    assert report["world_size"] == 2
    assert report["local_rank"] == report["rank"]
    assert report["node_rank"] == 0
    assert report["environment"] == environment
    assert report["strategy"] == "ddp"  # "auto" with two processes
    assert report["ranks_seen"] == [0, 1]
    assert report["pids"][report["rank"]] == report["pid"]
    assert len(set(report["pids"])) == 2 and os.getpid() not in report["pids"]
    assert torch.allclose(torch.tensor(report["params"]), expected, atol=1e-6)
    assert torch.allclose(torch.tensor(report["params_sum_over_ranks"]), 2 * expected, atol=1e-6)


def _check_reports(reports: list[dict], environment: str) -> None:
    """Exactly ranks 0 and 1 reported (torchloom started no extra ranks), each correctly."""
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        _check_report(report, environment)
    assert reports[0]["pids"] == reports[1]["pids"]


def _assert_clean(token: str) -> None:
    assert wait_no_strays(token) == [], "processes of the job survived it"


# ---- every launch path gives the same ranks and results ------------------------------------------------------
def test_plain_python_reexec(script):
    proc, token = run_job([PYTHON, str(script), "ok"], timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stdout
    reports = results(proc.stdout)
    # The re-run ranks live under torchloom's own elastic agent.
    _check_reports(reports, "TorchElasticEnvironment")
    _assert_clean(token)


def test_launch_function_returns_rank_zero_result(monkeypatch):
    """...also when the port torchloom drew for the rendezvous store was taken before its agent bound it (seen
    in `make test`: the launcher exited 1 before any rank started): the agent's launch is tried on a new draw."""
    from torchloom import environments

    resource_tracker.ensure_running()  # started now, so it does not carry the job's token below
    token = f"fn-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv(TOKEN_ENV, token)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    draws = [taken]
    real_draw = environments.find_free_port
    monkeypatch.setattr(environments, "find_free_port", lambda *a: draws.pop() if draws else real_draw(*a))
    loom = Loom(accelerator="cpu", devices=2)
    with held:
        result = loom.launch(fn_ok)
    assert not draws and loom.strategy.cluster_environment.main_port != taken
    assert isinstance(result, dict)
    assert result["rank"] == 0  # rank 0's result comes back
    _check_report(result, "TorchElasticEnvironment")
    _assert_clean(token)


def _faked_slurm(script: Path, mode: str) -> list[dict]:
    """Two tasks of one srun step on one node, each one rank (rank 0 hosts the store); their reports in rank
    order. The allocation is named "bash" (an salloc shell's): the tasks still make one job, not one job each."""
    port = str(free_port())

    def task(rank: int) -> tuple[subprocess.CompletedProcess, str]:
        env = {
            "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
            "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "bash", "MASTER_PORT": port,
            "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "127.0.0.1",
        }  # fmt: skip
        return run_job([PYTHON, str(script), mode], timeout=JOB_TIMEOUT, env=env)

    with ThreadPoolExecutor(2) as pool:
        jobs = list(pool.map(task, range(2)))
    reports = []
    for proc, token in jobs:
        assert proc.returncode == 0, proc.stdout
        found = results(proc.stdout)
        assert len(found) == 1, proc.stdout  # each task is one rank: nothing was re-launched
        reports += found
        _assert_clean(token)
    return sorted(reports, key=lambda r: r["rank"])


def _late_torchrun(script: Path) -> list[dict]:
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), "late"]  # fmt: skip
    proc, token = run_job(cmd, timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stdout
    _assert_clean(token)
    return results(proc.stdout)


class _LateJobs:
    """The "late" job of each launcher, started when a test first asks for it (rank 1 starts after Loom's
    timeout). It is also a plain torchrun / SLURM job, so the launch-path tests share it: starting a job
    dominates the cost of both."""

    def __init__(self, script: Path) -> None:
        self.script = script
        self.reports: dict[str, list[dict] | AssertionError] = {}

    def __getitem__(self, launch: str) -> list[dict]:
        if launch not in self.reports:
            try:
                if launch == "torchrun":
                    self.reports[launch] = _late_torchrun(self.script)
                else:
                    self.reports[launch] = _faked_slurm(self.script, "late")
            except AssertionError as error:  # the second test reports the same failure, without a new job
                self.reports[launch] = error
        found = self.reports[launch]
        if isinstance(found, AssertionError):
            raise found
        return found


@pytest.fixture(scope="module")
def late_reports(tmp_path_factory) -> _LateJobs:
    path = tmp_path_factory.mktemp("late") / "train.py"
    path.write_text(SCRIPT.format(tests=str(TESTS)))
    return _LateJobs(path)


def test_torchrun(late_reports):
    # Exactly two reports: torchloom started no more ranks under torchrun.
    _check_reports(late_reports["torchrun"], "TorchElasticEnvironment")


def test_faked_slurm(late_reports):
    _check_reports(late_reports["slurm"], "SLURMEnvironment")


@pytest.mark.parametrize("launch", ["torchrun", "slurm"])
def test_a_rank_that_starts_after_the_timeout_still_joins(late_reports, launch):
    """Loom(timeout=3 s) bounds collectives, not how long peers take to start: rank 1 reaches Loom(...) 6 s after
    rank 0 and the job trains as usual. (Before ranks met in the store first, gloo's connection set-up gave up
    after the group's 3 s: importing torch alone took 10 s on a loaded machine.) Under torchrun the agent holds
    the store; under SLURM rank 0 does."""
    reports = late_reports[launch]
    _check_reports(reports, "TorchElasticEnvironment" if launch == "torchrun" else "SLURMEnvironment")


# ---- failing ranks -------------------------------------------------------------------------------------------
FAILURES = ["raise", "exit", "kill", "segv", "oom"]


def _check_failure_output(proc, mode: str) -> None:
    assert "torchloom: rank 1 failed" in proc.stdout, proc.stdout
    if mode == "segv":
        assert "SIGSEGV" in proc.stdout, proc.stdout
    if mode == "oom":
        assert "can't allocate memory" in proc.stdout, proc.stdout


# Every failure kind under `python train.py`. `torchloom run` catches the same ChildFailedError of torch's agent
# and describes it with the same `_describe_failure` / `_exit_status`: its failing rank (an exception, with these
# same checks of the summary) is tests/test_run.py::test_failing_rank_ends_the_job_with_its_traceback. The
# other kinds' pairs with `torchloom run` took 5 jobs, ~35 CPU-s.
FAILURE_CASES = [(mode, "python") for mode in FAILURES]


@pytest.mark.parametrize(("mode", "launcher_kind"), FAILURE_CASES, ids=[f"{m}-{k}" for m, k in FAILURE_CASES])
def test_failing_rank_ends_the_job(script, mode, launcher_kind):
    if launcher_kind == "python":
        cmd = [PYTHON, str(script), mode]
    else:
        cmd = [PYTHON, "-m", "torchloom", "run", "--accelerator", "cpu", "--devices", "2", str(script), mode]
    proc, token = run_job(cmd, timeout=JOB_TIMEOUT)
    ended = time.time()
    assert proc.returncode != 0, proc.stdout
    _check_failure_output(proc, mode)
    if mode == "raise":
        assert (
            "RuntimeError: deliberate failure on rank 1\n(its traceback is in rank 1's output above)"
            in proc.stdout
        )
        # The rank printed its traceback; the launcher's summary does not print it a second time.
        assert proc.stdout.count('raise RuntimeError("deliberate failure on rank 1")') == 1, proc.stdout
    if mode == "exit":
        assert "exit code 3" in proc.stdout
        assert proc.returncode == 3
    if mode == "kill":
        assert "SIGKILL" in proc.stdout
    # Measured from the failure, not from the start (startup on 2 shared cores varies): rank 0 alone would wait
    # in its collective for the 30-minute process-group timeout. 30 s, not 10: under make test's three workers
    # the agent's SIGTERM and teardown took 11.6 s once (2026-12-03, the oom case).
    assert ended - failing_at(proc.stdout) < 30, proc.stdout
    _assert_clean(token)


# An exception (with its traceback in the LaunchError) and a death by signal (no error file): "oom" takes the
# exception's path and "segv" the signal's; their own messages are checked under `python train.py` above.
@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_launch_function_failure_raises_launch_error(monkeypatch, capfd, mode):
    resource_tracker.ensure_running()
    token = f"fnfail-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv(TOKEN_ENV, token)
    loom = Loom(accelerator="cpu", devices=2)
    with pytest.raises(LaunchError) as info:
        loom.launch(fn_fail, mode)
    # Rank 0 would wait 120 s (or the collective's timeout) if nobody stopped it; 30 s leaves room for a loaded
    # machine's slow exit and agent poll (10 s failed once beside a busy suite).
    assert time.time() - failing_at(capfd.readouterr().out) < 30
    assert info.value.rank == 1
    assert "rank 1 failed" in str(info.value)
    if mode == "raise":
        assert "RuntimeError: deliberate failure on rank 1" in str(info.value)
    _assert_clean(token)


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "launcher-killed"]
)
def test_stopping_the_launcher_stops_every_rank(script, sig):
    """Ctrl-C: the agent stops the ranks and exits 130; SIGTERM: the same, exit 143. SIGKILL: the launcher cannot
    clean up, and the ranks must die with it anyway."""
    token = f"stop-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [PYTHON, str(script), "forever"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    output: list[str] = []
    try:
        ready = set()
        deadline = time.monotonic() + JOB_TIMEOUT
        while len(ready) < 2:
            assert time.monotonic() < deadline, "ranks never became ready:\n" + "".join(output)
            assert proc.poll() is None, "job ended before the interrupt:\n" + "".join(output)
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            output.append(line)
            if line.startswith(READY_TAG):
                ready.add(line.strip())
        start = time.monotonic()
        os.kill(proc.pid, sig)
        returncode = proc.wait(timeout=10)
        # 130 is the shell's convention for "stopped by Ctrl-C".
        expected = {signal.SIGINT: 130, signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGKILL: -signal.SIGKILL}
        assert returncode == expected[sig]
        assert wait_no_strays(token, within=max(0.0, 10 - (time.monotonic() - start))) == []
    finally:
        kill_token(token)
        if proc.poll() is None:
            proc.kill()
        proc.wait()


GLOO_PEER_GONE = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35737"


def _failure(exitcode: int, message: str | None, timestamp: int = 1000) -> SimpleNamespace:
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message}}} if message else {}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, timestamp=timestamp, pid=100)


@pytest.mark.parametrize(
    "survivor",
    [
        _failure(-signal.SIGTERM, f"RuntimeError: {GLOO_PEER_GONE}"),
        _failure(1, f"RuntimeError: {GLOO_PEER_GONE}"),
        _failure(-signal.SIGTERM, None),
    ],
)
@pytest.mark.parametrize(
    "culprit", [_failure(-signal.SIGKILL, None), _failure(3, None), _failure(1, "ValueError: x")]
)
def test_root_cause_is_the_rank_that_failed_first_within_the_same_second(survivor, culprit):
    # The race the job tests can hit: rank 1 dies, rank 0's collective fails in the same second. Timestamps in
    # whole seconds tie, and rank 0 must still not be blamed.
    error = SimpleNamespace(failures={0: survivor, 1: culprit})
    assert launcher._root_failure(error)[0] == 1
    assert launcher._describe_failure(error).startswith("torchloom: rank 1 failed")


def test_failure_summary_without_an_error_file_says_so_instead_of_none():
    # torch elastic fills a missing error file with the placeholder message "<NONE>".
    error = SimpleNamespace(
        failures={
            0: _failure(-signal.SIGTERM, None),
            1: SimpleNamespace(
                exitcode=-signal.SIGSEGV, error_file_data={"message": "<NONE>"}, timestamp=1, pid=7
            ),
        }
    )
    text = launcher._describe_failure(error)
    assert "<NONE>" not in text, text
    assert "rank 1 failed (exit code -11, pid 7)" in text
    assert "It was killed by signal SIGSEGV." in text
    assert "No Python traceback was recorded; rank 1's output above shows what it printed." in text
    assert text.endswith("\nRank 0 also stopped."), text


def test_failure_summary_names_the_error_and_keeps_the_traceback_for_launch_error():
    error = SimpleNamespace(
        failures={2: _failure(1, "ValueError: x"), 0: _failure(-signal.SIGTERM, None), 1: _failure(-15, None)}
    )
    short = launcher._describe_failure(error)
    assert "ValueError: x\n(its traceback is in rank 2's output above)" in short
    assert "Traceback of rank 2" not in short
    assert short.endswith("\nRanks 0, 1 also stopped."), short
    assert "Traceback of rank 2:\nValueError: x" in launcher._describe_failure(error, with_traceback=True)


STARTUP_SCRIPT = """
import os, sys, time

marks, phases = sys.argv[1], sys.argv[2].split(",")
in_rank = os.environ.get("TORCHLOOM_LAUNCHED") == "1"
# Rank r stops in phases[r] (the last one for higher ranks). A spawned rank learns its rank only after it has
# imported the main module, so there every rank takes phases[0].
phase = phases[min(int(os.environ.get("RANK", "0")), len(phases) - 1)]


def stop_here(name):
    # Announce this rank, then stay in this phase of start-up until killed.
    open(os.path.join(marks, f"{{name}}-{{os.getpid()}}"), "w").close()
    time.sleep(120)


if in_rank and phase == "first_line":
    stop_here(phase)
if in_rank and phase == "importing_main" and __name__ == "__mp_main__":
    stop_here(phase)  # loom.launch(fn): a spawned rank re-imports the main module before it unpickles anything
import torch  # noqa: E402

if in_rank and phase == "imported_torch":
    stop_here(phase)
sys.path.insert(0, {tests!r})
from torchloom import Loom  # noqa: E402


def fn(loom):
    stop_here("in_fn")


if __name__ == "__main__":
    loom = Loom(accelerator="cpu", devices=max(2, len(phases)))
    if in_rank and phase == "before_launch":
        stop_here(phase)
    if phases[0] in ("importing_main", "in_fn"):
        loom.launch(fn)
    else:
        loom.launch()
        stop_here(phase)
"""

# The phases before a rank meets the others are independent, so one 3-rank job holds one rank in each. The
# phase after loom.launch() is test_stopping_the_launcher_stops_every_rank[launcher-killed]'s: there the ranks
# are past launch() (talking to each other) when the launcher gets SIGKILL.
STARTUP_JOBS = [("first_line", "imported_torch", "before_launch"), ("importing_main",), ("in_fn",)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("phases", STARTUP_JOBS, ids=["+".join(p) for p in STARTUP_JOBS])
def test_a_killed_launcher_takes_its_ranks_at_every_point_of_start_up(tmp_path, phases):
    """SIGKILL leaves the launcher no chance to clean up: each rank must already have asked the kernel to end
    it with its parent, from its first instant, not only once it reaches loom.launch()."""
    script = tmp_path / "start.py"
    script.write_text(STARTUP_SCRIPT.format(tests=str(TESTS)))
    marks = tmp_path / "marks"
    marks.mkdir()
    token = f"startup-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, TOKEN_ENV: token}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    log = tmp_path / "launcher.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PYTHON, str(script), str(marks), ",".join(phases)],
            env=env,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    ranks = max(2, len(phases))
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while len(list(marks.iterdir())) < ranks:
            assert proc.poll() is None, (
                f"the launcher ended (exit code {proc.returncode}) before its ranks got there:\n"
                f"{log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, (
                f"the ranks never reached the phases; there: {sorted(p.name for p in marks.iterdir())}"
            )
            time.sleep(0.1)
        where = {int(p.name.rsplit("-", 1)[1]): p.name.rsplit("-", 1)[0] for p in marks.iterdir()}
        assert sorted(where.values()) == sorted(phases * (ranks // len(phases))), where
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_no_strays(token, within=10)
        assert left == [], f"ranks outlived the launcher, in phases {[where.get(pid, pid) for pid in left]}"
    finally:
        kill_token(token)
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_ranks_error_file_appears_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's uncaught exception reaches the agent's error file by a rename, never through the file opened empty
    at its own path: the agent reads the file as soon as it sees the rank fail, and an empty one crashed
    torchelastic's agent (JSONDecodeError) and ended a replica group for good (seen once in `make test`)."""
    import builtins
    import json
    import sys

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.delenv(launcher.LAUNCHED_ENV, raising=False)
    monkeypatch.setattr(sys, "excepthook", lambda *args: None)
    launcher.record_errors_in_rank()
    opened: list[str] = []
    real_open = builtins.open

    def spy(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        if "w" in mode:
            opened.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    try:
        raise ValueError("boom")
    except ValueError as error:
        sys.excepthook(type(error), error, error.__traceback__)
    monkeypatch.setattr(builtins, "open", real_open)
    assert opened and str(path) not in opened
    assert "ValueError: boom" in json.loads(path.read_text())["message"]["message"]
    assert list(tmp_path.iterdir()) == [path]


# ---- the rendezvous port ----------------------------------------------------------------------------------------
def _store_on(port: int | None) -> int:
    """What torch's static rendezvous does first: listen on the port (a real bind)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    assert port is not None
    TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=5), wait_for_workers=False)
    return port


def test_a_drawn_port_is_drawn_again_and_a_chosen_one_is_not(capsys):
    """`launcher.on_a_free_port` (every launch path's: `loom.launch()`, `loom.launch(fn)`, `torchloom run`):
    a port torchloom drew and found taken is drawn again; one the user chose fails as it is; an error that is not
    a store failing to listen (a rank's failure whose text mentions EADDRINUSE) is never retried."""
    from torchloom.environments import find_free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        fresh = find_free_port()
        assert launcher.on_a_free_port(_store_on, taken, lambda: fresh) == fresh
        assert f"port {taken}, drawn for the rendezvous, was taken" in capsys.readouterr().err
        with pytest.raises(RuntimeError, match="EADDRINUSE") as caught:
            launcher.on_a_free_port(_store_on, taken, None)
        assert launcher.port_taken(caught.value)
        draws = []

        def redraw() -> int:
            draws.append(taken)
            return taken

        with pytest.raises(RuntimeError, match="EADDRINUSE"):
            launcher.on_a_free_port(_store_on, taken, redraw)
        assert len(draws) == launcher._PORT_DRAWS - 1  # then it gives up, with the store's own error

    def rank_failed(port: int | None) -> None:
        raise RuntimeError("rank 1 failed: OSError: [Errno 98] EADDRINUSE (the user's own server)")

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        launcher.on_a_free_port(rank_failed, 1234, lambda: pytest.fail("a rank's failure was retried"))


def test_torchloom_run_draws_its_port_again(monkeypatch, tmp_path):
    """`torchloom run` without --main-port hands torchrun a new port when its draw was taken; with one, none."""
    import torch.distributed.run

    from torchloom import run
    from torchloom.cli import _parser, split_run_args

    script = tmp_path / "train.py"
    script.write_text("")
    seen: list[int] = []

    def agent(config) -> None:  # torchrun's run: listen as its static rendezvous does, start no rank
        seen.append(config.master_port)
        _store_on(config.master_port)

    monkeypatch.setattr(torch.distributed.run, "run", agent)
    environment = dict(os.environ)  # `torchloom run` publishes its options there, for the ranks it starts
    with socket.socket() as held, contextlib.ExitStack() as restore:
        restore.callback(lambda: (os.environ.clear(), os.environ.update(environment)))
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = [taken]  # the first try's draw; the retry's is real
        real_draw = run.find_free_port
        monkeypatch.setattr(run, "find_free_port", lambda *a: draws.pop() if draws else real_draw(*a))
        ours, _ = split_run_args(["--devices", "2", str(script)])
        assert run.run(_parser().parse_args(["run", *ours])) == 0
        assert seen[0] == taken and len(seen) == 2 and seen[1] != taken
        seen.clear()
        ours, _ = split_run_args(["--devices", "2", "--main-port", str(taken), str(script)])
        with pytest.raises(ConfigurationError, match=str(taken)):  # checked before torchrun starts
            run.run(_parser().parse_args(["run", *ours]))
        assert seen == []
