"""Data loading in Fabric's order that can resume exactly, at any world size.

Each pass over a set-up loader is an epoch with one *global order* of samples, made by the rule Fabric's
`setup_dataloaders` would apply to the loader (`SEEDED`, `KEPT`, `WRAPPED` below): DistributedSampler's
permutation of `seed + epoch` (DDP, FSDP), the user's own sampler (one device: a `RandomSampler` draws its seed
from the global generator at every pass), or one draw of a custom sampler split across ranks. Each rank reads every
`world_size`-th sample of it, as `DistributedSampler` does, so global batch b of an epoch is
`order[b * G:(b + 1) * G]` for the global batch size G = world size x per-rank batch size.

The loader records what each pass's order came from instead of imposing another: the rule, the seed, the epoch,
the global samples handed out, the state the DataLoader drew its workers' base seed from, and for a drawn order the
states of the generators it was drawn from (torch's, Python's and NumPy's global ones and the sampler's own).
Resuming from them rebuilds the same order without drawing from the global generators (they stay as the checkpoint
restored them) and continues from the first sample not yet handed out, on any number of ranks: with the same
global batch size the resumed run sees exactly the global batches the uninterrupted run would have seen; with
another, it still sees each remaining sample of the epoch once. The saved rule is kept for the rest of the run, so
later epochs continue the saved run's orders: exactly for DistributedSampler's, and for a drawn order as far as the
generators it draws from are the saved run's (torchloom restores them at the same world size).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from torchloom._text import count
from torchloom.errors import CheckpointError, MisuseError
from torchloom.seed import seed_generators_from

log = logging.getLogger("torchloom")


def move_to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor in a nested structure (dicts, lists, tuples) to `device`."""
    non_blocking = device.type == "cuda"
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, data
    )


def gather_per_replica(
    gather: Callable[[Any], list[Any]], replica: int, replicas: int, obj: Any
) -> list[Any]:
    """Every data-parallel replica's `obj`, in replica order, through `gather` over all ranks. The ranks of one
    replica (a tensor-parallel group) read the same data, so any one of them stands for it."""
    out: list[Any] = [None] * replicas
    for r, value in gather((replica, obj)):
        out[r] = value
    return out


