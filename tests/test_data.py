"""Resuming exactly, at any world size: the loader's position and the random generators in the checkpoint.

Every multi-rank test records, for every step, the global set of sample indices (all-gathered over ranks) of an
uninterrupted run, saves inside the first and the second epoch, resumes on 1, 2 and 3 processes, and compares.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

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
    world_size: int, n: int, batch: int, ckpt: str, save_at: list[int], resume: str | None, fmt: str
) -> list[list[int]]:
    """Run the data loop under a fresh Loom (closed at the end, so the next run in these processes makes a
    new group); record every step's global indices. Save after the steps in `save_at` (to `ckpt`-STEP); with
    `resume`, load that checkpoint first and continue from it."""
    strategy = "fsdp2" if fmt == "sharded" else "ddp"
    with Loom(accelerator="cpu", devices=world_size, strategy=strategy) as loom:
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
                    loom.save(
                        f"{ckpt}-{step}", {"loader": loader, "model": model, "step": step, "epoch": epoch}
                    )
    return steps


N = 48  # 8 global batches per epoch
SAVE_AT = (3, 8, 11)  # inside epoch 0, at its last batch, inside epoch 1
AUGMENTED_RESUMES = {
    1: 1,
    3: 2,
}  # world size -> DataLoader workers per rank, resuming the 2-rank, 2-worker run
OTHER_BATCH_AT = 5  # also saved by the 2-rank run: resumed on 2 ranks with global batch 8 instead of 6


def _every_resume(rank: int, world_size: int, root: str, uninterrupted: bool) -> dict:
    """One rank group per world size (starting ranks dominates the cost): for each format, the uninterrupted
    run (on 2 ranks it writes every checkpoint), then a resume from every checkpoint, each under its own Loom.
    Keys: (fmt, None) for the uninterrupted run, (fmt, at) for the resume from `ckpt`-`at`, ("other batch",
    OTHER_BATCH_AT) for the 2-rank resume with 4 samples per rank, and "scenarios" for `_scenarios_then_resumed`."""
    out: dict = {}
    # test_worker_augmentations_follow_the_sample_not_the_worker's run at this world size (2 ranks: saved after
    # step 3; 1 and 3: resumed from there with AUGMENTED_RESUMES' workers). First: its DataLoader workers are
    # forked from the rank, and a worker forked after several Looms had come and gone in the same process
    # once died of a segfault in libc (one full-suite run; not reproduced alone).
    ckpt = f"{root}/augmented"
    if world_size == 2:
        out["augmented"] = _augmented_steps(rank, 2, ckpt, 3, None, 2)
    else:
        out["augmented"] = _augmented_steps(rank, world_size, ckpt, None, ckpt, AUGMENTED_RESUMES[world_size])
    for fmt in ("full", "sharded"):
        ckpt = f"{root}/{fmt}/ckpt"
        if uninterrupted:
            saves = [*SAVE_AT, OTHER_BATCH_AT] if world_size == 2 else []
            out[(fmt, None)] = _steps(world_size, N, G // world_size, ckpt, saves, None, fmt)
        for at in SAVE_AT:
            out[(fmt, at)] = _steps(world_size, N, G // world_size, ckpt, [], f"{ckpt}-{at}", fmt)
    if world_size == 2:
        ckpt = f"{root}/full/ckpt-{OTHER_BATCH_AT}"
        out[("other batch", OTHER_BATCH_AT)] = _steps(2, N, 4, ckpt, [], ckpt, "full")
    # test_resumes_equal_the_uninterrupted_run_in_every_scenario's runs at this world size, in this group too.
    out["scenarios"] = _scenarios_then_resumed(
        rank, world_size, f"{root}/live{world_size}", f"{root}/again{world_size}", f"{root}/live2"
    )
    return out


@pytest.fixture(scope="module")
def every_resume(tmp_path_factory) -> dict[int, dict]:
    """world size -> `_every_resume`'s runs; the 2-rank group first (it writes the checkpoints)."""
    root = tmp_path_factory.mktemp("resume")
    for name in ("full", "sharded", "live1", "live2", "live3"):
        (root / name).mkdir()
    return {ws: run_ranks(_every_resume, ws, str(root), ws != 3, timeout=500)[0] for ws in (2, 1, 3)}


