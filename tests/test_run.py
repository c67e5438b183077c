"""`torchloom run`: options reach Loom(), two "nodes" on loopback form one job, failures end the job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
import time

import pytest
from harness import PYTHON, free_port, run_job, wait_no_strays
from launch_helpers import failing_at

SCRIPT = textwrap.dedent(
    """
    import json, sys, time, warnings
    import torch
    from torchloom import Loom

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # "agree": the script names the command line's precision in Lightning's spelling; "two": it asks for 2
        # processes whatever the command line started.
        loom = Loom(precision="32") if "agree" in sys.argv else Loom(devices=2) if "two" in sys.argv else Loom()
    loom.launch()
    total = loom.all_reduce(torch.tensor(float(loom.global_rank + 1)), reduce_op="sum")
    # One write per line: both ranks share stdout, and print() may split a line in two writes.
    sys.stdout.write(json.dumps({
        "rank": loom.global_rank, "world": loom.world_size, "local": loom.local_rank, "node": loom.node_rank,
        "strategy": loom.strategy.name, "precision": loom.strategy.precision.name, "sum": float(total),
        "args": sys.argv[1:], "warnings": [str(w.message) for w in caught if "Loom(" in str(w.message)],
    }) + "\\n")
    sys.stdout.flush()
    if "fail" in sys.argv and loom.global_rank == 1:
        sys.stdout.write(f"TORCHLOOM_FAILING_AT {time.time()}\\n")
        sys.stdout.flush()
        raise ValueError("rank 1 cannot go on")
    loom.barrier()
    """
)


def _lines(output: str) -> list[dict]:
    return sorted(
        (json.loads(line) for line in output.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )


def test_a_script_that_disagrees_with_the_command_line_is_refused_naming_both(tmp_path):
    # The example scripts take --devices themselves: given after the script, it is still torchloom run's, so 1
    # process ran while the script's Loom asked for 2. It used to warn that the script won (it could not).
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [PYTHON, "-m", "torchloom", "run", "--accelerator", "cpu", str(script), "two", "--devices", "1"]
    result, token = run_job(cmd, timeout=180)
    assert result.returncode != 0
    assert (
        "Loom(devices=2) in the script disagrees with `torchloom run --devices 1`, which started 1 process per "
        "node. Drop one of them" in result.stdout
    ), result.stdout
    assert "put it after `--`: `torchloom run train.py -- --devices 1`" in result.stdout, result.stdout
    assert "torchrun" not in result.stdout and "overrides" not in result.stdout, result.stdout
    assert wait_no_strays(token) == []


def test_two_nodes_on_loopback_form_one_job_and_pass_options_to_loom(tmp_path):
    # One job for both claims (a job's start dominates the cost): two `torchloom run` agents form one world, and
    # each passes its --strategy and --precision to the script's Loom() and the script's own arguments to it.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            PYTHON,
            "-m",
            "torchloom",
            "run",
            "--accelerator",
            "cpu",
            "--devices",
            "1",
            "--num-nodes",
            "2",
            "--node-rank",
            str(node),
            "--main-address",
            "127.0.0.1",
            "--main-port",
            str(port),
            "--strategy",
            "fsdp2",
            "--precision",
            "32-true",
            str(script),
            "--lr",
            "3",
            "agree",
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    ranks = _lines("\n".join(outputs))
    assert [(r["rank"], r["node"], r["local"], r["world"]) for r in ranks] == [(0, 0, 0, 2), (1, 1, 0, 2)]
    for r in ranks:
        assert r["strategy"] == "fsdp2" and r["sum"] == 3.0
        assert r["args"] == ["--lr", "3", "agree"]
        assert r["precision"] == "32-true" and r["warnings"] == []  # '32' and '32-true' agree


def test_failing_rank_ends_the_job_with_its_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # 180 s, not 90: the job takes ~26 s at make test's usual load and printed nothing within 90 s once in CI
    # (2026-12-03). At a load average of 50 a 2-rank job took 81 s to reach its first collective; nothing in
    # the launch path was found to wait without bound. run_job dumps every process's stacks on a timeout.
    result, token = run_job(
        [PYTHON, "-m", "torchloom", "run", "--devices", "2", str(script), "fail"], timeout=180
    )
    ended = time.time()
    assert result.returncode != 0
    assert "torchloom: rank 1 failed" in result.stdout, result.stdout
    # The summary names the error and points at the rank's own traceback, which is printed once.
    assert "ValueError: rank 1 cannot go on\n(its traceback is in rank 1's output above)" in result.stdout, (
        result.stdout
    )
    assert result.stdout.count('raise ValueError("rank 1 cannot go on")') == 1, result.stdout
    # From the failure, not the start: rank 0 alone would wait in its barrier for the process group's 30 minutes
    # (30 s as in tests/test_launcher.py's failing ranks, for make test's load).
    assert ended - failing_at(result.stdout) < 30, result.stdout
    assert wait_no_strays(token) == []


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """`torchloom ...` in this process (no interpreter to start: each costs a torch import): its exit status and
    stderr. `torchloom run` writes its options into the environment before it checks them; they are undone."""
    from torchloom.cli import main

    saved = dict(os.environ)
    try:
        code = main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, capsys.readouterr().err


@pytest.mark.timeout(60)
def test_bad_invocations_fail_before_starting(tmp_path, capsys):
    code, err = _cli(["run", "--devices", "2", str(tmp_path / "nope.py")], capsys)
    assert code == 2 and "does not exist" in err
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = _cli(["run", "--devices", "2", "--main-port", str(port), str(script)], capsys)
    assert code == 2 and f"--main-port {port} is not free" in err
    code, err = _cli(["run", "--num-nodes", "2", str(script)], capsys)
    assert code == 2 and "--main-address" in err
