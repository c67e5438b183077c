"""Resuming loaders whose order the user chose: their own `DistributedSampler` (kept, resumed exactly inside an
epoch, at the same world size and at another), and the samplers torchloom cannot place inside an epoch (a custom
batch_sampler, a DistributedSampler subclass, a sampler read as it is), refused when saving, with advice that
works. Also the resume log: once per job, in data-parallel replicas under tensor parallelism.

The oracle for the user's DistributedSampler is torch's DistributedSampler itself, iterated in this process for
each rank; for a resume, the uninterrupted run's global batches after the save."""

from __future__ import annotations

import logging

import pytest
import torch
from harness import run_ranks
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from torchloom import CheckpointError, Loom, MisuseError

G = 6  # global batch: divisible by 1, 2 and 3 ranks
EPOCHS = 2
SEED = 7
SAVE_AT = 2  # global batches read in epoch 0 when saving
# (name, dataset size): 26 is ragged at 2 ranks' batches (a short last batch); 24 splits evenly at 1, 2 and 3
# ranks, so a resume at another world size has the same global batches to the epoch's end.
VARIANTS = (
    ("kept", 26),  # use_distributed_sampler=False
    ("default", 26),  # use_distributed_sampler=True: the user's DistributedSampler is kept too
    ("batch_sampler", 26),  # inside the user's BatchSampler, drop_last=True on the sampler
    ("even", 24),
)


