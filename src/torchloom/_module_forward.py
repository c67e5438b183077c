"""How a set-up model's methods reach the strategy: a method marked as a forward method runs through the wrapper's
forward (DDP's gradient sync, FSDP's unsharding, the precision's autocast), any other method that runs a layer
with parameters is refused on a wrapped root (it would bypass that path). Used by `LoomModule`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchloom.errors import MisuseError

# LightningModule's step methods: called on a set-up model, they run through the strategy like forward.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def forward_method_name(original: nn.Module, method: str | MethodType) -> str:
    """The name of `method` (a name or the bound method) that `mark_forward_method` may mark on `original`."""
    # A method read from the wrapper comes back wrapped (see LoomModule.__getattr__); it keeps the method's name.
    name = method if isinstance(method, str) else getattr(method, "__name__", None)
    if not isinstance(name, str) or not (isinstance(method, str) or callable(method)):
        raise TypeError(f"mark_forward_method expects a method or its name, got {type(method).__name__}.")
    if name == "forward":
        raise ValueError("forward already runs through the strategy; mark other methods only.")
    if not isinstance(getattr(original, name, None), MethodType):
        raise AttributeError(
            f"mark_forward_method({name!r}): {type(original).__name__}.{name} does not exist or is "
            "not a method."
        )
    return name


def through_forward(forward: Callable[..., Any], original: nn.Module, name: str) -> Callable[..., Any]:
    """`name` called as if it were forward: the arguments go through the wrapper's `forward` (precision,
    strategy wrapper, hooks), and where the wrapper calls the original module's forward, `name` runs
    instead. Inside it, the module's own forward is the real one again."""
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
            return forward(*args, **kwargs)
        finally:
            restore()

    return call


def refusing_submodule_calls(
    original: nn.Module, forward_module: nn.Module, method: Callable[..., Any], name: str
) -> Callable[..., Any]:
    """`method`, but calling a submodule that holds parameters inside it raises (it would bypass DDP/FSDP)."""
    owner = type(original).__name__
    # Under DDP every rank holds the whole model: a call that records no gradients (inference under
    # torch.no_grad(), e.g. choosing actions or computing targets) has nothing to synchronise, so it may run
    # the layers directly. Sharded models hold only shards outside forward, so they are always refused.
    whole_model = isinstance(forward_module, DistributedDataParallel)

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


def explain_skipped_call(error: RuntimeError) -> None:
    """A collective in forward or backward failed: if another rank was waiting in a call this rank skipped
    (`loom.save` on rank 0 only), raise the error that names it instead."""
    from torchloom import diagnostics

    skipped = diagnostics.skipped_call()
    if skipped is not None:
        raise MisuseError(skipped) from error
