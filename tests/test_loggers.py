"""Loggers and the progress bar: rank 0 only, CSV columns grow, TensorBoard writes events."""

from __future__ import annotations

import csv

import torch
from harness import run_ranks

from torchloom import Loom
from torchloom.loggers import CSVLogger, TensorBoardLogger


def test_csv_logger_columns_grow_and_append(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    logger.log_metrics({"loss": 1.5}, step=1)
    logger.log_metrics({"loss": 1.0, "acc": 0.5}, step=2)
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert rows == [{"step": "1", "loss": "1.5", "acc": ""}, {"step": "2", "loss": "1.0", "acc": "0.5"}]
    again = CSVLogger(tmp_path, name="run", append=True)
    again.log_metrics({"loss": 0.5}, step=3)
    assert len(list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))) == 3
    CSVLogger(tmp_path, name="run").log_metrics({"loss": 9.0}, step=1)  # a new run replaces the file
    assert len(list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))) == 1


def test_tensorboard_logger_writes_events(tmp_path):
    loom = Loom(accelerator="cpu", loggers=[TensorBoardLogger(tmp_path, name="tb")])
    loom.log("loss", torch.tensor(2.0), step=0)
    loom.log_dict({"loss": 1.0, "lr": 0.1}, step=1)
    loom.finalize_loggers()
    (events,) = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # Read the file back with TensorBoard's own reader: the values and steps that were logged, nothing else.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(events))
    reader.Reload()
    assert sorted(reader.Tags()["scalars"]) == ["loss", "lr"]
    assert [(e.step, e.value) for e in reader.Scalars("loss")] == [(0, 2.0), (1, 1.0)]
    assert [(e.step, round(e.value, 6)) for e in reader.Scalars("lr")] == [(1, 0.1)]


def _log_body(rank: int, world_size: int, root: str) -> bool:
    loom = Loom(accelerator="cpu", devices=world_size, loggers=[CSVLogger(root, name=f"rank{rank}")])
    loom.launch()
    loom.log("loss", torch.tensor(float(rank)), step=0)
    bar = loom.progress(range(3), desc="x", force=True)
    assert list(bar) == [0, 1, 2]
    bar.set_postfix(loss=1.0)
    bar.close()
    return bar.enabled


def test_only_rank_zero_logs_and_shows_a_bar(tmp_path):
    enabled = run_ranks(_log_body, 2, str(tmp_path), timeout=60)
    assert enabled == [True, False]
    assert (tmp_path / "rank0" / "metrics.csv").exists()
    assert not (tmp_path / "rank1").exists()


def test_no_bar_when_not_a_terminal(capsys):
    loom = Loom(accelerator="cpu")
    bar = loom.progress(range(2))
    assert not bar.enabled and list(bar) == [0, 1]
    bar.write("hello")
    assert "hello" in capsys.readouterr().out