def _loader(loom: Loom, name: str, n: int, world_size: int):
    data = TensorDataset(torch.arange(n))
    if name == "batch_sampler":
        sampler = DistributedSampler(data, seed=SEED, drop_last=True)
        loader = DataLoader(data, batch_sampler=BatchSampler(sampler, G // world_size, drop_last=False))
    else:
        loader = DataLoader(data, batch_size=G // world_size, sampler=DistributedSampler(data, seed=SEED))
    return loom.setup_dataloaders(loader, use_distributed_sampler=name != "kept")


def _run(rank: int, world_size: int, directory: str, resume: bool, names: list[str]):
    """Every variant's global batches (sorted), epoch after epoch; saved after SAVE_AT batches of epoch 0, or
    loaded from there. Also the torchloom log lines this rank showed."""
    shown: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchloom").addHandler(handler)
    with Loom(accelerator="cpu", devices=world_size, strategy="ddp") as loom:
        loom.launch()
        loom.seed_everything(0)
        out = {}
        for name, n in VARIANTS:
            if name not in names:
                continue
            loader = _loader(loom, name, n, world_size)
            model = loom.setup_module(nn.Linear(1, 1))  # the checkpoint in torchloom's own format
            path = f"{directory}/{name}.pt"
            if resume:
                loom.load(path, {"loader": loader, "model": model})
            steps = []
            for epoch in range(EPOCHS):
                for (idx,) in loader:
                    steps.append(sorted(loom.all_gather(idx).flatten().tolist()))
                    if not resume and epoch == 0 and len(steps) == SAVE_AT:
                        loom.save(path, {"loader": loader, "model": model})
            out[name] = steps
    logging.getLogger("torchloom").removeHandler(handler)
    return out, shown


def _run_then_resumed(rank: int, world_size: int, directory: str, names: list[str]):
    """The uninterrupted run, then a fresh Loom in the same processes resumed from its checkpoints."""
    return _run(rank, world_size, directory, False, names), _run(rank, world_size, directory, True, names)


def _torch_order(name: str, n: int, world_size: int) -> list[list[int]]:
    """Global batches of plain torch: each rank's DistributedSampler, batched, epoch after epoch."""
    data = range(n)
    steps = []
    for epoch in range(EPOCHS):
        per_rank = []
        for r in range(world_size):
            sampler = DistributedSampler(
                data, num_replicas=world_size, rank=r, seed=SEED, drop_last=name == "batch_sampler"
            )
            sampler.set_epoch(epoch)
            order = list(sampler)
            b = G // world_size
            per_rank.append([order[i : i + b] for i in range(0, len(order), b)])
        steps += [sorted(sum((batches[k] for batches in per_rank), [])) for k in range(len(per_rank[0]))]
    return steps


@pytest.mark.timeout(600)
def test_the_users_distributed_sampler_resumes_exactly(tmp_path):
    """Saved inside epoch 0 on 2 ranks: a fresh group of 2 reads exactly the uninterrupted run's global batches
    after the save, to the end of epoch 1 (ragged ends, drop_last, a BatchSampler around the sampler), with or
    without use_distributed_sampler; a group of 3 ranks (each building its DistributedSampler for its
    world) too, where the dataset splits evenly. Before, the save succeeded and the load refused."""
    names = [name for name, _ in VARIANTS]
    (live, _), (resumed, _) = run_ranks(_run_then_resumed, 2, str(tmp_path), names, timeout=300)[0]
    for name, n in VARIANTS:
        assert live[name] == _torch_order(name, n, 2), name  # the user's sampler, kept as it is
    for name in names:
        assert resumed[name] == live[name][SAVE_AT:], name
    # On 3 ranks (2 -> 1 takes the same path: the global order does not depend on the world size).
    ranks = run_ranks(_run, 3, str(tmp_path), True, ["even"], timeout=240)
    assert ranks[0][0]["even"] == live["even"][SAVE_AT:]
    # The log says it once (rank 0), in ranks (no tensor parallelism on either side).
    lines = [line for _, shown in ranks for line in shown if line.startswith("Resuming epoch")]
    assert lines == ["Resuming epoch 0 after 12 samples on 3 ranks (saved on 2): same global batches."], lines


def _model_parallel_resume(rank: int, world_size: int) -> tuple[list[list[int]], list[str], list[list[int]]]:
    """Saved on 2 DDP ranks (`_ddp_state`), then, under a fresh Loom in the same processes, dp 1 x tp 2: both
    ranks read every sample (one data-parallel replica), continuing that state. Returns what they read, the
    log lines of the resume, and the uninterrupted DDP run's global batches after the save."""
    from torchloom.strategies import ModelParallelStrategy

    state, rest = _ddp_state(rank, world_size)
    shown: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchloom").addHandler(handler)
    strategy = ModelParallelStrategy(lambda m, mesh: m, data_parallel_size=1, tensor_parallel_size=2)
    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    data = TensorDataset(torch.arange(24))
    # A DistributedSampler of the user's built for the whole world would feed the two ranks of the
    # tensor-parallel group different samples: refused, naming the split that works.
    try:
        loom.setup_dataloaders(DataLoader(data, batch_size=G, sampler=DistributedSampler(data)))
    except MisuseError as error:
        shown.append(str(error))
    loader = loom.setup_dataloaders(DataLoader(data, batch_size=G, shuffle=True))
    loader.load_state_dict(state)
    steps = [sorted(idx.tolist()) for (idx,) in loader]
    logging.getLogger("torchloom").removeHandler(handler)
    return steps, shown, rest


def _ddp_state(rank: int, world_size: int) -> tuple[dict, list[list[int]]]:
    with Loom(accelerator="cpu", devices=world_size, strategy="ddp") as loom:
        loom.launch()
        loom.seed_everything(0)
        loader = loom.setup_dataloaders(
            DataLoader(TensorDataset(torch.arange(24)), batch_size=G // world_size, shuffle=True)
        )
        batches = iter(loader)
        next(batches)
        state = loader.state_dict()
        rest = [sorted(loom.all_gather(idx).flatten().tolist()) for (idx,) in batches]
        # Rank 0's state, as a checkpoint holds it (the ranks' states agree: one global position).
        return loom.broadcast(state), rest


@pytest.mark.timeout(300)
def test_the_resume_log_is_said_once_in_data_parallel_replicas():
    """Saved on 2 DDP ranks, resumed under dp 1 x tp 2: both ranks read the uninterrupted run's global batches
    (one replica reads all of each), and the log says so once, counting replicas, not ranks. Before, every rank
    said "on 1 rank"."""
    ranks = run_ranks(_model_parallel_resume, 2, timeout=150)
    rest = ranks[0][2]
    assert [steps for steps, _, _ in ranks] == [rest, rest]
    lines = [line for _, shown, _ in ranks for line in shown if line.startswith("Resuming epoch")]
    assert lines == [
        "Resuming epoch 0 after 6 samples on 1 data-parallel replica (saved on 2): same global batches."
    ]
    for _, shown, _ in ranks:
        assert any("DistributedSampler(dataset, num_replicas=1, rank=0)" in line for line in shown), shown


# ---- what cannot be placed inside an epoch is refused when saving, with advice that works -------------------
class _OwnOrder(DistributedSampler):
    """A DistributedSampler subclass with an order of its own (torchloom cannot know it)."""

    def __iter__(self):
        return reversed(list(super().__iter__()))


class _ShuffledBatches(torch.utils.data.Sampler):
    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(5)

    def __len__(self) -> int:
        return 3

    def __iter__(self):
        return iter(torch.randperm(12, generator=self.generator).view(3, 4).tolist())


class _Reversed(torch.utils.data.Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


def _refused_loaders(data: TensorDataset) -> dict[str, tuple[DataLoader, bool, str]]:
    """name -> (loader, use_distributed_sampler, a fragment of the advice)."""
    return {
        "batch_sampler": (
            DataLoader(data, batch_sampler=_ShuffledBatches()),
            True,
            "build the DataLoader with sampler=... and batch_size=... instead",
        ),
        "subclass": (
            DataLoader(data, batch_size=4, sampler=_OwnOrder(data, num_replicas=1, rank=0)),
            True,
            "use torch's DistributedSampler itself",
        ),
        "subclass_in_batch_sampler": (
            DataLoader(data, batch_sampler=BatchSampler(_OwnOrder(data, num_replicas=1, rank=0), 4, False)),
            True,
            "use torch's DistributedSampler itself",
        ),
        "kept": (
            DataLoader(data, batch_size=4, sampler=_Reversed(12)),
            False,
            "set the loader up with use_distributed_sampler=True",
        ),
    }


def test_what_cannot_resume_inside_an_epoch_is_refused_at_save(tmp_path):
    """A custom batch_sampler, a DistributedSampler subclass and a sampler read as it is: the save inside an
    epoch raises (before, the subclass saved and its load refused; the others advised
    use_distributed_sampler=True, which changes nothing for a batch_sampler), saving between epochs works, and
    where the advice is use_distributed_sampler=True, following it resumes exactly."""
    data = TensorDataset(torch.arange(12))
    loom = Loom(accelerator="cpu", devices=1)
    model = loom.setup_module(nn.Linear(1, 1))
    for name, (plain, distributed, advice) in _refused_loaders(data).items():
        loader = loom.setup_dataloaders(plain, use_distributed_sampler=distributed)
        batches = iter(loader)
        next(batches)
        with pytest.raises(MisuseError, match="cannot save its position inside epoch 0") as refused:
            loom.save(tmp_path / f"{name}.pt", {"loader": loader, "model": model})
        assert advice in str(refused.value) and "save between epochs" in str(refused.value), name
        list(batches)  # the pass ends: between epochs
        loom.save(tmp_path / f"{name}.pt", {"loader": loader, "model": model})
    # The advice for a sampler read as it is, followed: resumed exactly inside the epoch.
    loader = loom.setup_dataloaders(DataLoader(data, batch_size=4, sampler=_Reversed(12)))
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    fresh = loom.setup_dataloaders(DataLoader(data, batch_size=4, sampler=_Reversed(12)))
    fresh.load_state_dict(state)
    assert (
        [idx.tolist() for (idx,) in fresh]
        == [idx.tolist() for (idx,) in batches]
        == [[7, 6, 5, 4], [3, 2, 1, 0]]
    )


def test_a_position_in_another_order_is_refused():
    """Resuming a shuffled epoch's position with a sampler that reads in order (or the other way) would read
    another order's remainder: refused."""
    data = TensorDataset(torch.arange(12))
    loom = Loom(accelerator="cpu", devices=1)

    def loader(shuffle: bool):
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=shuffle)
        return loom.setup_dataloaders(DataLoader(data, batch_size=4, sampler=sampler))

    live = loader(True)
    batches = iter(live)  # kept: a dropped iterator ends the pass
    next(batches)
    with pytest.raises(CheckpointError, match="read the dataset shuffled, this one reads it in order"):
        loader(False).load_state_dict(live.state_dict())
