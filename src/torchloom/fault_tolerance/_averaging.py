"""The cross-group sums of one rank's gradient pieces, in a layout that every group shares whatever its strategy
did with the gradients: the trainable parameters' local pieces (`exchange.local`) in reverse parameter order (the
order a backward produces them), cut by dtype and into chunks of at most `CHUNK_BYTES`, one persistent flat
tensor each, summed across the groups chunk by chunk (`manager.allreduce`) in that fixed order. gloo and NCCL pair
the collectives of the groups by their order, so the layout must not depend on when or how a group's pieces
became ready: DDP's own buckets do (DDP rebuilds them after its first backward from the order the gradients came
in, so a restarted group would lay its first step out otherwise than the survivors).

Under `ddp` the chunks are filled and summed during the backward: DDP's comm hook (`ReplicaGroup.ddp_comm_hook`)
averages each bucket inside the group as DDP does and hands its pieces here; a thread of this rank copies them into
their chunks once the group's average is in, and starts each chunk's cross-group sum as soon as it and the chunks
before it are full. After the backward, `finish` fills what no bucket brought (every piece, for the other
strategies, whose gradients are read after their backward) and starts the rest.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchloom.fault_tolerance import exchange, record

#: The largest chunk summed across the groups in one collective: DDP's default bucket size. Smaller chunks start
#: their sums earlier in the backward (more of the sums overlap it), but each collective costs a fixed latency
#: and torchft's bookkeeping (about a millisecond of Python on a loaded CPU): 4 MiB chunks would be 8,000
#: collectives a step for an 8B-parameter model's fp32 gradients.
CHUNK_BYTES = 25 << 20


@dataclass
class _Chunk:
    flat: torch.Tensor
    members: list[int]  # parameter indices
    pending: int = 0


@dataclass
class _Exchange:
    """One synchronising backward's sums in progress."""

    delivered: list[bool]
    works: list[Any] = field(default_factory=list)
    issued: int = 0
    # The fingerprint of the pieces summed so far (`record.fingerprint`, part by part), taken before each chunk's
    # sum overwrites it.
    value: float = 0.0
    scale: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Averager:
    """The chunks of one rank (see the module docstring). `allreduce(tensor)` starts a cross-group sum and returns
    its work (torchft's `manager.allreduce`, which records a failure on the manager instead of raising)."""

    def __init__(self, allreduce: Callable[[torch.Tensor], Any]) -> None:
        self._allreduce = allreduce
        self._params: list[nn.Parameter] = []
        self._ids: list[int] = []
        self._index: dict[int, int] = {}
        self._views: list[torch.Tensor] = []
        self._chunks: list[_Chunk] = []
        self._where: list[int] = []  # chunk of each parameter
        self._probes: list[tuple[int, int, torch.Tensor]] = []
        self._exchange: _Exchange | None = None
        self._queue: queue.SimpleQueue[tuple[_Exchange, Any, list[tuple[int, torch.Tensor | None]], bool]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return self._params

    @property
    def in_progress(self) -> bool:
        """Whether a backward's sums have begun and `finish` has not run yet."""
        return self._exchange is not None

    @property
    def views(self) -> list[torch.Tensor]:
        """Each parameter's piece of the sums, in parameter order (shaped as its local gradient)."""
        return self._views

    def lay_out(self, params: list[nn.Parameter]) -> None:
        """The layout for `params` (the trainable parameters of the set-up modules, in order), kept while they
        stay the same."""
        ids = [id(p) for p in params]
        if ids == self._ids:
            return
        self._params, self._ids = params, ids
        self._index = {pid: i for i, pid in enumerate(ids)}
        pieces = [exchange.local(p) for p in params]
        self._probes = record.probes(pieces)
        groups: list[list[int]] = []
        size = 0
        for i in reversed(range(len(params))):
            piece = pieces[i]
            nbytes = piece.numel() * piece.element_size()
            if (
                not groups
                or pieces[groups[-1][0]].dtype != piece.dtype
                or pieces[groups[-1][0]].device != piece.device
                or (size + nbytes > CHUNK_BYTES and groups[-1])
            ):
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += nbytes
        self._views = [torch.empty(0)] * len(params)
        self._where = [0] * len(params)
        self._chunks = []
        for c, members in enumerate(groups):
            first = pieces[members[0]]
            flat = torch.zeros(
                sum(pieces[i].numel() for i in members), dtype=first.dtype, device=first.device
            )
            offset = 0
            for i in members:
                self._views[i] = flat[offset : offset + pieces[i].numel()].view(pieces[i].shape)
                self._where[i] = c
                offset += pieces[i].numel()
            self._chunks.append(_Chunk(flat, members))

    # ---- during the backward (DDP's comm hook) ---------------------------------------------------------------
    def deliver(self, pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], ready: Any) -> None:
        """Pieces `(parameter, gradient piece)` whose values are in once `ready` (a future) completes: copied into
        their chunks, and full chunks summed, by this rank's thread."""
        current = self._open()
        items: list[tuple[int, torch.Tensor | None]] = [(self._index[id(p)], g) for p, g in pieces]
        for i, _ in items:
            current.delivered[i] = True
        self._queue.put((current, ready, items, False))

    # ---- after the backward ----------------------------------------------------------------------------------
    def finish(self, zeros: bool) -> tuple[list[Any], tuple[float, float]]:
        """Fill the pieces no hook delivered from the gradients (`zeros`: every piece with zeros), start the
        remaining sums, and return, once all have started, every chunk's work, in order, and the fingerprint of
        what this rank sent (`record.fingerprint` of its pieces in parameter order)."""
        current = self._open()
        rest: list[tuple[int, torch.Tensor | None]] = []
        for i, p in enumerate(self._params):
            if zeros:
                rest.append((i, None))
            elif not current.delivered[i]:
                rest.append((i, None if p.grad is None else exchange.local(p.grad)))
        self._queue.put((current, None, rest, True))
        current.done.wait()
        self._exchange = None
        if current.error is not None:
            raise current.error
        return current.works, (current.value, current.scale)

    def _open(self) -> _Exchange:
        if self._exchange is None:
            self._exchange = _Exchange(delivered=[False] * len(self._params))
            for chunk in self._chunks:
                chunk.pending = len(chunk.members)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torchloom-ft-averaging", daemon=True)
                self._thread.start()
        return self._exchange

    def _run(self) -> None:
        while True:
            current, ready, items, last = self._queue.get()
            if current.error is None:
                try:
                    if ready is not None:
                        ready.wait()
                    with torch.no_grad():
                        for i, piece in items:
                            if piece is None:
                                self._views[i].zero_()
                            else:
                                self._views[i].copy_(piece)
                            self._chunks[self._where[i]].pending -= 1
                    # In the fixed order, and each chunk once full: the same collectives in every group.
                    while current.issued < len(self._chunks) and self._chunks[current.issued].pending == 0:
                        chunk = self._chunks[current.issued]
                        for i in chunk.members:
                            value, scale = record.fingerprint_part(self._views[i], self._probes[i])
                            current.value += float(value)
                            current.scale += float(scale)
                        current.works.append(self._allreduce(chunk.flat))
                        current.issued += 1
                    if last and current.issued != len(self._chunks):
                        raise RuntimeError("a chunk of the cross-group average was not filled")
                except BaseException as error:  # handed to `finish`, in the training thread
                    current.error = error
            if last:
                current.done.set()
            # Nothing of a finished exchange stays referenced here while the thread waits: a failed step's works
            # would keep its process group's connections open (`ReplicaGroup._close_failed_process_group`).
            del current, ready, items
