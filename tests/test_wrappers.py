"""`torchloom.wrappers`: pieces that need no process group."""

from __future__ import annotations

import torch
from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

from torchloom.wrappers import ShardedSampler


def _parts(sampler, world_size: int = 3, epoch: int = 0, drop_last: bool = False) -> list[list[int]]:
    parts = []
    for rank in range(world_size):
        torch.manual_seed(100 + rank)  # unrelated global state per rank
        shard = ShardedSampler(sampler, num_replicas=world_size, rank=rank, seed=7, drop_last=drop_last)
        shard.set_epoch(epoch)
        parts.append([int(i) for i in shard])
    return parts


def test_sharded_sampler_partitions_one_draw():
    sampler = SubsetRandomSampler(list(range(10, 22)))
    parts = _parts(sampler)
    assert sorted(sum(parts, [])) == list(range(10, 22))
    assert all(len(p) == 4 for p in parts)
    assert _parts(sampler) == parts  # reproducible
    assert _parts(sampler, epoch=1) != parts  # reshuffled per epoch


def test_sharded_sampler_pads_or_drops_like_distributed_sampler():
    sampler = WeightedRandomSampler([1.0] * 5, num_samples=7, replacement=True)
    assert [len(p) for p in _parts(sampler)] == [3, 3, 3]
    assert [len(p) for p in _parts(sampler, drop_last=True)] == [2, 2, 2]


def test_sampler_with_its_own_generator_is_left_to_it():
    parts = [
        list(
            ShardedSampler(SubsetRandomSampler(range(6), generator=torch.Generator().manual_seed(1)), 2, rank)
        )
        for rank in range(2)
    ]
    assert sorted(parts[0] + parts[1]) == list(range(6))