# Where a pass's order comes from (Fabric's rule for the loader, kept by a checkpoint for the epoch it resumes):
#: DistributedSampler's: a permutation of the dataset seeded from seed + epoch (or the dataset's order).
SEEDED = "seeded"
#: The user's sampler iterated as it is, as Fabric leaves it in one process (a RandomSampler draws its seed from
#: the global generator at the first batch of every pass).
KEPT = "kept"
#: One draw of the user's whole sequence at the start of the pass, split across ranks, as Fabric's
#: DistributedSamplerWrapper does with a custom sampler on several ranks.
WRAPPED = "wrapped"
RULES = (SEEDED, KEPT, WRAPPED)


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` (same order, padding and dropping, same `set_epoch`) that can start an epoch after
    the first `start` samples of its global order, that works in one process too, and that can read the order
    of the user's own sampler instead (`rule`, see `KEPT` and `WRAPPED`).

    A drawn order (`KEPT`, `WRAPPED`) comes from the user's `sampler`, drawing from whatever generators it
    draws from (torch's, Python's and NumPy's global ones, or its own `generator`): their states just before the
    draw are kept in `record`, so a resumed pass draws the same sequence again from them (`replay`), leaving the
    global generators as they were. On several ranks every rank draws (its generators advance as under Fabric)
    and rank 0's draw is broadcast: the ranks' parts always partition one draw, even if their generators differ
    (under Fabric they would then overlap)."""

    def __init__(
        self,
        dataset: Any,
        num_replicas: int,
        rank: int,
        *,
        sampler: Any = None,
        rule: str = SEEDED,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, **kwargs)
        #: The user's sampler (read by the drawn rules; kept under SEEDED, so a checkpoint may switch rules).
        self.sampler = sampler
        self.rule = rule
        #: Global samples of the current epoch's order already consumed (set by a resume, for one epoch).
        self.start = 0
        #: Hand out `SampleKey`s instead of indices (for a `SeededPerSample` dataset).
        self.keyed = False
        #: Generator states the current epoch's draw came from (drawn rules; None before the pass draws).
        self.record: dict[str, torch.Tensor] | None = None
        #: Generator states the next draw must come from (set by a resume, for one epoch).
        self.replay: dict[str, torch.Tensor] | None = None
        self._warned_ranks = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        # Fabric calls the user's sampler's own set_epoch too (DistributedSamplerWrapper forwards it).
        own = getattr(self.sampler, "set_epoch", None)
        if callable(own):
            own(epoch)

    def _size(self) -> int:
        """Length of the sequence split across ranks: the dataset, or one draw of the user's sampler."""
        return len(self.dataset if self.rule == SEEDED else self.sampler)  # type: ignore[arg-type]

    def _keys(self, positions: Iterable[int], items: Iterable[Any]) -> Iterator[Any]:
        if not self.keyed:
            return iter(items)
        return (
            SampleKey(item, self.seed, self.epoch, pos) for pos, item in zip(positions, items, strict=False)
        )

    def global_order(self) -> list[Any]:
        """This epoch's order, the same on every rank: DistributedSampler's under SEEDED (the same at every world
        size), else the user's sampler's draw (made now)."""
        if self.rule != SEEDED:
            return self._drawn()
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _remaining(self) -> list[int]:
        """Positions in this epoch's global order still to read, padded or trimmed to a multiple of the world
        size as DistributedSampler does. Padding repeats the epoch's first samples (cycling over the epoch), as
        DistributedSampler's does: a resumed epoch then ends as the uninterrupted one does at this world size,
        not on repeats of the first samples left at the resume."""
        n = self._size()
        positions = list(range(self.start, n))
        ws = self.num_replicas
        if self.drop_last:
            return positions[: len(positions) // ws * ws]
        if positions:
            positions += [p % n for p in range(-len(positions) % ws)]
        return positions

    def _my_positions(self) -> list[int]:
        return self._remaining()[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[Any]:
        if self.rule == KEPT:
            return self._kept()  # lazy, as the user's own sampler: it draws at the pass's first batch
        # Eager, as DistributedSampler and DistributedSamplerWrapper: the draw happens at iter(sampler).
        order = self.global_order()
        mine = self._my_positions()
        return self._keys(mine, [order[p] for p in mine])

    def _kept(self) -> Iterator[Any]:
        if self.num_replicas == 1 and self.start == 0 and self.replay is None:
            # Exactly what the user's loader does in one process, draws interleaved with the loop included.
            self.record = _capture(_own_generator(self.sampler))
            yield from self._keys(itertools.count(), self.sampler)
            return
        order = self._drawn()
        mine = self._my_positions()
        yield from self._keys(mine, [order[p] for p in mine])

    def _drawn(self) -> list[Any]:
        """One draw of the user's sampler: from the recorded states on a resumed pass, else from the generators
        as they are now; on several ranks rank 0's draw (and record)."""
        own = _own_generator(self.sampler)
        replay, self.replay = self.replay, None
        if replay is not None:
            with _replaying(replay, own):
                draw = list(self.sampler)
            record = replay
        else:
            record = _capture(own)
            draw = list(self.sampler)
        if _shares_draws(self.num_replicas):
            shared = [draw, record]
            torch.distributed.broadcast_object_list(shared, src=0)
            if shared[0] != draw and not self._warned_ranks:
                self._warned_ranks = True
                log.warning(
                    "The ranks' %s drew different sequences (their random generators differ): every rank reads "
                    "its part of rank 0's draw, so the parts still cover it once (Fabric's "
                    "DistributedSamplerWrapper would split each rank's own draw: overlapping, missing samples).",
                    type(self.sampler).__name__,
                )
            draw, record = shared
        self.record = record
        if len(draw) != len(self.sampler):
            raise MisuseError(
                f"The dataloader's sampler ({type(self.sampler).__name__}) yielded {len(draw)} indices but its "
                f"len() is {len(self.sampler)}: torchloom splits the draw by its length. Make __len__ match "
                "what __iter__ yields."
            )
        return draw

    def __len__(self) -> int:
        remaining = self._size() - self.start
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def remaining_global(self) -> int:
        """Real (unpadded) samples of this epoch's order not yet consumed, before this epoch started."""
        return max(self._size() - self.start, 0)


def _own_generator(sampler: Any) -> Any:
    """The generator of its own a sampler draws from (its `generator`), if any."""
    generator = getattr(sampler, "generator", None)
    return None if generator is torch.default_generator else generator


def _capture(own: Any) -> dict[str, torch.Tensor]:
    """The states of torch's, Python's and NumPy's global generators (and of `own`, a torch.Generator), as
    tensors (a checkpoint of any format holds them)."""
    version, internal, gauss = random.getstate()
    states = {
        "torch": torch.default_generator.get_state(),
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor(math.nan if gauss is None else gauss, dtype=torch.float64),
    }
    try:
        import numpy
    except ImportError:
        numpy = None  # type: ignore[assignment]
    if numpy is not None:
        _, keys, pos, has_gauss, cached = numpy.random.get_state()
        states["numpy"] = torch.from_numpy(keys.astype(numpy.int64))
        states["numpy_rest"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    if isinstance(own, torch.Generator):
        states["own"] = own.get_state()
    return states


def _restore(states: dict[str, torch.Tensor], own: Any) -> None:
    torch.default_generator.set_state(states["torch"])
    python = states["python"].tolist()
    gauss = float(states["python_gauss"])
    random.setstate((python[0], tuple(python[1:]), None if math.isnan(gauss) else gauss))
    if "numpy" in states:
        import numpy

        pos, has_gauss, cached = states["numpy_rest"].tolist()
        numpy.random.set_state(
            ("MT19937", states["numpy"].numpy().astype(numpy.uint32), int(pos), int(has_gauss), cached)
        )
    if "own" in states:
        own.set_state(states["own"])


@contextlib.contextmanager
def _replaying(states: dict[str, torch.Tensor], own: Any) -> Iterator[None]:
    """The generators set to `states` inside; the global ones back as they were on leaving (the sampler's own
    generator stays where the replayed draw left it, as the interrupted pass left it)."""
    if "own" in states and not isinstance(own, torch.Generator):
        raise CheckpointError(
            "The checkpoint holds the state of the loader's sampler's own generator, but this loader's sampler "
            f"({type(own).__name__} generator) has no torch.Generator. Build the sampler as the saved run did "
            "(with generator=...)."
        )
    before = _capture(None)
    _restore(states, own)
    try:
        yield
    finally:
        _restore(before, None)


def _shares_draws(replicas: int) -> bool:
    """Whether rank 0's draw goes to every rank: when a process group is up in which the `replicas` readers are
    one rank each or tensor-parallel groups of equal size (every rank iterates its loader, so every rank joins
    the broadcast; the ranks of one tensor-parallel group must read the same draw too). A sampler built by hand
    outside such a group (a unit test) draws alone."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    world = dist.get_world_size()
    return world > 1 and world % replicas == 0


class SampleKey(NamedTuple):
    """What a keyed sampler hands the dataset: the sample's index, and where it stands in the epoch's global
    order (which, with the seed and the epoch, decides its random numbers)."""

    index: Any
    seed: int
    epoch: int
    position: int


class SeededPerSample(Dataset):
    """The user's dataset, with every sample read under random generators seeded from (seed, epoch, position of
    the sample in the epoch's global order).

    Used when DataLoader workers load the data: a worker's random stream otherwise depends on which batches it
    happened to get, which changes with the number of workers, the world size, and a resume in the middle of an
    epoch. Seeded per sample, a random augmentation of sample i in epoch e is the same in all of those cases.
    Attributes of the user's dataset are read through this wrapper."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, SampleKey):
            return self.dataset[key]
        seed_generators_from(f"{key.seed}/{key.epoch}/{key.position}")
        return self.dataset[key.index]

    def __getattr__(self, name: str) -> Any:
        # Dunder look-ups (DataLoader's fetcher asks for __getitems__) must not reach the user's dataset: its
        # batched fetch would get SampleKeys.
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def order_generator(sampler: Any, batch_sampler: Any = None) -> torch.Generator | None:
    """The generator of the user's own that a pass's order is drawn from, for a loader torchloom left with the
    user's sampler (a `ResumableSampler` records its own draws): the sampler's `generator`, or that of a batch
    sampler the loader uses as it is (a custom one) or of its sampler. None where the order comes from
    `seed + epoch` or from torch's global generator (restored with the other random generators)."""
    if isinstance(sampler, ResumableSampler):
        return None
    sources = [batch_sampler, getattr(batch_sampler, "sampler", None)] if batch_sampler is not None else []
    for source in (*sources, sampler):
        if isinstance(source, DistributedSampler):
            continue  # seed + epoch
        generator = getattr(source, "generator", None)
        if generator is not None and generator is not torch.default_generator:
            return generator
    return None


class LoomDataLoader:
    """Iterates the user's loader on this rank: each pass is a new epoch (a shuffling sampler reshuffles,
    identically on every rank), and batches are moved to the device.

    `state_dict()` / `load_state_dict()` record and restore the position in the global order (see the module
    docstring), so `loom.save(path, {..., "loader": loader})` and `loom.load` resume mid-epoch, at any world size.
    A batch counts as consumed once the loader has handed it out.

    A pass starts at `iter(loader)` and is over when it reaches its end or is left: `break` out of the loop, an
    exception out of it, or the iterator closed or garbage collected. The next pass reads the next epoch, so a
    checkpoint saved after leaving a pass early resumes at the next epoch, as this process would continue; one
    saved while a pass is still live resumes inside its epoch."""

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device | None,
        world_size: int = 1,
        rank: int = 0,
        all_gather_object: Callable[[Any], list[Any]] | None = None,
        *,
        global_rank: int = 0,
        ranks: int | None = None,
    ) -> None:
        self._loader = loader
        self._device = device
        #: The replicas reading different data (the data-parallel ones), and this one's number among them.
        self._world_size = world_size
        self._rank = rank
        #: The job's ranks (more than the replicas under tensor parallelism), and this process's: it logs on 0 only.
        self._ranks = world_size if ranks is None else ranks
        self._global_rank = global_rank
        self._all_gather_object = all_gather_object
        self._epoch = 0  # the epoch the next pass will read
        self._current: int | None = None  # the epoch the live pass is reading
        self._consumed = 0  # global samples handed out in the current epoch
        # (epoch, consumed, state the interrupted pass drew its base seed from) of a loaded checkpoint.
        self._resume: tuple[int, int, torch.Tensor | None] | None = None
        self._pass_base: torch.Tensor | None = None
        self._pass = 0  # number of the newest pass: only it moves the position
        self._interleaved = False  # an older pass handed out batches while the newest was live
        # The state of the sampler's own generator when the live pass began (see order_generator).
        self._pass_generator: torch.Tensor | None = None
        self._left: tuple[int, int] | None = None  # (epoch, consumed) of a pass left early, for the log
        self._warned_left = False

    @property
    def loader(self) -> DataLoader:
        return self._loader

    @property
    def sampler(self) -> Any:
        return self._loader.sampler

    def __len__(self) -> int:
        if self._resume is not None and isinstance(self.sampler, ResumableSampler):
            self._prepare_sampler(*self._resume[:2])
        return len(self._loader)

    def _prepare_sampler(self, epoch: int, start: int) -> None:
        # As Fabric's loader: set_epoch on the sampler and on the batch sampler's sampler, whatever they are.
        samplers = {id(self.sampler): self.sampler}
        inner = getattr(self._loader.batch_sampler, "sampler", None)
        if inner is not None:
            samplers[id(inner)] = inner
        for sampler in samplers.values():
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.start = start

    def __iter__(self) -> Iterator[Any]:
        epoch, start, base = self._resume if self._resume is not None else (self._epoch, 0, None)
        self._prepare_sampler(epoch, start)
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.record = None  # this epoch's draw is not made yet
        generator = order_generator(self.sampler, self._loader.batch_sampler)
        # The sampler draws this pass's order from its own generator: a checkpoint taken during the pass keeps the
        # state it drew from, so that the resumed pass draws the same order.
        drawn_from = generator.get_state() if isinstance(generator, torch.Generator) else None
        # The DataLoader draws its workers' base seed from its generator, else torch's global one, when the pass
        # starts (as under Fabric); a checkpoint taken during the pass keeps the state it drew from.
        pass_base = (self._loader.generator or torch.default_generator).get_state()
        batches = self._start(base)  # before the position moves: a loader that fails to start keeps it
        self._resume, self._pass_generator, self._pass_base = (
            None,
            drawn_from,
            pass_base if base is None else base,
        )
        self._pass += 1
        self._epoch, self._current, self._consumed = epoch + 1, epoch, start
        self._interleaved, self._left = False, None
        total = (
            self.sampler.remaining_global() + start if isinstance(self.sampler, ResumableSampler) else None
        )
        per_batch = (self._loader.batch_size or 1) * self._world_size
        return _Pass(self, self._pass, batches, total, per_batch)

    def _start(self, base: torch.Tensor | None) -> Iterator[Any]:
        """The DataLoader's iterator. A pass resumed inside its epoch (`base`: the state its base seed was drawn
        from) draws that seed again from a generator in that state, and nothing from the global generator: the
        interrupted run drew before its checkpoint captured the generators."""
        if base is None:
            return iter(self._loader)
        own = self._loader.generator
        if own is not None:
            own.set_state(base)
            return iter(self._loader)
        replay = torch.Generator()
        replay.set_state(base)
        self._loader.generator = replay
        try:
            return iter(self._loader)
        finally:
            self._loader.generator = None

    def _handed_out(self, number: int, total: int | None, per_batch: int) -> None:
        """Pass `number` hands out a batch. Counted before the batch is handed out: a checkpoint written while
        training on it resumes after it."""
        if number != self._pass:
            # torch lets two iterators over one loader run at once; a checkpoint holds one position.
            self._interleaved = True
            return
        consumed = self._consumed + per_batch
        self._consumed = consumed if total is None else min(consumed, total)

    def _pass_over(self, number: int, finished: bool) -> None:
        if number != self._pass or self._current is None:
            return
        if not finished:
            self._left = (self._current, self._consumed)
        self._current, self._consumed, self._pass_generator, self._pass_base = None, 0, None, None

    # ---- resuming --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is in its data: world-size independent (the same on every rank), except for an
        `IterableDataset`, whose every rank's own state is gathered (then a collective: call it on every rank,
        as `loom.save` does)."""
        if self._interleaved:
            raise MisuseError(
                "An earlier iterator over this loader handed out batches after a later iter(loader) began a new "
                "pass (two passes at once), so the loader has no single position to save. Finish or drop the "
                "earlier iterator before starting the next pass."
            )
        dataset = self._loader.dataset
        if isinstance(dataset, IterableDataset):
            return self._iterable_state(dataset)
        sampler = self.sampler
        if self._resume is not None:  # loaded, not yet iterated: still where the checkpoint said
            epoch, consumed = self._resume[:2]
        elif self._current is not None:  # inside a pass
            epoch, consumed = self._current, self._consumed
        else:
            epoch, consumed = self._epoch, 0
            self._log_left_pass()
        state: dict[str, Any] = {
            "epoch": epoch,
            "consumed": consumed,
            "dataset_len": len(dataset),  # type: ignore[arg-type]
            "global_batch": (self._loader.batch_size or 1) * self._world_size,
            "world_size": self._world_size,  # the data-parallel replicas
            "ranks": self._ranks,
        }
        if isinstance(sampler, DistributedSampler):
            state.update(seed=sampler.seed, shuffle=sampler.shuffle)
        if isinstance(sampler, ResumableSampler):
            state.update(self._order_state(sampler, epoch, consumed))
        elif state["consumed"]:
            # Refused here, while the run can still choose: a load in the next job could only refuse too.
            raise MisuseError(
                f"This loader cannot save its position inside epoch {epoch} ({count(consumed, 'sample')} read): "
                f"{self._why_no_position()}"
            )
        generator = self._order_generator_state(epoch, consumed)
        if generator is not None:
            state["order_generator"] = generator
        return state

    def _why_no_position(self) -> str:
        """Why this loader (not read through a `ResumableSampler`) has no position inside an epoch, and what
        works instead."""
        loader, sampler = self._loader, self.sampler
        between = (
            "save between epochs (after the loop over the loader ends; the run then resumes at the next one)"
        )
        batches = loader.batch_sampler
        if batches is not None and type(batches) is not BatchSampler:
            return (
                f"its batch_sampler ({type(batches).__name__}) is your own, and torchloom cannot tell where it "
                f"stands inside a pass. Either {between}, or build the DataLoader with sampler=... and "
                "batch_size=... instead: setup_dataloaders (use_distributed_sampler=True) then resumes it exactly."
            )
        if batches is not None and loader.batch_size is None:
            sampler = batches.sampler  # a BatchSampler given as batch_sampler: its sampler orders the data
        name = type(sampler).__name__
        if isinstance(sampler, DistributedSampler):
            if type(sampler) is not DistributedSampler:
                return (
                    f"its sampler ({name}) subclasses DistributedSampler, so its order is its own. Either "
                    f"{between}, or use torch's DistributedSampler itself (resumed exactly, at any world size), "
                    "or give the DataLoader an undistributed sampler and let setup_dataloaders split it "
                    "(use_distributed_sampler=True)."
                )
            return (
                f"torchloom could not rebuild your {type(loader).__name__} around a resumable copy of its "
                f"DistributedSampler. Either {between}, or make the loader rebuildable (its __init__ takes the "
                "DataLoader's arguments under their names and passes them on)."
            )
        if not hasattr(sampler, "__len__"):
            return (
                f"its sampler ({name}) has no len(), so torchloom cannot replay its order. Either {between}, or "
                "give the sampler __len__ (setup_dataloaders with use_distributed_sampler=True then resumes it)."
            )
        return (
            f"its sampler ({name}) is read as it is (set up with use_distributed_sampler=False, or a "
            f"{type(loader).__name__} torchloom could not rebuild). Either {between}, or set the loader up with "
            "use_distributed_sampler=True, which splits and resumes the sampler's order (give it a sampler that "
            "does not split the data itself)."
        )

    def _order_state(self, sampler: ResumableSampler, epoch: int, consumed: int) -> dict[str, Any]:
        """What the saved epoch's order came from: the rule; for a pass under way the state its base seed was
        drawn from and (drawn rules) the generator states of its draw; else the state of the sampler's own
        generator the next draw comes from."""
        state: dict[str, Any] = {"rule": sampler.rule, "samples": sampler._size()}
        if self._resume is not None:  # loaded, not yet iterated: pass the checkpoint's on
            base, draw = self._resume[2], sampler.replay
        elif self._current is not None:
            base, draw = self._pass_base, sampler.record
        else:
            base, draw = None, None
        if base is not None:
            state["base"] = base
        if sampler.rule == SEEDED:
            return state
        own = _own_generator(sampler.sampler)
        if (
            own is not None
            and not isinstance(own, torch.Generator)
            and (draw is not None or (epoch, consumed) != (0, 0))
        ):
            raise MisuseError(
                f"This loader's sampler draws its order from a generator torchloom cannot save "
                f"({type(own).__name__}, not a torch.Generator), so a resumed run would draw another order. "
                "Give the sampler a torch.Generator, or save before the first pass."
            )
        if draw is not None:
            state["draw"] = draw
        elif consumed:
            raise MisuseError("The loader handed out batches of a pass whose order it never drew.")  # a bug
        elif isinstance(own, torch.Generator):
            state["own_generator"] = own.get_state()  # the next draw's
        return state

    def _order_generator_state(self, epoch: int, consumed: int) -> torch.Tensor | None:
        """The state the sampler's own generator draws the saved epoch's order from (None without one)."""
        generator = order_generator(self.sampler, self._loader.batch_sampler)
        if generator is None:
            return None
        if not isinstance(generator, torch.Generator):
            if (epoch, consumed) == (0, 0):
                return None  # nothing drawn yet: the resumed run's generator starts where this one did
            raise MisuseError(
                f"This loader's sampler draws its order from a generator torchloom cannot save "
                f"({type(generator).__name__}, not a torch.Generator), so a resumed run would draw another order. "
                "Give the sampler a torch.Generator, or save before the first pass."
            )
        if self._current is not None and self._pass_generator is not None:
            return self._pass_generator.clone()
        return generator.get_state()

    def _log_left_pass(self) -> None:
        if self._left is None or self._warned_left:
            return
        self._warned_left = True
        epoch, consumed = self._left
        log.warning(
            "The pass over epoch %d was left after %d samples (break, an exception, or its iterator "
            "dropped); the loader's next pass reads epoch %d, and so does a run resumed from this checkpoint. To "
            "resume inside an epoch, save while its pass is live (inside the loop).",
            epoch,
            consumed,
            epoch + 1,
        )

    def _iterable_state(self, dataset: IterableDataset) -> dict[str, Any]:
        if not callable(getattr(dataset, "state_dict", None)):
            raise MisuseError(
                f"This loader reads an IterableDataset ({type(dataset).__name__}), which has no position torchloom "
                "can record. Give the dataset state_dict()/load_state_dict() (torchloom then saves those), or leave "
                "the loader out of the checkpoint."
            )
        if self._loader.num_workers > 0:
            raise MisuseError(
                f"This loader reads an IterableDataset ({type(dataset).__name__}) in {self._loader.num_workers} "
                "DataLoader worker processes: they iterate copies of the dataset, so its state_dict() in this "
                "process does not move. Save it with num_workers=0, or leave the loader out of the checkpoint."
            )
        mine = dataset.state_dict()  # type: ignore[attr-defined]
        # Each rank reads its own part of an iterable dataset (the dataset splits itself): every rank's position.
        ranks = self._gather(mine)
        return {"iterable_dataset_ranks": ranks, "world_size": len(ranks), "epoch": self._epoch}

    def _gather(self, obj: Any) -> list[Any]:
        if self._world_size == 1:
            return [obj]
        if self._all_gather_object is not None:
            return self._all_gather_object(obj)
        if not torch.distributed.is_initialized():
            raise MisuseError(
                f"This loader was set up for {count(self._world_size, 'rank')}, but there is no process group to gather "
                "every rank's iterable-dataset position over. Launch the Loom first."
            )
        out: list[Any] = [None] * self._world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (see `state_dict`) on the next pass over the loader."""
        dataset = self._loader.dataset
        if "iterable_dataset_ranks" in state or "iterable_dataset" in state:
            self._load_iterable(dataset, state)
            return
        if state["dataset_len"] != len(dataset):  # type: ignore[arg-type]
            raise CheckpointError(
                f"The checkpoint's loader read a dataset of {count(state['dataset_len'], 'sample')}, this one has "
                f"{len(dataset)}. A position in one dataset means nothing in another: load the checkpoint "  # type: ignore[arg-type]
                "without the loader entry to start the data from the beginning."
            )
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler) and "seed" in state:
            # The order is the checkpoint's, whatever this run was seeded with.
            sampler.seed = int(state["seed"])
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if consumed and not isinstance(sampler, ResumableSampler):
            raise CheckpointError(
                f"The checkpoint was saved inside epoch {epoch}, but this loader cannot start there: "
                f"{self._why_no_position()} Or load the checkpoint without the loader entry to start the data "
                "afresh."
            )
        if isinstance(sampler, ResumableSampler):
            self._load_rule(sampler, state, consumed)
            if (
                consumed
                and sampler.rule == SEEDED
                and bool(state.get("shuffle", sampler.shuffle)) != sampler.shuffle
            ):
                raise CheckpointError(
                    f"The checkpoint's loader read the dataset {'shuffled' if state['shuffle'] else 'in order'}, "
                    f"this one {'shuffles' if sampler.shuffle else 'reads it in order'}: its position inside epoch "
                    f"{epoch} means nothing in the other order. Build the sampler as the saved run did "
                    "(shuffle=...), or load without the loader entry to start the data afresh."
                )
        self._load_order_generator(state, epoch, consumed)
        if consumed and self._global_rank == 0:  # once per job, not once per rank
            self._log_resume(state, epoch, consumed)
        self._resume = (epoch, consumed, state.get("base"))
        self._epoch = epoch

    def _log_resume(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        global_batch = (self._loader.batch_size or 1) * self._world_size
        if global_batch != state["global_batch"]:
            log.warning(
                "Resuming epoch %d after %d of its %s with a global batch of %d (it was %d): "
                "the remaining samples are each read once, but batch boundaries differ from the uninterrupted run.",
                epoch,
                consumed,
                count(state["dataset_len"], "sample"),
                global_batch,
                state["global_batch"],
            )
        elif self._world_size != state["world_size"]:
            # The data is split over the data-parallel replicas: under tensor parallelism (now or in the saved
            # run) they are fewer than the ranks.
            saved_ranks = int(state.get("ranks", state["world_size"]))
            plain = self._ranks == self._world_size and saved_ranks == state["world_size"]
            log.info(
                "Resuming epoch %d after %s on %s (saved on %d): same global batches.",
                epoch,
                count(consumed, "sample"),
                count(self._world_size, "rank" if plain else "data-parallel replica"),
                state["world_size"],
            )

    @staticmethod
    def _load_rule(sampler: ResumableSampler, state: dict[str, Any], consumed: int) -> None:
        """The saved epoch's rule (kept for the rest of the run: later epochs continue the saved run's orders,
        see the module docstring) and the states its draw came from."""
        rule = state.get("rule")
        if (
            rule is None
        ):  # an older torchloom: DistributedSampler's order, but its own split of custom samplers
            if consumed and not isinstance(sampler.sampler, (RandomSampler, SequentialSampler)):
                raise CheckpointError(
                    "The checkpoint was saved inside an epoch by an older torchloom, which drew custom samplers "
                    "from other seeds: the resumed pass cannot read the saved order. Load the checkpoint without "
                    "the loader entry to start the data afresh."
                )
            rule = SEEDED
        if rule not in RULES or (rule != SEEDED and sampler.sampler is None):
            raise CheckpointError(
                f"The checkpoint's loader order rule {rule!r} cannot be followed by this loader."
            )
        sampler.rule = rule
        if "samples" in state and sampler._size() != int(state["samples"]):
            raise CheckpointError(
                f"The checkpoint's loader split a sequence of {count(int(state['samples']), 'sample')} per epoch, "
                f"this one's sampler gives {sampler._size()}. Build the loader's sampler as the saved run did, or "
                "load the checkpoint without the loader entry to start the data afresh."
            )
        if rule != SEEDED and consumed and "draw" not in state:
            raise CheckpointError(
                "The checkpoint was saved inside an epoch without the generator states its order was drawn from. "
                "Load it without the loader entry to start the data afresh."
            )
        sampler.replay = state.get("draw")
        if "own_generator" in state:
            own = _own_generator(sampler.sampler)
            if not isinstance(own, torch.Generator):
                raise CheckpointError(
                    "The checkpoint holds the state of the loader's sampler's own generator, but this loader's "
                    f"sampler ({type(sampler.sampler).__name__}) has no torch.Generator. Build the sampler as the "
                    "saved run did (with generator=...)."
                )
            own.set_state(state["own_generator"])

    def _load_order_generator(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        generator = order_generator(self.sampler, self._loader.batch_sampler)
        saved = state.get("order_generator")
        if saved is not None:
            if not isinstance(generator, torch.Generator):
                raise CheckpointError(
                    "The checkpoint holds the state of the loader's sampler's own generator, but this loader's "
                    f"sampler ({type(getattr(self.sampler, 'sampler', self.sampler)).__name__}) has no "
                    "torch.Generator. Build the sampler as the saved run did (with generator=...)."
                )
            generator.set_state(saved)
        elif isinstance(generator, torch.Generator) and (epoch, consumed) != (0, 0):
            raise CheckpointError(
                f"The checkpoint was saved in epoch {epoch} without the state of the sampler's own generator "
                "(written by an older torchloom, or by a sampler without one), so the resumed pass would draw "
                "another order than the saved run. Load the checkpoint without the loader entry to start the data "
                "afresh."
            )

    def _load_iterable(self, dataset: Any, state: dict[str, Any]) -> None:
        if not callable(getattr(dataset, "load_state_dict", None)):
            raise CheckpointError(
                "The checkpoint holds the position of an iterable dataset, but this loader's dataset "
                f"({type(dataset).__name__}) has no load_state_dict()."
            )
        if "iterable_dataset_ranks" in state:
            ranks = state["iterable_dataset_ranks"]
            if len(ranks) != self._world_size:
                raise CheckpointError(
                    f"The checkpoint holds the iterable dataset positions of {count(len(ranks), 'rank')}, this run has "
                    f"{self._world_size}. An IterableDataset splits itself across ranks, so torchloom cannot map "
                    f"one rank's position to another number of ranks: resume on {count(len(ranks), 'rank')}, or load "
                    "without the loader entry to start the data afresh."
                )
            mine = ranks[self._rank]
        elif self._world_size == 1:
            mine = state["iterable_dataset"]  # written by an older torchloom: right if saved in one process
        else:
            raise CheckpointError(
                "The checkpoint holds one iterable dataset position (written by an older torchloom, which saved "
                f"rank 0's only); this run has {count(self._world_size, 'rank')}, each with its own position. Load it "
                "without the loader entry to start the data afresh."
            )
        dataset.load_state_dict(mine)
        self._epoch = int(state.get("epoch", 0))

    @property
    def device(self) -> torch.device | None:
        """Where batches are moved (None with `setup_dataloaders(..., move_to_device=False)`), as Fabric's."""
        return self._device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Pass:
    """One pass over a `LoomDataLoader` (what `iter(loader)` returns): hands out the DataLoader's batches,
    moved to the device, and tells the loader when it is over, by reaching its end or by being left (closed, or
    garbage collected: what a `break` or an exception out of a `for` loop does to its iterator)."""

    def __init__(
        self, owner: LoomDataLoader, number: int, batches: Iterator[Any], total: int | None, per_batch: int
    ) -> None:
        self._owner = owner
        self._number = number
        self._batches: Iterator[Any] | None = batches
        self._total = total
        self._per_batch = per_batch

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            raise StopIteration
        try:
            batch = next(self._batches)
        except StopIteration:
            self._end(finished=True)
            raise
        self._owner._handed_out(self._number, self._total, self._per_batch)
        device = self._owner._device
        return batch if device is None else move_to_device(batch, device)

    def close(self) -> None:
        """Leave the pass: the loader's next pass reads the next epoch."""
        self._end(finished=False)

    def _end(self, finished: bool) -> None:
        if self._batches is None:
            return
        self._batches = None  # lets the DataLoader's iterator (and its workers) go
        self._owner._pass_over(self._number, finished)

    def __del__(self) -> None:
        self._end(finished=False)
