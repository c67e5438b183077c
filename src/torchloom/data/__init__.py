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

The package's modules: `order` (the rules and `ResumableSampler`), `draws` (the generator states a drawn order
comes from), `rebuild` (a user's DataLoader rebuilt around a `ResumableSampler`), `position` (where a loader
stands, moved by its passes), `resume` (saving and restoring that position) and `loader` (`LoomDataLoader`: the
passes and the device moves).
"""

from torchloom.data.loader import LoomDataLoader, gather_per_replica, move_to_device
from torchloom.data.order import (
    KEPT,
    RULES,
    SEEDED,
    WRAPPED,
    ResumableSampler,
    SampleKey,
    SeededPerSample,
    order_generator,
)
from torchloom.data.rebuild import (
    ordering_sampler,
    users_distributed_sampler,
    with_distributed_sampler,
    with_users_distributed_sampler,
)

__all__ = [
    "KEPT",
    "RULES",
    "SEEDED",
    "WRAPPED",
    "LoomDataLoader",
    "ResumableSampler",
    "SampleKey",
    "SeededPerSample",
    "gather_per_replica",
    "move_to_device",
    "order_generator",
    "ordering_sampler",
    "users_distributed_sampler",
    "with_distributed_sampler",
    "with_users_distributed_sampler",
]
