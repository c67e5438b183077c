"""Host and device apart in a planned CUDA job under CPU offload.

The plan's tensors are all fake CPU tensors, so the copies that CPU offload makes between the GPU and the CPU's
(pinned) memory are no-ops there and nothing tells the host's memory from the device's. For FSDP2's
`CPUOffloadPolicy` (torchloom's `cpu_offload=True` under `strategy="fsdp2"`), the plan makes those copies itself
and keeps the host's storages apart (`MemoryAccount.track_host`): they are not the device's, the caching
allocator never sees them, and the plan reports their peak as a second number.

Told by where torch makes them (the call's own frame in torch/distributed/fsdp/_fully_shard/):

- `pin_memory()` (what the policy's default `pin_memory=True` calls on each shard): a copy in the host's memory;
  `is_pinned()` answers for it;
- `.cpu()` / `.to("cpu")` in FSDP2's sharding of a parameter (`_init_sharded_param`, `reset_sharded_param`) and
  its gradient's device-to-host copy after the reduce-scatter (`foreach_reduce`): a copy in the host's memory;
- `.to(device)` of a host shard in `all_gather_inputs` (the host-to-device copy before each all-gather): a copy
  in the device's memory.

Whatever an op computes from the host's tensors alone is the host's too (the optimizer's state and step over
the offloaded shards, which run on the CPU, in the per-parameter loop torch chooses there). Any other
`pin_memory()` of a fake tensor is a host copy too (a real tensor's, a data loader's batch, is torch's own).
Not modelled: FSDP1's `CPUOffload` (a CUDA plan refuses it, see `_fake_rank._offload_accepted`), and host memory
that is neither pinned nor offloaded state (the script's own `.cpu()` copies).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from torchloom import _torch_compat

_FSDP2 = os.sep + os.path.join("distributed", "fsdp", "_fully_shard") + os.sep
_TO_HOST = {"_init_sharded_param", "reset_sharded_param", "foreach_reduce"}
_TO_DEVICE = {"all_gather_inputs"}


def _fsdp2_caller(frame: Any) -> str | None:
    """The FSDP2 function that made the call (None: someone else's)."""
    if _FSDP2 in frame.f_code.co_filename:
        return str(frame.f_code.co_name)
    return None


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`tensor.to(...)`'s arguments name the CPU as the device (not only a dtype)."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, str) and value.split(":")[0] == "cpu":
            return True
        if isinstance(value, torch.device) and value.type == "cpu":
            return True
    return False


def install(account: Any) -> Callable[[], None]:
    """Keep the host's memory apart in `account` from now on; returns a function that undoes it. The tensor
    methods themselves are wrapped (not a torch-function mode): FSDP2 copies a gradient to the host in its
    post-backward hook, where autograd runs no torch-function mode."""
    account.track_host = True
    tensor = torch.Tensor
    originals = {name: getattr(tensor, name) for name in ("to", "cpu", "pin_memory", "is_pinned")}

    @contextmanager
    def made_on(place: str) -> Iterator[None]:
        before = account.placement
        account.placement = place
        try:
            yield
        finally:
            account.placement = before

    def moved(self: torch.Tensor, caller: str | None) -> torch.Tensor | None:
        """The copy FSDP2's call makes between the host and the device (None: no copy)."""
        if caller in _TO_HOST and not account.is_host(self):
            with made_on("host"):
                return self.clone()
        if caller in _TO_DEVICE and account.is_host(self):
            with made_on("device"):
                return self.clone()
        return None

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _to_cpu(args, kwargs):
            copy = moved(self, _fsdp2_caller(sys._getframe(1)))
            if copy is not None:
                return originals["to"](copy, *args, **kwargs)
        return originals["to"](self, *args, **kwargs)

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        copy = moved(self, _fsdp2_caller(sys._getframe(1)))
        return copy if copy is not None else originals["cpu"](self, *args, **kwargs)

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _torch_compat.is_fake(self):  # a real tensor (a data loader's batch, in its own thread)
            return originals["pin_memory"](self, *args, **kwargs)
        if account.is_host(self):
            return self
        with made_on("host"):
            return self.clone()

    def is_pinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        if not _torch_compat.is_fake(self):
            return bool(originals["is_pinned"](self, *args, **kwargs))
        return bool(account.is_host(self))

    for name, method in (("to", to), ("cpu", cpu), ("pin_memory", pin_memory), ("is_pinned", is_pinned)):
        setattr(tensor, name, method)
    undo_optimizers = _optimizers_on_the_host(account)

    def undo() -> None:
        undo_optimizers()
        for name, method in originals.items():
            setattr(tensor, name, method)
        account.track_host = False

    return undo


def _optimizers_on_the_host(account: Any) -> Callable[[], None]:
    """An optimizer over offloaded parameters runs on the CPU, which has no foreach kernels: left to choose, torch
    runs its per-parameter loop there (`_default_to_fused_or_foreach`, which each optimizer's module imported by
    name), so the plan does too for parameters in the host's memory."""
    import importlib
    import pkgutil

    import torch.optim

    from torchloom.planning.tracker import _flat_tensors

    def on_host(param: torch.Tensor) -> bool:
        found: list[torch.Tensor] = []
        _flat_tensors(param, found)
        return any(account.is_host(t) for t in found)

    patched: list[tuple[Any, Any]] = []
    for info in pkgutil.iter_modules(torch.optim.__path__):
        module = importlib.import_module(f"torch.optim.{info.name}")
        original = getattr(module, "_default_to_fused_or_foreach", None)
        if original is None:
            continue

        def choose(
            params: Any, differentiable: bool, use_fused: bool = False, _original: Any = original
        ) -> Any:
            fused, foreach = _original(params, differentiable, use_fused)
            if foreach and any(p is not None and on_host(p) for p in params):
                foreach = False
            return fused, foreach

        module._default_to_fused_or_foreach = choose  # type: ignore[attr-defined]
        patched.append((module, original))

    def undo() -> None:
        for module, original in patched:
            module._default_to_fused_or_foreach = original

    return undo
