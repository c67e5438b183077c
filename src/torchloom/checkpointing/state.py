"""Checkpoints: collecting state from modules, optimizers and user objects, and writing it atomically.

A *full* checkpoint is one `torch.save` file written by rank 0. Its top-level keys are the user's keys; a model's
entry uses the module's own parameter names, an optimizer's entry is keyed by parameter name (the format of
`torch.distributed.checkpoint.state_dict`), so plain PyTorch can read it back:
`model.load_state_dict(torch.load(path)["model"])`. The reserved key `__torchloom__` holds metadata.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom.errors import CheckpointError
from torchloom.wrappers import LoomModule, LoomOptimizer, unwrap_module, unwrap_optimizer

if TYPE_CHECKING:
    from torchloom.strategies.base import Strategy

META_KEY = "__torchloom__"
FORMAT_VERSION = 1

# Finds the set-up module whose parameters an optimizer updates (None: the optimizer has no owner).
OwnerLookup = Callable[[Optimizer], "nn.Module | None"]


def _is_module(value: Any) -> bool:
    return isinstance(value, (nn.Module, LoomModule))


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, (Optimizer, LoomOptimizer))


def _has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def collect_state(strategy: "Strategy", state: dict[str, Any], owner_of: OwnerLookup) -> dict[str, Any]:
    """Turn the user's `state` into plain, picklable values (tensors, dicts, numbers)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"`state` must be a dict of name -> object, got {type(state).__name__}.")
    if META_KEY in state:
        raise CheckpointError(f"{META_KEY!r} is reserved for torchloom's metadata; rename that entry.")
    out: dict[str, Any] = {}
    for key, value in state.items():
        if _is_module(value):
            out[key] = strategy.module_state_dict(unwrap_module(value))
        elif _is_optimizer(value):
            optimizer = unwrap_optimizer(value)
            owner = owner_of(optimizer)
            # Without an owning module there are no parameter names; fall back to PyTorch's positional format.
            out[key] = optimizer.state_dict() if owner is None else strategy.optimizer_state_dict(owner, optimizer)
        elif _has_state(value):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def restore_state(
    strategy: "Strategy", state: dict[str, Any], checkpoint: dict[str, Any], strict: bool, owner_of: OwnerLookup
) -> dict[str, Any]:
    """Load `checkpoint` into the objects of `state` in place; replace plain values in `state`.

    Returns the entries of the checkpoint that `state` did not name.
    """
    missing = [k for k in state if k not in checkpoint]
    if missing and strict:
        raise CheckpointError(
            f"The checkpoint has no entries {missing} that `state` asks for (it has {sorted(_user_keys(checkpoint))}). "
            "Fix the names, or pass strict=False to load what matches."
        )
    for key, value in state.items():
        if key not in checkpoint:
            continue
        saved = checkpoint[key]
        if _is_module(value):
            load_module(strategy, unwrap_module(value), saved, strict, name=key)
        elif _is_optimizer(value):
            optimizer = unwrap_optimizer(value)
            owner = owner_of(optimizer)
            if owner is None or _is_positional(saved):
                optimizer.load_state_dict(saved)
            else:
                strategy.load_optimizer_state_dict(owner, optimizer, saved)
        elif _has_state(value):
            value.load_state_dict(saved)
        else:
            state[key] = saved
    return {k: v for k, v in checkpoint.items() if k not in state and k != META_KEY}


