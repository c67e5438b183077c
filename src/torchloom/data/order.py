"""The global sample order of a pass over a set-up loader: the rule it comes from (`SEEDED`, `KEPT`,
`WRAPPED`), the sampler that splits it across ranks and can start part-way (`ResumableSampler`), and the
generator of the user's own a pass's order is drawn from (`order_generator`). See `torchloom.data`."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, DistributedSampler

from torchloom.data.draws import capture, own_generator, replaying
from torchloom.errors import MisuseError
from torchloom.seed import seed_generators_from

log = logging.getLogger("torchloom")


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
            self.record = capture(own_generator(self.sampler))
            yield from self._keys(itertools.count(), self.sampler)
            return
        order = self._drawn()
        mine = self._my_positions()
        yield from self._keys(mine, [order[p] for p in mine])

    def _drawn(self) -> list[Any]:
        """One draw of the user's sampler: from the recorded states on a resumed pass, else from the generators
        as they are now; on several ranks rank 0's draw (and record)."""
        own = own_generator(self.sampler)
        replay, self.replay = self.replay, None
        if replay is not None:
            with replaying(replay, own):
                draw = list(self.sampler)
            record = replay
        else:
            record = capture(own)
            draw = list(self.sampler)
        if _shares_draws(self.num_replicas):
            shared: list[Any] = [draw, record]
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
