"""The main example (examples/train_lm.py) at a tiny size: it trains, logs, checkpoints, a resumed run reproduces
the uninterrupted run's losses exactly on CPU, and a run saved on 2 processes resumed on 1 or 3 continues the same
loss curve (the same global batches; only the order of summation differs).

The uninterrupted run is the user's command, `python examples/train_lm.py --devices 2`, a real job that starts its
own ranks. The other runs start each rank from `run_ranks`'s fork server with the environment torchrun gives a
rank (so `loom.launch()` starts nothing, as under torchrun): a rank that does not import torch again costs a
fraction of a launched one, and the resumed runs matching the launched run to every digit shows that both ways
train alike. The two argument checks fail before any rank starts, in one process."""

from __future__ import annotations

import csv
import json
import os
import runpy
import shutil
import sys
from pathlib import Path

import pytest
from harness import PYTHON, REPO, run_job, run_ranks, wait_no_strays

SCRIPT = REPO / "examples" / "train_lm.py"

TINY = [
    "--steps",
    "6",
    "--n-layer",
    "2",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "16",
    "--batch-size",
    "12",  # the global batch: 6 sequences per rank on 2, 4 on 3, 12 on 1
    "--log-every",
    "1",
    "--eval-every",
    "3",
    "--checkpoint-every",
    "3",
    "--eval-batches",
    "2",
    "--text-bytes",
    "2000",  # 112 training windows: 9 global batches, so step 5 reads the last of epoch 0 and the first of epoch 1
    "--sample-bytes",
    "8",  # the sample after training: each byte is a forward with collectives, and no curve reads it
]


def _run(out_dir, *extra: str, devices: int = 2) -> str:
    """The example as a user runs it: a job that starts its own ranks."""
    cmd = [PYTHON, str(SCRIPT), *TINY, "--devices", str(devices), "--out-dir", str(out_dir), *extra]
    result, token = run_job(cmd, timeout=180)
    assert wait_no_strays(token) == []
    assert result.returncode == 0, result.stdout
    return result.stdout


def _example_rank(rank: int, world_size: int, argv: list[str], log_dir: str) -> str:
    """One rank of the example, its stdout and stderr (the sharding summary is logged) in a file of its own."""
    log = Path(log_dir) / f"rank{rank}.txt"
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    sys.argv = [str(SCRIPT), *argv]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    except BaseException as e:
        sys.stdout.flush()
        sys.stderr.flush()
        raise AssertionError(f"{argv} failed on rank {rank}; its output:\n{log.read_text()}") from e
    sys.stdout.flush()
    sys.stderr.flush()
    return log.read_text()


def _run_on_ranks(out_dir, *extra: str, devices: int = 2) -> str:
    """The example on `devices` ranks started from the fork server: every rank's output, in rank order."""
    argv = [*TINY, "--devices", str(devices), "--out-dir", str(out_dir), *extra]
    log_dir = Path(out_dir) / "rank-output"
    log_dir.mkdir(parents=True, exist_ok=True)
    return "".join(run_ranks(_example_rank, devices, argv, str(log_dir), timeout=180))


