"""Lightning Fabric compatibility (issue 12): what a Fabric script does must do the same under torchloom.

The multi-rank checks share one launch of 2 CPU gloo ranks; each check records its result or its error, so one
failing check does not hide the others. Differential tests run the same small script through Lightning Fabric
and through torchloom (`fabric_scripts.py`) and compare losses, parameters and outputs.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from torchloom import Loom, MisuseError

STEPS = 3
GLOBAL_BATCH = 8
LR = 0.1


class StepNet(nn.Module):
    """A LightningModule-style model: the loop calls `training_step`, not forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 6)
        self.head = nn.Linear(6, 1)
        self.flag = "unset"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layer(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def my_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.l1_loss(self.head(torch.tanh(self.layer(x))), y)

    def describe(self) -> str:
        return f"StepNet({self.flag})"


class ToRecorder(StepNet):
    """Records whether setup moved it (`.to()`): on CPU a move changes nothing else one could see."""

    moved = False

    def to(self, *args: Any, **kwargs: Any) -> ToRecorder:
        self.moved = True
        return super().to(*args, **kwargs)


def make_model() -> StepNet:
    torch.manual_seed(0)
    return StepNet()


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g))
        for _ in range(STEPS)
    ]


def local(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    n = GLOBAL_BATCH // world_size
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def reference(step: str) -> dict[str, torch.Tensor]:
    """One process, the concatenated global batch, plain PyTorch."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in global_batches():
        loss = getattr(model, step)(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(out: dict, name: str, fn) -> None:
    try:
        out[name] = fn()
    except Exception as error:  # noqa: BLE001 - reported by the test that reads this entry
        out[name] = f"ERROR {type(error).__name__}: {error}"


def _setup(loom: Loom) -> tuple:
    model = make_model()
    return loom.setup(model, torch.optim.SGD(model.parameters(), lr=LR))


def _train(loom: Loom, step: str, mark: str | None = None) -> dict[str, torch.Tensor]:
    model, opt = _setup(loom)
    if mark is not None:
        model.mark_forward_method(mark)
    for batch in global_batches():
        loss = getattr(model, step)(local(batch, loom.global_rank, loom.world_size))
        opt.zero_grad()
        loom.backward(loss)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ddp_body(rank: int, world_size: int) -> dict:
    loom = Loom(accelerator="cpu", devices=world_size, strategy="ddp")
    # The ranks exist already (torchrun-style environment): the whole body runs without launch(), as Fabric
    # scripts written for `fabric run` do. The first call that needs the process group joins it.
    out: dict = {"group_at_construction": dist.is_initialized()}
    # 1: step methods and marked methods run through DDP; unmarked ones that run layers are refused.
    _check(out, "training_step", lambda: _train(loom, "training_step"))
    _check(out, "marked", lambda: _train(loom, "my_loss", mark="my_loss"))
    _check(out, "marked_by_method", lambda: _train_marked_by_method(loom))

    def unmarked() -> str:
        model = loom.setup(make_model())
        assert model.describe() == "StepNet(unset)"  # methods that run no layer are fine
        try:
            model.my_loss(local(global_batches()[0], rank, world_size))
        except MisuseError as error:
            return str(error)
        return "no error"

    _check(out, "unmarked", unmarked)

    def unmarked_no_grad() -> bool:
        # Inference under no_grad (the reinforcement_learning example's action choice): nothing to synchronise
        # under DDP, so it runs; the same call with gradients is still refused.
        model = loom.setup(make_model())
        batch = local(global_batches()[0], rank, world_size)
        with torch.no_grad():
            value = model.my_loss(batch)
        assert torch.equal(value, model.module.my_loss(batch).detach())
        try:
            model.my_loss(batch)
        except MisuseError:
            return True
        return False

    _check(out, "unmarked_no_grad", unmarked_no_grad)

    def no_move() -> tuple:
        model = ToRecorder()
        loom.setup(model, move_to_device=False)
        moved = ToRecorder()
        loom.setup(moved)
        return model.moved, moved.moved

    _check(out, "no_move", no_move)

    # 3: setting an attribute on the wrapper reaches the user's module.
    def setattr_reaches() -> tuple:
        model = loom.setup(make_model())
        model.flag = "set"
        model.new_attribute = 5
        model.eval()
        return (
            model.module.flag,
            getattr(model.module, "new_attribute", None),
            model.module.training,
            model.describe(),
        )

    _check(out, "setattr", setattr_reaches)

    # 2: numbers and nested collections, ReduceOp, group, sync_grads.
    _check(out, "reduce_number", lambda: loom.all_reduce(float(rank + 1)))
    _check(out, "reduce_sum_int", lambda: loom.all_reduce(rank + 1, reduce_op="sum"))
    _check(
        out,
        "reduce_nested",
        lambda: loom.all_reduce(
            {"a": float(rank), "b": [2.0 * rank, torch.tensor([1.0 + rank])]}, reduce_op="sum"
        ),
    )
    _check(out, "reduce_op_enum", lambda: loom.all_reduce(float(rank + 1), reduce_op=dist.ReduceOp.MAX))
    _check(out, "reduce_avg_enum", lambda: loom.all_reduce(float(rank + 1), reduce_op=dist.ReduceOp.AVG))
    _check(out, "gather_number", lambda: loom.all_gather(1.5 + rank))
    _check(out, "gather_nested", lambda: loom.all_gather({"loss": 0.5 * rank, "n": [rank]}))
    group = dist.new_group([0, 1])
    _check(
        out, "reduce_group", lambda: loom.all_reduce(torch.tensor(rank + 1.0), group=group, reduce_op="sum")
    )
    _check(out, "gather_group", lambda: loom.all_gather(torch.tensor(rank + 1.0), group=group))

    def sync_grads() -> tuple:
        x = torch.tensor(float(rank + 1), requires_grad=True)
        gathered = loom.all_gather(x * 3, sync_grads=True)
        (gathered * torch.tensor([1.0, 10.0])).sum().backward()
        no_sync = loom.all_gather(x * 3)
        return gathered.detach(), x.grad, no_sync.requires_grad

    _check(out, "sync_grads", sync_grads)

    # 6: DataLoader workers are seeded per rank and worker, reproducibly, and the user's worker_init_fn runs.
    _check(out, "workers", lambda: (_worker_draws(loom, 7), _worker_draws(loom, 7), _worker_draws(loom, 8)))
    _check(out, "launch_late", lambda: (loom.launch(), loom.launch(_ranked, 10, offset=1)))

    def rank_zero_first() -> bool:
        marker = Path(tempfile.gettempdir()) / f"torchloom-rank-zero-first-{os.environ['MASTER_PORT']}"
        with loom.rank_zero_first():
            if rank == 0:
                time.sleep(0.5)
                marker.write_text("ready")
            seen = marker.exists()
        loom.barrier()
        if rank == 0:
            marker.unlink()
        return seen

    _check(out, "rank_zero_first", rank_zero_first)

    def custom_samplers() -> dict:
        dataset = torch.utils.data.TensorDataset(torch.arange(20))
        samplers = {
            "subset": torch.utils.data.SubsetRandomSampler(list(range(3, 15))),
            "weighted": torch.utils.data.WeightedRandomSampler([1.0] * 10 + [5.0] * 10, num_samples=12),
        }
        torch.manual_seed(rank)  # the ranks' global generators differ: the split must not depend on them
        draws = {}
        for name, sampler in samplers.items():
            loader = loom.setup_dataloaders(
                torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=3)
            )
            draws[name] = [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]
        return draws

    _check(out, "custom_samplers", custom_samplers)
    return out


def _ranked(loom: Loom, base: int, offset: int = 0) -> int:
    return base + loom.global_rank + offset


class RandomAugment(torch.utils.data.Dataset):
    """Each item is what a random augmentation would draw: torch, Python `random` and NumPy numbers."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        import random

        import numpy as np

        tag = float(os.environ.get("USER_INIT_RAN", "0"))
        return torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand()), tag])


