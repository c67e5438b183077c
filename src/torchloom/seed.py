"""Seeding every random number generator a training script touches."""

from __future__ import annotations

import functools
import hashlib
import os
import random
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

SEED_ENV = "TORCHLOOM_SEED"
SEED_WORKERS_ENV = "TORCHLOOM_SEED_WORKERS"
# Lightning's names for the same two values: Fabric scripts (and libraries written for them) read these.
_LIGHTNING_SEED_ENV = "PL_GLOBAL_SEED"
_LIGHTNING_WORKERS_ENV = "PL_SEED_WORKERS"


def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
    """Seed Python's `random`, NumPy (if installed) and torch (CPU and every GPU); returns the seed.

    With no `seed`, the one exported by an earlier call (`TORCHLOOM_SEED`, else Lightning's `PL_GLOBAL_SEED`),
    else 0 (with a warning when `verbose`). The seed is exported as `TORCHLOOM_SEED`, so ranks started later by
    `loom.launch()` see it, and under Lightning's names (`PL_GLOBAL_SEED`, `PL_SEED_WORKERS`) as Fabric's
    `seed_everything` exports it, for scripts that read those.
    `workers=False` stops `setup_dataloaders` from seeding DataLoader workers per rank and worker (see
    `seed_worker`); the default (None or True) seeds them, as Fabric's `seed_everything` does.
    """
    if seed is None:
        seed = global_seed()
        if not {SEED_ENV, _LIGHTNING_SEED_ENV} & set(os.environ) and verbose:
            warnings.warn("seed_everything() got no seed and none was set before: using 0.", stacklevel=2)
    seed = int(seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}.")
    seed_workers = "0" if workers is False else "1"
    os.environ[SEED_ENV] = os.environ[_LIGHTNING_SEED_ENV] = str(seed)
    os.environ[SEED_WORKERS_ENV] = os.environ[_LIGHTNING_WORKERS_ENV] = seed_workers
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
    return seed


def global_seed() -> int:
    """The seed the last `seed_everything` exported: torchloom's (`TORCHLOOM_SEED`), else Lightning's
    (`PL_GLOBAL_SEED`, for a Fabric script that still calls `lightning.seed_everything`), else 0."""
    return _seed_from(SEED_ENV, _LIGHTNING_SEED_ENV)


def sampler_seed() -> int:
    """The seed `setup_dataloaders` gives a `DistributedSampler`: Fabric's (`PL_GLOBAL_SEED`, which torchloom's
    `seed_everything` exports too, so it is the last seed either library set), else `TORCHLOOM_SEED`, else 0."""
    return _seed_from(_LIGHTNING_SEED_ENV, SEED_ENV)


def _seed_from(*names: str) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def seed_generators_from(key: str) -> None:
    """Seed torch, Python's `random` and NumPy (if installed) from `key`, each with its own 64-bit seed."""
    digest = hashlib.blake2b(key.encode(), digest_size=24).digest()
    torch_seed, python_seed, numpy_seed = (int.from_bytes(digest[i : i + 8], "little") for i in (0, 8, 16))
    torch.manual_seed(torch_seed)
    random.seed(python_seed)
    try:
        import numpy as np

        np.random.seed(numpy_seed % 2**32)
    except ImportError:
        pass


def seed_worker(worker_id: int, rank: int, user_fn: Callable[[int], Any] | None = None) -> None:
    """A DataLoader `worker_init_fn`: seed torch, `random` and NumPy in worker `worker_id` of rank `rank`, then
    run the user's own `worker_init_fn`, if any.

    PyTorch seeds worker i with base + i, where base is drawn from the main process's generator; every rank
    seeded alike draws the same base, so worker i of every rank would produce the same "random" augmentations.
    Mixing in the rank makes every worker of every rank differ, while a run stays reproducible (the base
    follows the global seed, and changes each epoch)."""
    base = torch.initial_seed() - worker_id
    seed_generators_from(f"{base}/{worker_id}/{rank}")
    if user_fn is not None:
        user_fn(worker_id)


def add_worker_seeding(loader: DataLoader, rank: int) -> None:
    """Give `loader` the `seed_worker` init function for `rank`, keeping (and calling after it) the user's own.
    Skipped after `seed_everything(..., workers=False)`."""
    if os.environ.get(SEED_WORKERS_ENV) == "0":
        return
    current = loader.worker_init_fn
    if isinstance(current, functools.partial) and current.func is seed_worker:
        return  # already seeded (the loader was set up before)
    loader.worker_init_fn = functools.partial(seed_worker, rank=rank, user_fn=current)