@pytest.mark.timeout(1500)  # whichever runs first waits for `every_resume`'s three groups
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_resume_at_every_world_size_continues_the_same_global_batches(every_resume, fmt):
    full = every_resume[2][(fmt, None)]
    assert len(full) == 2 * N // G
    # Global batch b of an epoch is the same whatever the world size: one process agrees with two.
    assert every_resume[1][(fmt, None)] == full
    for at in SAVE_AT:
        for world_size in (1, 2, 3):
            assert every_resume[world_size][(fmt, at)] == full[at:], (at, world_size)
    # Each epoch reads every sample once, and the second epoch is shuffled differently.
    per_epoch = len(full) // EPOCHS
    epochs = [sum(full[e * per_epoch : (e + 1) * per_epoch], []) for e in range(EPOCHS)]
    assert all(sorted(e) == list(range(N)) for e in epochs)
    assert full[0] != full[per_epoch]


@pytest.mark.timeout(1500)  # whichever runs first waits for `every_resume`'s three groups
def test_another_global_batch_reads_each_remaining_sample_once(every_resume):
    # Saved after 5 steps of 2 ranks x 3 samples, resumed on 2 ranks with 4 samples each (global batch 8).
    full = every_resume[2][("full", None)]
    resumed = every_resume[2][("other batch", OTHER_BATCH_AT)]
    rest_steps = -(-(N - OTHER_BATCH_AT * G) // 8)  # 18 samples left: batches of 8, 8 and 2
    first_epoch_rest = sum(resumed[:rest_steps], [])
    assert sorted(sum(full[:OTHER_BATCH_AT], []) + first_epoch_rest) == list(
        range(N)
    )  # none twice, none skipped
    assert sorted(sum(resumed[rest_steps:], [])) == list(range(N))  # the next epoch is whole


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
    with Loom(accelerator="cpu", devices=world_size) as loom:
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


@pytest.mark.timeout(1500)  # whichever runs first waits for `every_resume`'s three groups
def test_worker_augmentations_follow_the_sample_not_the_worker(every_resume):
    """With DataLoader workers, each sample's random numbers depend on the seed, the epoch and the sample, so
    a resumed run (another world size, another number of workers) draws what the uninterrupted one drew."""
    full = every_resume[2]["augmented"]  # 2 ranks, 2 workers each, saved after step 3
    assert (
        len({noise for step in full for _, noise in step}) == len(full) * 6
    )  # no repeats across workers, ranks
    for world_size, workers in AUGMENTED_RESUMES.items():
        assert every_resume[world_size]["augmented"] == full[3:], (world_size, workers)


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _train(world_size: int, strategy: str, ckpt: str, save_at: int | None, resume: bool):
    from torch.distributed.fsdp import fully_shard

    with Loom(accelerator="cpu", devices=world_size, strategy=strategy) as loom:
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


def _train_and_resume(rank: int, world_size: int, root: str) -> dict:
    """Per strategy, in one rank group: the uninterrupted run (saving after step 5), then a fresh Loom resumed
    from it. The resume runs after the uninterrupted run, so these processes' generators are at the end of
    training, not at step 5: only the checkpoint's generators can give the same dropout."""
    out = {}
    for strategy in ("ddp", "fsdp2"):
        ckpt = f"{root}/{strategy}"
        out[strategy] = (
            _train(world_size, strategy, ckpt, 5, False),
            _train(world_size, strategy, ckpt, None, True),
        )
    return out


@pytest.fixture(scope="module")
def trained_and_resumed(tmp_path_factory) -> list[dict]:
    return run_ranks(_train_and_resume, 2, str(tmp_path_factory.mktemp("bit_identical")), timeout=400)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resume_at_the_same_world_size_is_bit_identical(trained_and_resumed, strategy):
    """Dropout on: without the random generators restored the resumed losses would differ."""
    for rank in range(2):
        full, resumed = trained_and_resumed[rank][strategy]
        assert resumed[0] == full[0][5:], rank
        for name, value in full[1].items():
            assert torch.equal(resumed[1][name], value), (rank, name)


def _other_world_size_warning(rank: int, world_size: int, ckpt: str) -> list[str]:
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchloom").addHandler(handler)
    try:
        loom = Loom(accelerator="cpu", devices=world_size)
        loom.launch()
        model = loom.setup_module(nn.Linear(1, 1))
        if world_size == 2:
            loom.save(ckpt, {"model": model})
        else:
            loom.load(ckpt, {"model": model}, restore_run_state=True)
    finally:
        logging.getLogger("torchloom").removeHandler(handler)
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
    """A custom sampler's draw (Fabric's DistributedSamplerWrapper rule: the user's sampler drawn whole) is
    recorded: replayed from that record after a start, the ranks together continue the same draw, at any world
    size, and the replay leaves the global generator as it was."""
    from torch.utils.data import WeightedRandomSampler

    from torchloom.data import WRAPPED

    weighted = WeightedRandomSampler([1.0] * 10 + [5.0] * 10, 20)

    def parts(ws: int, start: int, record: dict) -> list[int]:
        out = []
        for r in range(ws):
            sampler = ResumableSampler(range(20), ws, r, sampler=weighted, rule=WRAPPED)
            sampler.set_epoch(1)
            sampler.start, sampler.replay = start, record
            out.append(list(sampler))
        return [out[r][i] for i in range(len(out[0])) for r in range(ws)]

    torch.manual_seed(4)
    first = ResumableSampler(range(20), 1, 0, sampler=weighted, rule=WRAPPED)
    whole, record = list(first), first.record
    torch.manual_seed(4)
    assert whole == list(weighted)  # the user's sampler's own draw from the global generator
    after = torch.get_rng_state()
    for ws in (1, 2, 3):
        assert parts(ws, 7, record)[:13] == whole[7:], ws
        assert torch.equal(torch.get_rng_state(), after)


def _rebuilt_every_epoch(rank: int, world_size: int, ckpt: str, save_after: int | None, resume: bool):
    with Loom(accelerator="cpu", devices=world_size, strategy="ddp") as loom:
        return _rebuilt_every_epoch_with(loom, ckpt, save_after, resume)


def _rebuilt_then_resumed(rank: int, world_size: int, ckpt: str) -> tuple[list, list]:
    """The uninterrupted run (saving after epoch 1), then a fresh Loom in the same processes resumed from it."""
    return _rebuilt_every_epoch(rank, world_size, ckpt, 1, False), _rebuilt_every_epoch(
        rank, world_size, ckpt, None, True
    )


def _rebuilt_every_epoch_with(loom: Loom, ckpt: str, save_after: int | None, resume: bool):
    """A loop that builds and sets up its loaders again every epoch (k-fold style: a shuffled loader and a
    `SubsetRandomSampler` one over the same dataset). Returns every epoch's global order of both."""
    from torch.utils.data import SubsetRandomSampler

    loom.launch()
    loom.seed_everything(3)
    data = TensorDataset(torch.arange(12))
    model = loom.setup_module(nn.Linear(1, 1))
    first = 0
    if resume:
        # No optimizer or loader in `state`: the random generators (part of the run's state) are asked for.
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
def test_a_loader_set_up_again_every_epoch_follows_fabric_and_resumes(tmp_path):
    """As under Fabric (tests/test_fabric_data_order.py compares the two): a shuffled loader set up again under
    DDP restarts DistributedSampler's order at epoch 0 for the global seed, so it repeats its order; a custom
    sampler draws a new order from the global generator each time. The orders are the same at every world size
    (every rank's generator seeded alike), and a run resumed from the checkpoint's generators sets up the same
    orders as the uninterrupted one."""
    ckpt = str(tmp_path / "ckpt.pt")
    alone = _rebuilt_every_epoch(0, 1, ckpt, None, False)
    shuffled = [epoch[0] for epoch in alone]
    subsets = [epoch[1] for epoch in alone]
    g = torch.Generator().manual_seed(3)
    assert shuffled == [torch.randperm(12, generator=g).tolist()] * 4  # DistributedSampler(seed=3), epoch 0
    assert all(sorted(order) == list(range(6)) for order in subsets)
    assert len({tuple(o) for o in subsets}) == 4, subsets  # a new draw each time

    (two0, resumed), (two1, _) = run_ranks(_rebuilt_then_resumed, 2, ckpt)
    assert two0 == two1 == alone  # world-size independent
    assert resumed == alone[2:]


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


# ---- ragged ends, samplers with their own generator, iterable datasets, passes left early ----------------------
class _Stream(torch.utils.data.IterableDataset):
    """Rank `rank` of `world_size` reads records rank, rank + world_size, ... of one stream; its position is the
    next record's index in the stream, so the ranks' positions differ."""

    def __init__(self, rank: int, world_size: int, n: int) -> None:
        self.step, self.n, self.next = world_size, n, rank

    def __iter__(self):
        while self.next < self.n:
            record = self.next
            self.next += self.step
            yield record

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


def _scenario_loader(loom: Loom, name: str, world_size: int):
    from torch.utils.data import SubsetRandomSampler

    batch = G // world_size
    if name == "ragged":  # 49 samples: padded to 50 on 2 ranks, 51 on 3
        return loom.setup_dataloaders(
            DataLoader(TensorDataset(torch.arange(49)), batch_size=batch, shuffle=True)
        )
    if name == "own_generator":  # epoch e draws the permutation after e draws of its generator
        sampler = SubsetRandomSampler(range(30), generator=torch.Generator().manual_seed(7))
        return loom.setup_dataloaders(
            DataLoader(TensorDataset(torch.arange(40)), batch_size=batch, sampler=sampler)
        )
    if name == "iterable":
        return loom.setup_dataloaders(DataLoader(_Stream(loom.global_rank, world_size, n=42), batch_size=2))
    return loom.setup_dataloaders(DataLoader(TensorDataset(torch.arange(24)), batch_size=batch, shuffle=True))


def _record(loom: Loom, out: list, batch) -> None:
    (idx,) = batch if isinstance(batch, (list, tuple)) else (batch,)
    out.append(sorted(loom.all_gather(idx).flatten().tolist()))


# Scenarios saved inside a pass: (save after this step, in this pass, of so many passes).
_SAVED_INSIDE = {"ragged": (4, 0, 3), "own_generator": (8, 1, 3), "iterable": (4, 0, 1)}


def _scenario(loom: Loom, name: str, world_size: int, path: str, resume: str | None) -> list | str:
    """Run one scenario; a live run saves at its save point (to `path`) and goes on, a resumed one loads
    `resume` and runs what the live run ran after saving. Returns the global batches seen after the save point
    (or the error of a refused load)."""
    loader = _scenario_loader(loom, name, world_size)
    model = loom.setup_module(nn.Linear(1, 1))
    seen: list = []
    save = lambda: loom.save(path, {"loader": loader, "model": model})  # noqa: E731
    if resume is not None:
        try:
            loom.load(resume, {"loader": loader, "model": model})
        except Exception as error:  # noqa: BLE001 - the refusal is the result
            return f"{type(error).__name__}: {error}"
    if name in ("ragged", "own_generator", "iterable"):
        # Saved inside a pass: ragged at epoch 0's 4th batch, own_generator at epoch 1's 3rd, iterable (one pass)
        # at its 4th.
        at, saved_pass, passes = _SAVED_INSIDE[name]
        step = 0 if resume is None else at
        for _ in range(passes if resume is None else passes - saved_pass):
            for batch in loader:
                step += 1
                if step > at:
                    _record(loom, seen, batch)
                if step == at and resume is None:
                    save()
        return seen
    if name == "break":  # a cap on steps per epoch; saved after the break, before the next pass
        for epoch in range(0 if resume is None else 1, 3):
            for i, batch in enumerate(loader):
                if i == 2:
                    break
                if epoch > 0:
                    _record(loom, seen, batch)
            if epoch == 0 and resume is None:
                save()
        return seen
    if name == "live" and resume is not None:
        for batch in loader:  # the rest of the saved epoch
            _record(loom, seen, batch)
    elif name == "live":  # saved while the pass is live: resumes inside the epoch
        it = iter(loader)
        next(it)
        next(it)
        save()
        for batch in it:
            _record(loom, seen, batch)
    elif name == "exception" and resume is None:  # an exception out of the loop, caught outside it
        try:
            for i, _ in enumerate(loader):
                if i == 1:
                    raise RuntimeError("a bad batch")
        except RuntimeError:
            pass
        save()
    elif name == "dropped" and resume is None:  # an iterator garbage collected
        it = iter(loader)
        next(it)
        del it
        save()
    for batch in loader:  # the next epoch
        _record(loom, seen, batch)
    return seen


SCENARIOS = ("ragged", "own_generator", "iterable", "break", "exception", "dropped", "live")


def _scenarios(world_size: int, directory: str, resume_from: str | None) -> dict[str, list | str]:
    # DDP on one process too: Fabric's distributed order rule at every world size (a single device keeps the
    # loader's own sampler instead; see tests/test_fabric_data_order.py for resuming across the two).
    with Loom(accelerator="cpu", devices=world_size, strategy="ddp") as loom:
        loom.launch()
        loom.seed_everything(0)
        out = {}
        for name in SCENARIOS:
            resume = None if resume_from is None else f"{resume_from}/{name}.pt"
            out[name] = _scenario(loom, name, world_size, f"{directory}/{name}.pt", resume)
        return out


def _scenarios_then_resumed(
    rank: int, world_size: int, live: str, again: str, resume_from: str
) -> tuple[dict[str, list | str], dict[str, list | str]]:
    """The uninterrupted run (saving into `live`), then, under a fresh Loom in the same processes, the run
    resumed from the 2-rank run's checkpoints in `resume_from`."""
    return _scenarios(world_size, live, None), _scenarios(world_size, again, resume_from)


@pytest.mark.timeout(1500)  # whichever runs first waits for `every_resume`'s three groups
def test_resumes_equal_the_uninterrupted_run_in_every_scenario(every_resume):
    """Saved on 2 ranks, resumed on 2 (and 1 and 3): the global batches after the save point equal the
    uninterrupted run's at that world size. Ragged end: the padding after a resume repeats the epoch's first
    samples, as the uninterrupted run's does. A sampler with its own generator: the resumed pass draws the saved
    epoch's permutation. An IterableDataset: every rank continues from its own position (refused on another world
    size). A pass left early (break, exception, dropped iterator): the resumed run starts the next epoch, as the
    live one does; one saved while live resumes inside the epoch."""
    # Run in `every_resume`'s groups, the 2-rank group first (it writes the checkpoints every world size resumes
    # from).
    uninterrupted = {ws: every_resume[ws]["scenarios"][0] for ws in (1, 2, 3)}
    resumed = {ws: every_resume[ws]["scenarios"][1] for ws in (1, 2, 3)}
    for name in SCENARIOS:
        assert uninterrupted[2][name], name  # the scenario saw batches after its save point
        assert resumed[2][name] == uninterrupted[2][name], name
        for ws in (1, 3):
            if name == "iterable":
                assert "CheckpointError" in resumed[ws][name] and "resume on 2 ranks" in resumed[ws][name]
            else:
                assert resumed[ws][name] == uninterrupted[ws][name], (name, ws)
    # The ragged end of epoch 0 (the 5th batch after the save) really is padded: 49 samples make 25 + 25 on 2
    # ranks, 17 x 3 on 3.
    assert [len(uninterrupted[ws]["ragged"][4]) for ws in (1, 2, 3)] == [1, 2, 3]


def test_padding_after_a_start_repeats_the_epochs_first_samples():
    """10 samples on 4 ranks pad to 12 with the epoch's first two: the last global batch is order[8, 9, 0, 1]
    from the epoch's start, and the same after starting at 8 (not order[8, 9, 8, 9])."""
    data = list(range(10))

    def interleaved(start: int) -> list[int]:
        parts = []
        for r in range(4):
            sampler = ResumableSampler(data, 4, r, shuffle=True, seed=1)
            sampler.start = start
            parts.append(list(sampler))
        return [parts[r][i] for i in range(len(parts[0])) for r in range(4)]

    order = ResumableSampler(data, 1, 0, shuffle=True, seed=1).global_order()
    tail = [order[p] for p in (8, 9, 0, 1)]
    assert interleaved(0)[8:] == tail
    assert interleaved(8) == tail


def test_two_passes_at_once_cannot_be_saved():
    from torchloom import MisuseError

    loom = Loom(accelerator="cpu", devices=1)
    loader = loom.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True))
    first = iter(loader)
    next(first)
    second = iter(loader)
    next(second)
    assert loader.state_dict()["epoch"] == 1  # an earlier iterator merely kept alive does not matter
    next(first)  # torch lets it go on, but the loader now has two positions
    with pytest.raises(MisuseError, match="two passes at once"):
        loader.state_dict()
    del first, second
    list(loader)
    assert loader.state_dict()["epoch"] == 3


