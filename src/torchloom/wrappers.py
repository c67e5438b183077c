"""What `setup_module`, `setup_optimizers` and `setup_dataloaders` return.

The wrappers are thin: they route forward, `optimizer.step()` and batches through the strategy and precision,
and otherwise behave like the user's own objects (attributes, `state_dict()` keys without wrapper prefixes).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from torchloom._layout import unit_flavour

# LoomDataLoader and move_to_device are part of this module's API; the loader rebuilds (torchloom.data.rebuild)
# are re-exported while callers still import them from here.
from torchloom.data import (  # noqa: F401
    LoomDataLoader,
    move_to_device,
    ordering_sampler,
    with_distributed_sampler,
    with_users_distributed_sampler,
)
from torchloom.errors import MisuseError
from torchloom.precision import Precision

# Set on a user's module once it has been set up, so a second setup_module is caught.
SETUP_MARK = "_torchloom_is_setup"


# LightningModule's step methods: called on a set-up model, they run through the strategy like forward.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class LoomModule(nn.Module):
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
                _explain_skipped_call(error)
                raise
        return precision.convert_output(output)

    def mark_forward_method(self, method: str | MethodType) -> None:
        """Run the model's method `method` (a name or the bound method) through the strategy like forward, so
        that `model.generate(x)` or `model.my_step(batch)` synchronises gradients under DDP and unshards
        parameters under FSDP. The LightningModule step methods are marked already."""
        # A method read from this wrapper comes back wrapped (see __getattr__); it keeps the method's name.
        name = method if isinstance(method, str) else getattr(method, "__name__", None)
        if not isinstance(name, str) or not (isinstance(method, str) or callable(method)):
            raise TypeError(f"mark_forward_method expects a method or its name, got {type(method).__name__}.")
        if name == "forward":
            raise ValueError("forward already runs through the strategy; mark other methods only.")
        if not isinstance(getattr(self._original_module, name, None), MethodType):
            raise AttributeError(
                f"mark_forward_method({name!r}): {type(self._original_module).__name__}.{name} does not exist or is "
                "not a method."
            )
        self._forward_methods.add(name)

    def _through_forward(self, name: str) -> Callable[..., Any]:
        """`name` called as if it were forward: the arguments go through this wrapper's forward (precision,
        strategy wrapper, hooks), and where the wrapper calls the original module's forward, `name` runs
        instead. Inside it, the module's own forward is the real one again."""
        original = self._original_module
        method = getattr(original, name)

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            had_own = "forward" in original.__dict__
            saved = original.__dict__.get("forward")

            def restore() -> None:
                if had_own:
                    object.__setattr__(original, "forward", saved)
                else:
                    original.__dict__.pop("forward", None)

            def redirected(*inner_args: Any, **inner_kwargs: Any) -> Any:
                restore()  # the method may call self(...) or self.forward(...) itself
                return method(*inner_args, **inner_kwargs)

            object.__setattr__(original, "forward", redirected)
            try:
                return self.forward(*args, **kwargs)
            finally:
                restore()

        return call

    def _refusing_submodule_calls(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        """`method`, but calling a submodule that holds parameters inside it raises (it would bypass DDP/FSDP)."""
        original = self._original_module
        owner = type(original).__name__
        # Under DDP every rank holds the whole model: a call that records no gradients (inference under
        # torch.no_grad(), e.g. choosing actions or computing targets) has nothing to synchronise, so it may run
        # the layers directly. Sharded models hold only shards outside forward, so they are always refused.
        whole_model = isinstance(self._forward_module, DistributedDataParallel)

        def refuse(*_: Any) -> None:
            if whole_model and not torch.is_grad_enabled():
                return
            raise MisuseError(
                f"{owner}.{name}() was called on the set-up model and runs its layers outside the strategy's "
                f"forward, so under DDP/FSDP its gradients would not be synchronised (or its parameters not "
                f"gathered). Mark it once after setup: `model.mark_forward_method({name!r})`, or call it from "
                "inside forward."
            )

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            handles = [
                m.register_forward_pre_hook(refuse)
                for m in original.modules()
                if next(m.parameters(recurse=False), None) is not None
            ]
            try:
                return method(*args, **kwargs)
            finally:
                for handle in handles:
                    handle.remove()

        return call

    # Parameters and state under the original module's names, never "_forward_module.module.".
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self._original_module.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._original_module.parameters(recurse=recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self._original_module.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self._original_module.buffers(recurse=recurse)

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
            return self._through_forward(name)
        if self.__dict__["_wrapped_root"]:
            return self._refusing_submodule_calls(attr, name)
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


def _explain_skipped_call(error: RuntimeError) -> None:
    """A collective in forward or backward failed: if another rank was waiting in a call this rank skipped
    (`loom.save` on rank 0 only), raise the error that names it instead."""
    from torchloom import diagnostics

    skipped = diagnostics.skipped_call()
    if skipped is not None:
        raise MisuseError(skipped) from error


class LoomOptimizer:
    """The user's optimizer with `step()` routed through the precision (fp16 loss scaling). After each step it
    calls `on_after_optimizer_step(strategy=..., optimizer=...)` on every callback that has it (Fabric's hook).

    It is an instance of the user's optimizer class (so LR schedulers accept it) and shares its parameter groups
    and state, so changes made through either object show in both.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        precision: Precision,
        strategy: Any = None,
        callbacks: list[Any] | tuple[Any, ...] = (),
    ) -> None:
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_precision"] = precision
        precision.track(optimizer)
        self.__dict__["_strategy"] = strategy
        # The Loom's own list, as Fabric shares its list: a callback registered later (a LightningModule set up
        # after this optimizer) gets this optimizer's hooks too.
        self.__dict__["_callbacks"] = callbacks if isinstance(callbacks, list) else list(callbacks)
        self.__class__ = type(f"Loom{type(optimizer).__name__}", (LoomOptimizer, type(optimizer)), {})

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    def before_first_step(self, check: Callable[[], None]) -> None:
        """Run `check` at the first `step()` (it raises to refuse the step)."""
        self.__dict__["_first_step_check"] = check

    def step(self, closure: Any = None) -> Any:
        check = self.__dict__.pop("_first_step_check", None)
        if check is not None:
            check()
        kwargs = {} if closure is None else {"closure": closure}
        with _kinds_apart(self._optimizer):
            output = self._precision.optimizer_step(self._optimizer, **kwargs)
        # Fabric's hook, called on every callback that has it after each step (skipped or not by the scaler).
        for callback in self._callbacks:
            hook = getattr(callback, "on_after_optimizer_step", None)
            if callable(hook):
                hook(strategy=self._strategy, optimizer=self._optimizer)
        return output

    def zero_grad(self, set_to_none: bool = True) -> None:
        defaults = self._optimizer.defaults
        if (
            set_to_none
            or not (defaults.get("foreach") or defaults.get("fused"))
            or not _mixes_kinds(self._optimizer)
        ):
            self._optimizer.zero_grad(set_to_none=set_to_none)
            return
        # torch zeroes the gradients of one device and dtype in one foreach call, across groups: mixed DTensor
        # and plain gradients fail there (see _kinds_apart). One tensor at a time instead, for this call.
        saved = {k: defaults[k] for k in ("foreach", "fused") if k in defaults}
        defaults.update(dict.fromkeys(saved, False))
        try:
            self._optimizer.zero_grad(set_to_none=False)
        finally:
            defaults.update(saved)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_optimizer"], name)

    def __repr__(self) -> str:
        return f"Loom{self._optimizer!r}"


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
            optimizer.step = own  # type: ignore[method-assign]
        else:
            del optimizer.step


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LoomOptimizer) else optimizer


class JointModule(nn.Module):
    """Several set-up modules seen as one, each a child under its own name: what holds an optimizer over the
    parameters of several set-up modules (as Fabric allows) for checkpoints (its state is keyed by `name.parameter`,
    so a sharded state can be saved and loaded by name) and for clipping (the shard groups of every part). It is
    never trained, wrapped or registered anywhere: the parts stay the user's."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)

    @staticmethod
    def valid_name(name: str) -> bool:
        """Whether `name` can name a part (add_module's rules, and not an attribute every module has)."""
        return bool(name) and "." not in name and not hasattr(nn.Module, name)


def joint_owner(optimizer: Optimizer, named: dict[str, nn.Module]) -> JointModule | None:
    """A `JointModule` of the modules of `named` that hold the optimizer's parameters, when they hold all of them
    and no one of them does; else None."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    parts: dict[str, nn.Module] = {}
    held: set[int] = set()
    for name, module in named.items():
        own = {id(p) for p in module.parameters()}
        if ids & own and all(module is not m for m in parts.values()):
            parts[name] = module
            held |= own
    if len(parts) < 2 or not ids <= held or not all(JointModule.valid_name(n) for n in parts):
        return None
    return JointModule(parts)


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
