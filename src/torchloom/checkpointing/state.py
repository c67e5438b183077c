"""Turning the user's `state` dict into saveable values, and loading saved values back into the objects.

Modules and optimizers go through the layout's state-dict access (`StateAccess`, which strategies implement
with `torch.distributed.checkpoint.state_dict`): a module's keys are its own parameter names, an optimizer's state
is keyed by parameter name. Objects with `state_dict()`/`load_state_dict()` (LR schedulers, user objects) are
stored by their state dict; anything else is stored as it is.

`resolve` classifies each entry once, at the top of a save or load, including which module an optimizer's
parameters belong to; everything below works on the resolved `Entry`s.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom.checkpointing._interface import StateAccess
from torchloom.errors import CheckpointError
from torchloom.wrappers import (
    JointModule,
    LoomDataLoader,
    LoomModule,
    LoomOptimizer,
    joint_owner,
    state_module,
    unwrap_optimizer,
)

META_KEY = "__torchloom__"
# 2: a sharded checkpoint keeps the grad scaler and the random generators in extra.pt's `__torchloom__` record,
# as a full file keeps them in its `__torchloom__` metadata (version 1 stored them as `__grad_scaler__` and
# `__rng__`; both are still read).
FORMAT_VERSION = 2

MODULE, OPTIMIZER, POSITIONAL_OPTIMIZER, STATEFUL, VALUE = (
    "module",
    "optimizer",
    "optimizer-positional",
    "stateful",
    "value",
)


# Warnings PyTorch raises from inside its own non-deprecated state-dict and DCP code paths when it meets FSDP1
# units built without a device mesh. They describe PyTorch internals, not anything the user can change, so they
# are filtered here, only around torchloom's own checkpoint calls.
_INTERNAL_WARNINGS = (
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    (UserWarning, r"`_get_pg_default_device` will be deprecated"),
    (UserWarning, r"Multiple backends are registered with this ProcessGroup"),
    # torchloom reads a sharded checkpoint into one process on purpose (a plain model, or consolidate).
    (
        UserWarning,
        r"torch.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to load",
    ),
)


@contextlib.contextmanager
def torch_internal_warnings_filtered() -> Iterator[None]:
    with warnings.catch_warnings():
        for category, message in _INTERNAL_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def is_module(value: Any) -> bool:
    return isinstance(value, (nn.Module, LoomModule))


def is_optimizer(value: Any) -> bool:
    return isinstance(value, (Optimizer, LoomOptimizer))


def has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


@dataclass(frozen=True)
class Entry:
    """One entry of the user's `state`, classified: `obj` is the module or optimizer itself (wrappers removed),
    the object with state, or the plain value; `owner` is the module an optimizer's parameters belong to."""

    kind: str
    obj: Any
    owner: nn.Module | None = None
    #: The entry's saveable value, collected already (`save(..., filter=)` collects and filters it first).
    collected: Any = None


def resolve(state: dict[str, Any], modules: Iterable[nn.Module] = ()) -> dict[str, Entry]:
    """Classify every entry of `state`. An optimizer is matched by parameter name when all its parameters
    belong to one module: one of `state`'s own, or one of `modules` (those set up with the Loom)."""
    check_state_arg(state)
    in_state = {key: state_module(v) for key, v in state.items() if is_module(v)}
    set_up = list(modules)
    candidates = [*in_state.values(), *set_up]
    out: dict[str, Entry] = {}
    for key, value in state.items():
        if is_module(value):
            out[key] = Entry(MODULE, state_module(value))
        elif is_optimizer(value):
            optimizer = unwrap_optimizer(value)
            # Over the parameters of several modules (as Fabric allows): their union, each part named by its
            # key in `state`, or, where one is not in `state`, by its place among the set-up modules.
            owner = (
                _owner_of(optimizer, candidates)
                or joint_owner(optimizer, in_state)
                or joint_owner(optimizer, {f"module{i}": m for i, m in enumerate(set_up)})
            )
            if owner is None:
                _check_unsharded(key, optimizer)
            out[key] = Entry(OPTIMIZER if owner is not None else POSITIONAL_OPTIMIZER, optimizer, owner)
        elif has_state(value):
            out[key] = Entry(STATEFUL, value)
        else:
            out[key] = Entry(VALUE, value)
    return out


def _owner_of(optimizer: Optimizer, candidates: list[nn.Module]) -> nn.Module | None:
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in candidates:
        if ids <= {id(p) for p in module.parameters()}:
            return module
    return None