def _user_init(worker_id: int) -> None:
    os.environ["USER_INIT_RAN"] = "1"


def _worker_draws(loom: Loom, seed: int) -> torch.Tensor:
    loom.seed_everything(seed)
    # fork: the ranks were spawned, and spawning workers too would re-import torch in each (seconds apiece).
    loader = torch.utils.data.DataLoader(
        RandomAugment(),
        batch_size=2,
        num_workers=2,
        worker_init_fn=_user_init,
        multiprocessing_context="fork",
    )
    loader = loom.setup_dataloaders(loader)
    return torch.cat(list(loader))


def _train_marked_by_method(loom: Loom) -> dict[str, torch.Tensor]:
    model, opt = _setup(loom)
    loom.mark_forward_method(model.my_loss)  # read through a DDP-wrapped model: comes back wrapped
    for batch in global_batches():
        loss = model.my_loss(local(batch, loom.global_rank, loom.world_size))
        opt.zero_grad()
        loom.backward(loss)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ddp() -> list[dict]:
    return run_ranks(_ddp_body, 2, timeout=240)


def _value(ranks: list[dict], name: str) -> list:
    values = [r[name] for r in ranks]
    for v in values:
        assert not (isinstance(v, str) and v.startswith("ERROR")), v
    return values


def _assert_params_match(ranks: list[dict], name: str, expected: dict[str, torch.Tensor]) -> None:
    first, second = _value(ranks, name)
    for key in expected:
        assert torch.equal(first[key], second[key]), f"{name}: {key} differs between the ranks"
        torch.testing.assert_close(first[key], expected[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")


# ---- 1: methods other than forward ---------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_training_step_syncs_gradients_under_ddp(ddp):
    _assert_params_match(ddp, "training_step", reference("training_step"))


@pytest.mark.timeout(300)
def test_marked_methods_sync_gradients_under_ddp(ddp):
    _assert_params_match(ddp, "marked", reference("my_loss"))
    _assert_params_match(ddp, "marked_by_method", reference("my_loss"))


@pytest.mark.timeout(300)
def test_unmarked_method_running_layers_is_refused_under_ddp(ddp):
    for message in _value(ddp, "unmarked"):
        assert "StepNet.my_loss()" in message and "model.mark_forward_method('my_loss')" in message


def test_step_methods_single_process_run_through_forward():
    loom = Loom(accelerator="cpu")
    model = loom.setup(make_model())
    calls = []
    model.module.register_forward_pre_hook(lambda *_: calls.append("pre"))
    batch = local(global_batches()[0], 0, 1)
    loss = model.training_step(batch)
    torch.testing.assert_close(loss, make_model().training_step(batch))
    assert calls == ["pre", "pre"]  # once for the routed step, once for self(x) inside it
    assert "forward" not in model.module.__dict__  # the redirection leaves nothing behind
    assert model.my_loss(batch).shape == ()  # one process: nothing to bypass, no refusal
    with pytest.raises(AttributeError, match="does not exist or is not a method"):
        model.mark_forward_method("missing")
    with pytest.raises(ValueError, match="forward"):
        model.mark_forward_method("forward")


# ---- 3: attributes -------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.timeout(300)
def test_unmarked_method_without_gradients_runs_under_ddp(ddp):
    assert _value(ddp, "unmarked_no_grad") == [True, True]


@pytest.mark.timeout(300)
def test_setup_without_moving_to_the_device(ddp):
    # move_to_device=False leaves the model where it is (Fabric's meaning); the default moves it.
    assert _value(ddp, "no_move") == [(False, True), (False, True)]
    loom = Loom(accelerator="cpu")
    model = ToRecorder()
    loom.setup_module(model, move_to_device=False)
    assert not model.moved


def test_setattr_on_the_wrapper_reaches_the_module(ddp):
    for flag, new, training, described in _value(ddp, "setattr"):
        assert (flag, new, training, described) == ("set", 5, False, "StepNet(set)")


def test_setattr_single_process_and_device_dtype():
    loom = Loom(accelerator="cpu", precision="64-true")
    model = loom.setup(make_model())
    model.flag = "x"
    assert model.module.flag == "x" and model.flag == "x"
    assert model.device == torch.device("cpu") and model.dtype == torch.float64


# ---- 2: collectives on numbers -------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_collectives_on_numbers_and_nested_collections(ddp):
    for r in ddp:
        assert torch.equal(r["reduce_number"], torch.tensor(1.5))
        assert torch.equal(r["reduce_sum_int"], torch.tensor(3))
        nested = r["reduce_nested"]
        assert torch.equal(nested["a"], torch.tensor(1.0)) and torch.equal(nested["b"][0], torch.tensor(2.0))
        assert torch.equal(nested["b"][1], torch.tensor([3.0]))
        assert torch.equal(r["reduce_op_enum"], torch.tensor(2.0))
        assert torch.equal(r["reduce_avg_enum"], torch.tensor(1.5))
        assert torch.equal(r["gather_number"], torch.tensor([1.5, 2.5]))
        assert torch.equal(r["gather_nested"]["loss"], torch.tensor([0.0, 0.5]))
        assert torch.equal(r["gather_nested"]["n"][0], torch.tensor([0, 1]))
        assert torch.equal(r["reduce_group"], torch.tensor(3.0))
        assert torch.equal(r["gather_group"], torch.tensor([1.0, 2.0]))


@pytest.mark.timeout(300)
def test_all_gather_sync_grads(ddp):
    grads = []
    for r in _value(ddp, "sync_grads"):
        gathered, grad, no_sync_requires_grad = r
        assert torch.equal(gathered, torch.tensor([3.0, 6.0]))
        assert not no_sync_requires_grad
        grads.append(float(grad))
    # Each rank's loss weighs rank 0's entry by 1 and rank 1's by 10; gradients of both losses reach each input.
    assert grads == [3.0 * 2, 30.0 * 2]


def test_collectives_single_process_numbers():
    loom = Loom(accelerator="cpu")
    assert torch.equal(loom.all_reduce(2.5), torch.tensor(2.5))
    assert torch.equal(loom.all_gather(2.5), torch.tensor([2.5]))
    assert torch.equal(loom.all_reduce({"x": [1]}, reduce_op=dist.ReduceOp.SUM)["x"][0], torch.tensor(1))
    with pytest.raises(MisuseError, match=r"reduce_op='sum'"):
        loom.all_reduce(1.0, "sum")
    with pytest.raises(ValueError, match="not supported"):
        loom.all_reduce(1.0, reduce_op=dist.ReduceOp.BAND)


# ---- 4: clip_gradients takes Fabric's positional order -------------------------------------------------------
def test_clip_gradients_third_positional_argument_is_clip_val():
    loom = Loom(accelerator="cpu")
    model, opt = _setup(loom)
    reference_model = copy.deepcopy(model.module)
    batch = local(global_batches()[0], 0, 1)
    loom.backward(model.training_step(batch) * 100)
    reference_model.training_step(batch).mul(100).backward()
    assert loom.clip_gradients(model, opt, 0.01) is None  # by value, as Fabric
    torch.nn.utils.clip_grad_value_(reference_model.parameters(), 0.01)
    for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    norm = loom.clip_gradients(model, opt, None, 0.001)  # by norm
    assert norm is not None and float(norm) > 0.001


# ---- 1 under FSDP: every layout routes the step methods through its root --------------------------------------
def _fsdp_body(rank: int, world_size: int, layout: str) -> dict:
    import warnings

    from torchloom.wrappers import state_module

    warnings.simplefilter("ignore", UserWarning)  # "no policy" and similar advice
    strategy = {"fsdp1-policy": "fsdp", "fsdp1-units": "fsdp"}.get(layout, "fsdp2")
    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    if layout == "fsdp1-policy":
        loom._strategy.auto_wrap_policy = {nn.Linear}
    if layout == "fsdp2-policy":
        loom._strategy.shard_policy = lambda m: isinstance(m, nn.Linear)
    loom.launch()
    if layout == "fsdp1-units":
        from torch.distributed.fsdp.wrap import wrap

        with loom.init_module():
            model = make_model()
            model.layer = wrap(model.layer)
    else:
        model = make_model()
        if layout == "fsdp2-units":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model.layer, **loom.strategy.unit_kwargs())
    model = loom.setup_module(model)
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    out: dict = {}
    for batch in global_batches():
        loss = model.training_step(local(batch, rank, world_size))
        opt.zero_grad()
        loom.backward(loss)
        opt.step()
    full = loom.strategy.module_state_dict(state_module(model), full=True)
    out["params"] = {k: v.detach().clone() for k, v in full.items()}
    try:
        model.my_loss(local(global_batches()[0], rank, world_size))
        out["unmarked"] = "no error"
    except MisuseError as error:
        out["unmarked"] = str(error)
    try:
        with torch.no_grad():
            model.my_loss(local(global_batches()[0], rank, world_size))
        out["unmarked_no_grad"] = "no error"
    except MisuseError as error:
        out["unmarked_no_grad"] = str(error)
    out["wrapped_root"] = model._wrapped_root
    try:
        loom.setup_module(make_model(), move_to_device=False)
        out["no_move"] = "no error"
    except MisuseError as error:
        out["no_move"] = str(error)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["fsdp1-policy", "fsdp1-units", "fsdp2-policy", "fsdp2-units"])
