"""The command line: where `torchloom run`'s own options may stand (Fabric's rule), and `torchloom consolidate`
spelled Fabric's way on a real sharded checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.cli import _parser, consolidated_path, main, split_run_args


@pytest.mark.parametrize(
    ("argv", "ours", "theirs"),
    [
        # Options before the script: unchanged.
        (["--devices", "2", "train.py", "--lr", "3"], ["--devices", "2", "train.py"], ["--lr", "3"]),
        # After the script, as Fabric's READMEs write them.
        (
            ["train.py", "--devices", "2", "--accelerator", "cpu"],
            ["--devices", "2", "--accelerator", "cpu", "train.py"],
            [],
        ),
        # Mixed with the script's own arguments, `=` spellings and Fabric's underscore spellings.
        (
            ["train.py", "--lr", "3", "--devices=2", "x", "--num_nodes", "1", "--main_port", "5"],
            ["--devices=2", "--num_nodes", "1", "--main_port", "5", "train.py"],
            ["--lr", "3", "x"],
        ),
        # Everything after `--` is the script's, even torchloom's option names.
        (
            ["train.py", "--devices", "2", "--", "--devices", "9"],
            ["--devices", "2", "train.py"],
            ["--devices", "9"],
        ),
    ],
)
def test_split_run_args(argv, ours, theirs):
    assert split_run_args(argv) == (ours, theirs)


def test_options_after_the_script_reach_the_launcher():
    ours, theirs = split_run_args(["train.py", "--lr", "3", "--devices", "2", "--num_nodes", "1"])
    args = _parser().parse_args(["run", *ours])
    assert (args.script, args.devices, args.num_nodes) == ("train.py", "2", 1)
    assert theirs == ["--lr", "3"]


# Plain entries beside the model: the small ones `torchloom inspect` shows, the large ones it only names.
PLAIN_ENTRIES = {
    "epoch": 3,
    "tag": "run-a",
    "lrs": (0.1, 0.01),
    "best": torch.tensor(0.25),
    "done": False,
    "history": list(range(100)),
    "notes": "x" * 200,
    "buffer": torch.zeros(1000),
}
SHOWN = [
    "  step = 7",
    "  epoch = 3",
    "  tag = 'run-a'",
    "  lrs = (0.1, 0.01)",
    "  best = 0.25",
    "  done = False",
]
ONLY_NAMED = ["  history", "  notes", "  buffer"]


def _check_inspection(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("other entries:")
    shown = lines[start + 1 :]
    for line in SHOWN + ONLY_NAMED:
        assert line in shown, (line, lines)
    assert main(["inspect", "--json", str(path)]) == 0
    values = json.loads(capsys.readouterr().out)["values"]
    assert values == {"step": 7, "epoch": 3, "tag": "run-a", "lrs": [0.1, 0.01], "best": 0.25, "done": False}


def test_inspect_shows_small_values_of_a_sharded_checkpoint(sharded, capsys, monkeypatch):
    # Large entries are named only; torch.load maps extra.pt rather than reading its tensors.
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    _check_inspection(sharded[0], capsys)
    assert loads and all(k.get("mmap") and k.get("weights_only") for k in loads), loads


def test_inspect_shows_small_values_of_a_full_checkpoint(tmp_path, capsys):
    loom = Loom(accelerator="cpu", devices=1)
    model = loom.setup_module(nn.Linear(4, 2))
    loom.save(tmp_path / "full.pt", {"model": model, "step": 7, **PLAIN_ENTRIES})
    _check_inspection(tmp_path / "full.pt", capsys)


# ---- `torchloom consolidate`: Fabric's spelling beside torchloom's positional OUT_FILE ----------------------------
def _save_sharded(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    loom = Loom(accelerator="cpu", devices=world_size, strategy="fsdp2")
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    loom.save(path, {"model": model, "step": 7, **PLAIN_ENTRIES})
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A real sharded checkpoint written by 2 ranks, and the full weights it holds."""
    path = tmp_path_factory.mktemp("consolidate") / "checkpoint"
    weights, _ = run_ranks(_save_sharded, 2, str(path), timeout=150)
    assert path.is_dir()
    return path, weights


