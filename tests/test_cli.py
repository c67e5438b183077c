"""`torchloom run`'s command line: where its own options may stand (Fabric's rule)."""

from __future__ import annotations

import pytest

from torchloom.cli import _parser, split_run_args


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
