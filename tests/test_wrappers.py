"""`torchloom.wrappers`: pieces that need no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

from torchloom.data import WRAPPED, ResumableSampler


def _parts(sampler, world_size: int = 3, epoch: int = 0, drop_last: bool = False) -> list[list[int]]:
    """Each rank's part, every rank's global generator seeded alike (as seed_everything leaves them)."""
    parts = []
    for rank in range(world_size):
        torch.manual_seed(100 + epoch)
        shard = ResumableSampler(
            range(len(sampler)), world_size, rank, sampler=sampler, rule=WRAPPED, drop_last=drop_last
        )
        shard.set_epoch(epoch)
        parts.append([int(i) for i in shard])
    return parts


def test_wrapped_sampler_partitions_one_draw():
    sampler = SubsetRandomSampler(list(range(10, 22)))
    parts = _parts(sampler)
    assert sorted(sum(parts, [])) == list(range(10, 22))
    assert all(len(p) == 4 for p in parts)
    assert _parts(sampler) == parts  # the draw follows the global generator
    assert _parts(sampler, epoch=1) != parts


def test_wrapped_sampler_pads_or_drops_like_distributed_sampler():
    sampler = WeightedRandomSampler([1.0] * 5, num_samples=7, replacement=True)
    assert [len(p) for p in _parts(sampler)] == [3, 3, 3]
    assert [len(p) for p in _parts(sampler, drop_last=True)] == [2, 2, 2]


def test_sampler_with_its_own_generator_is_left_to_it():
    parts = []
    for rank in range(2):
        own = SubsetRandomSampler(range(6), generator=torch.Generator().manual_seed(1))
        parts.append(list(ResumableSampler(range(6), 2, rank, sampler=own, rule=WRAPPED)))
    assert sorted(parts[0] + parts[1]) == list(range(6))


# ---- optimizers whose groups mix FSDP2's DTensors with plain replicated parameters ------------------------------
# torch's foreach and fused kernels (the default on CUDA; asked for here, on CPU) take one list per parameter group,
# device and dtype: FSDP2's sharded parameters and the leftovers torchloom replicates failed there together.
OPTIMIZERS = {
    "sgd-foreach": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    "adamw-loop": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False),
}


def _two_groups(model) -> list[dict]:
    """Decay and no-decay groups, as language-model recipes make them: each mixes both kinds under FSDP2."""
    params = dict(model.named_parameters())
    return [
        {"params": [p for n, p in params.items() if n.endswith("weight")]},
        {"params": [p for n, p in params.items() if not n.endswith("weight")], "weight_decay": 0.0},
    ]


def _foreach_body(rank: int, world_size: int, name: str, sharded: bool) -> dict:
    import warnings

    from fsdp_models import ACCUM, MAX_NORM, MICRO, STEPS, Net, data, full_state
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from torchloom import Loom

    loom = Loom(accelerator="cpu", devices=world_size, strategy="fsdp2" if sharded else "ddp")
    loom.launch()
    torch.manual_seed(0)
    model = Net()
    if sharded:
        for block in model.blocks:
            fully_shard(block)  # the embedding and head stay plain, replicated by torchloom
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = loom.setup_module(model)
    opt = loom.setup_optimizers(OPTIMIZERS[name](_two_groups(model)))
    groups = list(opt.param_groups)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # group options change mid-run
    x, y = data()
    per = MICRO // world_size
    rows = slice(rank * per, (rank + 1) * per)
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = nn.functional.mse_loss(model(x[step, micro, rows]), y[step, micro, rows]) / ACCUM
                loom.backward(loss)
        norms.append(float(loom.clip_gradients(model, opt, max_norm=MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=step == STEPS - 1)  # torch's foreach zeroing across groups, but at the end
        scheduler.step()
    return {
        "params": full_state(model),
        "norms": norms,
        "same_groups": [id(g) for g in opt.param_groups] == [id(g) for g in groups],
        "lrs": [g["lr"] for g in opt.param_groups],
        "zeroed": all(p.grad is None for p in model.parameters()),
    }


def _foreach_reference(name: str) -> tuple[dict, list[float], list[float]]:
    """One process on the whole global batch, with the same optimizer, groups and schedule."""
    from fsdp_models import ACCUM, MAX_NORM, STEPS, Net, data
    from torch import nn

    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[name](_two_groups(model))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x, y = data()
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            nn.functional.mse_loss(model(x[step, micro]), y[step, micro]).div(ACCUM).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        norms,
        [g["lr"] for g in opt.param_groups],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_foreach_and_fused_optimizers_on_sharded_and_replicated_parameters(name):
    from harness import run_ranks

    results = run_ranks(_foreach_body, 2, name, True, timeout=240)
    expected, expected_norms, expected_lrs = _foreach_reference(name)
    initial_lr = OPTIMIZERS[name]([nn.Parameter(torch.zeros(1))]).param_groups[0]["lr"]
    for rank, r in enumerate(results):
        assert r["same_groups"], rank  # the user's two groups, not the per-step split
        assert r["zeroed"], rank
        assert r["lrs"] == pytest.approx(expected_lrs) and expected_lrs[0] == pytest.approx(initial_lr / 4), (
            rank
        )
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(expected_norms), atol=1e-5, rtol=1e-5
        )
        assert r["params"].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(
                r["params"][key], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {key}"
            )


def _resume_body(rank: int, world_size: int, name: str, path: str) -> dict:
    """For each checkpoint format: save before the first step and after two steps, load each into a new model
    and a new optimizer (no state yet: PyTorch steps it raw to make some), train on; every run must equal the
    uninterrupted one. Returns the largest difference per run and what the loads left in `param_groups`."""
    import warnings

    from fsdp_models import STEPS, Net, data, full_state
    from torch.distributed.fsdp import fully_shard

    from torchloom import Loom
    from torchloom.strategies import FSDP2Strategy

    x, y = data()
    rows = slice(rank * 4, rank * 4 + 4)
    out: dict = {}

    def setup(loom):
        torch.manual_seed(0)
        model = Net()
        for block in model.blocks:
            fully_shard(block)  # the embedding and head stay plain: every group mixes both kinds
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = loom.setup_module(model)
        return model, loom.setup_optimizers(OPTIMIZERS[name](_two_groups(model)))

    def train(loom, model, opt, steps):
        for step in steps:
            loom.backward(nn.functional.mse_loss(model(x[step, 0, rows]), y[step, 0, rows]))
            opt.step()
            opt.zero_grad()

    for fmt in ("full", "sharded"):
        loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(state_dict_type=fmt))
        loom.launch()
        model, opt = setup(loom)
        loom.save(f"{path}/{fmt}-0", {"model": model, "optimizer": opt})  # before the first step
        empty_after_save = not opt.state
        train(loom, model, opt, range(2))
        loom.save(f"{path}/{fmt}-2", {"model": model, "optimizer": opt})
        train(loom, model, opt, range(2, STEPS))
        expected = full_state(model)
        for start in (0, 2):
            model, opt = setup(loom)
            loom.load(f"{path}/{fmt}-{start}", {"model": model, "optimizer": opt})
            out[(fmt, start)] = {
                "empty_after_save": empty_after_save,
                "groups": [len(g["params"]) for g in opt.param_groups],
                "no_state": not opt.state,
            }
            train(loom, model, opt, range(start, STEPS))
            got = full_state(model)
            out[(fmt, start)]["diff"] = max((got[k] - v).abs().max().item() for k, v in expected.items())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sgd-foreach", "adamw-foreach", "adam-fused"])
def test_foreach_and_fused_optimizers_save_and_load_with_mixed_groups(tmp_path, name):
    """A new optimizer has no state, so PyTorch's state-dict functions step it raw (zero gradients, lr 0) to
    make some, when loading into it and when saving it before its first step: with foreach or fused kernels
    (CUDA's default) over FSDP2 DTensors and plain leftovers in one group, that step crashed ("got mixed
    torch.Tensor and DTensor"). Resuming must equal the uninterrupted run, and keep the user's two groups."""
    from harness import run_ranks

    for rank, result in enumerate(run_ranks(_resume_body, 2, name, str(tmp_path), timeout=240)):
        for (fmt, start), r in result.items():
            where = f"rank {rank} {fmt} from step {start}"
            assert r["empty_after_save"], where  # saving before the first step made no state
            assert r["groups"] == [8, 8], where  # the user's decay / no-decay groups, not the split ones
            assert r["no_state"] == (start == 0), where  # state exactly as saved
            assert r["diff"] <= 1e-5, (where, r["diff"])


def test_mixed_group_split_is_computed_once_per_set_of_groups(monkeypatch):
    """Which groups mix DTensors and plain tensors is worked out once, not on every step and zero_grad (a scan
    of every parameter: thousands in MoE models), and again when the groups change. Plumbing: DTensors are
    faked by a mark, counted where torchloom asks."""
    from torchloom import _mixed_groups

    asked = []

    def fake_is_dtensor(t):
        asked.append(t)
        return getattr(t, "fake_dtensor", False)

    monkeypatch.setattr(_mixed_groups, "_is_dtensor", fake_is_dtensor)
    params = [nn.Parameter(torch.zeros(2)) for _ in range(6)]
    for p in params[:3]:
        p.fake_dtensor = True
    opt = torch.optim.SGD(params[:4], lr=0.1)
    for _ in range(3):
        with _mixed_groups._kinds_apart(opt):
            assert [len(g["params"]) for g in opt.param_groups] == [3, 1]  # split for the step
        assert [len(g["params"]) for g in opt.param_groups] == [4]  # the user's group afterwards
        assert _mixed_groups._mixes_kinds(opt)
    first = len(asked)
    assert 0 < first <= 2 * 4  # one scan, on the first step only
    opt.add_param_group({"params": params[4:]})  # plain only: not split
    with _mixed_groups._kinds_apart(opt):
        assert [len(g["params"]) for g in opt.param_groups] == [3, 1, 2]
    assert len(asked) > first  # new groups: scanned again
    opt.param_groups[1]["params"] = params[:1]  # replaced list: scanned again
    with _mixed_groups._kinds_apart(opt):
        assert [len(g["params"]) for g in opt.param_groups] == [3, 1, 1]
    # A parameter swapped in place (same list, same length): the split groups hold the new one, so the step
    # updates it and not the one it replaced.
    swapped = nn.Parameter(torch.zeros(2))
    opt.param_groups[0]["params"][3] = swapped
    with _mixed_groups._kinds_apart(opt):
        assert any(p is swapped for p in opt.param_groups[1]["params"])
        assert not any(p is params[3] for g in opt.param_groups for p in g["params"])


# ---- a DataLoader subclass stays itself ------------------------------------------------------------------------
class _Scaling(torch.utils.data.DataLoader):
    """A loader whose own __iter__ transforms batches, with an argument of its own."""

    def __init__(self, dataset, factor: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self.factor = factor

    def __iter__(self):
        return (batch * self.factor for batch in super().__iter__())


class _Forgetful(torch.utils.data.DataLoader):
    def __init__(self, dataset, factor: int, **kwargs):  # factor is not kept anywhere
        super().__init__(dataset, **kwargs)


class _Fixed(torch.utils.data.DataLoader):
    def __init__(self, dataset, batch_size: int = 2):  # no way to pass a sampler in
        super().__init__(dataset, batch_size=batch_size)


def _scaled_batches(rank: int, world_size: int) -> list[list[int]]:
    from torchloom import Loom

    loom = Loom(accelerator="cpu", devices=world_size)
    loom.launch()
    loader = loom.setup_dataloaders(_Scaling(torch.arange(8), factor=10, batch_size=2))
    assert isinstance(loader.loader, _Scaling)
    batches = [batch.tolist() for batch in loader]
    loom.close()
    return batches


def test_a_dataloader_subclass_is_rebuilt_as_itself():
    """Its __iter__ still runs: in one process the batches are Fabric's (side by side), on 2 ranks each rank
    gets its half, transformed."""
    from lightning.fabric import Fabric

    fabric_loader = Fabric(accelerator="cpu", devices=1).setup_dataloaders(
        _Scaling(torch.arange(8), factor=10, batch_size=2)
    )
    theirs = [batch.tolist() for batch in fabric_loader]
    assert _scaled_batches(0, 1) == theirs == [[0, 10], [20, 30], [40, 50], [60, 70]]
    from harness import run_ranks

    first, second = run_ranks(_scaled_batches, 2)
    assert sorted(x for batch in first + second for x in batch) == list(range(0, 80, 10))
    assert len(first) == len(second) == 2


@pytest.mark.parametrize(
    ("cls", "says"), [(_Forgetful, "'factor' is not an attribute"), (_Fixed, "takes no 'sampler'")]
)
def test_a_dataloader_subclass_that_cannot_be_rebuilt_is_refused(cls, says):
    """Refused where the data must be split (several ranks: the rebuild fails before any collective); handed
    back untouched in one process, as Fabric does there, never replaced by a plain DataLoader."""
    from torchloom import Loom, MisuseError
    from torchloom.data import with_distributed_sampler

    loader = cls(torch.arange(8), 3) if cls is _Forgetful else cls(torch.arange(8))
    with pytest.raises(MisuseError, match=says):
        with_distributed_sampler(loader, num_replicas=2, rank=0)
    loom = Loom(accelerator="cpu", devices=1)
    assert loom.setup_dataloaders(loader).loader is loader
    assert loom.setup_dataloaders(loader, use_distributed_sampler=False).loader is loader
