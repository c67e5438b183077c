"""What `setup_module`, `setup_optimizers` and `setup_dataloaders` return.

The wrappers are thin: they route forward, `optimizer.step()` and batches through the strategy and precision,
and otherwise behave like the user's own objects (attributes, `state_dict()` keys without wrapper prefixes).
`LoomModule` lives here; how its methods reach the strategy is `_module_forward`'s, its names are
`_module_names`'s, `LoomOptimizer` is `_optimizer_wrapper`'s, mixed parameter groups `_mixed_groups`'s and
optimizers over several models `_joint`'s (all re-exported here).
"""

from __future__ import annotations

import inspect
import os
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

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
from torchloom.data import (  # noqa: F401 - LoomDataLoader and move_to_device are part of this module's API
    KEPT,
    SEEDED,
    WRAPPED,
    LoomDataLoader,
    ResumableSampler,
    SeededPerSample,
    move_to_device,
)
from torchloom.errors import MisuseError, MisuseTypeError
from torchloom.precision import Precision
from torchloom.seed import SEED_WORKERS_ENV

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


# DataLoader.__init__ arguments that a rebuilt loader must keep.
_LOADER_ARGS = (
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
)


def _plain_order(sampler: Any) -> bool:
    """Whether `sampler` reads the dataset once in order or in one uniform shuffle, which DistributedSampler's
    order replaces as Fabric's does: a SequentialSampler, or a RandomSampler without replacement or num_samples
    (exact types). Fabric also replaces subclasses and a RandomSampler with replacement or num_samples, silently
    dropping what they draw; torchloom splits their own draw instead (a deliberate difference)."""
    if type(sampler) is SequentialSampler:
        return True
    return type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None