def _assert_saved_between_epochs_resumes_the_next(loader) -> None:
    """One epoch of `loader(loom)`, saved; the next epoch of the live loader and of a fresh one loaded from the
    state must be the same batches."""
    loom = Loom(accelerator="cpu", devices=1)
    live = loader(loom)
    list(live)
    state = live.state_dict()
    expected = [idx.tolist() for (idx,) in live]
    resumed = loader(loom)
    resumed.load_state_dict(state)
    assert [idx.tolist() for (idx,) in resumed] == expected


def test_a_users_sampler_with_its_own_generator_resumes_its_next_epoch():
    """Not split by torchloom (use_distributed_sampler=False), saved between epochs: the resumed run's next
    epoch draws what the uninterrupted run's did, not the first epoch's permutation again."""
    from torch.utils.data import RandomSampler

    def loader(loom):
        sampler = RandomSampler(range(12), generator=torch.Generator().manual_seed(5))
        return loom.setup_dataloaders(
            DataLoader(TensorDataset(torch.arange(12)), batch_size=4, sampler=sampler),
            use_distributed_sampler=False,
        )

    _assert_saved_between_epochs_resumes_the_next(loader)


def test_a_custom_samplers_own_generator_resumes_its_next_epoch():
    """Set up by torchloom (its draw recorded per pass), saved between epochs: the sampler's own generator's
    state comes back, so the next epoch draws what the uninterrupted run's did."""
    from torch.utils.data import SubsetRandomSampler

    def loader(loom):
        sampler = SubsetRandomSampler(range(2, 12), generator=torch.Generator().manual_seed(5))
        return loom.setup_dataloaders(
            DataLoader(TensorDataset(torch.arange(12)), batch_size=4, sampler=sampler)
        )

    _assert_saved_between_epochs_resumes_the_next(loader)


