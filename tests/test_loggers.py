"""Loggers and the progress bar: the version_N layout, CSV buffering and resumed runs, TensorBoard events, rank 0
as the only writer (under run_ranks, a re-run script and launch(fn)), and loom.print per node.
(Differential tests against Fabric's own loggers: test_fabric_loggers.py.)"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from harness import PYTHON, REPO, run_job, run_ranks, wait_no_strays

from torchloom import Loom
from torchloom.errors import MisuseError
from torchloom.loggers import CSVLogger, TensorBoardLogger


def _rows(path: Path | str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_csv_versions_buffering_and_resume(tmp_path):
    logger = CSVLogger(tmp_path, name="run", flush_logs_every_n_steps=3)
    assert not tmp_path.joinpath("run").exists()  # constructing creates nothing
    assert logger.version == 0 and logger.log_dir == str(tmp_path / "run" / "version_0")
    logger.log_metrics({"loss": 1.5}, step=0)
    logger.log_metrics({"loss": 1.0, "acc": torch.tensor(0.5)}, step=1)
    metrics = tmp_path / "run" / "version_0" / "metrics.csv"
    assert not metrics.exists()  # buffered until (step + 1) % 3 == 0
    logger.log_metrics({"loss": 0.75, "tokens": 12}, step=2)
    assert _rows(metrics) == [
        {"acc": "", "loss": "1.5", "step": "0", "tokens": ""},
        {"acc": "0.5", "loss": "1.0", "step": "1", "tokens": ""},
        {"acc": "", "loss": "0.75", "step": "2", "tokens": "12"},  # ints stay ints
    ]
    logger.log_metrics({"loss": 0.5})  # without a step: the number of rows logged so far
    logger.finalize("success")
    assert _rows(metrics)[-1] == {"acc": "", "loss": "0.5", "step": "3", "tokens": ""}

    # A resumed run continues the latest version's file; a new run takes the next version.
    resumed = CSVLogger(tmp_path, name="run", append=True)
    resumed.log_metrics({"loss": 0.25, "lr": 0.1}, step=4)
    resumed.save()
    assert resumed.version == 0 and [r["step"] for r in _rows(metrics)] == ["0", "1", "2", "3", "4"]
    assert _rows(metrics)[-1]["lr"] == "0.1" and _rows(metrics)[0]["lr"] == ""  # header widened in place
    assert CSVLogger(tmp_path, name="run").version == 1
    # A string version is the directory's name; name=None or "" puts versions directly under root_dir.
    assert CSVLogger(tmp_path, name="run", version="final").log_dir == str(tmp_path / "run" / "final")
    assert CSVLogger(tmp_path, name=None).log_dir == str(tmp_path / "version_0")
    # An explicit version whose directory has a metrics.csv: replaced, with a warning (Fabric's behaviour).
    again = CSVLogger(tmp_path, name="run", version=0)
    with pytest.warns(UserWarning, match="exists and is not empty"):
        again.log_metrics({"loss": 9.0}, step=0)
    again.finalize("success")
    assert _rows(metrics) == [{"loss": "9.0", "step": "0"}]


def test_tensorboard_logger_writes_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb", prefix="train", sub_dir="scalars")
    assert not tmp_path.joinpath("tb").exists()
    loom = Loom(accelerator="cpu", loggers=[logger])
    loom.log("loss", torch.tensor(2.0), step=0)
    loom.log_dict({"loss": 1.0, "lr": 0.1}, step=1)
    loom.log("loss", 0.5)  # without a step: the step after the last one
    loom.finalize_loggers()
    (events,) = list((tmp_path / "tb" / "version_0" / "scalars").glob("events.out.tfevents.*"))
    # Read the file back with TensorBoard's own reader: the values and steps that were logged, nothing else.
    reader = EventAccumulator(str(events))
    reader.Reload()
    assert sorted(reader.Tags()["scalars"]) == ["train-loss", "train-lr"]
    assert [(e.step, e.value) for e in reader.Scalars("train-loss")] == [(0, 2.0), (1, 1.0), (2, 0.5)]
    assert [(e.step, round(e.value, 6)) for e in reader.Scalars("train-lr")] == [(1, 0.1)]
    assert TensorBoardLogger(tmp_path, name="tb").version == 1
    with pytest.raises(ValueError, match="cannot log 'fast'.*a number, a one-element tensor"):
        loom.log("speed", "fast")


def _log_body(rank: int, world_size: int, root: str) -> dict:
    csv_logger, tb_logger = CSVLogger(root, name="csv"), TensorBoardLogger(root, name="tb")
    loom = Loom(accelerator="cpu", devices=world_size, loggers=[csv_logger, tb_logger])
    loom.launch()
    loom.log("loss", torch.tensor(float(rank)), step=0)
    # Direct calls on every rank are harmless: rank 1 writes nothing and its .experiment does nothing.
    csv_logger.log_metrics({"direct": float(rank)}, step=1)
    tb_logger.log_hyperparams({"lr": 0.1})
    tb_logger.experiment.add_text("note", "hello")
    loom.finalize_loggers()
    bar = loom.progress(range(3), desc="x", force=True)
    assert list(bar) == [0, 1, 2]
    bar.set_postfix(loss=1.0)
    bar.close()
    return {"bar": bar.enabled, "experiment": type(tb_logger.experiment).__name__}


def test_only_rank_zero_writes_and_shows_a_bar(tmp_path):
    results = run_ranks(_log_body, 2, str(tmp_path), timeout=60)
    assert [r["bar"] for r in results] == [True, False]
    assert [r["experiment"] for r in results] == ["SummaryWriter", "_NoOpExperiment"]
    files = _files(tmp_path)
    assert (
        files[0] == "csv/version_0/metrics.csv" and len(files) == 2 and files[1].startswith("tb/version_0/")
    )
    assert _rows(tmp_path / "csv" / "version_0" / "metrics.csv") == [
        {"direct": "", "loss": "0.0", "step": "0"},
        {"direct": "0.0", "loss": "", "step": "1"},
    ]


LAUNCHED_SCRIPT = """\
import sys
from torchloom import Loom
from torchloom.loggers import CSVLogger, TensorBoardLogger