def test_training_step_under_every_fsdp_layout(layout):
    ranks = run_ranks(_fsdp_body, 2, layout, timeout=240)
    expected = reference("training_step")
    assert ranks[0]["params"]
    for key, value in expected.items():
        for r in ranks:
            if not r["params"]:
                continue  # the full state dict is gathered to rank 0 only
            torch.testing.assert_close(r["params"][key], value, rtol=0, atol=1e-5, msg=f"{layout}: {key}")
    # A root wrapper (or a root unit) is bypassed by unmarked methods: refused. Without one, each unit's own
    # hooks and the replicated leftovers' gradient hooks run whatever method calls them: allowed.
    has_root = layout.endswith("policy")
    assert all(r["wrapped_root"] == has_root for r in ranks)
    for r in ranks:
        assert ("mark_forward_method('my_loss')" in r["unmarked"]) == has_root, r["unmarked"]
        # Shards are not whole parameters: without gradients too, bypassing the root is refused.
        assert ("mark_forward_method('my_loss')" in r["unmarked_no_grad"]) == has_root, r["unmarked_no_grad"]
        assert "move_to_device=False) cannot be honoured" in r["no_move"], r["no_move"]


# ---- 5: `torchloom run SCRIPT --devices 2 --accelerator cpu` (options after the script, as Fabric's READMEs) ----
# One `torchloom run` job serves this check and the next section's (the constructor joins the group): each job
# starts three interpreters that import torch, the suite's main cost. Its script is the raw collective of the
# next section followed by test_run's script, which reports each rank's options and arguments.
@pytest.fixture(scope="module")
def run_job_output(tmp_path_factory) -> str:
    from harness import PYTHON, run_job, wait_no_strays
    from test_run import SCRIPT

    tmp_path = tmp_path_factory.mktemp("run")
    script = tmp_path / "train.py"
    script.write_text(RAW_COLLECTIVE_SCRIPT + SCRIPT)
    options = "--lr 3 --devices 2 --accelerator cpu --strategy ddp --num_nodes 1 -- --devices 9".split()
    cmd = [PYTHON, "-m", "torchloom", "run", str(script), *options]
    result, token = run_job(cmd, timeout=120)
    assert result.returncode == 0, result.stdout
    assert wait_no_strays(token) == []
    return result.stdout


