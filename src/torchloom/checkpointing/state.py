"""Turning the user's `state` dict into saveable values, and loading saved values back into the objects.

Modules and optimizers go through the strategy (which uses `torch.distributed.checkpoint.state_dict`): a
module's keys are its own parameter names, an optimizer's state is keyed by parameter name. Objects with
`state_dict()`/`load_state_dict()` (LR schedulers, user objects) are stored by their state dict; anything else is
stored as it is.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom.errors import CheckpointError
from torchloom.wrappers import LoomModule, LoomOptimizer, state_module, unwrap_optimizer

if TYPE_CHECKING:
    from torchloom.strategies.base import Strategy

META_KEY = "__torchloom__"
FORMAT_VERSION = 1

# Finds the module whose parameters an optimizer updates (None: the optimizer has no known owner).
OwnerLookup = Callable[[Optimizer], "nn.Module | None"]

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


def kind_of(value: Any, owner_of: OwnerLookup) -> str:
    if is_module(value):
        return MODULE
    if is_optimizer(value):
        return OPTIMIZER if owner_of(unwrap_optimizer(value)) is not None else POSITIONAL_OPTIMIZER
    if has_state(value):
        return STATEFUL
    return VALUE


def check_state_arg(state: Any) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(
            f"`state` must be a dict of name -> object, got {type(state).__name__}. Name each entry, e.g. "
            "{'model': model, 'optimizer': optimizer, 'step': step}."
        )
    if META_KEY in state:
        raise CheckpointError(f"{META_KEY!r} is reserved for torchloom's metadata; rename that entry.")


def collect_state(
    strategy: Strategy, state: dict[str, Any], owner_of: OwnerLookup, full: bool = True
) -> tuple[dict[str, Any], dict[str, str]]:
    """Every entry as a saveable value, and each entry's kind. With `full=False`, modules and optimizers stay
    sharded (DTensors) for `torch.distributed.checkpoint`."""
    check_state_arg(state)
    out: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for key, value in state.items():
        kind = kinds[key] = kind_of(value, owner_of)
        if kind == MODULE:
            out[key] = strategy.module_state_dict(state_module(value), full=full)
        elif kind == OPTIMIZER:
            optimizer = unwrap_optimizer(value)
            out[key] = strategy.optimizer_state_dict(owner_of(optimizer), optimizer, full=full)
        elif kind == POSITIONAL_OPTIMIZER:
            # Without an owning module there are no parameter names: PyTorch's positional format.
            out[key] = unwrap_optimizer(value).state_dict()
        elif kind == STATEFUL:
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out, kinds


def check_missing(state: dict[str, Any], available: list[str], strict: bool) -> None:
    missing = [k for k in state if k not in available]
    if missing and strict:
        raise CheckpointError(
            f"The checkpoint has no entries {missing} that `state` asks for (it has {sorted(available)}). Fix the "
            "names, or pass strict=False to load what matches."
        )


def restore_entry(
    strategy: Strategy,
    state: dict[str, Any],
    key: str,
    saved: Any,
    strict: bool,
    owner_of: OwnerLookup,
    full: bool = True,
) -> None:
    """Load one saved entry into `state[key]` in place (plain values replace `state[key]`)."""
    value = state[key]
    if is_module(value):
        load_module(strategy, state_module(value), saved, strict, name=key, full=full)
    elif is_optimizer(value):
        optimizer = unwrap_optimizer(value)
        owner = owner_of(optimizer)
        if owner is None or is_positional(saved):
            optimizer.load_state_dict(saved)
        else:
            strategy.load_optimizer_state_dict(owner, optimizer, saved, full=full)
    elif has_state(value):
        value.load_state_dict(saved)
    else:
        state[key] = saved


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


def load_module(
    strategy: Strategy, module: nn.Module, saved: Any, strict: bool, name: str = "model", full: bool = True
) -> None:
    """Load a module's saved state after checking it against the module."""
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"Entry {name!r} of the checkpoint is a {type(saved).__name__}, not a state dict."
        )
    expected = strategy.module_state_shapes(module)
    check_module_keys(expected, shapes_of(saved), strict, name)
    usable = {k: v for k, v in saved.items() if k in expected}
    strategy.load_module_state_dict(module, usable, strict=strict, full=full)


def is_positional(optimizer_state: Any) -> bool:
    if not isinstance(optimizer_state, dict):
        return False
    keys = list(optimizer_state.get("state", {}))
    keys += [p for g in optimizer_state.get("param_groups", []) for p in g.get("params", [])]
    return bool(keys) and all(isinstance(k, int) for k in keys)