root, unfinished = sys.argv[1], sys.argv[2]
csv_logger, tb_logger = CSVLogger(root, name="csv"), TensorBoardLogger(root, name="tb")
loom = Loom(accelerator="cpu", devices=2, loggers=[csv_logger, tb_logger])
csv_logger.log_metrics({"before_launch": 1.0}, step=0)  # runs in the launching process too: writes nothing there
loom.launch()
loom.log("rank", loom.global_rank, step=1)
loom.finalize_loggers()
# A logger of no Loom's, never finalized: its buffered row must reach the file when the rank's interpreter exits.
CSVLogger(unfinished).log_metrics({"x": 1}, step=0)
"""


@pytest.fixture(scope="module")
def launched_job(tmp_path_factory) -> dict:
    """One `python train.py` job (devices=2, launch() re-runs the script) for the two tests below."""
    tmp_path = tmp_path_factory.mktemp("launched")
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED_SCRIPT)
    cmd = [PYTHON, str(script), str(tmp_path / "logs"), str(tmp_path / "unfinished")]
    result, token = run_job(cmd, timeout=90, cwd=REPO)
    return {"result": result, "strays": wait_no_strays(token), "root": tmp_path}


@pytest.mark.timeout(120)
def test_rows_are_flushed_at_exit_without_finalize(launched_job):
    result = launched_job["result"]
    assert result.returncode == 0, result.stdout
    unfinished = launched_job["root"] / "unfinished"
    assert _rows(unfinished / "lightning_logs" / "version_0" / "metrics.csv") == [{"step": "0", "x": "1"}]
    assert _files(unfinished) == ["lightning_logs/version_0/metrics.csv"]  # rank 0's only


@pytest.mark.timeout(120)
def test_the_launching_process_creates_nothing(launched_job):
    """A plain `python train.py` with devices=2 runs the code before launch() in the launching process and in
    each rank: only rank 0 writes, so there is one version_0, not a version_0 of the launcher's and a version_1."""
    result = launched_job["result"]
    root = launched_job["root"] / "logs"
    assert result.returncode == 0, result.stdout
    assert launched_job["strays"] == []
    files = _files(root)
    assert (
        files[0] == "csv/version_0/metrics.csv" and len(files) == 2 and files[1].startswith("tb/version_0/")
    )
    assert _rows(root / "csv" / "version_0" / "metrics.csv") == [
        {"before_launch": "1.0", "rank": "", "step": "0"},
        {"before_launch": "", "rank": "0", "step": "1"},
    ]
    assert result.stdout.count("this process starts the ranks and is not one of them") == 1  # the launcher's


