"""Data loading that can resume exactly, at any world size.

An epoch has one *global order* of samples, the same at every world size: a permutation drawn from
`seed + epoch` (or the dataset's own order, or one draw of a custom sampler). Each rank reads every
`world_size`-th sample of it, as `DistributedSampler` does, so global batch b of an epoch is
`order[b * G:(b + 1) * G]` for the global batch size G = world size x per-rank batch size. The loader counts the
global samples handed out in the epoch; that count, the epoch and the seed are its state (with, for a custom
sampler that has a generator of its own, that generator's state at the start of the epoch). Resuming from
them continues the same global order from the first sample not yet handed out, on any number of ranks: with the
same global batch size the resumed run sees exactly the global batches the uninterrupted run would have seen;
with another, it still sees each remaining sample of the epoch once.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from torchloom._text import count
from torchloom.errors import CheckpointError, MisuseError
from torchloom.seed import seed_generators_from

log = logging.getLogger("torchloom")


def loader_seed(seed: int, number: int) -> int:
    """The sampler seed of the `number`-th loader a Loom sets up (counting from 0), from the global `seed`.

    The first keeps `seed` itself (the order `DistributedSampler(seed=seed)` gives). Later ones get a seed hashed
    from both: a loader built again every epoch would otherwise repeat its first epoch's order forever, and
    `seed + number` would make loader n's epoch e the order of loader n + 1's epoch e - 1."""
    if number == 0:
        return seed
    digest = hashlib.blake2b(f"torchloom-loader/{seed}/{number}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def move_to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor in a nested structure (dicts, lists, tuples) to `device`."""
    non_blocking = device.type == "cuda"
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, data
    )