def test_a_sampler_generator_torchloom_cannot_save_is_refused():
    import numpy as np

    from torchloom import MisuseError

    class NumpyShuffle(torch.utils.data.Sampler):
        def __init__(self) -> None:
            self.generator = np.random.default_rng(0)

        def __len__(self) -> int:
            return 8

        def __iter__(self):
            return iter(self.generator.permutation(8).tolist())

    loom = Loom(accelerator="cpu", devices=1)
    loader = loom.setup_dataloaders(
        DataLoader(TensorDataset(torch.arange(8)), batch_size=2, sampler=NumpyShuffle())
    )
    loader.state_dict()  # nothing drawn yet: nothing to lose
    next(iter(loader))
    with pytest.raises(MisuseError, match="generator torchloom cannot save"):
        loader.state_dict()


def test_an_iterable_dataset_read_by_workers_is_refused():
    from torchloom import MisuseError

    loom = Loom(accelerator="cpu", devices=1)
    loader = loom.setup_dataloaders(DataLoader(_Stream(0, 1, 8), batch_size=2, num_workers=1))
    with pytest.raises(MisuseError, match="worker processes"):
        loader.state_dict()


def test_a_checkpoint_after_a_break_says_it_resumes_at_the_next_epoch():
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchloom").addHandler(handler)
    try:
        loom = Loom(accelerator="cpu", devices=1)
        loader = loom.setup_dataloaders(
            DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True)
        )
        for i, _ in enumerate(loader):
            if i == 1:
                break
        assert (loader.state_dict()["epoch"], loader.state_dict()["consumed"]) == (1, 0)
    finally:
        logging.getLogger("torchloom").removeHandler(handler)
    assert sum("pass over epoch 0 was left after 4 samples" in r for r in records) == 1, records


