"""What `setup_module`, `setup_optimizers` and `setup_dataloaders` return.

The wrappers are thin: they route forward, `optimizer.step()` and batches through the strategy and precision,
and otherwise behave like the user's own objects (attributes, `state_dict()` keys without wrapper prefixes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from torchloom.errors import MisuseError
from torchloom.precision import Precision

# Set on a user's module once it has been set up, so a second setup_module is caught.
SETUP_MARK = "_torchloom_is_setup"


class LoomModule(nn.Module):
    """A set-up model. Calling it runs the forward through the strategy's wrapper and the precision.

    `.module` is the user's original module, `.forward_module` what the forward runs through (the DDP wrapper,
    the root FSDP unit, or the module itself). Attributes, parameters and `state_dict()` come from the original
    module under its own key names.
    """

    def __init__(self, forward_module: nn.Module, original_module: nn.Module, precision: Precision) -> None:
        super().__init__()
        self._forward_module = forward_module
        # Not registered as a child: its parameters are already reachable through the forward module.
        object.__setattr__(self, "_original_module", original_module)
        object.__setattr__(self, "_precision", precision)

    @property
    def module(self) -> nn.Module:
        return self._original_module

    @property
    def forward_module(self) -> nn.Module:
        return self._forward_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._forward_module(*args, **kwargs)
        return precision.convert_output(output)

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
            return getattr(self._original_module, name)

    def __repr__(self) -> str:
        return f"LoomModule({self._original_module!r})"


class LoomOptimizer:
    """The user's optimizer with `step()` routed through the precision (fp16 loss scaling).

    It is an instance of the user's optimizer class (so LR schedulers accept it) and shares its parameter groups
    and state, so changes made through either object show in both.
    """

    def __init__(self, optimizer: Optimizer, precision: Precision) -> None:
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_precision"] = precision
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

    def step(self, closure: Any = None) -> Any:
        kwargs = {} if closure is None else {"closure": closure}
        return self._precision.optimizer_step(self._optimizer, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

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


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LoomOptimizer) else optimizer


def unwrap_module(module: Any) -> nn.Module:
    return module.module if isinstance(module, LoomModule) else module


def state_module(module: Any) -> nn.Module:
    """The module whose state dict is the model's: the forward module of a set-up model (it includes a wrapped
    FSDP root, which owns the root's parameters), else the module itself."""
    return module.forward_module if isinstance(module, LoomModule) else module


def move_to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor in a nested structure (dicts, lists, tuples) to `device`."""
    non_blocking = device.type == "cuda"
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, data
    )


class LoomDataLoader:
    """Iterates the user's loader, advances the DistributedSampler's epoch and moves batches to the device."""

    def __init__(self, loader: DataLoader, device: torch.device | None) -> None:
        self._loader = loader
        self._device = device
        self._epoch = 0

    @property
    def loader(self) -> DataLoader:
        return self._loader

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        # Each pass is a new epoch: a shuffling sampler must reshuffle, identically on every rank.
        sampler = getattr(self._loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(self._epoch)
        self._epoch += 1
        for batch in self._loader:
            yield batch if self._device is None else move_to_device(batch, self._device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


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


def with_distributed_sampler(loader: DataLoader, num_replicas: int, rank: int, seed: int = 0) -> DataLoader:
    """Rebuild `loader` so each rank reads its own 1/num_replicas of the data, keeping its shuffle setting."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return loader  # an iterable dataset shards itself
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not torch.utils.data.BatchSampler:
        raise MisuseError(
            f"The dataloader uses a custom batch_sampler ({type(loader.batch_sampler).__name__}), which torchloom "
            "cannot split across ranks. Shard it yourself and pass use_distributed_sampler=False."
        )
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise MisuseError(
            f"The dataloader uses a custom sampler ({type(loader.sampler).__name__}), which torchloom cannot split "
            "across ranks. Make it rank-aware and pass use_distributed_sampler=False."
        )
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = DistributedSampler(
        loader.dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=bool(loader.drop_last),
    )
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return DataLoader(loader.dataset, sampler=sampler, **kwargs)