def log_in_fn(loom: Loom) -> str:
    loom.log("rank", loom.global_rank, step=0)
    loom.finalize_loggers()
    return loom.logger.log_dir


@pytest.mark.timeout(120)
def test_launch_fn_ranks_write_the_launchers_loggers(tmp_path):
    logger = CSVLogger(tmp_path)
    loom = Loom(accelerator="cpu", devices=2, loggers=logger)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # before launch, this process writes nothing and says so
        with pytest.raises(UserWarning, match="is not one of them"):
            logger.log_metrics({"x": 1.0}, step=0)
    assert not any(tmp_path.iterdir())
    assert loom.launch(log_in_fn) == str(tmp_path / "lightning_logs" / "version_0")
    assert _rows(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") == [{"rank": "0", "step": "0"}]


# ---- loom.print: local rank 0 of every node (Fabric's rule), or global rank 0 -------------------------------------
def _print_body(rank: int, world_size: int) -> tuple[int, int, str]:
    # A faked 2-node job: one rank per node, so each rank is local rank 0 of its node.
    os.environ.update({"LOCAL_RANK": "0", "GROUP_RANK": str(rank), "LOCAL_WORLD_SIZE": "1"})
    loom = Loom(accelerator="cpu", devices=1, num_nodes=world_size)
    loom.launch()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        loom.print("every node", end="|")
        loom.print("once", rank_zero="global")
    return loom.node_rank, loom.local_rank, out.getvalue()


@pytest.mark.timeout(120)
def test_print_on_local_rank_zero_of_every_node(tmp_path):
    assert run_ranks(_print_body, 2, timeout=60) == [(0, 0, "every node|once\n"), (1, 0, "every node|")]


def test_print_checks_its_choice(capsys):
    loom = Loom(accelerator="cpu")
    loom.print("a", "b", sep="-", file=sys.stdout)
    assert capsys.readouterr().out == "a-b\n"
    with pytest.raises(MisuseError, match="rank_zero='local'.*rank_zero='global'"):
        loom.print("x", rank_zero="node")


def test_no_bar_when_not_a_terminal(capsys):
    loom = Loom(accelerator="cpu")
    bar = loom.progress(range(2))
    assert not bar.enabled and list(bar) == [0, 1]
    bar.write("hello")
    assert "hello" in capsys.readouterr().out


def test_csv_logger_warns_only_when_it_replaces_a_metrics_file(tmp_path):
    """`profile_steps` writes into `log_dir/profile` before the first metrics: nothing is replaced, so no warning."""
    logger = CSVLogger(tmp_path)
    os.makedirs(os.path.join(logger.log_dir, "profile"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert os.path.isdir(os.path.join(logger.log_dir, "profile"))
    with pytest.warns(UserWarning, match="metrics.csv is replaced"):
        CSVLogger(tmp_path, version=0).log_metrics({"loss": 2.0}, step=0)
