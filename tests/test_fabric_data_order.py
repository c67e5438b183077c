"""Data order: the same script through Lightning Fabric 2.6.6 and through torchloom (`Loom` as `Fabric`) reads
the same samples in the same order on every rank, epoch after epoch, and draws the same numbers from the global
generator around it; a run resumed from a checkpoint taken inside an epoch then reads the rest of the
uninterrupted run's global batches, in one process and on two, also on the other number of ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fabric_scripts import make_fabric
from harness import run_ranks
from torch import nn
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

EPOCHS = 3
N = 22  # not a multiple of 2 x the batch size: padding and short batches show


class _EveryOther(torch.utils.data.Sampler):
    """A custom sampler with set_epoch (Fabric calls it each pass): the even or odd indices, shuffled."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(range(self.epoch % 2, self.n, 2))

    def __iter__(self):
        indices = list(range(self.epoch % 2, self.n, 2))
        return iter([indices[i] for i in torch.randperm(len(indices)).tolist()])


def _loader(case: str, data: TensorDataset) -> DataLoader:
    if case == "random":
        return DataLoader(data, batch_size=3, shuffle=True)
    if case == "sequential":
        return DataLoader(data, batch_size=3)
    if case == "drop_last":
        return DataLoader(data, batch_size=4, shuffle=True, drop_last=True)
    if case == "own_generator":
        return DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
    if case == "replacement":
        return DataLoader(data, batch_size=3, sampler=RandomSampler(data, replacement=True, num_samples=15))
    if case == "subset":
        return DataLoader(data, batch_size=3, sampler=SubsetRandomSampler(range(3, 17)))
    if case == "weighted":
        weights = [1.0] * 11 + [4.0] * 11
        return DataLoader(data, batch_size=3, sampler=WeightedRandomSampler(weights, 16))
    if case == "custom_epoch":
        return DataLoader(data, batch_size=3, sampler=_EveryOther(N))
    if case == "sequential_sampler":
        return DataLoader(data, batch_size=3, sampler=SequentialSampler(data))
    if case == "workers":
        return DataLoader(data, batch_size=3, shuffle=True, num_workers=2)
    raise ValueError(case)


CASES = [
    "random",
    "sequential",
    "drop_last",
    "own_generator",
    "replacement",
    "subset",
    "weighted",
    "custom_epoch",
    "sequential_sampler",
]
# On several ranks Fabric replaces a RandomSampler with replacement or num_samples (or a subclass) by
# DistributedSampler, dropping what it draws; torchloom splits its own draw (see test_data.py's
# test_the_users_sampler_is_split_not_replaced), a deliberate difference.
DISTRIBUTED_CASES = [case for case in CASES if case != "replacement"]


def _read(fabric: Any, loader: Any) -> tuple[list[int], list[float]]:
    """One pass: the indices this rank reads, and one global-generator draw after each batch (what dropout in
    the loop would see)."""
    seen, draws = [], []
    for (idx,) in loader:
        seen += idx.tolist()
        draws.append(torch.rand(()).item())
    return seen, draws


def order_script(rank: int, world_size: int, kind: str, cases: list[str], strategy: str) -> dict[str, Any]:
    """Every case: EPOCHS passes over one set-up loader, then EPOCHS loaders built and set up anew (one pass
    each, as a k-fold loop does), then two loaders set up together; records what this rank reads."""
    fabric = make_fabric(kind, accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    data = TensorDataset(torch.arange(N))
    out: dict[str, Any] = {}
    for case in cases:
        fabric.seed_everything(7)
        loader = fabric.setup_dataloaders(_loader(case, data))
        out[case] = [_read(fabric, loader) for _ in range(EPOCHS)]
        out[case + "/len"] = len(loader)
        out[case + "/recreated"] = [
            _read(fabric, fabric.setup_dataloaders(_loader(case, data))) for _ in range(EPOCHS)
        ]
        a, b = fabric.setup_dataloaders(_loader(case, data), _loader(case, data))
        out[case + "/two"] = [_read(fabric, a), _read(fabric, b)]
        out[case + "/after"] = torch.rand(()).item()
    return out


def _single(strategy: str, cases: list[str]) -> None:
    fabric = order_script(0, 1, "fabric", cases, strategy)
    ours = order_script(0, 1, "torchloom", cases, strategy)
    for key in fabric:
        assert ours[key] == fabric[key], key


def test_one_process_reads_fabrics_order():
    """One device: Fabric keeps the loader's own sampler (a RandomSampler draws its seed from the global
    generator at every pass, after the DataLoader's base seed); torchloom reads the same order."""
    _single("auto", CASES)


def test_one_process_ddp_reads_fabrics_distributed_order():
    """strategy='ddp' on one process: Fabric puts DistributedSampler (or its wrapper) in, as on several."""
    _single("ddp", DISTRIBUTED_CASES)


@pytest.mark.timeout(600)
def test_two_ranks_read_fabrics_order():
    """Two ranks: DistributedSampler with PL_GLOBAL_SEED for every loader (restarting at epoch 0 when set up
    again), custom samplers drawn whole each pass and split (DistributedSamplerWrapper), padding as Fabric's."""
    fabric = run_ranks(order_script, 2, "fabric", DISTRIBUTED_CASES, "ddp", timeout=300)
    ours = run_ranks(order_script, 2, "torchloom", DISTRIBUTED_CASES, "ddp", timeout=300)
    for rank in range(2):
        for key in fabric[rank]:
            assert ours[rank][key] == fabric[rank][key], (rank, key)


def test_worker_loaders_read_fabrics_order():
    """With DataLoader workers the order and the global stream are Fabric's too (the workers' own random
    numbers are seeded per sample, see docs/fabric.md)."""
    _single("auto", ["workers"])


# ---- resuming inside an epoch --------------------------------------------------------------------------------
def resume_script(
    rank: int, world_size: int, case: str, ckpt: str, save_at: int | None, resume: bool, strategy: str
) -> list[list[int]]:
    """EPOCHS passes; records every step's global batch (all ranks' indices, rank by rank). Saves after step
    `save_at`; with `resume`, loads that checkpoint first and continues."""
    import os

    from torchloom import Loom

    if strategy == "auto":
        # A plain `python train.py` on one device: not a process a launcher started (which reads
        # DistributedSampler's order even alone; see docs/fabric.md).
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(key, None)
    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    loom.seed_everything(7)
    per_rank = 6 // world_size
    data = TensorDataset(torch.arange(24))
    loader = loom.setup_dataloaders(_resume_loader(case, data, per_rank))
    expected = "kept" if strategy == "auto" else ("seeded" if case == "random" else "wrapped")
    assert loader.sampler.rule == expected  # Fabric's rule for this loader here (a load may switch it)
    model = loom.setup_module(nn.Linear(1, 1))
    steps, step, first = [], 0, 0
    if resume:
        rest = loom.load(ckpt, {"loader": loader, "model": model})
        step, first = rest["step"], rest["epoch"]
    for epoch in range(first, EPOCHS):
        for (idx,) in loader:
            steps.append(loom.all_gather(idx).flatten().tolist() + [round(torch.rand(()).item(), 6)])
            step += 1
            if step == save_at:
                loom.save(ckpt, {"loader": loader, "model": model, "step": step, "epoch": epoch})
    return steps


def _resume_loader(case: str, data: TensorDataset, batch: int) -> DataLoader:
    if case == "random":
        return DataLoader(data, batch_size=batch, shuffle=True)
    if case == "subset":
        return DataLoader(data, batch_size=batch, sampler=SubsetRandomSampler(range(2, 20)))
    raise ValueError(case)


def _global(steps: list[list[int]]) -> list[list[int]]:
    """The indices of each global batch, as a set (the random draw after it dropped)."""
    return [sorted(s[:-1]) for s in steps]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["random", "subset"])
