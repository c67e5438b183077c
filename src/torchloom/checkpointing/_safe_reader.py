"""Reading a sharded (DCP) checkpoint without running code from it.

DCP's own `FileSystemReader` unpickles `.metadata` with plain `pickle.load`, and its load planners unpickle every
non-tensor item ("byte items": an optimizer's hyperparameters, a module's extra state) with
`torch.load(weights_only=False)`: a checkpoint from elsewhere with a planted pickle in either runs any code its
author chose as soon as it is loaded. `SafeReader` reads the same files, but `.metadata` through an unpickler that
admits only what DCP's metadata is made of, and byte items with `torch.load(weights_only=True)`. Tensors DCP
already reads with `weights_only=True`.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

from torchloom import _torch_compat
from torchloom.checkpointing.full import unsafe_content_error
from torchloom.errors import CheckpointError

_TRUST_HINT = (
    "If you trust the checkpoint, load it with weights_only=False (loom.load(path, state, weights_only=False), "
    "or --allow-pickle for the command line)."
)

# How a path pickles: pathlib's classes (under `pathlib._local` from Python 3.13). DCP records the directory it
# wrote to as a Path in `storage_meta.checkpoint_id`.
_PATH_MODULES = ("pathlib", "pathlib._local")
_PATH_CLASSES = ("Path", "PurePath", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")

# torch's objects that pickle by name (`torch.float32` as the global `torch.float32`): never callable.
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for every class and function a `.metadata` written by DCP refers to."""
    public = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
        )
    }
    return {**public, ("torch", "Size"): torch.Size, **_torch_compat.dcp_metadata_private_globals()}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own dataclasses, torch.Size, dtypes and layouts, paths, and plain containers
    (which need no global). Any other global (a function to call, a class to build) is refused before it is
    looked up, so nothing of the file's choosing runs."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        if module in _PATH_MODULES and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r}")


def refused_error(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{str(file)!r} refers to {what}, which is not part of a checkpoint's metadata: loading it could run any "
        f"code the file's author chose, so loading with weights_only=True refuses it. {_TRUST_HINT}"
    )


def read_metadata_file(file: Path) -> dcp_metadata.Metadata:
    """A DCP `.metadata` file, unpickled with only DCP's metadata classes admitted."""
    with open(file, "rb") as stream:
        try:
            metadata = _MetadataUnpickler(stream).load()
        except _Refused as exc:
            raise refused_error(file, exc.name) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(
            f"{str(file)!r} does not hold a checkpoint's metadata (it unpickles to a {type(metadata).__name__}). "
            "The checkpoint is corrupt."
        )
    return metadata


class _WeightsOnlyBytes:
    """The load planner as the reader sees it: a byte item is unpickled with `weights_only=True` first, and the
    planner gets it saved again by torch.save here, so that its own `torch.load(weights_only=False)` reads only
    what this process wrote from plain data. Every other call goes to the planner itself."""

    def __init__(self, planner: Any, reader: SafeReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            if "weights only load failed" not in str(exc).lower():
                raise
            raise self._reader.unsafe_item_error(read_item, exc) from exc
        plain = io.BytesIO()
        torch.save(obj, plain)
        plain.seek(0)
        self._planner.load_bytes(read_item, plain)


class SafeReader(FileSystemReader):
    """DCP's `FileSystemReader`, but loading runs no code from the checkpoint: `.metadata` admits only DCP's
    metadata classes, byte items only plain data (`torch.load(weights_only=True)`). A file that holds anything
    else is refused with a `CheckpointError` naming it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        # The same files DCP's reader reads: `.metadata`, or `__<rank>.metadata` where DCP asks for a rank's own.
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata_file(Path(self.checkpoint_id) / name)
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _WeightsOnlyBytes(planner, self))

    def unsafe_item_error(self, read_item: Any, exc: BaseException) -> CheckpointError:
        info = self.storage_data.get(read_item.storage_index)
        file = Path(self.checkpoint_id) / getattr(info, "relative_path", "?")
        return unsafe_content_error(file, exc, item=read_item.storage_index.fqn)
