"""Meta-device initialisation for the sharded strategies and the pipeline stages: which modules of a model built with
`init_module(empty_init=True)` still hold meta tensors and how each initialises itself (its `reset_parameters`, or
a Hugging Face model's `_init_weights`), allocating them without untying shared parameters, and the order in which
rank 0 draws its random numbers for them."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from torchloom._layout import analyze
from torchloom.errors import MisuseError

PendingModules = list[tuple[str, nn.Module]]

# Initialisers found for modules without a reset_parameters of their own (see `meta_modules`).
_ANCESTOR_INIT: weakref.WeakKeyDictionary[nn.Module, Callable[[], None]] = weakref.WeakKeyDictionary()
# Meta parameter -> the real one made for it, so that a parameter shared by two modules (tied embeddings) is
# allocated once and stays shared; module-by-module materialisation would otherwise untie it. (Keyed by identity:
# tensors compare by value.)
_MATERIALIZED: Any = WeakIdKeyDictionary()


def init_fn(module: nn.Module) -> Callable[[], None] | None:
    """What initialises `module`'s own parameters: its `reset_parameters`, or an ancestor's `_init_weights`."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return _ANCESTOR_INIT.get(module)


def run_init(module: nn.Module) -> None:
    """Run `module`'s initialiser (`meta_modules` made sure it has one)."""
    fn = init_fn(module)
    if fn is None:
        raise MisuseError(
            f"{type(module).__name__} has no reset_parameters() to initialise its meta tensors."
        )
    fn()


def _has_own_state(module: nn.Module, meta_only: bool = True) -> bool:
    tensors = [
        *module.parameters(recurse=False),
        *(b for b in module.buffers(recurse=False) if b is not None),
    ]
    return any(t.is_meta for t in tensors) if meta_only else bool(tensors)


def materialize_meta(
    module: nn.Module, device: torch.device, param_device: torch.device | None = None
) -> None:
    """Allocate `module`'s own meta-device parameters (on `param_device`, default `device`) and buffers (on
    `device`), uninitialised, and leave its real tensors alone (`to_empty` would wipe them). Parameters keep
    their identity: FSDP2 holds on to its sharded DTensors."""
    for name, param in list(module._parameters.items()):
        if param is None or not param.is_meta:
            continue
        if type(param.data) is not torch.Tensor:  # a DTensor: swap, as nn.Module._apply does for subclasses
            empty = nn.Parameter(
                torch.empty_like(param, device=param_device or device), requires_grad=param.requires_grad
            )
            torch.utils.swap_tensors(param, empty)  # in place: every module sharing it sees the real one
        else:
            real = _MATERIALIZED.get(param)
            if real is None:
                real = _MATERIALIZED[param] = nn.Parameter(
                    torch.empty_like(param, device=param_device or device), requires_grad=param.requires_grad
                )
            module._parameters[name] = real  # what to_empty does: a meta tensor cannot take real data
    for name, buf in list(module._buffers.items()):
        if buf is not None and buf.is_meta:
            module._buffers[name] = torch.empty_like(buf, device=device)


def meta_modules(module: nn.Module) -> PendingModules:
    """Modules whose own parameters/buffers are on the meta device; each must know how to initialise itself."""
    found = [(name, m) for name, m in module.named_modules() if _has_own_state(m)]
    _find_ancestor_inits(module, [m for _, m in found])
    missing = [f"{name or '<root>'} ({type(m).__name__})" for name, m in found if init_fn(m) is None]
    if missing:
        raise MisuseError(
            "These modules were created on the meta device (init_module(empty_init=True)) but have no "
            f"reset_parameters() to initialise their own parameters: {', '.join(missing)}. Add a "
            "reset_parameters() method to them (or, as Hugging Face models do, an _init_weights(module) method to "
            "the model), or create the model with empty_init=False."
        )
    return found


def _find_ancestor_inits(root: nn.Module, modules: list[nn.Module]) -> None:
    """Hugging Face models initialise their modules from the model: `model._init_weights(module)` (an RMSNorm
    has no reset_parameters). Record that initialiser for each module that has none of its own."""
    needing = {id(m) for m in modules if init_fn(m) is None}
    if not needing:
        return

    def visit(module: nn.Module, initialiser: Any) -> None:
        own = getattr(module, "_init_weights", None)
        initialiser = own if callable(own) else initialiser
        if id(module) in needing and initialiser is not None:
            _ANCESTOR_INIT[module] = functools.partial(initialiser, module)
        for child in module.children():
            visit(child, initialiser)

    visit(root, None)


def materialize(
    module: nn.Module,
    pending: PendingModules,
    device: torch.device,
    holds_dtensors: Callable[[nn.Module], bool],
    materialize_units: Callable[[nn.Module, PendingModules], None],
) -> None:
    """Initialise the `pending` meta modules of the sharded `module`: those inside units (or holding DTensors,
    `holds_dtensors`) by the flavour's `materialize_units`, the replicated leftovers locally on `device` (the
    strategy then broadcasts rank 0's values)."""
    if not pending:
        return
    unit_owned = {id(m) for u in analyze(module).units for m in u.module.modules()}
    # In the model's own order, runs of modules inside units and outside them, so that rank 0 draws its random
    # numbers in the order a real initialisation draws them (meta init then gives the same values).
    runs: list[tuple[bool, PendingModules]] = []
    for name, mod in pending:
        distributed = id(mod) in unit_owned or holds_dtensors(mod)
        if runs and runs[-1][0] == distributed:
            runs[-1][1].append((name, mod))
        else:
            runs.append((distributed, [(name, mod)]))
    tied = _tied_slots(pending)
    first_draws: dict[int, torch.Tensor] = {}
    for distributed, modules in runs:
        # One module at a time where it holds a tied weight, which keeps its first user's draw (see `_keep_first`).
        batches = [[m] for m in modules] if tied else [modules]
        for batch in batches:
            if distributed:
                materialize_units(module, batch)
            else:
                with torch.no_grad():
                    for _, mod in batch:
                        # Leftovers are replicated: initialise locally, then _replicate_leftovers broadcasts rank 0's.
                        materialize_meta(mod, device)
                        run_init(mod)
            for _, mod in batch:
                _keep_first(mod, tied.get(id(mod), []), first_draws)


def _tied_slots(pending: PendingModules) -> dict[int, list[tuple[str, int]]]:
    """For each pending module that holds a weight shared with another module (tied embeddings): its attribute
    names of such weights, with the meta parameter's identity (before it is allocated)."""
    users: dict[int, int] = {}
    for _, mod in pending:
        for p in mod.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    slots: dict[int, list[tuple[str, int]]] = {}
    for _, mod in pending:
        for name, p in mod.named_parameters(recurse=False):
            if users[id(p)] > 1:
                slots.setdefault(id(mod), []).append((name, id(p)))
    return slots


@torch.no_grad()
def _keep_first(mod: nn.Module, slots: list[tuple[str, int]], first_draws: dict[int, torch.Tensor]) -> None:
    """A tied weight keeps the value its first user's initialiser drew, as the model built for real does (the
    head's `weight = embedding.weight` keeps the embedding's draw) and as the pipeline's stages do: each later
    user's initialiser still runs, so that the random numbers after it are drawn as a real build draws them, and
    its draw into the shared weight is undone."""
    for name, key in slots:
        param = mod._parameters.get(name)
        if param is None:  # taken over by a unit (FSDP1 flattens what it wraps): its unit initialised it
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        if key in first_draws:
            local.copy_(first_draws[key])
        else:
            first_draws[key] = local.detach().clone()
