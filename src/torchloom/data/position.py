"""Where a set-up loader is in its data, moved by the passes over it: the epoch the next pass reads, the live
pass and the global samples it has handed out, a loaded checkpoint's position not yet read, and what the live
pass's order and its workers' base seed were drawn from. `torchloom.data.resume` saves and restores it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchloom.data.order import ResumableSampler, order_generator


class Position:
    """The position of one `LoomDataLoader` (see the module docstring). A pass starts at `begin`, counts its
    batches through `handed_out` and ends at `over`; only the newest pass moves the position."""

    def __init__(
        self,
        loader: DataLoader,
        world_size: int,
        rank: int,
        all_gather_object: Callable[[Any], list[Any]] | None,
        global_rank: int,
        ranks: int | None,
    ) -> None:
        self.loader = loader
        #: The replicas reading different data (the data-parallel ones), and this one's number among them.
        self.world_size = world_size
        self.rank = rank
        #: The job's ranks (more than the replicas under tensor parallelism), and this process's: it logs on 0 only.
        self.ranks = world_size if ranks is None else ranks
        self.global_rank = global_rank
        self.all_gather_object = all_gather_object
        self.epoch = 0  # the epoch the next pass will read
        self.current: int | None = None  # the epoch the live pass is reading
        self.consumed = 0  # global samples handed out in the current epoch
        # (epoch, consumed, state the interrupted pass drew its base seed from) of a loaded checkpoint.
        self.resume: tuple[int, int, torch.Tensor | None] | None = None
        self.pass_base: torch.Tensor | None = None
        self.number = 0  # number of the newest pass: only it moves the position
        self.interleaved = False  # an older pass handed out batches while the newest was live
        # The state of the sampler's own generator when the live pass began (see order_generator).
        self.pass_generator: torch.Tensor | None = None
        self.left: tuple[int, int] | None = None  # (epoch, consumed) of a pass left early, for the log
        self.warned_left = False

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def prepare_length(self) -> None:
        """Before `len(loader)`: a loaded position not yet read shortens the epoch it resumes."""
        if self.resume is not None and isinstance(self.sampler, ResumableSampler):
            self._prepare_sampler(*self.resume[:2])

    def _prepare_sampler(self, epoch: int, start: int) -> None:
        # As Fabric's loader: set_epoch on the sampler and on the batch sampler's sampler, whatever they are.
        samplers = {id(self.sampler): self.sampler}
        inner = getattr(self.loader.batch_sampler, "sampler", None)
        if inner is not None:
            samplers[id(inner)] = inner
        for sampler in samplers.values():
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.start = start

    def begin(self) -> tuple[int, Iterator[Any], int | None, int]:
        """Start a pass: its number, the DataLoader's iterator, the epoch's global samples (None where unknown)
        and the global samples of one batch."""
        epoch, start, base = self.resume if self.resume is not None else (self.epoch, 0, None)
        self._prepare_sampler(epoch, start)
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.record = None  # this epoch's draw is not made yet
        generator = order_generator(self.sampler, self.loader.batch_sampler)
        # The sampler draws this pass's order from its own generator: a checkpoint taken during the pass keeps the
        # state it drew from, so that the resumed pass draws the same order.
        drawn_from = generator.get_state() if isinstance(generator, torch.Generator) else None
        # The DataLoader draws its workers' base seed from its generator, else torch's global one, when the pass
        # starts (as under Fabric); a checkpoint taken during the pass keeps the state it drew from.
        pass_base = (self.loader.generator or torch.default_generator).get_state()
        batches = self._start(base)  # before the position moves: a loader that fails to start keeps it
        self.resume, self.pass_generator, self.pass_base = (
            None,
            drawn_from,
            pass_base if base is None else base,
        )
        self.number += 1
        self.epoch, self.current, self.consumed = epoch + 1, epoch, start
        self.interleaved, self.left = False, None
        total = (
            self.sampler.remaining_global() + start if isinstance(self.sampler, ResumableSampler) else None
        )
        per_batch = (self.loader.batch_size or 1) * self.world_size
        return self.number, batches, total, per_batch

    def _start(self, base: torch.Tensor | None) -> Iterator[Any]:
        """The DataLoader's iterator. A pass resumed inside its epoch (`base`: the state its base seed was drawn
        from) draws that seed again from a generator in that state, and nothing from the global generator: the
        interrupted run drew before its checkpoint captured the generators."""
        if base is None:
            return iter(self.loader)
        own = self.loader.generator
        if own is not None:
            own.set_state(base)
            return iter(self.loader)
        replay = torch.Generator()
        replay.set_state(base)
        self.loader.generator = replay
        try:
            return iter(self.loader)
        finally:
            self.loader.generator = None

    def handed_out(self, number: int, total: int | None, per_batch: int) -> None:
        """Pass `number` hands out a batch. Counted before the batch is handed out: a checkpoint written while
        training on it resumes after it."""
        if number != self.number:
            # torch lets two iterators over one loader run at once; a checkpoint holds one position.
            self.interleaved = True
            return
        consumed = self.consumed + per_batch
        self.consumed = consumed if total is None else min(consumed, total)

    def over(self, number: int, finished: bool) -> None:
        """Pass `number` reached its end (`finished`) or was left."""
        if number != self.number or self.current is None:
            return
        if not finished:
            self.left = (self.current, self.consumed)
        self.current, self.consumed, self.pass_generator, self.pass_base = None, 0, None, None
