"""`torchloom.seed`: per-rank, per-worker seeding of DataLoader workers."""

from __future__ import annotations

import functools
import os
import pickle
import random

import pytest
import torch
from torch.utils.data import DataLoader

from torchloom.seed import SEED_WORKERS_ENV, add_worker_seeding, seed_everything, seed_worker


def _draws(worker_id: int, rank: int) -> tuple[float, float]:
    torch.manual_seed(1000 + worker_id)  # what PyTorch does in a worker: base seed + worker id
    seed_worker(worker_id, rank)
    return torch.rand(()).item(), random.random()


def test_seed_worker_differs_by_rank_and_worker_and_repeats():
    draws = {(w, r): _draws(w, r) for w in range(3) for r in range(3)}
    assert len(set(draws.values())) == len(draws)
    assert _draws(1, 2) == draws[(1, 2)]


def test_add_worker_seeding_chains_the_users_function_once(monkeypatch):
    monkeypatch.delenv(SEED_WORKERS_ENV, raising=False)
    calls = []
    loader = DataLoader(list(range(4)), worker_init_fn=calls.append)
    add_worker_seeding(loader, rank=3)
    add_worker_seeding(loader, rank=3)  # set up twice: still one layer
    assert (
        isinstance(loader.worker_init_fn, functools.partial) and loader.worker_init_fn.keywords["rank"] == 3
    )
    loader.worker_init_fn(5)
    assert calls == [5]
    pickle.dumps(DataLoader(list(range(4)), worker_init_fn=loader.worker_init_fn).worker_init_fn)


def test_seed_everything_workers_false_turns_it_off(monkeypatch):
    monkeypatch.delenv(SEED_WORKERS_ENV, raising=False)
    seed_everything(3, workers=False)
    loader = DataLoader(list(range(4)))
    add_worker_seeding(loader, rank=0)
    assert loader.worker_init_fn is None
    seed_everything(3)
    add_worker_seeding(loader, rank=0)
    assert loader.worker_init_fn is not None


def test_seed_everything_without_a_seed(monkeypatch):
    monkeypatch.delenv("TORCHLOOM_SEED", raising=False)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with pytest.warns(UserWarning, match="using 0"):
        assert seed_everything() == 0
    seed_everything(11)
    assert seed_everything() == 11


@pytest.mark.parametrize("workers", [None, True, False])
def test_seed_everything_exports_what_fabric_exports(monkeypatch, workers):
    """Scripts written for Fabric read `PL_GLOBAL_SEED` / `PL_SEED_WORKERS`: torchloom's seed_everything
    leaves them as Fabric's does (compared side by side with lightning's own)."""
    from lightning.fabric import Fabric

    names = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
    for name in (*names, "TORCHLOOM_SEED", SEED_WORKERS_ENV):
        monkeypatch.delenv(name, raising=False)
    Fabric.seed_everything(123, workers=workers, verbose=False)
    fabric_env = {name: os.environ.pop(name, None) for name in names}
    seed_everything(123, workers=workers, verbose=False)
    assert {name: os.environ.get(name) for name in names} == fabric_env
    # A later call without a seed reuses it, whichever library exported it.
    monkeypatch.delenv("TORCHLOOM_SEED")
    assert seed_everything(verbose=False) == 123
