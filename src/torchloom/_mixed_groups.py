"""Optimizer parameter groups that mix FSDP2's DTensors with plain tensors (the replicated leftovers torchloom
keeps outside every unit): stepped as groups of one kind each, since torch's foreach and fused kernels refuse the
mix. Used by `LoomOptimizer.step` and, around torch's own state-dict functions, by the strategies."""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim import Optimizer


def _is_dtensor(t: torch.Tensor) -> bool:
    # No DTensor exists unless its module was imported (about a second): never import it here.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


# optimizer -> (what its groups looked like, each group's (DTensors, plain tensors) when it mixes them, else None).
_KINDS: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[Any, ...], list[Any]]] = weakref.WeakKeyDictionary()


def _groups_key(optimizer: Optimizer) -> tuple[Any, ...]:
    # Changes whenever any group holds other parameters: a group added or replaced, its list replaced, grown,
    # shrunk, or a parameter swapped in place (the split groups would step the old one: silently wrong). The
    # identities are read in C (tens of microseconds for thousands of parameters); each one's kind is not.
    return tuple((id(g), tuple(map(id, g["params"]))) for g in optimizer.param_groups)


def _kinds_of(optimizer: Optimizer) -> list[Any]:
    """Per parameter group, its (DTensors, plain tensors) where it holds both kinds, else None. Computed once
    per set of groups: a parameter's kind never changes after setup, and scanning thousands of parameters on
    every step would cost the host more than the step itself does."""
    key = _groups_key(optimizer)
    cached = _KINDS.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    kinds: list[Any] = []
    for group in optimizer.param_groups:
        dtensors = [p for p in group["params"] if _is_dtensor(p)]
        plain = [p for p in group["params"] if not _is_dtensor(p)]
        kinds.append((dtensors, plain) if dtensors and plain else None)
    _KINDS[optimizer] = (key, kinds)
    return kinds


def _mixes_kinds(optimizer: Optimizer) -> bool:
    """Whether a parameter group holds DTensors and plain tensors: FSDP2's sharded parameters next to the
    replicated leftovers torchloom keeps outside every unit."""
    return any(split is not None for split in _kinds_of(optimizer))


@contextlib.contextmanager
def _kinds_apart(optimizer: Optimizer) -> Iterator[None]:
    """For one step, each parameter group that mixes DTensors and plain tensors becomes two groups with the same
    options, one of each kind.

    torch's optimizers run one foreach (or fused) kernel per parameter group, device and dtype: the default on
    CUDA. A group holding FSDP2's sharded parameters and plain replicated ones fails there ("got mixed
    torch.Tensor and DTensor"), though the per-parameter update is the same for both kinds. Per-parameter state
    is keyed by the parameter, so it is untouched; options an optimizer writes into a group during the step are
    written back to the user's group. The user's groups are what `param_groups` shows before and after."""
    kinds = _kinds_of(optimizer)
    if all(split is None for split in kinds):
        yield
        return
    groups = optimizer.param_groups
    parts: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for group, split in zip(groups, kinds, strict=True):
        for params in split if split is not None else (group["params"],):
            parts.append((group, {**group, "params": params}))
    optimizer.param_groups = [part for _, part in parts]
    try:
        yield
    finally:
        optimizer.param_groups = groups
        for group, part in parts:
            for key, value in part.items():
                if key != "params" and group.get(key) is not value:
                    group[key] = value


@contextlib.contextmanager
def steps_kinds_apart(optimizer: Optimizer) -> Iterator[None]:
    """Inside, a direct `optimizer.step()` runs as `LoomOptimizer.step` runs it: with mixed groups split (see
    `_kinds_apart`).

    torch's `get_optimizer_state_dict` and `set_optimizer_state_dict` give an optimizer without state (a new one
    a checkpoint is loaded into, or one saved before its first step) its state by calling its raw `step()` with
    zero gradients; with a foreach or fused optimizer (CUDA's default) over mixed groups that step fails. Only
    the step is split: the state dict those functions read and write keeps the user's groups, in their order."""
    if not _mixes_kinds(optimizer):
        yield
        return
    had_own = "step" in optimizer.__dict__  # an LR scheduler wraps `step` on the instance
    own = optimizer.__dict__.get("step")
    original = optimizer.step

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        with _kinds_apart(optimizer):
            return original(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            optimizer.__dict__["step"] = own  # the scheduler's wrapper, put back as it was
        else:
            del optimizer.step
