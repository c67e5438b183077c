"""Fault tolerance through torchft (`torchloom.fault_tolerance`): the launch's options and its refusals. The
jobs themselves (a healthy one and every fault, each judged by its replay) are in test_faults.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="the `ft` extra (torchft) is not installed")


def test_without_torchft_replica_groups_name_the_extra(tmp_path: Path) -> None:
    """`--replica-groups` without torchft installed: a clear error naming `pip install torchloom[ft]`."""
    blocker = tmp_path / "torchft.py"
    blocker.write_text("raise ImportError('torchft is not installed here')\n")
    (tmp_path / "train.py").write_text("print('never runs')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{Path(__file__).parents[2] / 'src'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "torchloom", "run", "--replica-groups", "2", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    assert "pip install torchloom[ft]" in done.stderr
    assert "never runs" not in done.stdout


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--replica-groups", "2", "--replica-group", "0"], "--replica-group needs --lighthouse"),
        (["--replica-groups", "2", "--lighthouse", "127.0.0.1:1"], "--lighthouse needs --replica-group"),
        (["--replica-groups", "2", "--lighthouse", "h:1", "--replica-group", "2"], "must be in 0..1"),
        (["--replica-groups", "2", "--strategy", "fsdp"], "use strategy='fsdp2'"),
        (["--replica-groups", "0"], "--replica-groups 0 is not valid"),
        (["--replica-groups", "2", "--ft-timeout", "0.2"], "--ft-timeout 0.2 is too short"),
        (["--replica-groups", "2", "--ft-quorum-timeout", "nan"], "--ft-quorum-timeout nan is too short"),
        (["--ft-timeout", "5"], "--ft-timeout applies to replica groups only"),
    ],
)
def test_replica_group_options_are_checked_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], words: str
) -> None:
    from torchloom.cli import main

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never runs')\n")
    assert main(["run", *options, str(script)]) == 2
    assert words in capsys.readouterr().err


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_an_iterable_dataset_in_a_replica_group_is_refused_by_name() -> None:
    """An IterableDataset splits itself by the rank it sees, the group's own inside a replica group: every group
    would read the same samples. Refused at `setup_dataloaders`, naming a map-style dataset as the fix. (The
    strategy stands in for a rank of a replica group: only what setup_dataloaders reads of it.)"""
    from types import SimpleNamespace

    from torchloom._loader_setup import setup_dataloaders
    from torchloom.errors import MisuseError

    rank = SimpleNamespace(
        distributed_sampler_kwargs={"num_replicas": 2, "rank": 0},
        world_size=1,
        all_gather_object=lambda obj: [obj],
        replicas=object(),
    )
    with pytest.raises(MisuseError, match="reads an IterableDataset.*Use a map-style Dataset"):
        setup_dataloaders(rank, [torch.utils.data.DataLoader(_Stream(), batch_size=2)], True, None)  # type: ignore[arg-type]


def test_a_distributed_sampler_over_one_groups_ranks_is_refused_by_name() -> None:
    """The user's own DistributedSampler split over the ranks of one group (`num_replicas=loom.world_size`): every
    group would read the same samples, silently. Refused at `setup_dataloaders`, naming the job's split (its
    readers are every group's); a sampler over the job's readers is kept. (The strategy stands in for rank 0 of
    group 1 of 2 groups of one process.)"""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from torchloom._loader_setup import setup_dataloaders
    from torchloom.errors import MisuseError

    rank = SimpleNamespace(
        distributed_sampler_kwargs={"num_replicas": 2, "rank": 1},
        world_size=1,
        global_rank=0,
        all_gather_object=lambda obj: [obj],
        cluster_environment=None,
        replicas=SimpleNamespace(add_loader=lambda loader: None),
    )
    data = TensorDataset(torch.arange(8))
    group_only = DistributedSampler(data, num_replicas=1, rank=0)
    with pytest.raises(MisuseError, match="each group reads its own shard.*num_replicas=2, rank=1"):
        setup_dataloaders(rank, [DataLoader(data, sampler=group_only)], True, None)  # type: ignore[arg-type]
    job = DistributedSampler(data, num_replicas=2, rank=1)
    (loader,) = setup_dataloaders(rank, [DataLoader(data, sampler=job)], True, None)  # type: ignore[arg-type]
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 1)
