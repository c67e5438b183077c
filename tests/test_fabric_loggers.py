"""Differential tests: the same logging script through Lightning Fabric's loggers and through torchloom's, on 2 CPU
ranks, must leave the same files (directory layout, metrics.csv byte for byte, TensorBoard scalars and
hyperparameters read back with TensorBoard's own reader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_ranks

pytest.importorskip("lightning.fabric")
pytest.importorskip("tensorboard")


def _loggers_module(kind: str) -> Any:
    if kind == "fabric":
        from lightning.fabric import loggers
    else:
        from torchloom import loggers
    return loggers


def logging_script(rank: int, world_size: int, kind: str, root: str) -> dict[str, Any]:
    """Written against Fabric's API; `kind` picks Fabric or torchloom (imported as Fabric). Two runs under one
    experiment name (version_0 and version_1), a prefix, a metric that appears mid-way, ints and tensors, a flush
    every 3 steps, hyperparameters, and the writer used directly through `.experiment` on every rank."""
    if kind == "fabric":
        from lightning.fabric import Fabric
    else:
        from torchloom import Loom as Fabric
    loggers = _loggers_module(kind)
    csv_logger = loggers.CSVLogger(root, name="exp", prefix="train", flush_logs_every_n_steps=3)
    tb_logger = loggers.TensorBoardLogger(root, name="tb", sub_dir="scalars")
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy="ddp", loggers=[csv_logger, tb_logger])
    fabric.launch()
    for step in range(7):
        metrics: dict[str, Any] = {"loss": torch.tensor(1.0 / (step + 1)), "seen": (step + 1) * 4}
        if step >= 4:
            metrics["acc"] = 0.25 * step  # a new column: the CSV header is rewritten
        fabric.log_dict(metrics, step=step)
    fabric.log("lr", torch.tensor(0.125), step=7)
    # With a step: without one Fabric puts hp_metric at step 0 where torchloom takes the next step.
    tb_logger.log_hyperparams({"lr": 0.1, "layers": 2, "optimizer": {"name": "sgd", "momentum": 0.9}}, step=0)
    tb_logger.experiment.add_scalar("direct", 3.0, 1)  # a no-op object on rank 1
    for logger in fabric.loggers:
        logger.finalize("success")
    # A second run of the same experiment: the next version directory.
    again = loggers.CSVLogger(root, name="exp")
    fabric.barrier()  # rank 1 looks at the directory only after rank 0 made version_0
    again.log_metrics({"loss": 0.5}, step=0)
    again.finalize("success")
    return {
        "csv_log_dir": csv_logger.log_dir,
        "tb_log_dir": tb_logger.log_dir,
        "again_version": again.version,
        "experiment_type": type(tb_logger.experiment).__name__,
    }


def _tree(root: Path) -> list[str]:
    """Every file under `root`, event files by kind only (their names hold the host, pid and time)."""
    names = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            relative = path.relative_to(root).as_posix()
            names.append(
                relative.split("events.out.tfevents")[0] + "events" if "tfevents" in relative else relative
            )
    return names


def _events(log_dir: Path) -> dict[str, Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    (file,) = log_dir.glob("events.out.tfevents.*")
    reader = EventAccumulator(str(file))
    reader.Reload()
    return {
        "scalars": {
            tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
        },
        # Parsed: the hyperparameters are a protobuf map, whose serialised order is not part of its meaning.
        "hparams": {
            tag: HParamsPluginData.FromString(content)
            for tag, content in reader.PluginTagToContent("hparams").items()
        },
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    out = {}
    for kind in ("fabric", "torchloom"):
        root = tmp_path_factory.mktemp(kind)
        out[kind] = (root, run_ranks(logging_script, 2, kind, str(root), timeout=180))
    return out


@pytest.mark.timeout(400)
def test_same_files_as_fabric(runs):
    (fabric_root, fabric_ranks), (ours_root, our_ranks) = runs["fabric"], runs["torchloom"]
    assert (
        _tree(ours_root)
        == _tree(fabric_root)
        == [
            "exp/version_0/metrics.csv",
            "exp/version_1/metrics.csv",
            "tb/version_0/scalars/events",
        ]
    )
    for relative in ("exp/version_0/metrics.csv", "exp/version_1/metrics.csv"):
        assert (ours_root / relative).read_bytes() == (fabric_root / relative).read_bytes(), relative
    header = (ours_root / "exp/version_0/metrics.csv").read_text().splitlines()[0]
    assert header == "step,train-acc,train-loss,train-lr,train-seen"  # sorted, as Fabric writes it
    ours, theirs = _events(ours_root / "tb/version_0/scalars"), _events(fabric_root / "tb/version_0/scalars")
    assert ours["scalars"] == theirs["scalars"]
    assert ours["scalars"]["direct"] == [(1, 3.0)] and ours["scalars"]["hp_metric"] == [(0, -1.0)]
    assert ours["hparams"] == theirs["hparams"] and ours["hparams"]  # the same HPARAMS records
    # Rank 0 holds the writer; rank 1 a no-op object, as in Fabric. Both agree on where rank 0 wrote.
    assert [r["experiment_type"] for r in our_ranks] == ["SummaryWriter", "_NoOpExperiment"]
    assert [r["experiment_type"] for r in fabric_ranks] == ["SummaryWriter", "_DummyExperiment"]
    for ranks, root in ((our_ranks, ours_root), (fabric_ranks, fabric_root)):
        assert Path(ranks[0]["csv_log_dir"]) == root / "exp" / "version_0"
        assert Path(ranks[0]["tb_log_dir"]) == root / "tb" / "version_0" / "scalars"
        assert ranks[0]["again_version"] == 1


def test_hparams_yaml_reads_back_like_lightnings(tmp_path):
    """Fabric's CSVLogger refuses hyperparameters (NotImplementedError); torchloom's writes hparams.yaml as
    Lightning Trainer's CSVLogger does, without needing PyYAML. Both files load to the same dict."""
    yaml = pytest.importorskip("yaml")
    from lightning.fabric.loggers import CSVLogger as FabricCSVLogger
    from lightning.pytorch.loggers import CSVLogger as TrainerCSVLogger

    from torchloom.loggers import CSVLogger

    params = {
        "lr": 1e-05,
        "steps": 300,
        "name": "run: 1 # not a comment",
        "true": "yes",
        "flag": False,
        "none": None,
        "layers": [64, 32.5, "x"],
        "optimizer": {"name": "adam", "betas": [0.9, 0.999]},
        "eps": float("inf"),
    }
    with pytest.raises(NotImplementedError):
        FabricCSVLogger(tmp_path / "fabric").log_hyperparams(params)
    theirs = TrainerCSVLogger(tmp_path / "trainer", name="exp")
    theirs.log_hyperparams(params)
    ours = CSVLogger(tmp_path / "ours", name="exp")
    ours.log_hyperparams(params)
    loaded = yaml.safe_load(Path(ours.log_dir, "hparams.yaml").read_text())
    assert loaded == yaml.safe_load(Path(theirs.log_dir, "hparams.yaml").read_text()) == params
    ours.log_hyperparams({"lr": 0.5, "extra": 1})  # later calls merge into the same file
    assert yaml.safe_load(Path(ours.log_dir, "hparams.yaml").read_text()) == {**params, "lr": 0.5, "extra": 1}
