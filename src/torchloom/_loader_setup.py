"""`setup_dataloaders`: each user DataLoader rebuilt to read its rank's part of the data in a resumable order
(the order's rules are `torchloom.data`'s), its workers seeded, and wrapped in a `LoomDataLoader`."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch.utils.data import DataLoader, DistributedSampler

from torchloom.data import (
    LoomDataLoader,
    gather_per_replica,
    ordering_sampler,
    with_distributed_sampler,
    with_users_distributed_sampler,
)
from torchloom.environments import TorchElasticEnvironment
from torchloom.errors import MisuseError, MisuseTypeError, MisuseValueError
from torchloom.seed import add_worker_seeding, sampler_seed
from torchloom.strategies.base import Strategy
from torchloom.strategies.parallel import ParallelStrategy


def setup_dataloaders(
    strategy: Strategy,
    dataloaders: Iterable[DataLoader],
    use_distributed_sampler: bool,
    device: torch.device | None,
) -> list[LoomDataLoader]:
    """Each loader set up for this rank (`device`: where batches go, None to leave them)."""
    out = []
    # Ranks that compute on one batch together (tensor parallel) read the same samples, with the same worker
    # seeds: the data is split over the data-parallel ranks only.
    split = strategy.distributed_sampler_kwargs
    replicas, rank = split["num_replicas"], split["rank"]
    world_size = strategy.world_size
    gather = strategy.all_gather_object
    if replicas != world_size:  # an iterable dataset's position: one per replica
        gather = functools.partial(gather_per_replica, gather, rank, replicas)
    for loader in dataloaders:
        if isinstance(loader, LoomDataLoader):
            raise MisuseValueError(
                "setup_dataloaders was given a loader it returned before; pass the DataLoader only once "
                "(Fabric raises the same ValueError)."
            )
        if not isinstance(loader, DataLoader):
            raise MisuseTypeError(
                f"setup_dataloaders expects torch DataLoaders, got {type(loader).__name__}."
            )
        if strategy.replicas is not None and isinstance(loader.dataset, torch.utils.data.IterableDataset):
            raise MisuseError(
                f"Under replica groups (torchloom run --replica-groups) this DataLoader reads an IterableDataset "
                f"({type(loader.dataset).__name__}). It splits itself by the rank it sees, which inside a replica "
                "group is the group's own, so every group would read the same samples, and a group that heals "
                "could not take its peer's position. Use a map-style Dataset (torchloom gives each group its own "
                "shard and heals its position), or run without --replica-groups."
            )
        if use_distributed_sampler:
            # In one process too (keeping the user's sampler's order there): a resumable sampler is what lets
            # a checkpoint resume inside an epoch, also on another number of ranks (see torchloom.data).
            loader = with_distributed_sampler(
                loader, replicas, rank, seed=sampler_seed(), distributed=distributed_order(strategy)
            )
        else:
            # The user's own DistributedSampler, kept (same order), made resumable inside an epoch.
            loader = with_users_distributed_sampler(loader)
        add_worker_seeding(loader, rank)
        # A DistributedSampler of the user's splits the data over its own replicas (a global position counts
        # its batches over those).
        own = ordering_sampler(loader)
        own = own if isinstance(own, DistributedSampler) else None
        if own is not None and replicas != world_size and (own.num_replicas, own.rank) != (replicas, rank):
            # Tensor-parallel ranks compute on one batch together: different samples on them is silently wrong.
            # Replica groups each read their own shard: a split over one group's ranks reads the same in each.
            why = (
                "under replica groups (torchloom run --replica-groups) each group reads its own shard: split "
                "over one group's ranks, every group would read the same samples"
                if strategy.replicas is not None
                else f"under {type(strategy).__name__} the ranks of one tensor-parallel group must read the "
                "same samples"
            )
            raise MisuseError(
                f"The dataloader's {type(own).__name__} splits the data over {own.num_replicas} replicas (this "
                f"rank reads part {own.rank}), but {why}: the data is split over the {replicas} "
                f"data-parallel replicas (this rank is replica {rank}). Build it as "
                f"DistributedSampler(dataset, num_replicas={replicas}, rank={rank}) "
                "(**loom.strategy.distributed_sampler_kwargs), or give the DataLoader an undistributed sampler "
                "and let setup_dataloaders split it."
            )
        # In a replica group (torchloom.fault_tolerance) each batch starts the fault-tolerant step.
        loader_class = LoomDataLoader if strategy.replicas is None else _replica_loader_class()
        out.append(
            loader_class(
                loader,
                device,
                replicas if own is None else own.num_replicas,
                rank=rank if own is None else own.rank,
                all_gather_object=gather,
                global_rank=strategy.global_rank,
                ranks=world_size,
            )
        )
    for set_up in out:
        if strategy.replicas is not None:
            strategy.replicas.add_loader(set_up)
    return out


def _replica_loader_class() -> type[LoomDataLoader]:
    from torchloom.fault_tolerance.replica import ReplicaLoader

    return ReplicaLoader


def distributed_order(strategy: Strategy) -> bool:
    """Whether set-up loaders read DistributedSampler's order (Fabric's rule for its parallel strategies)
    rather than the loader's own sampler (its one-device rule). Also a lone process started by torchrun or
    `torchloom run`: its job may restart at another world size (elastic), and DistributedSampler's order is
    the one a restart can continue exactly in every epoch (Fabric keeps the loader's sampler there)."""
    return isinstance(strategy, ParallelStrategy) or isinstance(
        strategy.cluster_environment, TorchElasticEnvironment
    )