def _torchloom_log(run: Callable[[], None]) -> list[str]:
    """The lines torchloom's logger shows while `run()` runs, formatted by its own handler ("[torchloom] ...")."""
    logger = logging.getLogger("torchloom")
    shown: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(logger.handlers[0].format(record))  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        run()
    finally:
        logger.removeHandler(handler)
    return shown


def test_log_lines_have_one_prefix_and_agreeing_plurals():
    def resume_on_one_rank_what_two_saved() -> None:
        loom = Loom(accelerator="cpu", devices=1)
        loader = loom.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        # As two ranks with one sample each per step would have saved it: the same global batch of 2.
        state.update(world_size=2, ranks=2)
        fresh = loom.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
        fresh.load_state_dict(state)

    shown = _torchloom_log(resume_on_one_rank_what_two_saved)
    assert (
        "[torchloom] Resuming epoch 0 after 2 samples on 1 rank (saved on 2): same global batches." in shown
    )
    assert not [line for line in shown if line.startswith("[torchloom] torchloom:")], shown


# ---- samplers torchloom must not replace by a plain shuffle, and custom orders split exactly ------------------
class _Reversed(torch.utils.data.SequentialSampler):
    """A SequentialSampler subclass that reads backwards: not the plain order."""

    def __iter__(self):
        return iter(range(len(self.data_source) - 1, -1, -1))


