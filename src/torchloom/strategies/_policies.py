"""The sharded strategies' options as users pass them: wrapping and activation-checkpointing policies in every
form torch and Fabric accept, `cpu_offload=`, and Fabric's deprecated `activation_checkpointing=`.

Every policy form becomes a module-level object (`_IsInstance`, `_InWrapPolicy`, or the user's own callable), never
a local function, so that a strategy pickles: `launch(fn)` sends the Loom and its strategy to spawned ranks.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from torchloom.errors import ConfigurationError

ModulePolicy = Callable[[nn.Module], bool]


class OptionTypeError(ConfigurationError, TypeError):
    """A strategy option of a type it does not take: a TypeError (as in PyTorch and Fabric) that is also
    torchloom's ConfigurationError."""


class _IsInstance:
    """A policy of module classes: whether a module is an instance of one of them."""

    def __init__(self, classes: tuple[type[nn.Module], ...]) -> None:
        self.classes = classes

    def __call__(self, module: nn.Module) -> bool:
        return isinstance(module, self.classes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.classes!r})"


class _InWrapPolicy:
    """FSDP's `ModuleWrapPolicy` asked "is this module one of yours?"."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def __call__(self, module: nn.Module) -> bool:
        # Its documented call: (module, recurse, nonwrapped_numel); recurse=False asks "is this one of them?".
        return bool(self.policy(module, False, -1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.policy!r})"


def is_wrap_policy(policy: Any) -> bool:
    """Whether `policy` has FSDP1's auto-wrap form rather than being a predicate `(module) -> bool`: a policy
    object (`ModuleWrapPolicy`, `CustomPolicy`) or a callable taking `(module, recurse, nonwrapped_numel)`, such
    as `functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})` (what Fabric's users pass
    to both `auto_wrap_policy` and `activation_checkpointing_policy`)."""
    wrap = sys.modules.get("torch.distributed.fsdp.wrap")
    if wrap is not None and isinstance(policy, (wrap.ModuleWrapPolicy, wrap.CustomPolicy)):
        return True
    if not callable(policy) or isinstance(policy, type):
        return False
    try:
        params = inspect.signature(policy).parameters
    except (TypeError, ValueError):  # builtins without a signature: call them as predicates
        return False
    if "recurse" in params or "nonwrapped_numel" in params:
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params.values() if p.kind in positional and p.default is inspect.Parameter.empty]
    return len(required) >= 3


def as_module_policy(policy: Any, what: str, wrap_form: bool = False) -> Any:
    """A set of module classes, FSDP's `ModuleWrapPolicy` (what Fabric's users pass), or a callable(module) ->
    bool, as a callable(module) -> bool (None stays None). With `wrap_form`, a policy in FSDP1's auto-wrap form
    (`is_wrap_policy`) is returned as it is, for torch to apply with its own recursion (size-based policies need
    the count of parameters not yet wrapped, which only that recursion knows); without, it is refused."""
    if policy is None:
        return None
    wrap = sys.modules.get("torch.distributed.fsdp.wrap")
    if wrap is not None and isinstance(policy, wrap.ModuleWrapPolicy):
        return _InWrapPolicy(policy)
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise ConfigurationError(
                f"{what} must be a set of nn.Module classes or a callable, got {policy!r}."
            )
        return _IsInstance(classes)
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return _IsInstance((policy,))
    if is_wrap_policy(policy):
        if wrap_form:
            return policy
        raise ConfigurationError(
            f"{what}={policy!r} is an FSDP1 auto-wrap policy (module, recurse, nonwrapped_numel), which {what} "
            "does not take: pass the set of your block classes (e.g. {Block}) or a callable(module) -> bool."
        )
    if callable(policy):
        return policy
    raise ConfigurationError(f"{what} must be a set of nn.Module classes or a callable, got {policy!r}.")


def fsdp_types(*names: str) -> tuple[Any, ...]:
    """torch.distributed.fsdp's classes `names`, or () when nobody has imported it: an object of one of them
    cannot exist then, and importing it here would cost a second in the launching process."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return tuple(getattr(fsdp, n) for n in names) if fsdp is not None else ()


def offload_params(value: Any, accepted: tuple[str, ...], owner: str) -> bool:
    """Whether `cpu_offload=` asks to offload: a bool, FSDP1's `CPUOffload(offload_params=...)`, or (FSDP2's)
    `CPUOffloadPolicy()` (offload) / `OffloadPolicy()` (none)."""
    if isinstance(value, bool):
        return value
    cpu_offload = fsdp_types("CPUOffload")
    if cpu_offload and isinstance(value, cpu_offload):
        return bool(value.offload_params)
    if "CPUOffloadPolicy" in accepted and (policies := fsdp_types("CPUOffloadPolicy", "OffloadPolicy")):
        if isinstance(value, policies[0]):
            return True
        if type(value) is policies[1]:
            return False
    names = ", ".join(f"torch.distributed.fsdp.{n}" for n in accepted)
    raise OptionTypeError(
        f"{owner}(cpu_offload={value!r}): cpu_offload must be a bool or one of {names}, got "
        f"{type(value).__name__}. Pass True/False, or e.g. CPUOffload(offload_params=True)."
    )


