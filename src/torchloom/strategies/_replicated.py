"""Data-parallel semantics for parameters that no FSDP unit owns (the "replicated leftovers").

PyTorch leaves such parameters unsynchronised under FSDP1 and has no answer for them under FSDP2 except sharding
the root. torchloom treats them like DDP does: same values on every rank at setup (broadcast from rank 0), and
gradients averaged over all ranks after every synchronising backward. Gradients are packed into fixed buckets
and each bucket's all-reduce starts as soon as its last gradient is ready, so communication overlaps the rest of
backward; buckets start in the same order on every rank, and the end of backward waits for all of them.

Every backward run through `loom.backward` is one *round*: it starts from a clean state and, whatever happens
inside it, issues every bucket's all-reduce exactly once on every rank. That is what keeps ranks aligned when a
rank's backward reaches no leftover at all (a branch not taken, an expert not routed to), or only some of them,
or raises midway (an out-of-memory error the user catches before retrying): the missing buckets are sent at the
end of the round, so the ranks never wait in collectives that their peers will not issue. A plain
`loss.backward()` through the model's output is a round too: it starts when backward reaches the output.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from torchloom import _torch_compat
from torchloom.errors import MisuseError

_BUCKET_BYTES = 25 * 2**20


def broadcast_tensors(
    tensors: Iterable[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    src: int = 0,
    device: torch.device | None = None,
    packed: bool = False,
) -> None:
    """Overwrite `tensors` in place with rank `src`'s values, a few large broadcasts instead of one per tensor.

    `device`: where the group's backend communicates (this rank's GPU under NCCL). Tensors held elsewhere travel
    through it one bucket at a time: NCCL refuses CPU tensors, and a model built on the CPU is still there when
    the units are about to be made (FSDP moves each unit to the GPU only as it shards it), so its start-from-rank-0
    broadcast would fail; moving the whole model first would need all of it in GPU memory at once.

    `packed`: tensors of every dtype travel together as bytes, so a few small tensors of mixed kinds (a model's
    BatchNorm statistics and their int64 batch counts, sent before every forward) take one broadcast."""
    # Grouped by device and dtype (a stable sort: every rank orders the same list alike), so that interleaved
    # kinds make one bucket each, not one per run.
    kept = sorted(
        (t for t in tensors if t.numel() > 0 and not t.is_meta), key=lambda t: (str(t.device), str(t.dtype))
    )
    src = dist.get_global_rank(group, src) if group is not None else src
    for bucket in _buckets(kept, same_dtype=not packed):
        if packed:
            parts = []
            for t in bucket:
                parts.append(t.detach().reshape(-1).view(torch.uint8))
                if pad := -_nbytes(t) % _ALIGN:
                    parts.append(parts[-1].new_zeros(pad))
            flat = torch.cat(parts)
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        if device is not None and flat.device != device:
            flat = flat.to(device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in bucket:
                if packed:
                    # Each tensor starts at a multiple of _ALIGN bytes, where a byte slice views as any dtype.
                    t.copy_(flat[offset : offset + _nbytes(t)].view(t.dtype).view_as(t))
                    offset += _nbytes(t) + (-_nbytes(t) % _ALIGN)
                else:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))  # back to wherever `t` lives
                    offset += t.numel()


_ALIGN = 16  # bytes: the largest element size (complex128)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buckets(
    tensors: list[torch.Tensor], limit: int = _BUCKET_BYTES, same_dtype: bool = True
) -> list[list[torch.Tensor]]:
    """Consecutive runs of same dtype (unless `same_dtype` is False) and device tensors, each at most `limit`
    bytes (or one tensor)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = _nbytes(t)
        current = buckets[-1] if buckets else None
        if (
            current is None
            or (same_dtype and current[0].dtype != t.dtype)
            or current[0].device != t.device
            or size + nbytes > limit
        ):
            buckets.append([t])
            size = nbytes
        else:
            current.append(t)
            size += nbytes
    return buckets


