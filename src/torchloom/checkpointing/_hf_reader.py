"""One rank's part of a Hugging Face safetensors checkpoint, read memory-mapped: the reader of its files (one
file, or shards with an index) and the slice of a tensor that a DTensor shard owns, read run by run. `hf.load`
decides what goes where; this module only reads."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from torchloom import _torch_compat
from torchloom.errors import CheckpointError, CheckpointNotFoundError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch  # noqa: F401 - save_file
    except ImportError as error:
        raise CheckpointError(
            "Hugging Face checkpoints need the safetensors package: pip install safetensors "
            "(or torchloom[safetensors])."
        ) from error
    return safetensors


# A read of at least this many bytes unmaps its file afterwards (see _Reader).
_UNMAP_AFTER = 1 << 20


class _Reader:
    """The tensors of a safetensors checkpoint (one file, or shards with an index), memory-mapped, one file at a
    time.

    Pages of a mapped file count in the process's memory once touched, and stay counted while the file is
    mapped; the kernel also maps them in blocks (large folios, up to 2 MiB on ext4), a little beyond each slice.
    A rank that kept every file mapped would end up holding its whole part of the checkpoint on top of the
    model it loads into. So the file is unmapped after every large read (and when the next file is opened):
    what a rank holds at any moment is the model, one slice as read, and the pages of that slice."""

    def __init__(self, path: Path, stack: contextlib.ExitStack) -> None:
        self._safe_open = _safetensors().safe_open
        self._stack = stack  # closes the file still open when loading ends (or fails)
        self._file: Path | None = None
        self._handle_of_file: Any = None
        self._closer: contextlib.ExitStack | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.path = path
        if not path.exists():
            raise CheckpointNotFoundError(
                f"No checkpoint at {str(path)!r}. Pass a model.safetensors file or the directory that holds "
                f"{INDEX_FILE} and its shards."
            )
        if path.is_dir() and (path / INDEX_FILE).is_file():
            index_file = path / INDEX_FILE
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(
                    f"Cannot read {str(index_file)!r}: {type(error).__name__}: {error}. The index is corrupt; it "
                    "must be JSON with a 'weight_map' of tensor name -> shard file."
                ) from error
            self.files = {name: path / file for name, file in weight_map.items()}
            for file in sorted(set(self.files.values())):
                if not file.is_file():
                    raise CheckpointError(
                        f"{str(index_file)!r} names the shard {file.name!r}, which is not in {str(path)!r}. "
                        "Copy the whole checkpoint directory."
                    )
        else:
            file = path / SINGLE_FILE if path.is_dir() else path
            self.files = {name: file for name in self._handle(file).keys()}

    def _handle(self, file: Path) -> Any:
        if file != self._file:
            if self._closer is not None:
                self._closer.close()  # unmaps the previous file
            self._closer = self._stack.enter_context(contextlib.ExitStack())
            self._file = None
            try:
                self._handle_of_file = self._closer.enter_context(self._safe_open(str(file), framework="pt"))
            except Exception as error:  # noqa: BLE001 - any failure to open means a bad file; say which
                raise CheckpointError(
                    f"Cannot read {str(file)!r}: {type(error).__name__}: {error}. The file is truncated, corrupt "
                    "or not safetensors."
                ) from error
            self._file = file
        return self._handle_of_file

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            # All of a file's shapes at once: checking in state-dict order must not reopen files back and forth.
            handle = self._handle(self.files[name])
            self._shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
        return self._shapes[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or the block `index` of it: only those bytes are read from the mapped file."""
        handle = self._handle(self.files[name])
        tensor = handle.get_tensor(name) if not index else handle.get_slice(name)[index]
        if tensor.numel() * tensor.element_size() >= _UNMAP_AFTER and self._closer is not None:
            # Reopening costs a parse of the file's header: worth it only after a large read.
            self._closer.close()
            self._file = None
        return tensor


def _fill(target: torch.Tensor, reader: _Reader, key: str) -> None:
    """Copy this rank's part of checkpoint tensor `key` into `target` (cast to its dtype)."""
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        local = target.to_local()
        runs = _local_runs(target, key)
        shape = tuple(sum(b - a for a, b in dim_runs) for dim_runs in runs)
        if local.numel() == 0 and shape == tuple(local.shape):
            return  # an uneven split can leave a rank nothing of a small tensor
        # Where the piece starts, as DTensor's checkpoint helper says, must agree with the first run: two of
        # torch's own computations, so a torch that shards otherwise fails here instead of loading wrong values.
        first = tuple(r[0][0] if r else size for r, size in zip(runs, target.shape, strict=True))
        if (shape, first) != (tuple(local.shape), _torch_compat.local_shape_and_offset(target)[1]):
            raise CheckpointError(
                f"{key}: this rank's shard has shape {tuple(local.shape)} at offset "
                f"{_torch_compat.local_shape_and_offset(target)[1]}, but DTensor's placements {target.placements} "
                f"give it {shape} at {first}. This torch version shards in a way torchloom does not know; please "
                "report it."
            )
        local.copy_(_read_runs(reader, key, runs, ()))
    else:
        target.copy_(reader.read(key))


def _local_runs(target: Any, key: str) -> list[list[tuple[int, int]]]:
    """For each dimension, the [start, stop) runs of global indices this rank's shard of `target` holds, in its
    order: one run per dimension unless a strided placement interleaves them."""
    try:
        indices = _torch_compat.local_indices(target)
    except ValueError as exc:
        raise CheckpointError(
            f"{key}: cannot load a slice of the checkpoint into this parameter: {exc}"
        ) from exc
    runs = []
    for size, index in zip(target.shape, indices, strict=True):
        if index is None:
            runs.append([(0, size)])
            continue
        dim_runs: list[tuple[int, int]] = []
        for i in index.tolist():
            if dim_runs and dim_runs[-1][1] == i:
                dim_runs[-1] = (dim_runs[-1][0], i + 1)
            else:
                dim_runs.append((i, i + 1))
        runs.append(dim_runs)
    return runs


def _read_runs(
    reader: _Reader, key: str, runs: list[list[tuple[int, int]]], prefix: tuple[slice, ...]
) -> torch.Tensor:
    """The block of `key` that `runs` select, read run by run (only those bytes), joined in order."""
    dim = len(prefix)
    if dim == len(runs):
        return reader.read(key, prefix)
    if len(runs[dim]) == 1 and all(len(r) == 1 for r in runs[dim + 1 :]):
        return reader.read(key, prefix + tuple(slice(*r[0]) for r in runs[dim:]))
    parts = [_read_runs(reader, key, runs, (*prefix, slice(a, b))) for a, b in runs[dim]]
    return torch.cat(parts, dim=dim)


def _copy_local(target: torch.Tensor, source: torch.Tensor) -> None:
    local = target.to_local() if hasattr(target, "to_local") else target
    src = source.to_local() if hasattr(source, "to_local") else source
    if local.data_ptr() != src.data_ptr():
        local.copy_(src)
