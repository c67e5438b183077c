"""Resuming exactly, at any world size: the loader's position and the random generators in the checkpoint.

Every multi-rank test records, for every step, the global set of sample indices (all-gathered over ranks) of an
uninterrupted run, saves inside the first and the second epoch, resumes on 1, 2 and 3 processes, and compares.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from harness import run_ranks
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from torchloom import Loom
from torchloom.data import ResumableSampler

G = 6  # global batch: divisible by 1, 2 and 3 ranks
EPOCHS = 2


def _steps(
    rank: int,
    world_size: int,
    n: int,
    batch: int,
    ckpt: str,
    save_at: list[int],
    resume: str | None,
    fmt: str,
):
    """Run the data loop; record every step's global indices. Save after the steps in `save_at` (to
    `ckpt`-STEP); with `resume`, load that checkpoint first and continue from it."""
    strategy = "fsdp2" if fmt == "sharded" else "ddp"
    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    loom.seed_everything(0)
    loader = loom.setup_dataloaders(
        DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, shuffle=True)
    )
    model = loom.setup_module(nn.Linear(1, 1))  # a model makes the checkpoint torchloom's own format
    steps, step, first_epoch = [], 0, 0
    if resume is not None:
        rest = loom.load(resume, {"loader": loader, "model": model})
        step, first_epoch = rest["step"], rest["epoch"]
    for epoch in range(first_epoch, EPOCHS):
        for (idx,) in loader:
            steps.append(sorted(loom.all_gather(idx).flatten().tolist()))
            step += 1
            if resume is None and step in save_at:
                loom.save(f"{ckpt}-{step}", {"loader": loader, "model": model, "step": step, "epoch": epoch})
    return steps


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_resume_at_every_world_size_continues_the_same_global_batches(tmp_path, fmt):
    n = 48  # 8 global batches per epoch
    ckpt = str(tmp_path / "ckpt")
    save_at = [3, 8, 11]  # inside epoch 0, at its last batch, inside epoch 1
    full = run_ranks(_steps, 2, n, G // 2, ckpt, save_at, None, fmt, timeout=240)[0]
    assert len(full) == 2 * n // G
    # Global batch b of an epoch is the same whatever the world size: one process agrees with two.
    assert run_ranks(_steps, 1, n, G, ckpt, [], None, fmt, timeout=120)[0] == full
    for at in save_at:
        for world_size in (1, 2, 3):
            resumed = run_ranks(
                _steps, world_size, n, G // world_size, ckpt, [], f"{ckpt}-{at}", fmt, timeout=240
            )
            assert resumed[0] == full[at:], (at, world_size)
    # Each epoch reads every sample once, and the second epoch is shuffled differently.
    per_epoch = len(full) // EPOCHS
    epochs = [sum(full[e * per_epoch : (e + 1) * per_epoch], []) for e in range(EPOCHS)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert full[0] != full[per_epoch]


@pytest.mark.timeout(300)
def test_another_global_batch_reads_each_remaining_sample_once(tmp_path):
    n = 48
    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(_steps, 2, n, 3, ckpt, [5], None, "full", timeout=240)[0]
    # Resume on 2 ranks with 4 samples each (global batch 8 instead of 6).
    resumed = run_ranks(_steps, 2, n, 4, ckpt, [], f"{ckpt}-5", "full", timeout=240)[0]
    rest_steps = -(-(n - 5 * G) // 8)  # 18 samples left: batches of 8, 8 and 2
    first_epoch_rest = sum(resumed[:rest_steps], [])
    assert sorted(sum(full[:5], []) + first_epoch_rest) == list(range(n))  # none twice, none skipped
    assert sorted(sum(resumed[rest_steps:], [])) == list(range(n))  # the next epoch is whole


def test_the_global_order_and_ragged_ends_at_every_world_size():
    """Sampler level: rank parts interleave the global order; a ragged end is padded or dropped as
    DistributedSampler does; a start skips exactly the consumed samples."""
    from torch.utils.data import DistributedSampler

    data = list(range(50))
    for drop_last in (False, True):
        for ws in (1, 2, 3, 4):
            ours = [
                list(ResumableSampler(data, ws, r, shuffle=True, seed=3, drop_last=drop_last))
                for r in range(ws)
            ]
            theirs = [
                list(DistributedSampler(data, ws, r, shuffle=True, seed=3, drop_last=drop_last))
                for r in range(ws)
            ]
            assert ours == theirs, (ws, drop_last)  # identical to PyTorch's when not resuming
    order = ResumableSampler(data, 1, 0, shuffle=True, seed=3).global_order()
    for ws in (1, 2, 3):
        parts = []
        for r in range(ws):
            sampler = ResumableSampler(data, ws, r, shuffle=True, seed=3)
            sampler.start = 20
            parts.append(list(sampler))
            assert len(sampler) == len(parts[-1])
        got = [parts[r][i] for i in range(len(parts[0])) for r in range(ws)]
        assert got[:30] == order[20:], ws  # the rest of the order, in order; padding only after it


class _Augmented(Dataset):
    """A random augmentation drawn in the worker: (index, noise)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item() + random.random()])