def _rows(out_dir) -> list[dict[str, str]]:
    with open(out_dir / "logs" / "version_0" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _curve(out_dir, key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in _rows(out_dir) if r[key]]


def _assert_same_curve(expected_dir, got_dir) -> None:
    """The same logged steps, and values equal up to the order of summation (fp32)."""
    for key in ("train_loss", "val_loss", "grad_norm"):
        expected, got = _curve(expected_dir, key), _curve(got_dir, key)
        assert [s for s, _ in got] == [s for s, _ in expected], key
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-4), key


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted 2-process run (fsdp2)."""
    whole = tmp_path_factory.mktemp("lm") / "whole"
    out = _run(whole)
    assert "replicated on every rank" in out and "sample:" in out and "tokens/s over the run" in out
    return whole


@pytest.fixture(scope="module")
def runs(whole, tmp_path_factory):
    """The uninterrupted run, and one stopped after its checkpoint at step 3 (fsdp2)."""
    stopped = tmp_path_factory.mktemp("lm") / "stopped"
    _run_on_ranks(stopped, "--stop-at", "3")
    assert (stopped / "checkpoint").is_dir()  # sharded
    return whole, stopped


@pytest.mark.timeout(900)
def test_resume_reproduces_the_uninterrupted_run(runs, tmp_path):
    whole, stopped = runs
    split = tmp_path / "split"
    shutil.copytree(stopped, split)
    resumed = _run_on_ranks(split, "--resume")
    assert "resumed from" in resumed and "at step 3" in resumed
    a, b = _rows(whole), _rows(split)
    # Columns sorted by name, as Fabric's CSVLogger writes them.
    assert list(a[0]) == ["grad_norm", "lr", "step", "tokens_per_s", "train_loss", "val_loss"]
    for key in ("train_loss", "val_loss", "grad_norm", "lr"):
        assert [(r["step"], r[key]) for r in a if r[key]] == [(r["step"], r[key]) for r in b if r[key]], key
    assert {r["step"] for r in a} == {str(s) for s in range(0, 7)}
    losses = [float(r["val_loss"]) for r in a if r["val_loss"]]
    assert losses[-1] < losses[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices", [1, 3])
def test_resume_at_another_world_size_continues_the_curve(runs, tmp_path, devices):
    # The global batch stays 12, so steps 4-6 read the same global batches as the uninterrupted run, split over
    # another number of ranks: the losses differ only by the order of summation (fp32).
    whole, stopped = runs
    split = tmp_path / "split"
    shutil.copytree(stopped, split)
    resumed = _run_on_ranks(split, "--resume", devices=devices)
    assert "at step 3" in resumed and f"({devices} rank" in resumed
    _assert_same_curve(whole, split)


# The argument checks, each `python examples/train_lm.py ...` in one process, which must stop before any rank
# starts: one interpreter runs them in turn (the first fails before the Loom is made, the second after).
_ARGUMENT_CASES = {
    "tp": [*TINY, "--devices", "3", "--tp", "2"],
    "batch": [*TINY, "--devices", "2", "--batch-size", "13"],
}
_CASES_DRIVER = """
import json, runpy, sys
script, cases = sys.argv[1], json.loads(sys.argv[2])
for name, argv in cases.items():
    print(f"=== case {name}", flush=True)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        print(f"=== exit {e.code}", flush=True)
    else:
        print("=== exit 0", flush=True)
"""


@pytest.fixture(scope="module")
def argument_errors(tmp_path_factory) -> dict[str, str]:
    """Each case's output up to its exit code, by case name."""
    folder = tmp_path_factory.mktemp("lm-arguments")
    cases = {name: [*argv, "--out-dir", str(folder / name)] for name, argv in _ARGUMENT_CASES.items()}
    result, token = run_job([PYTHON, "-c", _CASES_DRIVER, str(SCRIPT), json.dumps(cases)], timeout=120)
    assert wait_no_strays(token) == []
    assert result.returncode == 0, result.stdout
    parts = result.stdout.split("=== case ")[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in parts}


def test_global_batch_must_divide_over_the_ranks(argument_errors):
    out = argument_errors["batch"]
    assert "=== exit 2" in out, out  # argparse's usage error
    assert "--batch-size 13 (the global batch) must be divisible by 2 ranks" in out


@pytest.mark.timeout(300)
def test_fsdp1_flavour_trains(tmp_path):
    out = _run_on_ranks(tmp_path, "--flavour", "fsdp", "--precision", "bf16-mixed")
    assert "4 FullyShardedDataParallel unit(s)" not in out and "2 FullyShardedDataParallel unit(s)" in out
    losses = [float(r["val_loss"]) for r in _rows(tmp_path) if r["val_loss"]]
    assert losses[-1] < losses[0]


@pytest.mark.timeout(900)
def test_tensor_parallel_reproduces_the_fsdp2_curve(whole, tmp_path):
    # --tp 2 on 4 processes: 2 data-parallel ranks, as in the 2-process fsdp2 run, so the same global batches split
    # the same way; each block's attention and MLP are split over a tensor-parallel pair of ranks that read the
    # same batch. The curve is the same up to the order of summation (fp32).
    out = _run_on_ranks(tmp_path, "--tp", "2", devices=4)
    assert "2 fully_shard unit(s)" in out and "sample:" in out
    assert (tmp_path / "checkpoint").is_dir()
    _assert_same_curve(whole, tmp_path)


def test_tensor_parallel_size_must_divide_the_devices(argument_errors):
    out = argument_errors["tp"]
    assert "=== exit 2" in out, out  # argparse's usage error
    assert "--devices 3 must be a number of processes divisible by --tp 2" in out
