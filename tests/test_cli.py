"""The command line: where `torchloom run`'s own options may stand (Fabric's rule), and `torchloom consolidate`
spelled Fabric's way on a real sharded checkpoint."""

from __future__ import annotations

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


# ---- `torchloom consolidate`: Fabric's spelling beside torchloom's positional OUT_FILE ----------------------------
def _save_sharded(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    loom = Loom(accelerator="cpu", devices=world_size, strategy="fsdp2")
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    loom.save(path, {"model": model, "step": 7})
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
