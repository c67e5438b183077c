"""The main example (examples/train_lm.py) at a tiny size: it trains, logs, checkpoints, and a resumed run
reproduces the uninterrupted run's losses exactly on CPU."""

from __future__ import annotations

import csv

from harness import PYTHON, REPO, run_job, wait_no_strays

TINY = [
    "--devices",
    "2",
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
    "4",
    "--eval-every",
    "3",
    "--checkpoint-every",
    "3",
    "--eval-batches",
    "2",
    "--text-bytes",
    "20000",
]


def _run(out_dir, *extra: str) -> str:
    result, token = run_job(
        [PYTHON, str(REPO / "examples" / "train_lm.py"), *TINY, "--out-dir", str(out_dir), *extra],
        timeout=180,
    )
    assert result.returncode == 0, result.stdout
    assert wait_no_strays(token) == []
    return result.stdout


def _rows(out_dir) -> list[dict[str, str]]:
    with open(out_dir / "logs" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_fsdp1_flavour_trains(tmp_path):
    out = _run(tmp_path, "--flavour", "fsdp", "--precision", "bf16-mixed")
    assert "4 FullyShardedDataParallel unit(s)" not in out and "2 FullyShardedDataParallel unit(s)" in out
    losses = [float(r["val_loss"]) for r in _rows(tmp_path) if r["val_loss"]]
    assert losses[-1] < losses[0]


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    flavour = "fsdp2"
    whole, split = tmp_path / "whole", tmp_path / "split"
    out = _run(whole, "--flavour", flavour)
    assert "replicated on every rank" in out and "sample:" in out
    _run(split, "--flavour", flavour, "--stop-at", "3")
    resumed = _run(split, "--flavour", flavour, "--resume")
    assert "resumed from" in resumed and "at step 3" in resumed
    a, b = _rows(whole), _rows(split)
    assert list(a[0]) == ["step", "val_loss", "train_loss", "grad_norm", "lr", "tokens_per_s"]
    for key in ("train_loss", "val_loss", "grad_norm", "lr"):
        assert [(r["step"], r[key]) for r in a if r[key]] == [(r["step"], r[key]) for r in b if r[key]], key
    assert {r["step"] for r in a} == {str(s) for s in range(0, 7)}
    assert (split / "checkpoint").is_dir()  # sharded
    losses = [float(r["val_loss"]) for r in a if r["val_loss"]]
    assert losses[-1] < losses[0]