class PeerBackwardFailedError(MisuseError):
    """Another rank's backward failed in the round in which this rank's succeeded."""


@dataclass
class _Round:
    """What one backward has done so far: buckets still waiting for gradients, the next bucket to start, and
    the all-reduces in flight."""

    missing: list[int]
    managed: bool  # started by `loom.backward` (which ends it), or by the first hook of a plain `.backward()`
    graph_task: int = -1
    next: int = 0
    pending: list[tuple[list[nn.Parameter], torch.Tensor, dist.Work]] = field(default_factory=list)


class ReplicatedGradSync:
    """Averages the gradients of `params` over `group` after each backward, unless `enabled` is False (with
    `divisor`: sums them over `group` and divides by `divisor`).

    `begin()` before and `end(error)` after a backward make it one round (what `loom.backward` does). A plain
    `loss.backward()` also works: its first hook (on the model's output, see `watch_outputs`, or on a replicated
    parameter) starts a round and queues the end of it on autograd's engine.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        bucket_bytes: int | None = None,
        divisor: int | None = None,
    ):
        self.group = group
        self.world_size = dist.get_world_size(group)
        #: The summed gradients are divided by this: the group's size (the mean over it), or the number of
        #: data-parallel replicas when each rank of a tensor-parallel group holds one part of a sum.
        self.divisor = divisor or self.world_size
        #: Called at the end of every round that reduced (`_end`, not failed), after the results are written.
        self.after_round: Callable[[], None] | None = None
        self.enabled = True
        trainable = [p for p in params if p.requires_grad]
        # Gradients become ready roughly in reverse order of definition, as in DDP.
        self.buckets = _buckets(list(reversed(trainable)), bucket_bytes or _BUCKET_BYTES)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        # How a bucket's all-reduced tensor splits: each parameter's gradient, then the flags (see `_launch`).
        self._splits = [[p.numel() for p in bucket] + [len(bucket) + 1] for bucket in self.buckets]
        # Hooks run on autograd's threads (one per device): the round is shared between them.
        self._lock = threading.Lock()
        self._round: _Round | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- one round per backward --------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a round; a round left open by a plain backward that raised is closed first."""
        stale = self._round
        if stale is not None:
            self._end(stale, failed=True)
        self._round = self._new_round(managed=True)

    def end(self, error: BaseException | None = None) -> None:
        """End the round `begin` started: send every bucket not yet sent, wait, and write the averages.

        After a failed backward (`error`), this rank sends zeros so the other ranks' collectives still match,
        and keeps its own gradients untouched. Where the failure is the process group's own (a peer died, a
        collective timed out), nothing more is sent: the group is broken."""
        current, self._round = self._round, None
        if current is None:
            return
        if error is not None and isinstance(error, dist.DistError):
            return
        self._end(current, failed=error is not None)

    def _new_round(self, managed: bool) -> _Round:
        return _Round(missing=[len(b) for b in self.buckets], managed=managed)

    def watch_outputs(self, module: nn.Module) -> None:
        """Start a round at the start of every plain `.backward()` through `module`'s output, on every rank, so
        that a rank whose backward reaches no replicated parameter (a branch not taken, an expert without tokens)
        still sends every bucket. Without it, that rank's first gradient hook would never run: it would send
        nothing, and its peers' all-reduces would pair with its next backward's (wrong averages) or wait for
        them (a hang). A backward through the output that accumulates nothing (`torch.autograd.grad`) is a round
        too: it sends the current gradients, which the average leaves as they are when every rank does it."""
        self._handles.append(module.register_forward_hook(self._on_forward))

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._plain_round()

    def _plain_round(self) -> _Round:
        """The round of the backward running now: `loom.backward`'s, or else one started (with its end queued)
        by the first hook of this plain backward."""
        current = self._round
        if current is not None and not current.managed:
            if current.graph_task != _torch_compat.current_graph_task_id():
                # A plain backward that raised never ran its end-of-backward callback.
                self._round = None
                self._end(current, failed=True)
                current = None
        if current is None:
            current = self._round = self._new_round(managed=False)
            current.graph_task = _torch_compat.current_graph_task_id()
            # Runs once at the very end of this backward pass, after every hook, and after the end-of-backward
            # callbacks queued before it runs (FSDP's, which reduce the units' gradients): the round's last
            # all-reduce waits for every rank, so it must come after every collective of the backward, on every
            # rank, whichever hook queued it first.
            _torch_compat.queue_backward_callback(
                lambda: _torch_compat.queue_backward_callback(self._end_plain_backward)
            )
        return current

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # Runs once per replicated parameter per backward: kept to a few dictionary and list operations.
        if not self.enabled:
            return
        with self._lock:
            current = self._round
            if current is None or not current.managed:
                current = self._plain_round()
            index = self._bucket_of[id(param)]
            current.missing[index] -= 1
            if index == current.next and not current.missing[index]:
                self._launch(current, force=False)  # buckets go strictly in order: only the next one can

    def _end_plain_backward(self) -> None:
        current, self._round = self._round, None
        if current is not None:
            self._end(current, failed=False)

    def _launch(self, current: _Round, force: bool, failed: bool = False) -> None:
        # Strictly in bucket order: collectives must be issued in the same order on every rank. The last bucket
        # is only ever sent at the end of the round, so it can carry whether this rank's backward failed.
        last = len(self.buckets) - 1
        while current.next <= last and (
            force or (current.next < last and current.missing[current.next] == 0)
        ):
            bucket = self.buckets[current.next]
            grads = [None if failed else p.grad for p in bucket]
            # One extra element per parameter records whether any rank produced a gradient for it, so a
            # parameter unused everywhere keeps grad=None as it would without torchloom; one more counts the
            # ranks whose backward failed.
            flags = [float(g is not None) for g in grads]
            flags.append(float(failed and current.next == last))
            with torch.no_grad():
                parts = [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1)
                    for p, g in zip(bucket, grads, strict=True)
                ]
                parts.append(torch.tensor(flags, dtype=parts[0].dtype, device=parts[0].device))
                flat = torch.cat(parts)
                flat.div_(self.divisor)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            current.pending.append((bucket, flat, work))
            current.next += 1

    def _end(self, current: _Round, failed: bool) -> None:
        if not self.buckets:
            return
        self._launch(current, force=True, failed=failed)
        for _, _, work in current.pending:
            work.wait()
        if failed:
            return
        _, last_flat, _ = current.pending[-1]
        peers_failed = round(last_flat[-1].item() * self.divisor)
        if peers_failed:
            raise PeerBackwardFailedError(
                f"{peers_failed} other rank(s) failed their backward pass while this rank's succeeded, so the "
                "gradients of the replicated parameters cannot be averaged for this step. A backward that can "
                "fail (e.g. out of memory) must be retried on every rank or on none: catch this error too, or "
                "agree first, e.g. `retry = loom.all_reduce(torch.tensor(float(failed)), reduce_op='max')`."
            )
        with torch.no_grad():
            for (bucket, flat, _), splits in zip(current.pending, self._splits, strict=True):
                used = flat[-len(bucket) - 1 : -1].tolist()  # one device sync per bucket, not per parameter
                pieces = flat.split(splits)
                targets, averages = [], []
                for p, piece, was_used in zip(bucket, pieces[:-1], used, strict=True):
                    if not was_used:
                        continue
                    if p.grad is None:
                        p.grad = piece.view_as(p).clone()
                    else:
                        targets.append(p.grad)
                        averages.append(piece.view_as(p))
                if targets:
                    torch._foreach_copy_(targets, averages)  # one call, not one copy_ per parameter
        if self.after_round is not None:
            self.after_round()
