"""Data parallel: every rank holds the whole model; DistributedDataParallel averages gradients in backward."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchloom import _run_protocol
from torchloom.errors import ConfigurationError
from torchloom.strategies.parallel import ParallelStrategy, refuse_options


class DDPStrategy(ParallelStrategy):
    """PyTorch's `DistributedDataParallel`. Extra keyword arguments (e.g. `find_unused_parameters`,
    `static_graph`, `bucket_cap_mb`, `gradient_as_bucket_view`) go to `DistributedDataParallel` unchanged.
    `start_method="fork"` makes `launch(fn)` fork its ranks (Fabric's "ddp_notebook"), so `fn` may be defined in a
    notebook cell."""

    name = "ddp"

    def __init__(
        self,
        timeout: timedelta | None = None,
        process_group_backend: str | None = None,
        start_method: str = "spawn",
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend)
        if start_method not in ("spawn", "fork"):
            raise ConfigurationError(
                f"DDPStrategy(start_method={start_method!r}) is not valid: 'spawn' (the default: launch(fn) needs "
                "an importable fn) or 'fork' (fn may live in a notebook; what strategy='ddp_notebook' picks)."
            )
        #: How `launch(fn)` starts the ranks.
        self.start_method = start_method
        refuse_options(
            type(self).__name__, ddp_kwargs, {"device_ids": "set by torchloom to each rank's device"}
        )
        self.ddp_kwargs = ddp_kwargs

    # In a replica group (torchloom.fault_tolerance): DDP averages the gradients inside the group, the group's
    # `ReplicaGroup` across the groups, bucket by bucket in the backward that synchronises (its comm hook).
    replica_groups_refusal = None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return _run_protocol.split_over_replica_groups(super().distributed_sampler_kwargs)

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, **kwargs: Any) -> None:
        super().backward(tensor, module, **kwargs)
        if self.replicas is not None and not self._accumulating:
            self.replicas.average_gradients()

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> nn.Module:
        self._require_group("setup_module with strategy='ddp'")
        self._check_not_meta(module)
        if move_to_device:
            module = module.to(self.root_device)
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        wrapped = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        if self.replicas is not None:
            self.replicas.add_module(wrapped)
            # The cross-group sums start bucket by bucket, overlapping the backward (torchft's own DDP wrapper's
            # hook crashes a survivor when a group dies mid-step). A lambda: DDP refuses a hook whose annotations
            # are not its own objects, and this module's are strings.
            replicas = self.replicas
            wrapped.register_comm_hook(
                wrapped.process_group, lambda group, bucket: replicas.ddp_comm_hook(group, bucket)
            )
        return wrapped

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Generator[None, None, None]:
        if not enabled or not isinstance(module, DistributedDataParallel):
            yield
            return
        self._accumulating += 1
        try:
            with module.no_sync():
                yield
        finally:
            self._accumulating -= 1

    def __repr__(self) -> str:
        return f"DDPStrategy({', '.join(f'{k}={v!r}' for k, v in self.ddp_kwargs.items())})"
