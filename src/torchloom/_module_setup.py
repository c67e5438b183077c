"""`setup_module`: the refusals (a `LoomModule`, a model another Loom set up, not a module), a model from
`torch.compile` set up as the module it compiled, the precision's conversion and the strategy's wrapping or
sharding; and finding the set-up model a call names (`clip_gradients`, `mark_forward_method`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from torchloom._torch_compat import compiled_parts
from torchloom.errors import MisuseError, MisuseTypeError, MisuseValueError
from torchloom.strategies.base import Strategy
from torchloom.wrappers import SETUP_MARK, LoomModule


def set_up_before(module: Any, modules: list[LoomModule]) -> LoomModule | None:
    """The `LoomModule` this Loom made of `module` already (a notebook cell run twice), else None; refuses
    what cannot be set up."""
    if isinstance(module, LoomModule):
        raise MisuseValueError(
            "setup_module was given a LoomModule, which is set up already: pass the model itself, or keep "
            "using the LoomModule that setup_module returned."
        )
    if getattr(module, SETUP_MARK, False):
        earlier = next((m for m in modules if m.module is module), None)
        if earlier is None:
            raise MisuseValueError(
                "setup_module was given a model that another Loom set up (and wrapped or sharded for its "
                "own processes). Build the model again for this Loom, or keep using the first one."
            )
        # The same model set up again on this Loom: wrapping or sharding it a second time would stack a
        # second DDP or FSDP over the first, so it gets the same LoomModule.
        return earlier
    if not isinstance(module, nn.Module):
        raise MisuseError(
            f"setup_module expects a torch.nn.Module, got {type(module).__name__}. Pass the model itself "
            "(an nn.Module), not its state_dict or parameters."
        )
    return None


def wrap(
    strategy: Strategy, module: nn.Module, move_to_device: bool, loom: Any, callbacks: list[Any]
) -> LoomModule:
    """`module` converted by the precision, wrapped or sharded by the strategy, marked as set up. A
    LightningModule gets `loom` as its Fabric and joins `callbacks`."""
    compiled = compiled_parts(module)
    if compiled is not None:
        # A model from torch.compile: wrap (DDP, FSDP units) the module it compiled, then compile the wrapper
        # the same way, the order PyTorch documents (DDP's graph splitting at its buckets; FSDP1's state-dict
        # names would otherwise keep the compile wrapper's `_orig_mod.` segment).
        module, compile_like = compiled
    precision = strategy.precision
    module = precision.convert_module(module)
    if move_to_device:
        forward_module = strategy.setup_module(module)
    elif strategy.replaces_parameters:
        raise MisuseError(
            f"setup_module(move_to_device=False) cannot be honoured with strategy {strategy.name!r}: "
            "sharding puts each rank's shards on loom.device. Leave move_to_device=True (create the model "
            "under loom.init_module() to build it there directly)."
        )
    else:
        forward_module = strategy.setup_module(module, move_to_device=False)
    object.__setattr__(module, SETUP_MARK, True)
    if hasattr(module, "_fabric"):
        # A LightningModule: its self.log, self.logger and self.backward go through this back-reference, and,
        # as Fabric does, it becomes a callback, so `loom.call("on_train_start")` reaches its hooks.
        setattr(module, "_fabric", loom)  # noqa: B010 - nn.Module's typed __setattr__ takes no Loom
        if not any(c is module for c in callbacks):
            callbacks.append(module)
    compiled_forward = compile_like(forward_module) if compiled is not None else None
    return LoomModule(forward_module, module, precision, compiled_forward=compiled_forward)


def set_up_one(module: Any, modules: list[LoomModule], what: str) -> LoomModule:
    """The `LoomModule` of `module` (itself, or the set-up module of the user's model)."""
    if isinstance(module, LoomModule):
        return module
    for wrapped in modules:
        if wrapped.module is module:
            return wrapped
    raise MisuseTypeError(
        f"{what} got a module that was not set up. Pass the object returned by loom.setup_module(model)."
    )


def forward_method_targets(method: Any, modules: list[LoomModule]) -> list[tuple[LoomModule, Any]]:
    """`mark_forward_method`: each set-up model that has `method` (the bound method of a set-up model, or a
    name), with what to mark on it."""
    # Read from a set-up model, a method comes back wrapped.
    method = getattr(method, "__wrapped__", method)
    owner = getattr(method, "__self__", None)
    targets = [
        m
        for m in modules
        if (owner is None and callable(getattr(m.module, str(method), None))) or owner in (m, m.module)
    ]
    if not targets:
        raise MisuseError(
            f"mark_forward_method({method!r}): no model set up with this Loom has that method. Call it after "
            "setup, on a method of the set-up model, e.g. loom.mark_forward_method(model.generate)."
        )
    return [(wrapped, method if owner is None else method.__name__) for wrapped in targets]
