"""Callbacks (`Loom(callbacks=...)`) and how their hooks are called, as Fabric calls them: `loom.call(name, ...)`
and the hooks torchloom calls itself (`on_after_setup`). Also how a function's signature is read to decide what
to pass it (the callbacks' keyword arguments, `launch`'s function)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from torchloom.errors import warn_user


def as_list(objects: Any) -> list[Any]:
    """`Loom(callbacks=...)` or `Loom(loggers=...)` as a list: None is none, a list or tuple its items, else one."""
    if objects is None:
        return []
    return list(objects) if isinstance(objects, (list, tuple)) else [objects]


def accepted_kwargs(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `method` accepts (all of them if it takes `**kwargs` or has no signature)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def named_parameters(method: Callable[..., Any]) -> set[str]:
    """The parameters `method` names (that a keyword can fill); empty where it has no signature to read."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def takes_the_loom(fn: Callable[..., Any]) -> bool:
    """Whether `fn` accepts a first positional argument (the Loom launch passes it)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): the call itself will tell
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)


def hook_methods(callbacks: list[Any], hook_name: str) -> Iterator[Callable[..., Any]]:
    """Each callback's `hook_name` method; an attribute of that name that is not callable is skipped with a
    warning, as Fabric does."""
    for callback in callbacks:
        method = getattr(callback, hook_name, None)
        if method is None:
            continue
        if not callable(method):
            warn_user(f"Skipping the callback `{type(callback).__name__}.{hook_name}`: it is not callable.")
            continue
        yield method


def call(callbacks: list[Any], hook_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """`loom.call`: `hook_name(*args, **kwargs)` on every callback that has it, each given only the keyword
    arguments its signature accepts."""
    for method in hook_methods(callbacks, hook_name):
        method(*args, **accepted_kwargs(method, kwargs))


def call_builtin_hook(
    callbacks: list[Any], hook_name: str, kwargs: dict[str, Any], own_names: dict[str, Any]
) -> None:
    """A hook torchloom itself calls, as `call` does with Fabric's keywords (`kwargs`): a method that takes
    `**kwargs` gets exactly Fabric's, so a callback written for Fabric, or a `Mock(wraps=...)` of one, that
    forwards them to `def hook(self, fabric, module)` works unchanged. torchloom's own spellings
    (`own_names`, e.g. `loom=`) go only to a method that names them."""
    for method in hook_methods(callbacks, hook_name):
        named = named_parameters(method)
        extra = {k: v for k, v in own_names.items() if k in named and k not in kwargs}
        method(**accepted_kwargs(method, kwargs), **extra)