class _GlobalRngShuffle(torch.utils.data.Sampler):
    """Shuffles with Python's and NumPy's global generators (torch's is not involved)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import numpy as np

        order = np.random.permutation(self.n).tolist()
        random.shuffle(order)
        return iter(order)


class _OwnRngShuffle(_GlobalRngShuffle):
    """Shuffles with a private Python generator seeded with `seed`: different on every rank when seeded with it."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__(n)
        self.rng = random.Random(seed)

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)


SAMPLERS = ("replacement", "num_samples", "subclass", "batch_sampler", "global_rngs", "rank_rng")


def _user_sampler(name: str, rank: int):
    """The user's sampler of scenario `name` (as built on rank `rank`), and the DataLoader arguments around it."""
    from torch.utils.data import BatchSampler, RandomSampler, WeightedRandomSampler

    data = range(20)
    if name == "replacement":
        return RandomSampler(
            data, replacement=True, num_samples=30, generator=torch.Generator().manual_seed(1)
        )
    if name == "num_samples":
        return RandomSampler(data, num_samples=27, generator=torch.Generator().manual_seed(2))
    if name == "subclass":
        return _Reversed(data)
    if name == "batch_sampler":
        weighted = WeightedRandomSampler(
            [1.0] * 10 + [4.0] * 10, 20, generator=torch.Generator().manual_seed(3)
        )
        return BatchSampler(weighted, 3, drop_last=False)
    if name == "global_rngs":
        return _GlobalRngShuffle(20)
    return _OwnRngShuffle(20, seed=rank)