def _weights_equal(file: Path, expected: dict[str, torch.Tensor]) -> None:
    checkpoint = torch.load(file, weights_only=True)
    assert checkpoint["step"] == 7
    assert checkpoint["model"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(checkpoint["model"][key], value), key


@pytest.mark.timeout(240)
def test_consolidate_spellings(sharded, tmp_path, capsys):
    path, expected = sharded
    # Fabric's default: CHECKPOINT.consolidated beside the checkpoint.
    assert main(["consolidate", str(path)]) == 0
    default = path.with_name(path.name + ".consolidated")
    _weights_equal(default, expected)
    # ... which is never overwritten: a second run without a name refuses, naming the way out.
    before = default.stat().st_mtime_ns
    assert main(["consolidate", str(path)]) == 2
    assert "exists already" in capsys.readouterr().err and default.stat().st_mtime_ns == before
    default.unlink()
    # Fabric's --output_file, its dashed twin, and torchloom's positional OUT_FILE.
    for argv in (
        ["--output_file", "a.pt"],
        ["--output-file", "b.pt"],
        ["c.pt"],
        ["d.pt", "--output_file", "d.pt"],
    ):
        out = tmp_path / argv[-1]
        argv = [str(tmp_path / a) if a.endswith(".pt") else a for a in argv]
        assert main(["consolidate", str(path), *argv]) == 0
        _weights_equal(out, expected)
    assert not default.exists()
    # Two different outputs are a contradiction, not a choice.
    assert (
        main(["consolidate", str(path), str(tmp_path / "e.pt"), "--output_file", str(tmp_path / "f.pt")]) == 2
    )
    assert "two output files" in capsys.readouterr().err
    assert not (tmp_path / "e.pt").exists() and not (tmp_path / "f.pt").exists()


def test_consolidate_default_name_matches_fabric(tmp_path):
    fabric_cli = pytest.importorskip("lightning.fabric.utilities.consolidate_checkpoint")
    from argparse import Namespace

    folder = tmp_path / "epoch=3.ckpt"
    folder.mkdir()
    (
        folder / fabric_cli._METADATA_FILENAME
    ).touch()  # Fabric checks that the folder looks like its checkpoint
    theirs = fabric_cli._process_cli_args(Namespace(checkpoint_folder=str(folder), output_file=None))
    assert consolidated_path(str(folder), None, None) == Path(theirs.output_file)


# ---- `torchloom consolidate` replaces only a checkpoint, never the run's folder or its own source -----------------
def _tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def test_consolidate_never_replaces_a_folder_or_its_source(sharded, tmp_path, capsys):
    path, expected = sharded
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(path, run / "step-100")
    (run / "notes.txt").write_text("keep me")
    before = _tree(run)
    for extra in ([], ["--model-only", "--format", "safetensors"]):
        # The run's folder, which holds the checkpoint: once replaced by the consolidated file.
        assert main(["consolidate", str(run / "step-100"), str(run), *extra]) == 2
        err = capsys.readouterr().err
        assert "not a checkpoint" in err and "notes.txt" in err, err
        # The checkpoint itself, or a file inside it.
        for out in (run / "step-100", run / "step-100" / "model.pt"):
            assert main(["consolidate", str(run / "step-100"), str(out), *extra]) == 2
            assert "is the checkpoint being consolidated" in capsys.readouterr().err
    assert (
        main(["consolidate", str(run / "step-100"), str(run / "step-100"), "--model-only", "--format", "hf"])
        == 2
    )
    assert _tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # Into a folder of the user's, --format hf adds the weights and keeps the rest (the hf layout is a folder
    # that holds other files: a tokenizer, a README).
    published = tmp_path / "published"
    (published / "tokenizer").mkdir(parents=True)
    (published / "tokenizer" / "vocab.json").write_text("{}")
    assert main(["consolidate", str(path), str(published), "--model-only", "--format", "hf"]) == 0
    assert (published / "tokenizer" / "vocab.json").read_text() == "{}"
    assert (published / "model.safetensors").is_file()


def test_consolidate_safetensors_flushes_the_file_and_leaves_no_temporary(sharded, tmp_path, monkeypatch):
    st = pytest.importorskip("safetensors.torch")
    path, expected = sharded
    out = tmp_path / "model.safetensors"
    argv = ["consolidate", str(path), str(out), "--model-only", "--format", "safetensors"]

    # A writer failing half-way: no output, and no temporary file left beside it.
    real = st.save_file

    def failing(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        main(argv)
    assert list(tmp_path.iterdir()) == []

    # The file is flushed to disk before it is renamed into place.
    monkeypatch.setattr(st, "save_file", real)
    flushed: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    assert main(argv) == 0
    temporaries = [Path(p) for p in flushed if Path(p).name.startswith(".model.safetensors.tmp-")]
    assert temporaries and all(p.parent == tmp_path for p in temporaries), flushed
    assert st.load_file(out).keys() == expected.keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