def load_module(strategy: "Strategy", module: nn.Module, saved: Any, strict: bool, name: str = "model") -> list[str]:
    """Load a module's state, naming every missing/unexpected key and every shape or dtype mismatch."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"Entry {name!r} of the checkpoint is a {type(saved).__name__}, not a state dict.")
    expected = strategy.module_state_dict(module)
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Entry {name!r} does not match the module: missing keys {missing}, unexpected keys {unexpected}. "
            "Load into the same architecture, or pass strict=False to load the keys that match."
        )
    mismatched = []
    for key in sorted(set(saved) & set(expected)):
        want, got = expected[key], saved[key]
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            if tuple(want.shape) != tuple(got.shape):
                mismatched.append(f"{key}: checkpoint {tuple(got.shape)} vs module {tuple(want.shape)}")
            elif want.dtype != got.dtype and strict:
                mismatched.append(f"{key}: checkpoint dtype {got.dtype} vs module dtype {want.dtype}")
    if mismatched:
        raise CheckpointError(f"Entry {name!r} has tensors that do not fit the module: " + "; ".join(mismatched))
    usable = {k: v for k, v in saved.items() if k in expected}
    strategy.load_module_state_dict(module, usable, strict=strict)
    return missing + unexpected


def _is_positional(optimizer_state: Any) -> bool:
    state = optimizer_state.get("state", {}) if isinstance(optimizer_state, dict) else {}
    groups = optimizer_state.get("param_groups", []) if isinstance(optimizer_state, dict) else []
    keys = list(state) + [p for g in groups for p in g.get("params", [])]
    return bool(keys) and all(isinstance(k, int) for k in keys)


def _user_keys(checkpoint: dict[str, Any]) -> list[str]:
    return [k for k in checkpoint if k != META_KEY]


# ---- the full-file format ------------------------------------------------------------------------------------
def temporary_sibling(path: Path) -> Path:
    """A unique name beside `path`, so a rename into place stays on one filesystem (atomic)."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")


def atomic_torch_save(obj: dict[str, Any], path: Path) -> None:
    """Write `obj` beside `path`, flush it to disk, then rename it over `path` in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def find_unpicklable(obj: dict[str, Any]) -> str | None:
    """The first top-level key whose value pickle cannot write."""
    for key, value in obj.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - any pickling failure counts
            return key
    return None


def read_full_file(path: Path, weights_only: bool = False) -> dict[str, Any]:
    """Read a full checkpoint file. Memory-mapped, so ranks share the page cache instead of each holding a copy."""
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {str(path)!r}.")
    if path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a directory (a sharded checkpoint), which this strategy cannot read. Load it with an "
            "FSDP strategy, or turn it into one file with `torchloom consolidate`."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception as error:  # noqa: BLE001 - the file is corrupt in some way; say which file
        raise CheckpointError(
            f"Cannot read checkpoint {str(path)!r}: {type(error).__name__}: {error}. The file is truncated, corrupt "
            "or not a torch checkpoint."
        ) from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict) and meta.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} was written by a newer torchloom (format version {meta['version']}; this one reads up "
            f"to {FORMAT_VERSION}). Upgrade torchloom to load it."
        )
    return checkpoint


def save_full(strategy: "Strategy", path: Path, state: dict[str, Any], owner_of: OwnerLookup) -> None:
    """Every rank collects (sharded strategies gather here); rank 0 writes; all ranks learn the outcome."""
    payload = collect_state(strategy, state, owner_of)
    assert strategy.precision is not None
    payload[META_KEY] = {
        "version": FORMAT_VERSION,
        "format": "full",
        "world_size": strategy.world_size,
        "strategy": strategy.name,
        "precision": strategy.precision.name,
        "grad_scaler": strategy.precision.state_dict(),
    }
    error = None
    if strategy.global_rank == 0:
        try:
            atomic_torch_save(payload, path)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            key = find_unpicklable(payload)
            if key is not None:
                error = (
                    f"Cannot save entry {key!r} of the checkpoint: {type(exc).__name__}: {exc}. Store a picklable "
                    "value there (or an object with state_dict()/load_state_dict())."
                )
            else:
                error = f"Cannot write checkpoint {str(path)!r}: {type(exc).__name__}: {exc}"
    if strategy.is_distributed:
        # Doubles as the barrier: no rank returns before the file is in place (or has failed everywhere).
        error = strategy.broadcast(error, src=0)
    if error:
        raise CheckpointError(error)


def load_full(
    strategy: "Strategy", path: Path, state: dict[str, Any], strict: bool, owner_of: OwnerLookup,
    weights_only: bool = False,
) -> dict[str, Any]:
    checkpoint = read_full_file(path, weights_only=weights_only)
    remaining = restore_state(strategy, state, checkpoint, strict, owner_of)
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict) and meta.get("grad_scaler") and strategy.precision is not None:
        strategy.precision.load_state_dict(meta["grad_scaler"])
    return remaining