def _sampler_scenario(loom: Loom, name: str, path: str, resume: str | None) -> list[list[list[int]]]:
    """Two epochs (a resumed run: the rest of epoch 1) of scenario `name`, saved in epoch 1 after its 2nd step.
    Returns each epoch's global batches (sorted)."""
    import numpy as np

    sampler = _user_sampler(name, loom.global_rank)
    arguments = (
        {"batch_sampler": sampler} if name == "batch_sampler" else {"batch_size": 3, "sampler": sampler}
    )
    loader = loom.setup_dataloaders(DataLoader(TensorDataset(torch.arange(20)), **arguments))
    model = loom.setup_module(nn.Linear(1, 1))
    if resume is not None:
        loom.load(resume, {"loader": loader, "model": model})
    epochs = []
    for epoch in range(1 if resume else 0, 2):
        # The ranks' global generators drift apart, as other code in a training loop makes them.
        for _ in range(loom.global_rank + 1):
            random.random()
            np.random.rand()
        steps = []
        for (idx,) in loader:
            steps.append(sorted(loom.all_gather(idx).flatten().tolist()))
            if epoch == 1 and len(steps) == 2 and resume is None:
                loom.save(path, {"loader": loader, "model": model})
        epochs.append(steps)
    return epochs


def _samplers(rank: int, world_size: int, directory: str, resume_from: str | None) -> dict[str, list]:
    with Loom(accelerator="cpu", devices=world_size) as loom:
        loom.launch()
        loom.seed_everything(0)
        out = {}
        for name in SAMPLERS:
            resume = None if resume_from is None else f"{resume_from}/{name}.pt"
            out[name] = _sampler_scenario(loom, name, f"{directory}/{name}.pt", resume)
        return out


def _samplers_then_resumed(rank: int, world_size: int, live: str, again: str) -> tuple[dict, dict]:
    """The uninterrupted run (saving into `live`), then a fresh Loom in the same processes resumed from it."""
    return _samplers(rank, world_size, live, None), _samplers(rank, world_size, again, live)