def _augmented_steps(
    rank: int, world_size: int, ckpt: str, save_at: int | None, resume: str | None, workers: int
):
    loom = Loom(accelerator="cpu", devices=world_size)
    loom.launch()
    loom.seed_everything(0)
    loader = loom.setup_dataloaders(
        DataLoader(_Augmented(), batch_size=6 // world_size, shuffle=True, num_workers=workers)
    )
    model = loom.setup_module(nn.Linear(1, 1))
    steps, step, first_epoch = [], 0, 0
    if resume:
        rest = loom.load(resume, {"loader": loader, "model": model})
        step, first_epoch = rest["step"], rest["epoch"]
    for epoch in range(first_epoch, 2):
        for batch in loader:
            gathered = loom.all_gather(batch).reshape(-1, 2)
            steps.append(sorted(map(tuple, gathered.tolist())))
            step += 1
            if step == save_at:
                loom.save(ckpt, {"loader": loader, "model": model, "step": step, "epoch": epoch})
    return steps


@pytest.mark.timeout(600)
def test_worker_augmentations_follow_the_sample_not_the_worker(tmp_path):
    """With DataLoader workers, each sample's random numbers depend on the seed, the epoch and the sample, so
    a resumed run (another world size, another number of workers) draws what the uninterrupted one drew."""
    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(_augmented_steps, 2, ckpt, 3, None, 2, timeout=240)[0]
    assert (
        len({noise for step in full for _, noise in step}) == len(full) * 6
    )  # no repeats across workers, ranks
    for world_size, workers in ((1, 1), (3, 2)):
        resumed = run_ranks(_augmented_steps, world_size, ckpt, None, ckpt, workers, timeout=240)[0]
        assert resumed == full[3:], (world_size, workers)


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _train(rank: int, world_size: int, strategy: str, ckpt: str, save_at: int | None, resume: bool):
    from torch.distributed.fsdp import fully_shard

    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    loom.seed_everything(0)
    model = _Noisy()
    if strategy == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
    model, opt = loom.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 8, generator=g)
    loader = loom.setup_dataloaders(
        DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    )
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 0, "epoch": 0}
    if resume:
        loom.load(ckpt, state)
    losses = []
    for epoch in range(state["epoch"], 2):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            loom.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            state["step"] += 1
            state["epoch"] = epoch
            if state["step"] == save_at:
                loom.save(ckpt, state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model.forward_module, options=StateDictOptions(full_state_dict=True))
    return losses, {k: v.clone() for k, v in full.items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resume_at_the_same_world_size_is_bit_identical(tmp_path, strategy):
    """Dropout on: without the random generators restored the resumed losses would differ."""
    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(_train, 2, strategy, ckpt, 5, False, timeout=240)
    resumed = run_ranks(_train, 2, strategy, ckpt, None, True, timeout=240)
    for rank in range(2):
        assert resumed[rank][0] == full[rank][0][5:], rank
        for name, value in full[rank][1].items():
            assert torch.equal(resumed[rank][1][name], value), (rank, name)


def _other_world_size_warning(rank: int, world_size: int, ckpt: str) -> list[str]:
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchloom").addHandler(handler)
    loom = Loom(accelerator="cpu", devices=world_size)
    loom.launch()
    model = loom.setup_module(nn.Linear(1, 1))
    if world_size == 2:
        loom.save(ckpt, {"model": model})
    else:
        loom.load(ckpt, {"model": model}, restore_run_state=True)
    return records


@pytest.mark.timeout(300)
def test_generators_of_another_world_size_are_not_restored_and_the_log_says_so(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_other_world_size_warning, 2, ckpt, timeout=120)
    (records,) = run_ranks(_other_world_size_warning, 1, ckpt, timeout=120)
    assert any(
        "random generators of 2 ranks, this run has 1: they were not restored" in r for r in records
    ), records


def test_an_iterable_dataset_without_state_is_refused():
    from torchloom import MisuseError

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    loom = Loom(accelerator="cpu", devices=1)
    loader = loom.setup_dataloaders(DataLoader(Stream(), batch_size=2))
    with pytest.raises(MisuseError, match="IterableDataset .*state_dict"):
        loader.state_dict()


def test_a_custom_sampler_resumes_at_every_world_size():
    """A custom sampler's draw for an epoch (seeded from seed + epoch) is split like the dataset order: after a
    start, the ranks together continue the same draw, at any world size."""
    from torch.utils.data import WeightedRandomSampler

    from torchloom.wrappers import ShardedSampler

    def parts(ws: int, start: int) -> list[int]:
        out = []
        for r in range(ws):
            sampler = ShardedSampler(WeightedRandomSampler([1.0] * 10 + [5.0] * 10, 20), ws, r, seed=4)
            sampler.set_epoch(1)
            sampler.start = start
            out.append(list(sampler))
        return [out[r][i] for i in range(len(out[0])) for r in range(ws)]

    whole = parts(1, 0)
    assert parts(2, 0) == whole and parts(1, 0) == whole  # the same draw at every world size
    for ws in (1, 2, 3):
        assert parts(ws, 7)[:13] == whole[7:], ws


def _rebuilt_every_epoch(rank: int, world_size: int, ckpt: str, save_after: int | None, resume: bool):
    """A loop that builds and sets up its loaders again every epoch (k-fold style: a shuffled loader and a
    `SubsetRandomSampler` one over the same dataset). Returns every epoch's global order of both."""
    from torch.utils.data import SubsetRandomSampler

    loom = Loom(accelerator="cpu", devices=world_size, strategy="ddp")
    loom.launch()
    loom.seed_everything(3)
    data = TensorDataset(torch.arange(12))
    model = loom.setup_module(nn.Linear(1, 1))
    first = 0
    if resume:
        # No optimizer or loader in `state`: the loader count (part of the run's state) is asked for.
        first = loom.load(ckpt, {"model": model}, restore_run_state=True)["epoch"] + 1
    orders = []
    for epoch in range(first, 4):
        shuffled = loom.setup_dataloaders(DataLoader(data, batch_size=2, shuffle=True))
        subset = loom.setup_dataloaders(DataLoader(data, batch_size=2, sampler=SubsetRandomSampler(range(6))))
        orders.append(
            [
                [i for (idx,) in loader for i in loom.all_gather(idx).T.flatten().tolist()]
                for loader in (shuffled, subset)
            ]
        )
        if epoch == save_after:
            loom.save(ckpt, {"model": model, "epoch": epoch})
    return orders


@pytest.mark.timeout(300)
def test_a_loader_set_up_again_every_epoch_gets_a_new_order_that_resumes(tmp_path):
    """As a new DataLoader does in plain PyTorch, a loader set up again draws a new order: never its first
    epoch's order again. The orders are the same at every world size, and a checkpoint keeps the count of loaders
    set up, so a resumed run sets up the same orders as the uninterrupted one."""
    ckpt = str(tmp_path / "ckpt.pt")
    alone = _rebuilt_every_epoch(0, 1, ckpt, None, False)
    shuffled = [epoch[0] for epoch in alone]
    subsets = [epoch[1] for epoch in alone]
    assert all(sorted(order) == list(range(12)) for order in shuffled)
    assert all(sorted(order) == list(range(6)) for order in subsets)
    assert len({tuple(o) for o in shuffled}) == 4, shuffled  # no epoch repeats another's order
    assert len({tuple(o) for o in subsets}) == 4, subsets
    # The first loader set up keeps DistributedSampler's order for the global seed.
    g = torch.Generator().manual_seed(3)
    assert shuffled[0] == torch.randperm(12, generator=g).tolist()

    two = run_ranks(_rebuilt_every_epoch, 2, ckpt, 1, False)
    assert two[0] == two[1] == alone  # world-size independent
    resumed = run_ranks(_rebuilt_every_epoch, 2, ckpt, None, True)
    assert resumed[0] == alone[2:]
    # Resumed on another world size too.
    assert _rebuilt_every_epoch(0, 1, ckpt, None, True) == alone[2:]


def test_seeding_again_replays_the_same_loader_orders():
    """As in plain PyTorch, where seeding again makes a new loader repeat the orders drawn after the last
    seeding: the count of set-up loaders restarts at every seed_everything."""
    loom = Loom(accelerator="cpu", devices=1)
    data = TensorDataset(torch.arange(20))

    def orders() -> list[list[int]]:
        loom.seed_everything(5)
        return [
            [
                int(i)
                for (idx,) in loom.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
                for i in idx
            ]
            for _ in range(3)
        ]

    first = orders()
    assert len({tuple(o) for o in first}) == 3
    assert orders() == first