def with_distributed_sampler(
    loader: DataLoader, num_replicas: int, rank: int, seed: int = 0, distributed: bool = True
) -> DataLoader:
    """Rebuild `loader` to read through a `torchloom.data.ResumableSampler` that gives the order Fabric's
    `setup_dataloaders` gives and can start an epoch part-way (see `torchloom.data`).

    `distributed` (Fabric's parallel strategies, even on one process): a `RandomSampler` or `SequentialSampler`
    becomes DistributedSampler's order for `seed` (shuffled for a RandomSampler), any other sampler is drawn
    whole at the start of each pass and split across ranks (DistributedSamplerWrapper's). Otherwise (one device)
    the user's sampler is iterated as it is."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return loader  # an iterable dataset shards itself
    if isinstance(ordering_sampler(loader), DistributedSampler):
        # The user's own split (a subclass too): kept, never split again.
        return with_users_distributed_sampler(loader)
    custom_batches = (
        loader.batch_sampler is not None and type(loader.batch_sampler) is not torch.utils.data.BatchSampler
    )
    if (custom_batches or not hasattr(loader.sampler, "__len__")) and num_replicas == 1:
        return loader  # one process reads everything: nothing to split (but no mid-epoch resume either)
    if custom_batches:
        # A TypeError too, as Fabric raises for a custom batch sampler it cannot re-instantiate.
        raise MisuseTypeError(
            f"The dataloader uses a custom batch_sampler ({type(loader.batch_sampler).__name__}), which torchloom "
            "cannot split across ranks. Shard it yourself and pass use_distributed_sampler=False."
        )
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    user_sampler = loader.sampler
    if loader.batch_size is None and loader.batch_sampler is not None:
        # batch_sampler=BatchSampler(sampler, ...) given explicitly: loader.sampler is a placeholder the
        # DataLoader made (SequentialSampler) and loader.batch_size None; the order and the batching are the
        # BatchSampler's.
        user_sampler = loader.batch_sampler.sampler
        kwargs["batch_size"] = loader.batch_sampler.batch_size
        kwargs["drop_last"] = bool(loader.batch_sampler.drop_last)
    if not hasattr(user_sampler, "__len__"):
        # A TypeError too: Fabric's DistributedSamplerWrapper fails on len() of such a sampler with one.
        raise MisuseTypeError(
            f"The dataloader's custom sampler ({type(user_sampler).__name__}) has no len(), so torchloom "
            "cannot split its draw across ranks. Give it __len__, or make it rank-aware and pass "
            "use_distributed_sampler=False."
        )
    if not distributed:
        rule = KEPT
    elif _plain_order(user_sampler):
        rule = SEEDED
    else:
        rule = WRAPPED
    # drop_last stays the loader's (its last, short batch); Fabric's sampler pads, never drops.
    sampler = ResumableSampler(
        loader.dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=isinstance(user_sampler, RandomSampler),
        seed=seed,
        sampler=user_sampler,
        rule=rule,
    )
    try:
        return _rebuild_reading(loader, sampler, kwargs)
    except MisuseError:
        if num_replicas > 1:
            raise
        # One process reads everything: Fabric hands such a loader back untouched, and so does torchloom (it then
        # has no mid-epoch resume, as for a custom batch_sampler; its state_dict says so inside an epoch).
        return loader


def ordering_sampler(loader: DataLoader) -> Any:
    """The sampler that orders the loader's samples: its sampler, or that of a `BatchSampler` given as
    batch_sampler (the loader's own `sampler` is then a placeholder)."""
    if loader.batch_size is None and type(loader.batch_sampler) is torch.utils.data.BatchSampler:
        return loader.batch_sampler.sampler
    return loader.sampler


def users_distributed_sampler(loader: DataLoader) -> DistributedSampler | None:
    """The user's own torch `DistributedSampler` the loader reads through (as its sampler, or inside a
    `BatchSampler` given as batch_sampler), if any. Only torch's class itself: a subclass may order otherwise."""
    sampler = ordering_sampler(loader)
    return sampler if type(sampler) is DistributedSampler else None


def with_users_distributed_sampler(loader: DataLoader) -> DataLoader:
    """`loader`, rebuilt to read its user's `DistributedSampler` through a `ResumableSampler` of the same
    replicas, rank, seed, shuffle and drop_last: the same samples on this rank, in the same order, every epoch
    (its order is a function of those and the epoch), and a position inside an epoch that a checkpoint can
    resume, at the same world size or another (the global order is the same at every world size). Done with or
    without `use_distributed_sampler`: the sampler is kept as it is, only made resumable. A loader that cannot
    be rebuilt (or a subclass of DistributedSampler) is returned as it is: it saves between epochs only."""
    user = users_distributed_sampler(loader)
    if user is None:
        return loader
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    if loader.batch_size is None and loader.batch_sampler is not None:
        kwargs["batch_size"] = loader.batch_sampler.batch_size
        kwargs["drop_last"] = bool(loader.batch_sampler.drop_last)
    sampler = ResumableSampler(
        user.dataset,
        num_replicas=user.num_replicas,
        rank=user.rank,
        shuffle=user.shuffle,
        seed=user.seed,
        drop_last=user.drop_last,
        sampler=user,  # its set_epoch is still called, as Fabric's loader calls it
        rule=SEEDED,
    )
    try:
        return _rebuild_reading(loader, sampler, kwargs)
    except MisuseError:
        return loader  # its own DistributedSampler still splits the data; state_dict refuses inside an epoch


def _rebuild_reading(loader: DataLoader, sampler: ResumableSampler, kwargs: dict[str, Any]) -> DataLoader:
    """`loader` rebuilt to read through `sampler`, with its worker settings made consistent."""
    dataset = loader.dataset
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    elif os.environ.get(SEED_WORKERS_ENV) != "0":
        # Workers' random streams would depend on which batches each happened to load: seed every sample.
        dataset, sampler.keyed = SeededPerSample(dataset), True
    return _rebuild(loader, dataset, sampler, kwargs)


def _rebuild(
    loader: DataLoader, dataset: Any, sampler: DistributedSampler, kwargs: dict[str, Any]
) -> DataLoader:
    """A loader of the user's class reading `dataset` through `sampler`. A DataLoader subclass (one whose
    `__iter__` transforms batches, say) is rebuilt as itself: each argument of its `__init__` is the one torchloom
    sets, else the loader's attribute of the same name, else its default. One that cannot be rebuilt so is
    refused: a plain DataLoader in its place would silently drop what the subclass does."""
    cls = type(loader)
    if cls is DataLoader:
        return DataLoader(dataset, sampler=sampler, **kwargs)
    ours = {"dataset": dataset, "sampler": sampler, **kwargs}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    args: dict[str, Any] = {}
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name in ours:
            args[param.name] = ours[param.name]
        elif hasattr(loader, param.name):
            args[param.name] = getattr(loader, param.name)
        elif param.default is param.empty:
            raise MisuseError(
                f"setup_dataloaders must rebuild your {cls.__name__} with a sampler that splits the data across "
                f"ranks, but its __init__ argument {param.name!r} is not an attribute of the loader, so its value "
                f"is unknown. Store it as `self.{param.name}` in __init__, or shard the data yourself and pass "
                "use_distributed_sampler=False."
            )
    if takes_any:
        args.update({k: v for k, v in ours.items() if k not in named})
    missing = [k for k in ("dataset", "sampler") if k not in args]
    if missing:
        raise MisuseError(
            f"setup_dataloaders must rebuild your {cls.__name__} with a sampler that splits the data across ranks, "
            f"but its __init__ takes no {' or '.join(repr(k) for k in missing)} argument to pass it through. "
            "Accept and pass on the DataLoader's arguments (e.g. **kwargs), or shard the data yourself and pass "
            "use_distributed_sampler=False."
        )
    try:
        rebuilt = cls(**args)
    except TypeError as error:
        raise MisuseTypeError(
            f"setup_dataloaders must rebuild your {cls.__name__} with a sampler that splits the data across ranks, "
            f"but {cls.__name__}(...) with the loader's own arguments ({', '.join(sorted(args))}) failed: {error}. "
            "Make its __init__ take the DataLoader's arguments under their names and pass them on (no fixed "
            "dataset or batch_size inside it), or shard the data yourself and pass use_distributed_sampler=False."
        ) from error
    if rebuilt.sampler is not sampler:
        raise MisuseError(
            f"setup_dataloaders rebuilt your {cls.__name__} with a sampler that splits the data across ranks, but "
            "its __init__ did not use it. Pass `sampler` on to DataLoader.__init__, or shard the data yourself and "
            "pass use_distributed_sampler=False."
        )
    return rebuilt


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
