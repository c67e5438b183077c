"""Data loading that can resume exactly, at any world size.

An epoch has one *global order* of samples, the same at every world size: a permutation drawn from
`seed + epoch` (or the dataset's own order, or one draw of a custom sampler). Each rank reads every
`world_size`-th sample of it, as `DistributedSampler` does, so global batch b of an epoch is
`order[b * G:(b + 1) * G]` for the global batch size G = world size x per-rank batch size. The loader counts the
global samples handed out in the epoch; that count, the epoch and the seed are its whole state. Resuming from
them continues the same global order from the first sample not yet handed out, on any number of ranks: with the
same global batch size the resumed run sees exactly the global batches the uninterrupted run would have seen;
with another, it still sees each remaining sample of the epoch once.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

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
        size as DistributedSampler does (padding repeats the first remaining samples)."""
        positions = list(range(self.start, len(self.dataset)))  # type: ignore[arg-type]
        ws = self.num_replicas
        if self.drop_last:
            return positions[: len(positions) // ws * ws]
        if positions and len(positions) % ws:
            pad = ws - len(positions) % ws
            positions += (positions * math.ceil(pad / len(positions)))[:pad]
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


class LoomDataLoader:
    """Iterates the user's loader on this rank: each pass is a new epoch (a shuffling sampler reshuffles,
    identically on every rank), and batches are moved to the device.

    `state_dict()` / `load_state_dict()` record and restore the position in the global order (see the module
    docstring), so `loom.save(path, {..., "loader": loader})` and `loom.load` resume mid-epoch, at any world size.
    A batch counts as consumed once the loader has handed it out."""

    def __init__(self, loader: DataLoader, device: torch.device | None, world_size: int = 1) -> None:
        self._loader = loader
        self._device = device
        self._world_size = world_size
        self._epoch = 0  # the epoch the next pass will read
        self._current: int | None = None  # the epoch a pass is reading now
        self._consumed = 0  # global samples handed out in the current epoch
        self._resume: tuple[int, int] | None = None

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
        if self._resume is not None:
            epoch, start = self._resume
            self._resume = None
        else:
            epoch, start = self._epoch, 0
        if start == 0 and getattr(self._loader, "_torchloom_generator", False):
            # The user's loader, without a generator of its own, would draw its workers' base seed from the
            # global generator at the start of each pass (plain PyTorch and Fabric do). Ours reads its own
            # generator, so draw that number here and discard it: dropout and every other random call in the
            # loop then see the same stream as under Fabric. A pass resumed mid-epoch does not draw: the
            # interrupted run drew before its checkpoint captured the generator's state.
            torch.empty((), dtype=torch.int64).random_()
        self._prepare_sampler(epoch, start)
        self._epoch, self._current, self._consumed = epoch + 1, epoch, start
        total = (
            self.sampler.remaining_global() + start if isinstance(self.sampler, ResumableSampler) else None
        )
        per_batch = (self._loader.batch_size or 1) * self._world_size
        for batch in self._loader:
            # Counted before the batch is handed out: a checkpoint written while training on it resumes after it.
            self._consumed = (
                self._consumed + per_batch if total is None else min(self._consumed + per_batch, total)
            )
            yield batch if self._device is None else move_to_device(batch, self._device)
        self._current, self._consumed = None, 0

    # ---- resuming --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is in its data: world-size independent (the same on every rank)."""
        dataset = self._loader.dataset
        if isinstance(dataset, IterableDataset):
            if callable(getattr(dataset, "state_dict", None)):
                return {"iterable_dataset": dataset.state_dict(), "epoch": self._epoch}
            raise MisuseError(
                f"This loader reads an IterableDataset ({type(dataset).__name__}), which has no position torchloom "
                "can record. Give the dataset state_dict()/load_state_dict() (torchloom then saves those), or leave "
                "the loader out of the checkpoint."
            )
        sampler = self.sampler
        if self._resume is not None:  # loaded, not yet iterated: still where the checkpoint said
            epoch, consumed = self._resume
        elif self._current is not None:  # inside a pass
            epoch, consumed = self._current, self._consumed
        else:
            epoch, consumed = self._epoch, 0
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
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (see `state_dict`) on the next pass over the loader."""
        dataset = self._loader.dataset
        if "iterable_dataset" in state:
            if not callable(getattr(dataset, "load_state_dict", None)):
                raise CheckpointError(
                    "The checkpoint holds the position of an iterable dataset, but this loader's dataset "
                    f"({type(dataset).__name__}) has no load_state_dict()."
                )
            dataset.load_state_dict(state["iterable_dataset"])  # type: ignore[union-attr]
            self._epoch = int(state.get("epoch", 0))
            return
        if state["dataset_len"] != len(dataset):  # type: ignore[arg-type]
            raise CheckpointError(
                f"The checkpoint's loader read a dataset of {state['dataset_len']} samples, this one has "
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
        global_batch = (self._loader.batch_size or 1) * self._world_size
        if consumed and global_batch != state["global_batch"]:
            log.warning(
                "torchloom: resuming epoch %d after %d of its %d samples with a global batch of %d (it was %d): "
                "the remaining samples are each read once, but batch boundaries differ from the uninterrupted run.",
                epoch,
                consumed,
                state["dataset_len"],
                global_batch,
                state["global_batch"],
            )
        elif consumed and self._world_size != state["world_size"]:
            log.info(
                "torchloom: resuming epoch %d after %d samples on %d ranks (saved on %d): same global batches.",
                epoch,
                consumed,
                self._world_size,
                state["world_size"],
            )
        self._resume = (epoch, consumed)
        self._epoch = epoch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
