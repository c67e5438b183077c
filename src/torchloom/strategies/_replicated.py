"""Data-parallel semantics for parameters that no FSDP unit owns (the "replicated leftovers").

PyTorch leaves such parameters unsynchronised under FSDP1 and has no answer for them under FSDP2 except sharding
the root. torchloom treats them like DDP does: same values on every rank at setup (broadcast from rank 0), and
gradients averaged over all ranks after every synchronising backward. Gradients are packed into fixed buckets
and each bucket's all-reduce starts as soon as its last gradient is ready, so communication overlaps the rest of
backward; buckets start in the same order on every rank, and the end of backward waits for all of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from torchloom import _torch_compat

_BUCKET_BYTES = 25 * 2**20


def broadcast_tensors(
    tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None, src: int = 0
) -> None:
    """Overwrite `tensors` in place with rank `src`'s values, a few large broadcasts instead of one per tensor."""
    for bucket in _buckets([t for t in tensors if t.numel() > 0 and not t.is_meta]):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
        offset = 0
        with torch.no_grad():
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _buckets(tensors: list[torch.Tensor], limit: int = _BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Consecutive runs of same dtype/device tensors, each at most `limit` bytes (or one tensor)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        current = buckets[-1] if buckets else None
        if (
            current is None
            or current[0].dtype != t.dtype
            or current[0].device != t.device
            or size + nbytes > limit
        ):
            buckets.append([t])
            size = nbytes
        else:
            current.append(t)
            size += nbytes
    return buckets


class ReplicatedGradSync:
    """Averages the gradients of `params` over `group` after each backward, unless `enabled` is False."""

    def __init__(
        self, params: list[nn.Parameter], group: dist.ProcessGroup, bucket_bytes: int = _BUCKET_BYTES
    ):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.enabled = True
        trainable = [p for p in params if p.requires_grad]
        # Gradients become ready roughly in reverse order of definition, as in DDP.
        self.buckets = _buckets(list(reversed(trainable)), bucket_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._missing = [len(b) for b in self.buckets]
        self._next = 0
        self._pending: list[tuple[list[nn.Parameter], torch.Tensor, dist.Work]] = []
        self._callback_queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self._callback_queued:
            # Runs once at the very end of this backward pass, after every hook.
            _torch_compat.queue_backward_callback(self._finish)
            self._callback_queued = True
        self._missing[self._bucket_of[id(param)]] -= 1
        self._launch(force=False)

    def _launch(self, force: bool) -> None:
        # Strictly in bucket order: collectives must be issued in the same order on every rank.
        while self._next < len(self.buckets) and (force or self._missing[self._next] == 0):
            bucket = self.buckets[self._next]
            parts = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in bucket
            ]
            # One extra element per parameter records whether any rank produced a gradient for it, so a
            # parameter unused everywhere keeps grad=None as it would without torchloom.
            used = torch.tensor(
                [float(p.grad is not None) for p in bucket], dtype=parts[0].dtype, device=parts[0].device
            )
            flat = torch.cat([*parts, used])
            flat.div_(self.world_size)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((bucket, flat, work))
            self._next += 1

    def _finish(self) -> None:
        self._launch(force=True)
        with torch.no_grad():
            for bucket, flat, work in self._pending:
                work.wait()
                used = flat[-len(bucket) :].tolist()  # one device sync per bucket, not per parameter
                offset = 0
                for i, p in enumerate(bucket):
                    averaged = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if used[i] == 0:
                        continue
                    if p.grad is None:
                        p.grad = averaged.clone()
                    else:
                        p.grad.copy_(averaged)
        self._pending = []
        self._missing = [len(b) for b in self.buckets]
        self._next = 0
        self._callback_queued = False