def gather_per_replica(
    gather: Callable[[Any], list[Any]], replica: int, replicas: int, obj: Any
) -> list[Any]:
    """Every data-parallel replica's `obj`, in replica order, through `gather` over all ranks. The ranks of one
    replica (a tensor-parallel group) read the same data, so any one of them stands for it."""
    out: list[Any] = [None] * replicas
    for r, value in gather((replica, obj)):
        out[r] = value
    return out


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` (same order, padding and dropping, same `set_epoch`) that can start an epoch after
    the first `start` samples of its global order, and that works in one process too."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, **kwargs: Any) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, **kwargs)
        #: Global samples of the current epoch's order already consumed (set by a resume, for one epoch).
        self.start = 0
        #: Hand out `SampleKey`s instead of indices (for a `SeededPerSample` dataset).
        self.keyed = False

    def _keys(self, positions: list[int], items: list[Any]) -> Iterator[Any]:
        if not self.keyed:
            return iter(items)
        return (
            SampleKey(item, self.seed, self.epoch, pos) for pos, item in zip(positions, items, strict=True)
        )

    def global_order(self) -> list[int]:
        """This epoch's order of the whole dataset, the same on every rank and at every world size."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _remaining(self) -> list[int]:
        """Positions in this epoch's global order still to read, padded or trimmed to a multiple of the world
        size as DistributedSampler does. Padding repeats the epoch's first samples (cycling over the epoch), as
        DistributedSampler's does: a resumed epoch then ends as the uninterrupted one does at this world size,
        not on repeats of the first samples left at the resume."""
        n = len(self.dataset)  # type: ignore[arg-type]
        positions = list(range(self.start, n))
        ws = self.num_replicas
        if self.drop_last:
            return positions[: len(positions) // ws * ws]
        if positions:
            positions += [p % n for p in range(-len(positions) % ws)]
        return positions

    def _my_positions(self) -> list[int]:
        return self._remaining()[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[Any]:
        order = self.global_order()
        mine = self._my_positions()
        return self._keys(mine, [order[p] for p in mine])

    def __len__(self) -> int:
        remaining = len(self.dataset) - self.start  # type: ignore[arg-type]
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def remaining_global(self) -> int:
        """Real (unpadded) samples of this epoch's order not yet consumed, before this epoch started."""
        return max(len(self.dataset) - self.start, 0)  # type: ignore[arg-type]


class SampleKey(NamedTuple):
    """What a keyed sampler hands the dataset: the sample's index, and where it stands in the epoch's global
    order (which, with the seed and the epoch, decides its random numbers)."""

    index: Any
    seed: int
    epoch: int
    position: int


class SeededPerSample(Dataset):
    """The user's dataset, with every sample read under random generators seeded from (seed, epoch, position of
    the sample in the epoch's global order).

    Used when DataLoader workers load the data: a worker's random stream otherwise depends on which batches it
    happened to get, which changes with the number of workers, the world size, and a resume in the middle of an
    epoch. Seeded per sample, a random augmentation of sample i in epoch e is the same in all of those cases.
    Attributes of the user's dataset are read through this wrapper."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, SampleKey):
            return self.dataset[key]
        seed_generators_from(f"{key.seed}/{key.epoch}/{key.position}")
        return self.dataset[key.index]

    def __getattr__(self, name: str) -> Any:
        # Dunder look-ups (DataLoader's fetcher asks for __getitems__) must not reach the user's dataset: its
        # batched fetch would get SampleKeys.
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def order_generator(sampler: Any, batch_sampler: Any = None) -> torch.Generator | None:
    """The generator of the user's own that a pass's order is drawn from, if any: a custom sampler split by
    torchloom (`ShardedSampler`) draws with its inner sampler's `generator`, a sampler torchloom did not replace
    with its own with its `generator`, and a batch sampler the loader uses as it is (a custom one, or a
    `BatchSampler` given explicitly) with its own `generator` or its sampler's. None where the order comes from
    `seed + epoch` or from torch's global generator (restored with the other random generators)."""
    sources = [batch_sampler, getattr(batch_sampler, "sampler", None)] if batch_sampler is not None else []
    for source in (*sources, sampler):
        if isinstance(source, DistributedSampler):
            source = getattr(source, "sampler", None)  # a ShardedSampler's custom sampler; else seed + epoch
        generator = getattr(source, "generator", None)
        if generator is not None and generator is not torch.default_generator:
            return generator
    return None


class LoomDataLoader:
    """Iterates the user's loader on this rank: each pass is a new epoch (a shuffling sampler reshuffles,
    identically on every rank), and batches are moved to the device.

    `state_dict()` / `load_state_dict()` record and restore the position in the global order (see the module
    docstring), so `loom.save(path, {..., "loader": loader})` and `loom.load` resume mid-epoch, at any world size.
    A batch counts as consumed once the loader has handed it out.

    A pass starts at `iter(loader)` and is over when it reaches its end or is left: `break` out of the loop, an
    exception out of it, or the iterator closed or garbage collected. The next pass reads the next epoch, so a
    checkpoint saved after leaving a pass early resumes at the next epoch, as this process would continue; one
    saved while a pass is still live resumes inside its epoch."""

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device | None,
        world_size: int = 1,
        rank: int = 0,
        all_gather_object: Callable[[Any], list[Any]] | None = None,
    ) -> None:
        self._loader = loader
        self._device = device
        self._world_size = world_size
        self._rank = rank
        self._all_gather_object = all_gather_object
        self._epoch = 0  # the epoch the next pass will read
        self._current: int | None = None  # the epoch the live pass is reading
        self._consumed = 0  # global samples handed out in the current epoch
        self._resume: tuple[int, int] | None = None
        self._pass = 0  # number of the newest pass: only it moves the position
        self._interleaved = False  # an older pass handed out batches while the newest was live
        # The state of the sampler's own generator when the live pass began (see order_generator).
        self._pass_generator: torch.Tensor | None = None
        self._left: tuple[int, int] | None = None  # (epoch, consumed) of a pass left early, for the log
        self._warned_left = False

    @property
    def loader(self) -> DataLoader:
        return self._loader

    @property
    def sampler(self) -> Any:
        return self._loader.sampler

    def __len__(self) -> int:
        if self._resume is not None and isinstance(self.sampler, ResumableSampler):
            self._prepare_sampler(*self._resume)
        return len(self._loader)

    def _prepare_sampler(self, epoch: int, start: int) -> None:
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
            if getattr(self._loader, "_torchloom_generator", False):
                self._loader.generator.manual_seed(sampler.seed + epoch)
        if isinstance(sampler, ResumableSampler):
            sampler.start = start

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._resume if self._resume is not None else (self._epoch, 0)
        if start == 0 and getattr(self._loader, "_torchloom_generator", False):
            # The user's loader, without a generator of its own, would draw its workers' base seed from the
            # global generator at the start of each pass (plain PyTorch and Fabric do). Ours reads its own
            # generator, so draw that number here and discard it: dropout and every other random call in the
            # loop then see the same stream as under Fabric. A pass resumed mid-epoch does not draw: the
            # interrupted run drew before its checkpoint captured the generator's state.
            torch.empty((), dtype=torch.int64).random_()
        self._prepare_sampler(epoch, start)
        generator = order_generator(self.sampler, self._loader.batch_sampler)
        # The sampler draws this pass's order from its own generator: a checkpoint taken during the pass keeps the
        # state it drew from, so that the resumed pass draws the same order.
        drawn_from = generator.get_state() if isinstance(generator, torch.Generator) else None
        batches = iter(self._loader)  # before the position moves: a loader that fails to start keeps it
        self._resume, self._pass_generator = None, drawn_from
        self._pass += 1
        self._epoch, self._current, self._consumed = epoch + 1, epoch, start
        self._interleaved, self._left = False, None
        total = (
            self.sampler.remaining_global() + start if isinstance(self.sampler, ResumableSampler) else None
        )
        per_batch = (self._loader.batch_size or 1) * self._world_size
        return _Pass(self, self._pass, batches, total, per_batch)

    def _handed_out(self, number: int, total: int | None, per_batch: int) -> None:
        """Pass `number` hands out a batch. Counted before the batch is handed out: a checkpoint written while
        training on it resumes after it."""
        if number != self._pass:
            # torch lets two iterators over one loader run at once; a checkpoint holds one position.
            self._interleaved = True
            return
        consumed = self._consumed + per_batch
        self._consumed = consumed if total is None else min(consumed, total)

    def _pass_over(self, number: int, finished: bool) -> None:
        if number != self._pass or self._current is None:
            return
        if not finished:
            self._left = (self._current, self._consumed)
        self._current, self._consumed, self._pass_generator = None, 0, None

    # ---- resuming --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is in its data: world-size independent (the same on every rank), except for an
        `IterableDataset`, whose every rank's own state is gathered (then a collective: call it on every rank,
        as `loom.save` does)."""
        if self._interleaved:
            raise MisuseError(
                "An earlier iterator over this loader handed out batches after a later iter(loader) began a new "
                "pass (two passes at once), so the loader has no single position to save. Finish or drop the "
                "earlier iterator before starting the next pass."
            )
        dataset = self._loader.dataset
        if isinstance(dataset, IterableDataset):
            return self._iterable_state(dataset)
        sampler = self.sampler
        if self._resume is not None:  # loaded, not yet iterated: still where the checkpoint said
            epoch, consumed = self._resume
        elif self._current is not None:  # inside a pass
            epoch, consumed = self._current, self._consumed
        else:
            epoch, consumed = self._epoch, 0
            self._log_left_pass()
        state: dict[str, Any] = {
            "epoch": epoch,
            "consumed": consumed,
            "dataset_len": len(dataset),  # type: ignore[arg-type]
            "global_batch": (self._loader.batch_size or 1) * self._world_size,
            "world_size": self._world_size,
        }
        if isinstance(sampler, DistributedSampler):
            state.update(seed=sampler.seed, shuffle=sampler.shuffle)
        elif state["consumed"]:
            raise MisuseError(
                f"This loader's sampler ({type(sampler).__name__}) was not set up by torchloom, so a position inside "
                "an epoch cannot be restored. Call setup_dataloaders with use_distributed_sampler=True, or save "
                "between epochs."
            )
        generator = self._order_generator_state(epoch, consumed)
        if generator is not None:
            state["order_generator"] = generator
        return state

    def _order_generator_state(self, epoch: int, consumed: int) -> torch.Tensor | None:
        """The state the sampler's own generator draws the saved epoch's order from (None without one)."""
        generator = order_generator(self.sampler, self._loader.batch_sampler)
        if generator is None:
            return None
        if not isinstance(generator, torch.Generator):
            if (epoch, consumed) == (0, 0):
                return None  # nothing drawn yet: the resumed run's generator starts where this one did
            raise MisuseError(
                f"This loader's sampler draws its order from a generator torchloom cannot save "
                f"({type(generator).__name__}, not a torch.Generator), so a resumed run would draw another order. "
                "Give the sampler a torch.Generator, or save before the first pass."
            )
        if self._current is not None and self._pass_generator is not None:
            return self._pass_generator.clone()
        return generator.get_state()

    def _log_left_pass(self) -> None:
        if self._left is None or self._warned_left:
            return
        self._warned_left = True
        epoch, consumed = self._left
        log.warning(
            "The pass over epoch %d was left after %d samples (break, an exception, or its iterator "
            "dropped); the loader's next pass reads epoch %d, and so does a run resumed from this checkpoint. To "
            "resume inside an epoch, save while its pass is live (inside the loop).",
            epoch,
            consumed,
            epoch + 1,
        )

    def _iterable_state(self, dataset: IterableDataset) -> dict[str, Any]:
        if not callable(getattr(dataset, "state_dict", None)):
            raise MisuseError(
                f"This loader reads an IterableDataset ({type(dataset).__name__}), which has no position torchloom "
                "can record. Give the dataset state_dict()/load_state_dict() (torchloom then saves those), or leave "
                "the loader out of the checkpoint."
            )
        if self._loader.num_workers > 0:
            raise MisuseError(
                f"This loader reads an IterableDataset ({type(dataset).__name__}) in {self._loader.num_workers} "
                "DataLoader worker processes: they iterate copies of the dataset, so its state_dict() in this "
                "process does not move. Save it with num_workers=0, or leave the loader out of the checkpoint."
            )
        mine = dataset.state_dict()  # type: ignore[attr-defined]
        # Each rank reads its own part of an iterable dataset (the dataset splits itself): every rank's position.
        ranks = self._gather(mine)
        return {"iterable_dataset_ranks": ranks, "world_size": len(ranks), "epoch": self._epoch}

    def _gather(self, obj: Any) -> list[Any]:
        if self._world_size == 1:
            return [obj]
        if self._all_gather_object is not None:
            return self._all_gather_object(obj)
        if not torch.distributed.is_initialized():
            raise MisuseError(
                f"This loader was set up for {count(self._world_size, 'rank')}, but there is no process group to gather "
                "every rank's iterable-dataset position over. Launch the Loom first."
            )
        out: list[Any] = [None] * self._world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (see `state_dict`) on the next pass over the loader."""
        dataset = self._loader.dataset
        if "iterable_dataset_ranks" in state or "iterable_dataset" in state:
            self._load_iterable(dataset, state)
            return
        if state["dataset_len"] != len(dataset):  # type: ignore[arg-type]
            raise CheckpointError(
                f"The checkpoint's loader read a dataset of {count(state['dataset_len'], 'sample')}, this one has "
                f"{len(dataset)}. A position in one dataset means nothing in another: load the checkpoint "  # type: ignore[arg-type]
                "without the loader entry to start the data from the beginning."
            )
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler) and "seed" in state:
            # The order is the checkpoint's, whatever this run was seeded with.
            sampler.seed = int(state["seed"])
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if consumed and not isinstance(sampler, ResumableSampler):
            raise CheckpointError(
                "The checkpoint was saved in the middle of an epoch, but this loader's sampler "
                f"({type(sampler).__name__}) cannot start there. Set the loader up with setup_dataloaders "
                "(use_distributed_sampler=True)."
            )
        self._load_order_generator(state, epoch, consumed)
        global_batch = (self._loader.batch_size or 1) * self._world_size
        if consumed and global_batch != state["global_batch"]:
            log.warning(
                "Resuming epoch %d after %d of its %s with a global batch of %d (it was %d): "
                "the remaining samples are each read once, but batch boundaries differ from the uninterrupted run.",
                epoch,
                consumed,
                count(state["dataset_len"], "sample"),
                global_batch,
                state["global_batch"],
            )
        elif consumed and self._world_size != state["world_size"]:
            log.info(
                "Resuming epoch %d after %s on %s (saved on %d): same global batches.",
                epoch,
                count(consumed, "sample"),
                count(self._world_size, "rank"),
                state["world_size"],
            )
        self._resume = (epoch, consumed)
        self._epoch = epoch

    def _load_order_generator(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        generator = order_generator(self.sampler, self._loader.batch_sampler)
        saved = state.get("order_generator")
        if saved is not None:
            if not isinstance(generator, torch.Generator):
                raise CheckpointError(
                    "The checkpoint holds the state of the loader's sampler's own generator, but this loader's "
                    f"sampler ({type(getattr(self.sampler, 'sampler', self.sampler)).__name__}) has no "
                    "torch.Generator. Build the sampler as the saved run did (with generator=...)."
                )
            generator.set_state(saved)
        elif isinstance(generator, torch.Generator) and (epoch, consumed) != (0, 0):
            raise CheckpointError(
                f"The checkpoint was saved in epoch {epoch} without the state of the sampler's own generator "
                "(written by an older torchloom, or by a sampler without one), so the resumed pass would draw "
                "another order than the saved run. Load the checkpoint without the loader entry to start the data "
                "afresh."
            )

    def _load_iterable(self, dataset: Any, state: dict[str, Any]) -> None:
        if not callable(getattr(dataset, "load_state_dict", None)):
            raise CheckpointError(
                "The checkpoint holds the position of an iterable dataset, but this loader's dataset "
                f"({type(dataset).__name__}) has no load_state_dict()."
            )
        if "iterable_dataset_ranks" in state:
            ranks = state["iterable_dataset_ranks"]
            if len(ranks) != self._world_size:
                raise CheckpointError(
                    f"The checkpoint holds the iterable dataset positions of {count(len(ranks), 'rank')}, this run has "
                    f"{self._world_size}. An IterableDataset splits itself across ranks, so torchloom cannot map "
                    f"one rank's position to another number of ranks: resume on {count(len(ranks), 'rank')}, or load "
                    "without the loader entry to start the data afresh."
                )
            mine = ranks[self._rank]
        elif self._world_size == 1:
            mine = state["iterable_dataset"]  # written by an older torchloom: right if saved in one process
        else:
            raise CheckpointError(
                "The checkpoint holds one iterable dataset position (written by an older torchloom, which saved "
                f"rank 0's only); this run has {count(self._world_size, 'rank')}, each with its own position. Load it "
                "without the loader entry to start the data afresh."
            )
        dataset.load_state_dict(mine)
        self._epoch = int(state.get("epoch", 0))

    @property
    def device(self) -> torch.device | None:
        """Where batches are moved (None with `setup_dataloaders(..., move_to_device=False)`), as Fabric's."""
        return self._device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Pass:
    """One pass over a `LoomDataLoader` (what `iter(loader)` returns): hands out the DataLoader's batches,
    moved to the device, and tells the loader when it is over, by reaching its end or by being left (closed, or
    garbage collected: what a `break` or an exception out of a `for` loop does to its iterator)."""

    def __init__(
        self, owner: LoomDataLoader, number: int, batches: Iterator[Any], total: int | None, per_batch: int
    ) -> None:
        self._owner = owner
        self._number = number
        self._batches: Iterator[Any] | None = batches
        self._total = total
        self._per_batch = per_batch

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            raise StopIteration
        try:
            batch = next(self._batches)
        except StopIteration:
            self._end(finished=True)
            raise
        self._owner._handed_out(self._number, self._total, self._per_batch)
        device = self._owner._device
        return batch if device is None else move_to_device(batch, device)

    def close(self) -> None:
        """Leave the pass: the loader's next pass reads the next epoch."""
        self._end(finished=False)

    def _end(self, finished: bool) -> None:
        if self._batches is None:
            return
        self._batches = None  # lets the DataLoader's iterator (and its workers) go
        self._owner._pass_over(self._number, finished)

    def __del__(self) -> None:
        self._end(finished=False)
