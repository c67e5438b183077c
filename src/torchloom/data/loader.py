"""What `setup_dataloaders` returns: `LoomDataLoader` iterates the user's loader on this rank, one epoch a
pass, and moves the batches to the device. Where it stands in its data is its `Position`
(`torchloom.data.position`), saved and restored by `torchloom.data.resume`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchloom.data import resume
from torchloom.data.position import Position


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


class LoomDataLoader:
    """Iterates the user's loader on this rank: each pass is a new epoch (a shuffling sampler reshuffles,
    identically on every rank), and batches are moved to the device.

    `state_dict()` / `load_state_dict()` record and restore the position in the global order (see
    `torchloom.data`), so `loom.save(path, {..., "loader": loader})` and `loom.load` resume mid-epoch, at any
    world size. A batch counts as consumed once the loader has handed it out.

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
        *,
        global_rank: int = 0,
        ranks: int | None = None,
    ) -> None:
        self._loader = loader
        self._device = device
        self._position = Position(loader, world_size, rank, all_gather_object, global_rank, ranks)

    @property
    def loader(self) -> DataLoader:
        return self._loader

    @property
    def sampler(self) -> Any:
        return self._loader.sampler

    def __len__(self) -> int:
        self._position.prepare_length()
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        return _Pass(self._position, self._device, *self._position.begin())

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is in its data: world-size independent (the same on every rank), except for an
        `IterableDataset`, whose every rank's own state is gathered (then a collective: call it on every rank,
        as `loom.save` does)."""
        return resume.state_dict(self._position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (see `state_dict`) on the next pass over the loader."""
        resume.load_state_dict(self._position, state)

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
        self,
        position: Position,
        device: torch.device | None,
        number: int,
        batches: Iterator[Any],
        total: int | None,
        per_batch: int,
    ) -> None:
        self._position = position
        self._device = device
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
        self._position.handed_out(self._number, self._total, self._per_batch)
        return batch if self._device is None else move_to_device(batch, self._device)

    def close(self) -> None:
        """Leave the pass: the loader's next pass reads the next epoch."""
        self._end(finished=False)

    def _end(self, finished: bool) -> None:
        if self._batches is None:
            return
        self._batches = None  # lets the DataLoader's iterator (and its workers) go
        self._position.over(self._number, finished)

    def __del__(self) -> None:
        self._end(finished=False)