def test_a_run_resumes_inside_an_epoch_at_one_and_two_ranks(tmp_path, case):
    """Saved in one process (the user's sampler's order) and on two ranks (DistributedSampler's or the
    wrapper's), resumed in a fresh process on 1 and 2 ranks: the rest of the uninterrupted run's global
    batches, every epoch (the saved run's order rule is kept); at the same world size also the same global
    random numbers after each step."""
    for saved_on, strategy in ((1, "auto"), (2, "ddp")):
        ckpt = str(tmp_path / f"{case}-{saved_on}.pt")
        full = run_ranks(resume_script, saved_on, case, ckpt, 5, False, strategy, timeout=240)[0]
        assert len(full) >= 6
        for world_size in (1, 2):
            resumed = run_ranks(
                resume_script,
                world_size,
                case,
                ckpt,
                None,
                True,
                "ddp" if world_size > 1 else "auto",
                timeout=240,
            )[0]
            left = _left_in_epoch(full, 5)
            if world_size == saved_on:
                assert resumed == full[5:], (saved_on, world_size)
            elif case == "random" and saved_on == 2:
                # DistributedSampler's order is kept for every later epoch: all the same global batches.
                assert _global(resumed) == _global(full[5:]), (saved_on, world_size)
            else:
                # A drawn order: the epoch in progress is the saved one; later epochs draw from this run's
                # generators (the saved ones come back only at the same world size).
                assert _global(resumed[:left]) == _global(full[5:])[:left], (saved_on, world_size)
                assert len(resumed) == len(full) - 5


def _left_in_epoch(full: list[list[int]], at: int) -> int:
    per_epoch = len(full) // EPOCHS
    return per_epoch - at % per_epoch


def drifted_script(rank: int, world_size: int, kind: str) -> tuple[list[int], list[str]]:
    """Two ranks whose global generators differ (seeded apart) read a SubsetRandomSampler loader: the indices
    this rank reads in one pass, and torchloom's warnings."""
    import logging

    fabric = make_fabric(kind, accelerator="cpu", devices=world_size, strategy="ddp")
    fabric.launch()
    torch.manual_seed(rank)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchloom").addHandler(handler)
    loader = fabric.setup_dataloaders(
        DataLoader(TensorDataset(torch.arange(N)), sampler=SubsetRandomSampler(range(12)))
    )
    return [i for (idx,) in loader for i in idx.tolist()], warnings


def test_ranks_whose_generators_differ_split_rank_zeros_draw():
    """Different on purpose: Fabric splits each rank's own draw of a custom sampler (with generators that differ,
    samples overlap and others are missing); torchloom splits rank 0's draw, broadcast, and warns."""
    fabric = run_ranks(drifted_script, 2, "fabric", timeout=150)
    ours = run_ranks(drifted_script, 2, "torchloom", timeout=150)
    assert sorted(fabric[0][0] + fabric[1][0]) != list(range(12))  # Fabric: not one draw's partition
    assert sorted(ours[0][0] + ours[1][0]) == list(range(12))
    torch.manual_seed(0)
    torch.empty((), dtype=torch.int64).random_()  # the DataLoader's base seed comes first
    draw = list(SubsetRandomSampler(range(12)))  # rank 0's draw
    assert ours[0][0] == draw[0::2] and ours[1][0] == draw[1::2]
    assert any("drew different sequences" in line for line in ours[1][1])