def _batches(draw: list[int], size: int) -> list[list[int]]:
    return [sorted(draw[i : i + size]) for i in range(0, len(draw), size)]


@pytest.mark.timeout(600)
def test_the_users_sampler_is_split_not_replaced(tmp_path):
    """On 2 ranks, each global batch is the next 6 samples the user's sampler yields in one process: with
    replacement, with num_samples, a SequentialSampler subclass, an explicit BatchSampler (its batch size kept),
    a sampler shuffling with Python's and NumPy's global generators (whose states differ between the ranks), and
    one with a private generator seeded differently on each rank (rank 0's draw is the epoch's). Saved inside
    epoch 1, a run resumed on 2 ranks reads what the uninterrupted run read after the save."""
    live, again = tmp_path / "live", tmp_path / "again"
    live.mkdir()
    again.mkdir()
    two, resumed = run_ranks(_samplers_then_resumed, 2, str(live), str(again), timeout=400)[0]
    for name in ("replacement", "num_samples", "subclass", "batch_sampler", "rank_rng"):
        sampler = _user_sampler(name, 0)
        if name == "batch_sampler":
            sampler = sampler.sampler  # each rank reads batches of 3: global batches of 6
        # The sampler's own epochs, in one process; a ragged end padded with the epoch's first samples.
        draws = [list(sampler) for _ in range(2)]
        expected = [_batches(draw + draw[: -len(draw) % 2], 6) for draw in draws]
        assert two[name] == expected, name
    # Python's and NumPy's generators: each epoch one shuffle of the dataset, the one a single process reads.
    assert all(sorted(sum(epoch, [])) == list(range(20)) for epoch in two["global_rngs"]), two["global_rngs"]
    assert two["global_rngs"][0] != two["global_rngs"][1]
    one = _samplers(0, 1, str(tmp_path), None)
    assert [_batches(sum(epoch, []), 6) for epoch in one["global_rngs"]] == two["global_rngs"]
    for name in SAMPLERS:
        if name != "rank_rng":  # a private generator's state is not in the checkpoint
            assert resumed[name] == [two[name][1][2:]], name


def test_a_custom_batch_samplers_own_generator_resumes_its_next_epoch():
    """A custom batch sampler, used as it is in one process: saved between epochs, the resumed run's next epoch
    draws what the uninterrupted run's did, not the first epoch's batches again."""

    class ShuffledBatches(torch.utils.data.Sampler):
        def __init__(self) -> None:
            self.generator = torch.Generator().manual_seed(5)

        def __len__(self) -> int:
            return 3

        def __iter__(self):
            return iter(torch.randperm(12, generator=self.generator).view(3, 4).tolist())

    def loader(loom):
        return loom.setup_dataloaders(
            DataLoader(TensorDataset(torch.arange(12)), batch_sampler=ShuffledBatches())
        )

    _assert_saved_between_epochs_resumes_the_next(loader)


def test_a_resumed_pass_saved_before_its_first_batch_keeps_its_draw():
    """A pass resumed inside its epoch (a custom sampler's draw replayed from the checkpoint's record) and saved
    again after `iter()` but before its first batch, where a replica group keeps its step's start: the state holds
    the draw the pass is about to replay, and a loader loaded from it reads the same batches. (Found by the
    scenario engine's replica groups: it raised "handed out batches of a pass whose order it never drew".)"""
    from torch.utils.data import SubsetRandomSampler

    def loader(loom):
        sampler = SubsetRandomSampler(range(12), generator=torch.Generator().manual_seed(5))
        return loom.setup_dataloaders(
            DataLoader(TensorDataset(torch.arange(12)), batch_size=2, sampler=sampler)
        )

    loom = Loom(accelerator="cpu", devices=1)
    live = loader(loom)
    batches = iter(live)
    next(batches), next(batches)
    state = live.state_dict()
    expected = [idx.tolist() for (idx,) in batches]
    resumed = loader(loom)
    resumed.load_state_dict(state)
    started = iter(resumed)
    again = resumed.state_dict()
    assert [idx.tolist() for (idx,) in started] == expected
    third = loader(loom)
    third.load_state_dict(again)
    assert [idx.tolist() for (idx,) in third] == expected
