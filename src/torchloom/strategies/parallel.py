"""What every multi-process strategy shares: the process group and the collectives."""

from __future__ import annotations

import atexit
import contextlib
import sys
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchloom.errors import CollectiveTimeoutError, MisuseError
from torchloom.strategies._gather import all_gather_with_grads
from torchloom.strategies.base import Strategy, _reduce_op


class ParallelStrategy(Strategy):
    """A strategy whose ranks talk over a `torch.distributed` process group."""

    def __init__(self, timeout: timedelta | None = None, process_group_backend: str | None = None) -> None:
        super().__init__(timeout=timeout)
        self.process_group_backend = process_group_backend

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size() if self.cluster_environment else 1

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment else 0

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.cluster_environment else 0

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.cluster_environment else 0

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def backend(self) -> str:
        assert self.accelerator is not None
        return self.process_group_backend or self.accelerator.backend

    def setup_environment(self) -> None:
        super().setup_environment()
        if dist.is_initialized():
            return
        env = self.cluster_environment
        assert env is not None
        env.export()
        kwargs: dict[str, Any] = {}
        if self.root_device.type == "cuda":
            # Binding the group to this rank's GPU lets NCCL connect eagerly and avoids device guessing.
            kwargs["device_id"] = self.root_device
        dist.init_process_group(
            self.backend,
            init_method="env://",
            rank=env.global_rank(),
            world_size=env.world_size(),
            timeout=self.timeout,
            **kwargs,
        )
        atexit.register(_destroy_group_at_exit)

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _require_group(self, what: str) -> None:
        if not dist.is_initialized():
            raise MisuseError(
                f"{what} needs the process group, which does not exist yet. Call `loom.launch()` first "
                "(or run your function with `loom.launch(fn)`)."
            )

    # ---- collectives -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _collective(self, name: str) -> Generator[None, None, None]:
        """Turn a collective's timeout into an error that names it and says what to do."""
        try:
            yield
        except RuntimeError as error:
            text = str(error).lower()
            if "timed out" not in text and "timeout" not in text:
                raise
            raise CollectiveTimeoutError(
                f"loom.{name}() on rank {self.global_rank} timed out after {self.timeout}: another rank did not "
                f"reach the same {name} in time (stuck in a loop, much slower, or it called a different collective). "
                f"Make every rank call {name} at the same point; if one rank legitimately needs longer (e.g. a long "
                f"evaluation on rank 0), raise Loom(timeout=...). PyTorch said: {error}"
            ) from error

    def all_reduce(self, data: Any, reduce_op: str = "mean", group: Any = None) -> Any:
        op = _reduce_op(reduce_op)
        self._require_group("all_reduce")

        def reduce(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            out = t.detach().clone()
            if out.device != self.root_device:
                out = out.to(self.root_device)
            with self._collective("all_reduce"):
                dist.all_reduce(out, op=op, group=group)
            if reduce_op.lower() in ("mean", "avg"):
                size = self.world_size if group is None else dist.get_world_size(group)
                out = out / size if out.is_floating_point() else out // size
            return out

        return torch.utils._pytree.tree_map(reduce, data)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        self._require_group("all_gather")

        def gather(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            t = t.contiguous().to(self.root_device)
            if sync_grads:
                with self._collective("all_gather"):
                    return all_gather_with_grads(t, group)
            t = t.detach()
            size = self.world_size if group is None else dist.get_world_size(group)
            out = [torch.empty_like(t) for _ in range(size)]
            with self._collective("all_gather"):
                dist.all_gather(out, t, group=group)
            return torch.stack(out)

        return torch.utils._pytree.tree_map(gather, data)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._require_group("broadcast")
        box = [obj]
        with self._collective("broadcast"):
            dist.broadcast_object_list(
                box, src=src, device=self.root_device if self.backend == "nccl" else None
            )
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._require_group("all_gather_object")
        out: list[Any] = [None] * self.world_size
        with self._collective("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out

    @property
    def checkpoint_group(self) -> Any:
        # A gloo group of its own: DCP coordinates on CPU, and an async save's collectives run in a background
        # thread, where sharing the training group could interleave with training collectives.
        if getattr(self, "_checkpoint_group", None) is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group

    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        with self._collective("barrier"):
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()


def _destroy_group_at_exit() -> None:
    """Destroy the process group while the interpreter is still whole. Left to interpreter teardown, gloo's
    worker threads can abort a rank that finished fine ("terminate called without an active exception", exit
    SIGABRT; pytorch/pytorch#190489). Skipped when the rank dies of an uncaught exception: the agent stops the
    job anyway, and tearing down a group whose peers are stuck in a collective can block."""
    if getattr(sys, "last_value", None) is not None:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