@pytest.mark.timeout(150)
def test_run_with_options_after_the_script(run_job_output):
    from test_run import _lines

    ranks = _lines(run_job_output)
    assert [r["rank"] for r in ranks] == [0, 1], run_job_output
    for r in ranks:
        assert r["world"] == 2 and r["strategy"] == "ddp" and r["sum"] == 3.0
        assert r["args"] == ["--lr", "3", "--devices", "9"]


# ---- 6: DataLoader workers ------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_dataloader_workers_are_seeded_per_rank_and_worker(ddp):
    runs = _value(ddp, "workers")
    first = torch.cat([r[0] for r in runs])  # seed 7, both ranks: 8 items, 4 per rank, 2 workers each
    assert torch.all(first[:, 3] == 1.0)  # the user's worker_init_fn ran in every worker
    for column in range(3):  # torch, random, numpy: no two items of any rank or worker draw the same number
        assert len(set(first[:, column].tolist())) == len(first), first
    for seven, again, eight in runs:
        assert torch.equal(seven, again)  # the same seed gives the same draws
        assert not torch.equal(seven, eight)


# ---- 7: a plain state saved with loom.save round-trips through plain PyTorch ----------------------------------
def test_saved_state_dict_loads_with_plain_pytorch(tmp_path):
    from torchloom.checkpointing import META_KEY

    loom = Loom(accelerator="cpu")
    model = loom.setup(make_model())
    loom.save(tmp_path / "weights.pt", model.state_dict())
    plain = StepNet()
    plain.load_state_dict(torch.load(tmp_path / "weights.pt"))  # strict: no extra key
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value)
    # torchloom reads it back too, whole or into a module.
    assert set(loom.load(tmp_path / "weights.pt")) == set(model.state_dict())
    loom.load_raw(tmp_path / "weights.pt", model)
    # A state holding objects still records its metadata beside the user's entries.
    loom.save(tmp_path / "full.pt", {"model": model, "step": 3})
    checkpoint = torch.load(tmp_path / "full.pt", weights_only=False)
    assert checkpoint[META_KEY]["kinds"] == {"model": "module", "step": "value"}
    plain.load_state_dict(checkpoint["model"])
    # Files written before (metadata beside plain values) still load.
    old_record = {k: v for k, v in checkpoint[META_KEY].items() if k != "checksum"}  # none was written then
    torch.save({**model.state_dict(), META_KEY: old_record}, tmp_path / "old.pt")
    assert set(loom.load(tmp_path / "old.pt")) == set(model.state_dict())