def is_resume(entries: dict[str, Entry]) -> bool:
    """Whether a load continues a run, so the saved run's state (random generators, loss scaler, the Loom's
    counters) is restored with it: `state` names an optimizer or a set-up data loader. A load of weights only
    (modules, plain values, other objects) starts another run from them and keeps this run's generators."""
    return any(
        entry.kind in (OPTIMIZER, POSITIONAL_OPTIMIZER) or isinstance(entry.obj, LoomDataLoader)
        for entry in entries.values()
    )


def _check_unsharded(key: str, optimizer: Optimizer) -> None:
    """An optimizer no one module owns is saved positionally, as `optimizer.state_dict()`: over sharded
    parameters (FSDP2's DTensors, FSDP1's flattened views) that is this rank's shards only, which one file cannot
    hold for every rank and every rank would load as its own."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(hasattr(p, "to_local") or getattr(p, "_fsdp_flattened", False) for p in params):
        raise CheckpointError(
            f"Entry {key!r} is an optimizer over sharded parameters that belong to no one module of `state` or "
            "set up with this Loom (e.g. the parameters of two set-up modules), so its state cannot be saved or "
            "loaded by parameter name. Set up one module holding all its parameters, or use one optimizer per "
            "module."
        )


def check_state_arg(state: Any) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(
            f"`state` must be a dict of name -> object, got {type(state).__name__}. Name each entry, e.g. "
            "{'model': model, 'optimizer': optimizer, 'step': step}."
        )
    if META_KEY in state:
        raise CheckpointError(f"{META_KEY!r} is reserved for torchloom's metadata; rename that entry.")


def collect(io: StateAccess, entry: Entry, full: bool = True) -> Any:
    """One entry as a saveable value. With `full=False`, modules and optimizers stay sharded (DTensors) for
    `torch.distributed.checkpoint`."""
    if entry.collected is not None:
        return entry.collected
    if entry.kind == MODULE:
        return io.module_state_dict(entry.obj, full=full)
    if entry.kind == OPTIMIZER:
        assert entry.owner is not None  # resolve() gives every OPTIMIZER entry its owner
        return io.optimizer_state_dict(entry.owner, entry.obj, full=full)
    if entry.kind in (POSITIONAL_OPTIMIZER, STATEFUL):
        # An optimizer without an owning module has no parameter names: PyTorch's positional format.
        return entry.obj.state_dict()
    return entry.obj


def collect_state(io: StateAccess, entries: dict[str, Entry], full: bool = True) -> dict[str, Any]:
    return {key: collect(io, entry, full) for key, entry in entries.items()}


def kinds_of(entries: dict[str, Entry]) -> dict[str, str]:
    return {key: entry.kind for key, entry in entries.items()}


def check_missing(state: dict[str, Any], available: list[str], strict: bool) -> None:
    missing = [k for k in state if k not in available]
    if missing and strict:
        raise CheckpointError(
            f"The checkpoint has no entries {missing} that `state` asks for (it has {sorted(available)}). Fix the "
            "names, or pass strict=False to load what matches."
        )


def restore_entry(
    io: StateAccess, key: str, entry: Entry, saved: Any, strict: bool, full: bool = True
) -> None:
    """Load one saved entry into its object in place (a plain value is the caller's to put back)."""
    if entry.kind == MODULE:
        load_module(io, entry.obj, saved, strict, name=key, full=full)
    elif entry.kind == OPTIMIZER and not is_positional(saved):
        assert entry.owner is not None
        if isinstance(entry.owner, JointModule):
            _check_joint_names(key, entry.owner, saved)
        io.load_optimizer_state_dict(entry.owner, entry.obj, saved, full=full)
    elif entry.kind in (OPTIMIZER, POSITIONAL_OPTIMIZER, STATEFUL):
        entry.obj.load_state_dict(saved)


def _check_joint_names(key: str, owner: JointModule, saved: Any) -> None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if isinstance(groups, list):
        check_joint_parts(key, owner, {str(n).split(".")[0] for g in groups for n in g.get("params", [])})


def check_joint_parts(key: str, owner: nn.Module, saved_parts: set[str]) -> None:
    """An optimizer over several modules is keyed by each module's name (its key in `state`, or `moduleN`, its
    place among the set-up modules): a checkpoint keyed otherwise would load no state at all, silently.
    `saved_parts`: the first segment of the parameter names the checkpoint holds the optimizer's state under."""
    if not isinstance(owner, JointModule):
        return
    if saved_parts and not saved_parts <= set(owner._modules):
        raise CheckpointError(
            f"Entry {key!r} is an optimizer over the parameters of several modules, saved under the module names "
            f"{sorted(saved_parts)}, but here they are named {sorted(owner._modules)}. Name the modules in `state` "
            "as when it was saved (their keys name the optimizer's parts), or leave them all out of `state` on "
            "both sides (then the order in which they were set up names them)."
        )


def check_module_keys(
    expected: dict[str, tuple[torch.Size, torch.dtype]],
    saved: dict[str, tuple[torch.Size, torch.dtype]],
    strict: bool,
    name: str,
) -> None:
    """Name every missing/unexpected key (strict) and every shape or dtype mismatch."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Entry {name!r} does not match the module: missing keys {missing}, unexpected keys {unexpected}. "
            "Load into the same architecture, or pass strict=False to load the keys that match."
        )
    mismatched = []
    for key in sorted(set(saved) & set(expected)):
        (want_shape, want_dtype), (got_shape, got_dtype) = expected[key], saved[key]
        if tuple(want_shape) != tuple(got_shape):
            mismatched.append(
                f"{key}: checkpoint shape {tuple(got_shape)} vs module shape {tuple(want_shape)}"
            )
        elif want_dtype != got_dtype and strict:
            mismatched.append(f"{key}: checkpoint dtype {got_dtype} vs module dtype {want_dtype}")
    if mismatched:
        raise CheckpointError(
            f"Entry {name!r} has tensors that do not fit the module: "
            + "; ".join(mismatched)
            + ". "
            + (
                "Convert the module to the saved dtype, or pass strict=False to cast."
                if not any("shape" in m for m in mismatched)
                else "Load into the architecture the checkpoint was saved from."
            )
        )


def shapes_of(state_dict: dict[str, Any]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {k: (v.shape, v.dtype) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def whole_module_shapes(
    io: StateAccess, current: dict[str, Any]
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The shapes of the whole module's state dict: this rank's, or, where each rank holds only part of the
    module (pipeline stages: a strategy with `holds_module_parts`), every rank's joined."""
    if not getattr(io, "holds_module_parts", False):
        return shapes_of(current)
    whole: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for part in io.all_gather_object(shapes_of(current)):
        whole.update(part)
    return whole


def extra_state_of(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The entries of a module state dict that are not tensors: what modules defining `get_extra_state` return,
    under their `<module>._extra_state` keys (a tensor returned there travels with the tensors)."""
    return {k: v for k, v in state_dict.items() if not isinstance(v, torch.Tensor)}


def check_extra_state(
    expected: Iterable[str], saved: Iterable[str], strict: bool, name: str, hint: str = ""
) -> None:
    """With `strict`, name every extra state (`get_extra_state`) the module has and the checkpoint lacks, and
    the reverse, instead of PyTorch's bare "Missing key(s)" from inside `load_state_dict`."""
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Entry {name!r} does not match the module's extra state (get_extra_state/set_extra_state): missing "
            f"{missing}, unexpected {unexpected}. Load into the same architecture, or pass strict=False to load "
            f"what matches.{hint if missing else ''}"
        )


def with_own_extra_state(state: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """`state` plus the module's own extra state (`current`'s) where the checkpoint has none (`strict=False`):
    PyTorch's full-state-dict loading would otherwise hand `set_extra_state` an internal placeholder object."""
    return {**{k: v for k, v in extra_state_of(current).items() if k not in state}, **state}


def load_module(
    io: StateAccess, module: nn.Module, saved: Any, strict: bool, name: str = "model", full: bool = True
) -> None:
    """Load a module's saved state after checking it against the module."""
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"Entry {name!r} of the checkpoint is a {type(saved).__name__}, not a state dict."
        )
    current = io.module_state_dict(module, full=False)  # shapes (global, on every rank) and extra state
    expected = whole_module_shapes(io, current)
    check_module_keys(expected, shapes_of(saved), strict, name)
    extra = extra_state_of(current)
    check_extra_state(extra, extra_state_of(saved), strict, name)
    usable = {k: v for k, v in saved.items() if k in expected or k in extra}
    io.load_module_state_dict(module, with_own_extra_state(usable, current), strict=strict, full=full)


def is_positional(optimizer_state: Any) -> bool:
    if not isinstance(optimizer_state, dict):
        return False
    keys = list(optimizer_state.get("state", {}))
    keys += [p for g in optimizer_state.get("param_groups", []) for p in g.get("params", [])]
    return bool(keys) and all(isinstance(k, int) for k in keys)