def checkpointing_policy(owner: str, old: Any, policy: Any) -> Any:
    """Fabric's deprecated `activation_checkpointing=` (a module class or a list of them) as a policy."""
    if old is None:
        return policy
    if policy is not None:
        raise ConfigurationError(
            "You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter."
        )
    classes = tuple(old) if isinstance(old, (list, tuple, set, frozenset)) else (old,)
    as_module_policy(set(classes), "activation_checkpointing")  # the same error as the policy for non-classes
    # Fabric's own deprecation message, so that a Fabric user recognises it. FutureWarning: shown by default.
    warnings.warn(
        f"`{owner}(activation_checkpointing={old})` is deprecated, use "
        f"`{owner}(activation_checkpointing_policy={set(classes)})` instead.",
        FutureWarning,
        stacklevel=4,  # the user's call: checkpointing_policy <- ShardedStrategy <- the flavour's __init__
    )
    return set(classes)


def apply_activation_checkpointing(module: nn.Module, policy: Any) -> None:
    """Wrap the modules `policy` selects in torch's checkpoint wrapper, unless the user placed one already."""
    if policy is None:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )

    if any(isinstance(m, CheckpointWrapper) for m in module.modules()):
        return  # the user already placed activation checkpointing; do not nest another layer
    if is_wrap_policy(policy):
        apply_activation_checkpointing(module, auto_wrap_policy=policy)
    else:
        apply_activation_checkpointing(module, check_fn=policy)


# ---- tied weights under a wrapping policy ----------------------------------------------------------------------
def tie_splitters(model: nn.Module) -> dict[int, str]:
    """id(module) -> its path, for every module that a unit must not be made of because it holds some but not all
    users of a tied weight (an input embedding tied to the output head under a policy of `nn.Linear`): each unit
    would shard its own copy (the copies train apart under fully_shard; FullyShardedDataParallel crashes). Left
    out of the policy, its parameters join the unit above it, and the tied weight lands in the lowest unit that
    holds every user (the root at the latest), where torch shards a shared parameter once."""
    users: dict[int, set[str]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            users.setdefault(id(p), set()).add(path)
    ties = [paths for paths in users.values() if len(paths) > 1]
    splitters: dict[int, str] = {}
    for path, mod in model.named_modules():
        if not path:
            continue
        inside = [[u for u in paths if u == path or u.startswith(path + ".")] for paths in ties]
        if any(0 < len(held) < len(paths) for held, paths in zip(inside, ties, strict=True)):
            splitters[id(mod)] = path
    return splitters


class _Skipping:
    """A policy that picks what the given one picks, except the modules in `skip` (by id): as a predicate
    `(module) -> bool | dict` for `CustomPolicy`, or in FSDP1's legacy auto-wrap form."""

    def __init__(self, policy: Any, skip: dict[int, str], legacy: bool) -> None:
        self.policy, self.skip, self.legacy = policy, skip, legacy

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        recurse = args[0] if args else kwargs.get("recurse", False)
        if id(module) in self.skip and not (self.legacy and recurse):
            return False
        return self.policy(module, *args, **kwargs)


def skipping(policy: Any, skip: dict[int, str]) -> Any:
    """FSDP1's `auto_wrap_policy` (a set of classes, a predicate, `ModuleWrapPolicy`, `CustomPolicy`, or a legacy
    `(module, recurse, nonwrapped_numel)` callable) with the modules in `skip` left out."""
    if not skip:
        return policy
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    if isinstance(policy, (set, frozenset, list, tuple)):
        policy = ModuleWrapPolicy(set(policy))
    elif isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = ModuleWrapPolicy({policy})
    if isinstance(policy, ModuleWrapPolicy):
        return CustomPolicy(_Skipping(_InWrapPolicy(policy), skip, legacy=False))
    if isinstance(policy, CustomPolicy):
        # CustomPolicy keeps its predicate (which may answer with a unit's keyword arguments) in `_lambda_fn`.
        return CustomPolicy(_Skipping(policy._lambda_fn, skip, legacy=False))
    if is_wrap_policy(policy):
        return _Skipping(policy, skip, legacy=True)
    return CustomPolicy(_Skipping(policy, skip, legacy=False))