# ---- differential: the same Fabric script through Lightning Fabric and through torchloom -----------------------
def _same(a: Any, b: Any, where: str) -> None:
    """Equal structure and values; integer tensors may differ in width (Fabric int32, torchloom int64)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        if a.is_floating_point():
            assert a.dtype == b.dtype, where
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=where)
        else:
            assert torch.equal(a.long(), b.long()), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _same_through_both(script_name: str) -> list[Any]:
    """Run fabric_scripts.`script_name` on 2 ranks through Fabric and through torchloom; assert the same
    results on every rank; return torchloom's."""
    pytest.importorskip("lightning.fabric")
    import fabric_scripts

    script = getattr(fabric_scripts, script_name)
    fabric = run_ranks(script, 2, "fabric", timeout=150)
    loom = run_ranks(script, 2, "torchloom", timeout=150)
    for rank in range(2):
        _same(fabric[rank], loom[rank], f"rank {rank}")
    return loom


@pytest.mark.timeout(300)
def test_fabric_script_gives_the_same_results_under_torchloom():
    loom = _same_through_both("training_script")
    for key, value in loom[0]["params"].items():  # and DDP kept the ranks together
        assert torch.equal(value, loom[1]["params"][key])


@pytest.mark.timeout(300)
def test_loader_and_dropout_give_fabrics_random_stream():
    # Lightning's image_classifier example: a DataLoader set up by Fabric and a model with dropout. The
    # loader must draw from the global generator at each pass as the user's loader would, or every dropout
    # mask after it differs from Fabric's.
    _same_through_both("loader_script")


def test_optimizer_step_calls_on_after_optimizer_step_as_fabric_does():
    pytest.importorskip("lightning.fabric")
    from fabric_scripts import callback_script

    fabric = callback_script("fabric")
    assert fabric == [(True, True)] * 3
    assert callback_script("torchloom") == fabric


def test_shuffle_seed_follows_lightnings_seed_everything(monkeypatch):
    # A Fabric script may keep calling lightning's seed_everything (language_model does): its seed
    # (PL_GLOBAL_SEED) then orders the shuffled data, as it does under Fabric.
    monkeypatch.delenv("TORCHLOOM_SEED", raising=False)
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    loom = Loom(accelerator="cpu")
    data = torch.utils.data.TensorDataset(torch.arange(10))
    loader = loom.setup_dataloaders(torch.utils.data.DataLoader(data, shuffle=True))
    assert loader.sampler.seed == 42
    # Both libraries' seed_everything export PL_GLOBAL_SEED, so it holds the last seed either set: Fabric reads
    # it, and so does torchloom (TORCHLOOM_SEED only without it).
    monkeypatch.setenv("TORCHLOOM_SEED", "3")
    assert loom.setup_dataloaders(torch.utils.data.DataLoader(data, shuffle=True)).sampler.seed == 42
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert loom.setup_dataloaders(torch.utils.data.DataLoader(data, shuffle=True)).sampler.seed == 3


# ---- `torchloom run` joins the group in Loom(), as `fabric run` does -------------------------------------------
RAW_COLLECTIVE_SCRIPT = """
import torch
import torch.distributed as dist
from torchloom import Loom

loom = Loom()
# Straight to torch.distributed, as a library wrapping the optimizer does (the meta_learning example's cherry).
t = torch.tensor([loom.global_rank + 1.0])
dist.all_reduce(t)
print(f"SUM {loom.global_rank} {t.item()}", flush=True)
"""


@pytest.mark.timeout(150)
def test_torchloom_run_joins_the_group_in_the_constructor(run_job_output):
    # The job of test_run_with_options_after_the_script (`torchloom run SCRIPT --devices 2 --accelerator cpu
    # ...`), whose script starts with RAW_COLLECTIVE_SCRIPT. Two ranks write to one pipe unbuffered, so their
    # lines can interleave: find the records, not the lines.
    assert sorted(re.findall(r"SUM (\d) ([\d.]+)", run_job_output)) == [("0", "3.0"), ("1", "3.0")], (
        run_job_output
    )


# ---- Loom(...) in processes that exist already ------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_no_launch_needed_when_the_processes_exist(ddp):
    assert [r["group_at_construction"] for r in ddp] == [False, False]  # constructing a Loom never blocks
    # A later launch() starts nothing; launch(fn, *args, **kwargs) runs fn in the rank.
    assert _value(ddp, "launch_late") == [(None, 11), (None, 12)]


@pytest.mark.timeout(300)
def test_rank_zero_first(ddp):
    assert _value(ddp, "rank_zero_first") == [True, True]


# ---- Fabric's spellings of the constructor's arguments ----------------------------------------------------------
@pytest.mark.parametrize(
    ("precision", "name"),
    [
        (64, "64-true"),
        ("64", "64-true"),
        (32, "32-true"),
        ("32", "32-true"),
        ("bf16", "bf16-mixed"),
        (None, "32-true"),
    ],
)
def test_precision_aliases(precision, name):
    assert Loom(accelerator="cpu", precision=precision).strategy.precision.name == name


def test_fabric_strategy_names():
    from torchloom import ConfigurationError
    from torchloom.strategies import DDPStrategy

    loom = Loom(accelerator="cpu", devices=1, strategy="ddp_find_unused_parameters_true")
    assert isinstance(loom.strategy, DDPStrategy) and loom.strategy.ddp_kwargs == {
        "find_unused_parameters": True
    }
    assert isinstance(Loom(accelerator="cpu", devices=1, strategy="ddp_spawn").strategy, DDPStrategy)
    with pytest.raises(ConfigurationError, match="cpu_offload=True moves sharded parameters"):
        Loom(accelerator="cpu", devices=1, strategy="fsdp_cpu_offload")  # the feature exists, not on CPU
    for name in ("ddp_fork", "ddp_notebook"):
        strategy = Loom(accelerator="cpu", devices=1, strategy=name).strategy
        assert isinstance(strategy, DDPStrategy) and strategy.start_method == "fork"
    with pytest.raises(ConfigurationError, match=r"start_method='popen'\) is not valid"):
        DDPStrategy(start_method="popen")


