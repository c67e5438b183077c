"""Saving and restoring a loader's `Position` (what `LoomDataLoader.state_dict()` and `load_state_dict()`
return and take): the epoch and the global samples consumed, the order's rule and what it was drawn from, with
every check that a resumed run can read the saved order, or an IterableDataset's own per-rank states. See
`torchloom.data` for what a resume reproduces."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from torchloom._text import count
from torchloom.data.draws import own_generator
from torchloom.data.order import RULES, SEEDED, ResumableSampler, order_generator
from torchloom.data.position import Position
from torchloom.errors import CheckpointError, MisuseError

log = logging.getLogger("torchloom")


def state_dict(position: Position) -> dict[str, Any]:
    """Where this loader is in its data: world-size independent (the same on every rank), except for an
    `IterableDataset`, whose every rank's own state is gathered (then a collective: call it on every rank,
    as `loom.save` does)."""
    if position.interleaved:
        raise MisuseError(
            "An earlier iterator over this loader handed out batches after a later iter(loader) began a new "
            "pass (two passes at once), so the loader has no single position to save. Finish or drop the "
            "earlier iterator before starting the next pass."
        )
    dataset = position.loader.dataset
    if isinstance(dataset, IterableDataset):
        return _iterable_state(position, dataset)
    sampler = position.sampler
    if position.resume is not None:  # loaded, not yet iterated: still where the checkpoint said
        epoch, consumed = position.resume[:2]
    elif position.current is not None:  # inside a pass
        epoch, consumed = position.current, position.consumed
    else:
        epoch, consumed = position.epoch, 0
        _log_left_pass(position)
    state: dict[str, Any] = {
        "epoch": epoch,
        "consumed": consumed,
        "dataset_len": len(dataset),  # type: ignore[arg-type]
        "global_batch": (position.loader.batch_size or 1) * position.world_size,
        "world_size": position.world_size,  # the data-parallel replicas
        "ranks": position.ranks,
    }
    if isinstance(sampler, DistributedSampler):
        state.update(seed=sampler.seed, shuffle=sampler.shuffle)
    if isinstance(sampler, ResumableSampler):
        state.update(_order_state(position, sampler, epoch, consumed))
    elif state["consumed"]:
        # Refused here, while the run can still choose: a load in the next job could only refuse too.
        raise MisuseError(
            f"This loader cannot save its position inside epoch {epoch} ({count(consumed, 'sample')} read): "
            f"{_why_no_position(position)}"
        )
    generator = _order_generator_state(position, epoch, consumed)
    if generator is not None:
        state["order_generator"] = generator
    return state


def _why_no_position(position: Position) -> str:
    """Why this loader (not read through a `ResumableSampler`) has no position inside an epoch, and what
    works instead."""
    loader, sampler = position.loader, position.sampler
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


def _order_state(position: Position, sampler: ResumableSampler, epoch: int, consumed: int) -> dict[str, Any]:
    """What the saved epoch's order came from: the rule; for a pass under way the state its base seed was
    drawn from and (drawn rules) the generator states of its draw; else the state of the sampler's own
    generator the next draw comes from."""
    state: dict[str, Any] = {"rule": sampler.rule, "samples": sampler._size()}
    if position.resume is not None:  # loaded, not yet iterated: pass the checkpoint's on
        base, draw = position.resume[2], sampler.replay
    elif position.current is not None:
        # A pass that has begun but not drawn yet (saved between `iter()` and its first batch, as a replica group
        # keeps its step's start) draws from what a resume handed it, if any.
        base, draw = position.pass_base, sampler.record if sampler.record is not None else sampler.replay
    else:
        base, draw = None, None
    if base is not None:
        state["base"] = base
    if sampler.rule == SEEDED:
        return state
    own = own_generator(sampler.sampler)
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


def _order_generator_state(position: Position, epoch: int, consumed: int) -> torch.Tensor | None:
    """The state the sampler's own generator draws the saved epoch's order from (None without one)."""
    generator = order_generator(position.sampler, position.loader.batch_sampler)
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
    if position.current is not None and position.pass_generator is not None:
        return position.pass_generator.clone()
    return generator.get_state()


def _log_left_pass(position: Position) -> None:
    if position.left is None or position.warned_left:
        return
    position.warned_left = True
    epoch, consumed = position.left
    log.warning(
        "The pass over epoch %d was left after %d samples (break, an exception, or its iterator "
        "dropped); the loader's next pass reads epoch %d, and so does a run resumed from this checkpoint. To "
        "resume inside an epoch, save while its pass is live (inside the loop).",
        epoch,
        consumed,
        epoch + 1,
    )


def _iterable_state(position: Position, dataset: IterableDataset) -> dict[str, Any]:
    if not callable(getattr(dataset, "state_dict", None)):
        raise MisuseError(
            f"This loader reads an IterableDataset ({type(dataset).__name__}), which has no position torchloom "
            "can record. Give the dataset state_dict()/load_state_dict() (torchloom then saves those), or leave "
            "the loader out of the checkpoint."
        )
    if position.loader.num_workers > 0:
        raise MisuseError(
            f"This loader reads an IterableDataset ({type(dataset).__name__}) in {position.loader.num_workers} "
            "DataLoader worker processes: they iterate copies of the dataset, so its state_dict() in this "
            "process does not move. Save it with num_workers=0, or leave the loader out of the checkpoint."
        )
    mine = dataset.state_dict()  # type: ignore[attr-defined]
    # Each rank reads its own part of an iterable dataset (the dataset splits itself): every rank's position.
    ranks = _gather(position, mine)
    return {"iterable_dataset_ranks": ranks, "world_size": len(ranks), "epoch": position.epoch}


def _gather(position: Position, obj: Any) -> list[Any]:
    if position.world_size == 1:
        return [obj]
    if position.all_gather_object is not None:
        return position.all_gather_object(obj)
    if not torch.distributed.is_initialized():
        raise MisuseError(
            f"This loader was set up for {count(position.world_size, 'rank')}, but there is no process group to gather "
            "every rank's iterable-dataset position over. Launch the Loom first."
        )
    out: list[Any] = [None] * position.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def load_state_dict(position: Position, state: dict[str, Any]) -> None:
    """Continue from `state` (see `state_dict`) on the next pass over the loader."""
    dataset = position.loader.dataset
    if "iterable_dataset_ranks" in state or "iterable_dataset" in state:
        _load_iterable(position, dataset, state)
        return
    if state["dataset_len"] != len(dataset):  # type: ignore[arg-type]
        raise CheckpointError(
            f"The checkpoint's loader read a dataset of {count(state['dataset_len'], 'sample')}, this one has "
            f"{len(dataset)}. A position in one dataset means nothing in another: load the checkpoint "  # type: ignore[arg-type]
            "without the loader entry to start the data from the beginning."
        )
    sampler = position.sampler
    if isinstance(sampler, DistributedSampler) and "seed" in state:
        # The order is the checkpoint's, whatever this run was seeded with.
        sampler.seed = int(state["seed"])
    epoch, consumed = int(state["epoch"]), int(state["consumed"])
    if consumed and not isinstance(sampler, ResumableSampler):
        raise CheckpointError(
            f"The checkpoint was saved inside epoch {epoch}, but this loader cannot start there: "
            f"{_why_no_position(position)} Or load the checkpoint without the loader entry to start the data "
            "afresh."
        )
    if isinstance(sampler, ResumableSampler):
        _load_rule(sampler, state, consumed)
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
    _load_order_generator(position, state, epoch, consumed)
    if consumed and position.global_rank == 0:  # once per job, not once per rank
        _log_resume(position, state, epoch, consumed)
    position.resume = (epoch, consumed, state.get("base"))
    position.epoch = epoch


def _log_resume(position: Position, state: dict[str, Any], epoch: int, consumed: int) -> None:
    global_batch = (position.loader.batch_size or 1) * position.world_size
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
    elif position.world_size != state["world_size"]:
        # The data is split over the data-parallel replicas: under tensor parallelism (now or in the saved
        # run) they are fewer than the ranks.
        saved_ranks = int(state.get("ranks", state["world_size"]))
        plain = position.ranks == position.world_size and saved_ranks == state["world_size"]
        log.info(
            "Resuming epoch %d after %s on %s (saved on %d): same global batches.",
            epoch,
            count(consumed, "sample"),
            count(position.world_size, "rank" if plain else "data-parallel replica"),
            state["world_size"],
        )


def _load_rule(sampler: ResumableSampler, state: dict[str, Any], consumed: int) -> None:
    """The saved epoch's rule (kept for the rest of the run: later epochs continue the saved run's orders,
    see `torchloom.data`) and the states its draw came from."""
    rule = state.get("rule")
    if rule is None:  # an older torchloom: DistributedSampler's order, but its own split of custom samplers
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
        own = own_generator(sampler.sampler)
        if not isinstance(own, torch.Generator):
            raise CheckpointError(
                "The checkpoint holds the state of the loader's sampler's own generator, but this loader's "
                f"sampler ({type(sampler.sampler).__name__}) has no torch.Generator. Build the sampler as the "
                "saved run did (with generator=...)."
            )
        own.set_state(state["own_generator"])


def _load_order_generator(position: Position, state: dict[str, Any], epoch: int, consumed: int) -> None:
    generator = order_generator(position.sampler, position.loader.batch_sampler)
    saved = state.get("order_generator")
    if saved is not None:
        if not isinstance(generator, torch.Generator):
            raise CheckpointError(
                "The checkpoint holds the state of the loader's sampler's own generator, but this loader's "
                f"sampler ({type(getattr(position.sampler, 'sampler', position.sampler)).__name__}) has no "
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


def _load_iterable(position: Position, dataset: Any, state: dict[str, Any]) -> None:
    if not callable(getattr(dataset, "load_state_dict", None)):
        raise CheckpointError(
            "The checkpoint holds the position of an iterable dataset, but this loader's dataset "
            f"({type(dataset).__name__}) has no load_state_dict()."
        )
    if "iterable_dataset_ranks" in state:
        ranks = state["iterable_dataset_ranks"]
        if len(ranks) != position.world_size:
            raise CheckpointError(
                f"The checkpoint holds the iterable dataset positions of {count(len(ranks), 'rank')}, this run has "
                f"{position.world_size}. An IterableDataset splits itself across ranks, so torchloom cannot map "
                f"one rank's position to another number of ranks: resume on {count(len(ranks), 'rank')}, or load "
                "without the loader entry to start the data afresh."
            )
        mine = ranks[position.rank]
    elif position.world_size == 1:
        mine = state["iterable_dataset"]  # written by an older torchloom: right if saved in one process
    else:
        raise CheckpointError(
            "The checkpoint holds one iterable dataset position (written by an older torchloom, which saved "
            f"rank 0's only); this run has {count(position.world_size, 'rank')}, each with its own position. Load it "
            "without the loader entry to start the data afresh."
        )
    dataset.load_state_dict(mine)
    position.epoch = int(state.get("epoch", 0))
