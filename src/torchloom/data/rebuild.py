"""Rebuilding a user's DataLoader to read through a `ResumableSampler`: the order Fabric's `setup_dataloaders`
gives (`with_distributed_sampler`), or the user's own `DistributedSampler` made resumable
(`with_users_distributed_sampler`), keeping the loader's class and settings."""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from torchloom.data.order import KEPT, SEEDED, WRAPPED, ResumableSampler, SeededPerSample
from torchloom.errors import MisuseError, MisuseTypeError
from torchloom.seed import SEED_WORKERS_ENV

# DataLoader.__init__ arguments that a rebuilt loader must keep.
_LOADER_ARGS = (
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
)


def _plain_order(sampler: Any) -> bool:
    """Whether `sampler` reads the dataset once in order or in one uniform shuffle, which DistributedSampler's
    order replaces as Fabric's does: a SequentialSampler, or a RandomSampler without replacement or num_samples
    (exact types). Fabric also replaces subclasses and a RandomSampler with replacement or num_samples, silently
    dropping what they draw; torchloom splits their own draw instead (a deliberate difference)."""
    if type(sampler) is SequentialSampler:
        return True
    return type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None


def with_distributed_sampler(
    loader: DataLoader, num_replicas: int, rank: int, seed: int = 0, distributed: bool = True
) -> DataLoader:
    """Rebuild `loader` to read through a `torchloom.data.ResumableSampler` that gives the order Fabric's
    `setup_dataloaders` gives and can start an epoch part-way (see `torchloom.data`).

    `distributed` (Fabric's parallel strategies, even on one process): a `RandomSampler` or `SequentialSampler`
    becomes DistributedSampler's order for `seed` (shuffled for a RandomSampler), any other sampler is drawn
    whole at the start of each pass and split across ranks (DistributedSamplerWrapper's). Otherwise (one device)
    the user's sampler is iterated as it is."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return loader  # an iterable dataset shards itself
    if isinstance(ordering_sampler(loader), DistributedSampler):
        # The user's own split (a subclass too): kept, never split again.
        return with_users_distributed_sampler(loader)
    custom_batches = (
        loader.batch_sampler is not None and type(loader.batch_sampler) is not torch.utils.data.BatchSampler
    )
    if (custom_batches or not hasattr(loader.sampler, "__len__")) and num_replicas == 1:
        return loader  # one process reads everything: nothing to split (but no mid-epoch resume either)
    if custom_batches:
        # A TypeError too, as Fabric raises for a custom batch sampler it cannot re-instantiate.
        raise MisuseTypeError(
            f"The dataloader uses a custom batch_sampler ({type(loader.batch_sampler).__name__}), which torchloom "
            "cannot split across ranks. Shard it yourself and pass use_distributed_sampler=False."
        )
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    user_sampler = loader.sampler
    if loader.batch_size is None and loader.batch_sampler is not None:
        # batch_sampler=BatchSampler(sampler, ...) given explicitly: loader.sampler is a placeholder the
        # DataLoader made (SequentialSampler) and loader.batch_size None; the order and the batching are the
        # BatchSampler's.
        batches: Any = loader.batch_sampler
        user_sampler = batches.sampler
        kwargs["batch_size"] = batches.batch_size
        kwargs["drop_last"] = bool(batches.drop_last)
    if not hasattr(user_sampler, "__len__"):
        # A TypeError too: Fabric's DistributedSamplerWrapper fails on len() of such a sampler with one.
        raise MisuseTypeError(
            f"The dataloader's custom sampler ({type(user_sampler).__name__}) has no len(), so torchloom "
            "cannot split its draw across ranks. Give it __len__, or make it rank-aware and pass "
            "use_distributed_sampler=False."
        )
    if not distributed:
        rule = KEPT
    elif _plain_order(user_sampler):
        rule = SEEDED
    else:
        rule = WRAPPED
    # drop_last stays the loader's (its last, short batch); Fabric's sampler pads, never drops.
    sampler = ResumableSampler(
        loader.dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=isinstance(user_sampler, RandomSampler),
        seed=seed,
        sampler=user_sampler,
        rule=rule,
    )
    try:
        return _rebuild_reading(loader, sampler, kwargs)
    except MisuseError:
        if num_replicas > 1:
            raise
        # One process reads everything: Fabric hands such a loader back untouched, and so does torchloom (it then
        # has no mid-epoch resume, as for a custom batch_sampler; its state_dict says so inside an epoch).
        return loader


def ordering_sampler(loader: DataLoader) -> Any:
    """The sampler that orders the loader's samples: its sampler, or that of a `BatchSampler` given as
    batch_sampler (the loader's own `sampler` is then a placeholder)."""
    if loader.batch_size is None and type(loader.batch_sampler) is torch.utils.data.BatchSampler:
        return loader.batch_sampler.sampler
    return loader.sampler


def users_distributed_sampler(loader: DataLoader) -> DistributedSampler | None:
    """The user's own torch `DistributedSampler` the loader reads through (as its sampler, or inside a
    `BatchSampler` given as batch_sampler), if any. Only torch's class itself: a subclass may order otherwise."""
    sampler = ordering_sampler(loader)
    return sampler if type(sampler) is DistributedSampler else None


def with_users_distributed_sampler(loader: DataLoader) -> DataLoader:
    """`loader`, rebuilt to read its user's `DistributedSampler` through a `ResumableSampler` of the same
    replicas, rank, seed, shuffle and drop_last: the same samples on this rank, in the same order, every epoch
    (its order is a function of those and the epoch), and a position inside an epoch that a checkpoint can
    resume, at the same world size or another (the global order is the same at every world size). Done with or
    without `use_distributed_sampler`: the sampler is kept as it is, only made resumable. A loader that cannot
    be rebuilt (or a subclass of DistributedSampler) is returned as it is: it saves between epochs only."""
    user = users_distributed_sampler(loader)
    if user is None:
        return loader
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    batches: Any = loader.batch_sampler
    if loader.batch_size is None and batches is not None:
        kwargs["batch_size"] = batches.batch_size
        kwargs["drop_last"] = bool(batches.drop_last)
    sampler = ResumableSampler(
        user.dataset,
        num_replicas=user.num_replicas,
        rank=user.rank,
        shuffle=user.shuffle,
        seed=user.seed,
        drop_last=user.drop_last,
        sampler=user,  # its set_epoch is still called, as Fabric's loader calls it
        rule=SEEDED,
    )
    try:
        return _rebuild_reading(loader, sampler, kwargs)
    except MisuseError:
        return loader  # its own DistributedSampler still splits the data; state_dict refuses inside an epoch


def _rebuild_reading(loader: DataLoader, sampler: ResumableSampler, kwargs: dict[str, Any]) -> DataLoader:
    """`loader` rebuilt to read through `sampler`, with its worker settings made consistent."""
    dataset = loader.dataset
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    elif os.environ.get(SEED_WORKERS_ENV) != "0":
        # Workers' random streams would depend on which batches each happened to load: seed every sample.
        dataset, sampler.keyed = SeededPerSample(dataset), True
    return _rebuild(loader, dataset, sampler, kwargs)


def _rebuild(
    loader: DataLoader, dataset: Any, sampler: DistributedSampler, kwargs: dict[str, Any]
) -> DataLoader:
    """A loader of the user's class reading `dataset` through `sampler`. A DataLoader subclass (one whose
    `__iter__` transforms batches, say) is rebuilt as itself: each argument of its `__init__` is the one torchloom
    sets, else the loader's attribute of the same name, else its default. One that cannot be rebuilt so is
    refused: a plain DataLoader in its place would silently drop what the subclass does."""
    cls = type(loader)
    if cls is DataLoader:
        return DataLoader(dataset, sampler=sampler, **kwargs)
    ours = {"dataset": dataset, "sampler": sampler, **kwargs}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    args: dict[str, Any] = {}
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name in ours:
            args[param.name] = ours[param.name]
        elif hasattr(loader, param.name):
            args[param.name] = getattr(loader, param.name)
        elif param.default is param.empty:
            raise MisuseError(
                f"setup_dataloaders must rebuild your {cls.__name__} with a sampler that splits the data across "
                f"ranks, but its __init__ argument {param.name!r} is not an attribute of the loader, so its value "
                f"is unknown. Store it as `self.{param.name}` in __init__, or shard the data yourself and pass "
                "use_distributed_sampler=False."
            )
    if takes_any:
        args.update({k: v for k, v in ours.items() if k not in named})
    missing = [k for k in ("dataset", "sampler") if k not in args]
    if missing:
        raise MisuseError(
            f"setup_dataloaders must rebuild your {cls.__name__} with a sampler that splits the data across ranks, "
            f"but its __init__ takes no {' or '.join(repr(k) for k in missing)} argument to pass it through. "
            "Accept and pass on the DataLoader's arguments (e.g. **kwargs), or shard the data yourself and pass "
            "use_distributed_sampler=False."
        )
    try:
        rebuilt = cls(**args)
    except TypeError as error:
        raise MisuseTypeError(
            f"setup_dataloaders must rebuild your {cls.__name__} with a sampler that splits the data across ranks, "
            f"but {cls.__name__}(...) with the loader's own arguments ({', '.join(sorted(args))}) failed: {error}. "
            "Make its __init__ take the DataLoader's arguments under their names and pass them on (no fixed "
            "dataset or batch_size inside it), or shard the data yourself and pass use_distributed_sampler=False."
        ) from error
    if rebuilt.sampler is not sampler:
        raise MisuseError(
            f"setup_dataloaders rebuilt your {cls.__name__} with a sampler that splits the data across ranks, but "
            "its __init__ did not use it. Pass `sampler` on to DataLoader.__init__, or shard the data yourself and "
            "pass use_distributed_sampler=False."
        )
    return rebuilt