@pytest.mark.timeout(300)
def test_ddp_notebook_forks_ranks_that_run_a_function_defined_anywhere():
    """As in a notebook cell: the function is a closure (spawn could not pickle it); 2 forked ranks train with
    DDP to what one process gets on the global batch, and every rank ends with the same parameters."""
    torch.manual_seed(0)
    start = nn.Linear(3, 1)
    inputs = torch.randn(4, 3)

    def train(loom: Loom) -> tuple[list[torch.Tensor], bool]:
        model = copy.deepcopy(start)
        model, optimizer = loom.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        mine = inputs[loom.global_rank * 2 : loom.global_rank * 2 + 2]
        for _ in range(3):
            loom.backward(model(mine).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        params = [p.detach().clone() for p in model.parameters()]
        gathered = loom.all_gather(torch.cat([p.flatten() for p in params]))
        return params, bool((gathered == gathered[0]).all())

    params, same_everywhere = Loom(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(train)
    reference = copy.deepcopy(start)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        reference(inputs).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert same_everywhere
    for ours, theirs in zip(params, reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-6)


def test_ddp_notebook_refuses_what_fork_cannot_do(monkeypatch):
    from torchloom.strategies import DDPStrategy

    with pytest.raises(MisuseError, match=r"forks ranks that run a function: call loom.launch\(train\)"):
        Loom(accelerator="cpu", devices=2, strategy="ddp_notebook").launch()
    earlier = Loom(accelerator="cpu", devices=1, strategy="ddp")
    earlier.launch()
    earlier.setup_module(nn.Linear(2, 2))  # holds a process group, never closed
    with pytest.raises(MisuseError, match="still holds a process group.*close\\(\\)"):
        Loom(accelerator="cpu", devices=2, strategy=DDPStrategy(start_method="fork")).launch(_world_size_of)
    earlier.close()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(MisuseError, match="CUDA was initialised in this process"):
        Loom(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(_world_size_of)


def _world_size_of(loom: Loom) -> int:
    return loom.world_size


def test_gpu_means_cuda():
    from torchloom import ConfigurationError

    if torch.cuda.is_available():
        assert Loom(accelerator="gpu").accelerator.name == "cuda"
    else:
        with pytest.raises(ConfigurationError, match="cuda|CUDA"):
            Loom(accelerator="gpu")


# ---- Fabric's methods and properties ----------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.calls: list = []

    def on_train_epoch_end(self, *args, **kwargs) -> None:
        self.calls.append((args, kwargs))


def test_callbacks_logger_and_conveniences(tmp_path):
    from torchloom.loggers import CSVLogger

    first, second = Recorder(), Recorder()
    logger = CSVLogger(tmp_path)
    loom = Loom(accelerator="cpu", callbacks=[first, second, object()], loggers=[logger])
    loom.call("on_train_epoch_end", 1, loss=0.5)
    loom.call("a_hook_nobody_has")
    assert first.calls == second.calls == [((1,), {"loss": 0.5})]
    assert loom.logger is logger and Loom(accelerator="cpu").logger is None
    assert loom.accelerator.name == "cpu"
    batch = loom.to_device({"x": torch.ones(2), "n": [torch.zeros(1)]})
    assert batch["x"].device == loom.device and isinstance(loom.to_device(nn.Linear(1, 1)), nn.Linear)
    with Loom(accelerator="cpu", precision="64-true").init_tensor():
        assert torch.ones(1).dtype == torch.float64
    with Loom(accelerator="cpu", precision="bf16-mixed").autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with loom.rank_zero_first(local=True):
        pass


def test_setup_with_scheduler_and_load_raw_weights_only(tmp_path):
    loom = Loom(accelerator="cpu")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, returned = loom.setup(model, optimizer, scheduler=scheduler, move_to_device=True)
    assert returned is scheduler
    torch.save({"weights": model.state_dict(), "note": object.__new__(Recorder)}, tmp_path / "mixed.pt")
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    loom.load_raw(tmp_path / "plain.pt", model, weights_only=True)
    with pytest.raises(Exception, match="weights_only|Weights only"):
        loom.load_raw(tmp_path / "mixed.pt", model)


def test_save_with_filter(tmp_path):
    loom = Loom(accelerator="cpu")
    model, optimizer = _setup(loom)
    loom.save(
        tmp_path / "head.pt",
        {"model": model, "step": 4},
        filter={"model": lambda k, v: k.startswith("head.")},
    )
    saved = torch.load(tmp_path / "head.pt", weights_only=False)
    assert set(saved["model"]) == {"head.weight", "head.bias"} and saved["step"] == 4
    fresh = loom.setup(StepNet())
    loom.load(tmp_path / "head.pt", {"model": fresh}, strict=False)
    assert torch.equal(fresh.head.weight, model.head.weight)
    with pytest.raises(MisuseError, match="does not have"):
        loom.save(tmp_path / "x.pt", {"model": model}, filter={"optimizer": lambda k, v: True})


# ---- custom samplers: each rank gets its part of one draw -------------------------------------------------------
@pytest.mark.timeout(300)
def test_custom_samplers_are_split_across_ranks(ddp):
    first, second = _value(ddp, "custom_samplers")
    for epoch in range(2):
        subset = first["subset"][epoch] + second["subset"][epoch]
        assert sorted(subset) == list(range(3, 15))  # disjoint parts that make up the subset
        assert len(first["weighted"][epoch]) == len(second["weighted"][epoch]) == 6
    assert first["subset"][0] != first["subset"][1]  # a new draw each epoch


def test_lightning_module_logs_through_loom(tmp_path):
    lightning = pytest.importorskip("lightning")

    class Lit(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch: torch.Tensor) -> torch.Tensor:
            loss = self.layer(batch).pow(2).mean()
            self.log("train_loss", loss)
            return loss

    from torchloom.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    loom = Loom(accelerator="cpu", loggers=logger)
    module = Lit()
    model, optimizer = loom.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    loss = model.training_step(torch.ones(3, 2))
    loom.finalize_loggers()
    assert module.logger is logger and module.optimizers() is optimizer
    logged = "".join(p.read_text() for p in tmp_path.rglob("*.csv"))
    assert "train_loss" in logged and f"{loss.item():.4f}"[:5] in logged


def test_checkpoints_cross_load_between_fabric_and_torchloom(tmp_path):
    """A checkpoint saved by one loads into the other (one process; model, optimizer and a plain value)."""
    pytest.importorskip("lightning.fabric")
    from fabric_scripts import make_fabric

    def trained(kind: str) -> tuple:
        fabric = make_fabric(kind, accelerator="cpu", devices=1)
        model = make_model()
        model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
        batch = local(global_batches()[0], 0, 1)
        fabric.backward(model.training_step(batch))
        optimizer.step()
        return fabric, model, optimizer

    for saver, loader in (("fabric", "torchloom"), ("torchloom", "fabric")):
        fabric, model, optimizer = trained(saver)
        fabric.save(tmp_path / f"{saver}.ckpt", {"model": model, "optimizer": optimizer, "step": 5})
        other, fresh_model, fresh_optimizer = trained(loader)
        with torch.no_grad():
            for p in fresh_model.parameters():
                p.zero_()
        state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
        other.load(tmp_path / f"{saver}.ckpt", state)
        assert state["step"] == 5, saver
        for key, value in model.state_dict().items():
            assert torch.equal(fresh_model.state_dict()[key], value), (saver, key)
        saved_state = optimizer.state_dict()["state"]
        loaded_state = fresh_optimizer.state_dict()["state"]
        for a, b in zip(saved_state.values(), loaded_state.values(), strict=True):
            assert torch.equal(a["exp_avg"], b["exp_avg"]), saver


def test_loom_mark_forward_method():
    loom = Loom(accelerator="cpu")
    model = loom.setup(make_model())
    loom.mark_forward_method(model.module.my_loss)
    loom.mark_forward_method("describe")
    assert {"my_loss", "describe"} <= model._forward_methods
    with pytest.raises(MisuseError, match="no model set up"):
        loom.mark_forward_method("missing")


def test_unwrap_and_is_wrapped():
    # Fabric's `_unwrap_objects` (which Lightning's build_your_own_trainer example imports) and `is_wrapped`.
    from torchloom import is_wrapped, unwrap

    loom = Loom(accelerator="cpu")
    module = make_model()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)))
    model, opt = loom.setup(module, optimizer)
    wrapped_loader = loom.setup_dataloaders(loader)
    assert all(is_wrapped(x) for x in (model, opt, wrapped_loader))
    assert not any(is_wrapped(x) for x in (module, optimizer, loader, 3))
    out = unwrap({"model": model, "rest": [opt, (wrapped_loader, 5)]})
    assert (
        out["model"] is module and out["rest"][0] is optimizer and out["rest"][1][0] is wrapped_loader.loader
    )
    assert out["rest"][1][1] == 5 and unwrap(module) is module


