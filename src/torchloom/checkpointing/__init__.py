"""Checkpoints: "full" (one file, rank 0) and "sharded" (a DCP directory, every rank), written atomically.

`save` picks the format the strategy asks for; `load` detects the format from what is at `path`, so either loads
into any strategy and any world size.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchloom.checkpointing import atomic, full, hf
from torchloom.checkpointing.state import (
    FORMAT_VERSION,
    META_KEY,
    OwnerLookup,
    load_module,
    torch_internal_warnings_filtered,
)

if TYPE_CHECKING:
    from torchloom.strategies.base import Strategy

__all__ = [
    "save",
    "load",
    "load_module",
    "hf",
    "torch_internal_warnings_filtered",
    "FORMAT_VERSION",
    "META_KEY",
    "OwnerLookup",
]


def save(
    strategy: Strategy,
    path: Path,
    state: dict[str, Any],
    owner_of: OwnerLookup,
    fmt: str,
    async_save: bool = False,
    fsync: bool = True,
) -> Future | None:
    if fmt == "sharded":
        # torch.distributed.checkpoint (about a second to import) is loaded when a sharded checkpoint is touched.
        from torchloom.checkpointing import sharded

        return sharded.save(strategy, path, state, owner_of, async_save=async_save, fsync=fsync)
    return full.save(strategy, path, state, owner_of, async_save=async_save, fsync=fsync)


def load(
    strategy: Strategy,
    path: Path,
    state: dict[str, Any],
    strict: bool,
    owner_of: OwnerLookup,
    weights_only: bool = True,
) -> dict[str, Any]:
    path = atomic.recover(path)
    # A path that does not exist is reported by full.read, with the same words for both formats.
    if path.is_dir():  # a sharded checkpoint
        from torchloom.checkpointing import sharded

        return sharded.load(strategy, path, state, strict, owner_of, weights_only=weights_only)
    return full.load(strategy, path, state, strict, owner_of, weights_only=weights_only)
