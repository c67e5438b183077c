"""The main example (examples/train_lm.py) at a tiny size: it trains, logs, checkpoints, a resumed run reproduces
the uninterrupted run's losses exactly on CPU, and a run saved on 2 processes resumed on 1 or 3 continues the same
loss curve (the same global batches; only the order of summation differs)."""

from __future__ import annotations

import csv
import shutil

import pytest
from harness import PYTHON, REPO, run_job, wait_no_strays

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


def _job(out_dir, devices: int, *extra: str):
    cmd = [PYTHON, str(REPO / "examples" / "train_lm.py"), *TINY, "--devices", str(devices)]
    result, token = run_job([*cmd, "--out-dir", str(out_dir), *extra], timeout=180)
    assert wait_no_strays(token) == []
    return result


def _run(out_dir, *extra: str, devices: int = 2) -> str:
    result = _job(out_dir, devices, *extra)
    assert result.returncode == 0, result.stdout
    return result.stdout


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
    _run(stopped, "--stop-at", "3")
    assert (stopped / "checkpoint").is_dir()  # sharded
    return whole, stopped


@pytest.mark.timeout(900)
def test_resume_reproduces_the_uninterrupted_run(runs, tmp_path):
    whole, stopped = runs
    split = tmp_path / "split"
    shutil.copytree(stopped, split)
    resumed = _run(split, "--resume")
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
    resumed = _run(split, "--resume", devices=devices)
    assert "at step 3" in resumed and f"({devices} rank" in resumed
    _assert_same_curve(whole, split)


def test_global_batch_must_divide_over_the_ranks(tmp_path):
    result = _job(tmp_path, 2, "--batch-size", "13")
    assert result.returncode != 0
    assert "--batch-size 13 (the global batch) must be divisible by 2 ranks" in result.stdout


@pytest.mark.timeout(300)
def test_fsdp1_flavour_trains(tmp_path):
    out = _run(tmp_path, "--flavour", "fsdp", "--precision", "bf16-mixed")
    assert "4 FullyShardedDataParallel unit(s)" not in out and "2 FullyShardedDataParallel unit(s)" in out
    losses = [float(r["val_loss"]) for r in _rows(tmp_path) if r["val_loss"]]
    assert losses[-1] < losses[0]


@pytest.mark.timeout(900)
def test_tensor_parallel_reproduces_the_fsdp2_curve(whole, tmp_path):
    # --tp 2 on 4 processes: 2 data-parallel ranks, as in the 2-process fsdp2 run, so the same global batches split
    # the same way; each block's attention and MLP are split over a tensor-parallel pair of ranks that read the
    # same batch. The curve is the same up to the order of summation (fp32).
    out = _run(tmp_path, "--tp", "2", devices=4)
    assert "2 fully_shard unit(s)" in out and "sample:" in out
    assert (tmp_path / "checkpoint").is_dir()
    _assert_same_curve(whole, tmp_path)


def test_tensor_parallel_size_must_divide_the_devices(tmp_path):
    result = _job(tmp_path, 3, "--tp", "2")
    assert result.returncode != 0
    assert "--devices 3 must be a number of processes divisible by --tp 2" in result.stdout