@pytest.mark.parametrize("move_to_device", [True, False])
def test_loader_device_is_fabrics(move_to_device):
    """`loader.device` on a loader from setup_dataloaders: where batches go, None when they stay put; the
    same value Fabric's loader reports, side by side."""
    from lightning.fabric import Fabric

    data = torch.utils.data.DataLoader(list(range(4)))
    theirs = Fabric(accelerator="cpu", devices=1).setup_dataloaders(data, move_to_device=move_to_device)
    ours = Loom(accelerator="cpu", devices=1).setup_dataloaders(data, move_to_device=move_to_device)
    assert ours.device == theirs.device
    assert (ours.device is None) is (not move_to_device)


# ---- Fabric's subclass entry point and deprecated context ------------------------------------------------------
class _Job(Loom):
    def run(self, scale: float) -> tuple[float, int]:
        total = self.all_reduce(torch.tensor([float(self.global_rank + 1)]), reduce_op="sum")
        return float(total) * scale, self.world_size


@pytest.mark.timeout(300)
def test_an_overridden_run_is_launched_on_every_rank():
    """As with a Fabric subclass: `loom.run(...)` starts the ranks and runs the override on each."""
    assert _Job(accelerator="cpu", devices=2, strategy="ddp").run(10.0) == (30.0, 2)
    assert _Job(accelerator="cpu", devices=1).run(scale=2.0) == (2.0, 1)
    assert Loom(accelerator="cpu").run(1) is None  # not overridden: nothing, as Fabric's


def test_sharded_model_is_init_module_and_deprecated_as_in_fabric():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.warns(DeprecationWarning, match="init_module"), fabric.sharded_model():
        theirs = nn.Linear(2, 2)
    loom = Loom(accelerator="cpu", devices=1, precision="bf16-true")
    with pytest.warns(DeprecationWarning, match="init_module"), loom.sharded_model():
        ours = nn.Linear(2, 2)
    assert theirs.weight.dtype == torch.float32 and ours.weight.dtype == torch.bfloat16  # init_module's dtype


