"""What `setup_module`, `setup_optimizers` and `setup_dataloaders` return.

The wrappers are thin: they route forward, `optimizer.step()` and batches through the strategy and precision,
and otherwise behave like the user's own objects (attributes, `state_dict()` keys without wrapper prefixes).
`LoomModule` lives here; how its methods reach the strategy is `_module_forward`'s, its names are
`_module_names`'s, `LoomOptimizer` is `_optimizer_wrapper`'s, mixed parameter groups `_mixed_groups`'s and
optimizers over several models `_joint`'s (all re-exported here).
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Any

import torch
from torch import nn

from torchloom._joint import JointModule, joint_owner  # noqa: F401 - re-exported
from torchloom._layout import unit_flavour
from torchloom._mixed_groups import (  # noqa: F401 - re-exported (the private names for tests)
    _is_dtensor,
    _kinds_apart,
    _kinds_of,
    _mixes_kinds,
    steps_kinds_apart,
)
from torchloom._module_forward import (
    STEP_METHODS,
    explain_skipped_call,
    forward_method_name,
    refusing_submodule_calls,
    through_forward,
)
from torchloom._module_names import OriginalNames
from torchloom._optimizer_wrapper import LoomOptimizer, unwrap_optimizer  # noqa: F401 - re-exported
from torchloom.data import (  # noqa: F401 - LoomDataLoader and move_to_device are part of this module's API;
    # the loader rebuilds (torchloom.data.rebuild) are re-exported while callers still import them from here.
    LoomDataLoader,
    move_to_device,
    ordering_sampler,
    with_distributed_sampler,
    with_users_distributed_sampler,
)
from torchloom.precision import Precision

# Set on a user's module once it has been set up, so a second setup_module is caught.
SETUP_MARK = "_torchloom_is_setup"

#: The former private name of `_module_forward.explain_skipped_call`.
_explain_skipped_call = explain_skipped_call


class LoomModule(OriginalNames):
    """A set-up model. Calling it runs the forward through the strategy's wrapper and the precision.

    `.module` is the user's original module, `.forward_module` what the forward runs through (the DDP wrapper,
    the root FSDP unit, or the module itself). Attributes, parameters and `state_dict()` come from the original
    module under its own key names; setting an attribute on the wrapper sets it on the original module.

    The step methods (`training_step`, `validation_step`, `test_step`, `predict_step`) and any method marked
    with `mark_forward_method` run through the same path as forward (DDP's gradient sync, FSDP's unsharding,
    the precision's autocast). Any other method of the model that runs a submodule with parameters is refused
    on a DDP/FSDP model, because it would bypass that path (under DDP, a call that records no gradients, inside
    `torch.no_grad()`, is allowed: every rank holds the whole model and there is nothing to synchronise).
    """

    def __init__(
        self,
        forward_module: nn.Module,
        original_module: nn.Module,
        precision: Precision,
        compiled_forward: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self._forward_module = forward_module
        # The forward module compiled (for a model set up from torch.compile); not registered as a child, so
        # state dicts and the strategy see the forward module's own names.
        object.__setattr__(self, "_compiled_forward", compiled_forward)
        # Not registered as a child: its parameters are already reachable through the forward module.
        object.__setattr__(self, "_original_module", original_module)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_forward_methods", set(STEP_METHODS))
        # Whether forward runs through something the bare module's methods would bypass: a DDP or FSDP wrapper,
        # or a root made an FSDP2 unit in place (its hooks sit on the module itself). Hand-made units without a
        # root unit need no routing: their own hooks, and the replicated leftovers' gradient hooks, always run.
        wrapped_root = forward_module is not original_module or unit_flavour(original_module) is not None
        object.__setattr__(self, "_wrapped_root", wrapped_root)
        object.__setattr__(self, "_loom_initialized", True)

    @property
    def module(self) -> nn.Module:
        return self._original_module

    @property
    def forward_module(self) -> nn.Module:
        return self._forward_module

    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter (or buffer); CPU for a model without either."""
        for t in (*self._original_module.parameters(), *self._original_module.buffers()):
            return t.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's first floating-point parameter (float32 for a model without one)."""
        for p in self._original_module.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.get_default_dtype()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            run = self._forward_module if self._compiled_forward is None else self._compiled_forward
            try:
                output = run(*args, **kwargs)
            except RuntimeError as error:
                explain_skipped_call(error)
                raise
        return precision.convert_output(output)

    def mark_forward_method(self, method: str | MethodType) -> None:
        """Run the model's method `method` (a name or the bound method) through the strategy like forward, so
        that `model.generate(x)` or `model.my_step(batch)` synchronises gradients under DDP and unshards
        parameters under FSDP. The LightningModule step methods are marked already."""
        self._forward_methods.add(forward_method_name(self._original_module, method))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        original = self.__dict__["_original_module"]
        attr = getattr(original, name)
        if not inspect.ismethod(attr):
            return attr
        if name in self.__dict__["_forward_methods"]:
            return through_forward(self.forward, original, name)
        if self.__dict__["_wrapped_root"]:
            return refusing_submodule_calls(original, self._forward_module, attr, name)
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        # `model.x = value` reaches the user's module; the wrapper's own attributes stay on the wrapper (an
        # attribute both have, e.g. `training`, is set on both).
        if not self.__dict__.get("_loom_initialized", False):
            super().__setattr__(name, value)
            return
        original = self._original_module
        own = name in self.__dict__ or hasattr(type(self), name) or name in self._modules
        if own:
            super().__setattr__(name, value)
        if not own or hasattr(original, name):
            setattr(original, name, value)

    def __repr__(self) -> str:
        return f"LoomModule({self._original_module!r})"


def state_module(module: Any) -> nn.Module:
    """The module whose state dict is the model's: the forward module of a set-up model (it includes a wrapped
    FSDP root, which owns the root's parameters), else the module itself."""
    return module.forward_module if isinstance(module, LoomModule) else module


def is_wrapped(obj: Any) -> bool:
    """Whether `obj` was set up by a Loom: a `LoomModule`, `LoomOptimizer` or `LoomDataLoader` (Fabric's
    `is_wrapped`)."""
    return isinstance(obj, (LoomModule, LoomOptimizer, LoomDataLoader))


def unwrap(obj: Any) -> Any:
    """The user's own objects behind set-up ones, also inside nested dicts, lists and tuples: a `LoomModule`'s
    module, a `LoomOptimizer`'s optimizer, a `LoomDataLoader`'s DataLoader; anything else is returned as it is
    (what Fabric's `lightning.fabric.wrappers._unwrap_objects` does for its wrappers)."""

    def one(item: Any) -> Any:
        if isinstance(item, LoomModule):
            return item.module
        if isinstance(item, LoomOptimizer):
            return item.optimizer
        if isinstance(item, LoomDataLoader):
            return item.loader
        return item

    return torch.utils._pytree.tree_map(one, obj)