def test_fabric_refuses_fsdp_on_cpu_where_torchloom_configures_it():
    """README's comparison table, row "FSDP on CPU": Lightning Fabric refuses it, torchloom configures it (the
    FSDP tests then train with it on 2 CPU ranks)."""
    fabric = pytest.importorskip("lightning.fabric")
    with pytest.raises(ValueError, match="only available on GPU"):
        fabric.Fabric(accelerator="cpu", devices=2, strategy="fsdp")
    for strategy in ("fsdp", "fsdp2"):
        assert Loom(accelerator="cpu", devices=2, strategy=strategy).world_size == 2


# ---- hooks and errors as Fabric users catch and use them (issue 26) -------------------------------------------
class _SetupHook:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def on_after_setup(self, fabric: Any, module: Any) -> None:
        self.calls.append((type(module).__name__, callable(getattr(fabric, "setup_module", None))))


class _NarrowHook:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def on_epoch(self, results: Any) -> None:  # accepts only `results` of what call() passes
        self.calls.append(results)


class _WideHook:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def on_epoch(self, **kwargs: Any) -> None:
        self.calls.append(sorted(kwargs))


class _NotAHook:
    on_epoch = 3


class _KeywordLogger:
    """A logger whose log_metrics takes keywords only: Fabric calls `log_metrics(metrics=..., step=...)`."""

    name, version, root_dir, log_dir, group_separator = "kw", 0, None, None, "/"

    def __init__(self) -> None:
        self.logged: list[Any] = []

    def log_metrics(self, *, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((dict(metrics), step))

    def log_hyperparams(self, params: Any) -> None:
        pass

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        pass


def _hooks_script(kind: str) -> dict[str, Any]:
    """The same calls through Fabric or Loom; what a user sees of each."""
    import warnings

    hooks = [_SetupHook(), _NarrowHook(), _WideHook(), _NotAHook()]
    logger = _KeywordLogger()
    if kind == "fabric":
        from lightning.fabric import Fabric

        runner: Any = Fabric(accelerator="cpu", devices=1, callbacks=hooks, loggers=[logger])
    else:
        runner = Loom(accelerator="cpu", devices=1, callbacks=hooks, loggers=[logger])
    out: dict[str, Any] = {}
    try:
        runner.launch(None)  # the mistake `launch(train(fabric))`
        out["launch(None)"] = "no error"
    except TypeError as error:
        out["launch(None)"] = ("TypeError", "HINT" in str(error))
    runner.launch()
    runner.setup_module(nn.Linear(2, 2))  # Fabric calls on_after_setup from setup() only
    model = nn.Linear(2, 2)
    runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.call("on_epoch", results=1, extra=2)
    out["skipped"] = [
        "Skipping the callback `_NotAHook.on_epoch`" in str(w.message) and "not callable" in str(w.message)
        for w in caught
    ]
    runner.log_dict({"loss": 0.5}, step=3)
    out["setup"] = [c[1] for c in hooks[0].calls]
    out["narrow"], out["wide"], out["logged"] = hooks[1].calls, hooks[2].calls, logger.logged
    return out


def test_hooks_callbacks_and_launch_errors_as_fabric_has_them():
    pytest.importorskip("lightning.fabric")
    fabric = _hooks_script("fabric")
    assert fabric == {
        "launch(None)": ("TypeError", True),
        "skipped": [True],
        "setup": [True],
        "narrow": [1],
        "wide": [["extra", "results"]],
        "logged": [({"loss": 0.5}, 3)],
    }
    assert _hooks_script("torchloom") == fabric


def _misuse_error_types(kind: str, tmp: Path) -> dict[str, str]:
    """Which of Python's exception types `except` clauses written for Fabric would catch, for each misuse."""
    if kind == "fabric":
        from lightning.fabric import Fabric

        runner: Any = Fabric(accelerator="cpu", devices=1)
    else:
        runner = Loom(accelerator="cpu", devices=1)
    runner.launch()
    model = runner.setup_module(nn.Linear(2, 2))
    cases = {
        "setup_module twice": lambda: runner.setup_module(model),
        "setup_optimizers()": lambda: runner.setup_optimizers(),
        "setup_dataloaders()": lambda: runner.setup_dataloaders(),
        "setup_dataloaders(not a loader)": lambda: runner.setup_dataloaders([1, 2]),
        "no_backward_sync(raw model)": lambda: runner.no_backward_sync(nn.Linear(2, 2)).__enter__(),
        "save(filter='foo')": lambda: runner.save(tmp / f"{kind}-a.ckpt", {"model": model}, filter="foo"),
        "save(filter=unknown)": lambda: runner.save(
            tmp / f"{kind}-b.ckpt", {"model": model}, filter={"nope": lambda k, v: True}
        ),
        "load(missing)": lambda: runner.load(tmp / "missing.ckpt"),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the type is the result
            out[name] = next(
                (t.__name__ for t in (FileNotFoundError, TypeError, ValueError) if isinstance(error, t)),
                f"only {type(error).__name__}",
            )
    return out


def test_misuse_errors_are_also_the_types_fabric_raises(tmp_path):
    pytest.importorskip("lightning.fabric")
    fabric = _misuse_error_types("fabric", tmp_path)
    assert "no error" not in fabric.values() and not any(v.startswith("only") for v in fabric.values()), (
        fabric
    )
    assert _misuse_error_types("torchloom", tmp_path) == fabric
