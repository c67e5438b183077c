"""A checkpoint saved at any point of training restores the optimizer's state exactly: before the first step, after
a step the fp16 loss scaler skipped (gradients present, no state), and with a parameter that never got a gradient
(state for some parameters only). The loaded optimizer has state for exactly the parameters that had it, and its
next step matches the uninterrupted run. Real 2-rank gloo runs for the sharded strategies; both formats."""

from __future__ import annotations

import pytest
import torch
from fsdp_models import full_state
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.strategies import DDPStrategy, FSDP2Strategy, FSDPStrategy

SCENARIOS = ("before_first_step", "skipped_step", "param_without_grad")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 2)  # never in the graph: no gradient, so Adam never gives it state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _strategy(name: str, fmt: str):
    if name == "fsdp2":
        return FSDP2Strategy(state_dict_type=fmt)
    if name == "fsdp":
        return FSDPStrategy(state_dict_type=fmt)
    if name == "ddp":
        return DDPStrategy(find_unused_parameters=True)  # `_Net.unused` gets no gradient
    return name


def _batch(loom, seed: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(seed + loom.global_rank))


def _setup(strategy: str, fmt: str, world_size: int, precision: str, seed: int):
    loom = Loom(accelerator="cpu", devices=world_size, strategy=_strategy(strategy, fmt), precision=precision)
    loom.launch()
    torch.manual_seed(seed)
    model = loom.setup_module(_Net())
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    return loom, model, opt


def _with_state(opt) -> list[int]:
    params = [p for group in opt.optimizer.param_groups for p in group["params"]]
    return [i for i, p in enumerate(params) if opt.optimizer.state.get(p)]


def _step(loom, model, opt, seed: int) -> None:
    opt.zero_grad()
    loom.backward(model(_batch(loom, seed)).pow(2).mean())
    opt.step()


def _body(rank: int, world_size: int, strategy: str, fmt: str, scenario: str, path: str) -> dict:
    precision = "16-mixed" if scenario == "skipped_step" else "32-true"
    loom, model, opt = _setup(strategy, fmt, world_size, precision, seed=0)
    if scenario == "skipped_step":
        # An infinite loss gives infinite gradients: the scaler skips the step, so Adam never creates state.
        # Saved without zero_grad, so the gradients are still there.
        loom.backward(model(_batch(loom, 1)).sum() * float("inf"))
        opt.step()
    elif scenario == "param_without_grad":
        _step(loom, model, opt, 1)
    saved_with_state = _with_state(opt)
    loom.save(path, {"model": model, "optimizer": opt})
    assert _with_state(opt) == saved_with_state, "saving changed the optimizer's state"
    _step(loom, model, opt, 2)
    expected = full_state(model)

    loom2, model2, opt2 = _setup(strategy, fmt, world_size, precision, seed=1)
    loom2.load(path, {"model": model2, "optimizer": opt2})
    loaded_with_state = _with_state(opt2)
    _step(loom2, model2, opt2, 2)
    got = full_state(model2)
    return {
        "saved": saved_with_state,
        "loaded": loaded_with_state,
        "diff": max((expected[k] - got[k]).abs().max().item() for k in expected),
    }


def _check(results: list[dict], scenario: str) -> None:
    for r in results:
        assert r["loaded"] == r["saved"]
        if scenario in ("before_first_step", "skipped_step"):
            assert r["saved"] == []
        assert r["diff"] <= 1e-6


@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_sharded_strategies_two_ranks(tmp_path, strategy, fmt):
    for scenario in SCENARIOS:
        results = run_ranks(_body, 2, strategy, fmt, scenario, str(tmp_path / f"{scenario}"))
        _check(results, scenario)


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp", "auto"])
def test_one_process(tmp_path, strategy):
    for scenario in SCENARIOS:
        _check([_body(0, 1, strategy, "sharded", scenario, str(tmp_path / scenario))], scenario)


def test_ddp_two_ranks(tmp_path):
    for scenario in SCENARIOS:
        _check(run_ranks(_body, 2, "ddp", "full", scenario, str(tmp_path / scenario)), scenario)


def _save_two_ranks(rank: int, world_size: int, path: str) -> list[int]:
    loom, model, opt = _setup("fsdp2", "sharded", world_size, "32-true", seed=0)
    _step(loom, model, opt, 1)
    loom.save(path, {"model": model, "optimizer": opt})
    _step(loom, model, opt, 2)
    return [_with_state(opt), full_state(model)]


def test_two_ranks_to_one_keeps_partial_state(tmp_path):
    """A sharded checkpoint written by 2 ranks, with state for some parameters only, loads into 1 process and
    its next step matches the 2 ranks' next step."""
    (saved, expected), _ = run_ranks(_save_two_ranks, 2, str(tmp_path / "c"))
    loom, model, opt = _setup("fsdp2", "sharded", 1, "32-true", seed=1)
    loom.load(str(tmp_path / "c"), {"model": model, "optimizer": opt})
    assert _with_state(opt) == saved == [0, 1, 2, 3]
    # Both ranks' batches at once: the mean over 8 rows has the gradient DDP-style averaging gave the 2 ranks.
    batch = torch.cat([torch.randn(4, 4, generator=torch.Generator().manual_seed(2 + r)) for r in range(2)])
    opt.zero_grad()
    loom.backward(model(batch).pow(2).mean())
    opt.step()
    got = full_state(model)
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) <= 1e-6


def _two_modules_body(rank: int, world_size: int, strategy: str, root: str) -> dict:
    """One optimizer over the parameters of two modules set up separately (as Fabric allows): its state is
    saved by the names of both modules (their keys in `state`), also where each rank holds only its shards of it
    (FSDP): the resumed step must match the uninterrupted one."""
    from itertools import chain

    from torchloom import CheckpointError

    loom = Loom(accelerator="cpu", devices=world_size, strategy=_strategy(strategy, "sharded"))
    loom.launch()

    def fresh(seed: int):
        torch.manual_seed(seed)
        return loom.setup_module(_Net()), loom.setup_module(_Net())

    def step(a, b, opt, seed: int) -> None:
        x = _batch(loom, seed)
        loom.backward(a(x).sum() + b(x).pow(2).sum())
        opt.step()
        opt.zero_grad()

    a, b = fresh(0)
    opt = loom.setup_optimizers(torch.optim.Adam(chain(a.parameters(), b.parameters()), lr=1e-2))
    for seed in range(2):
        step(a, b, opt, seed)
    loom.save(f"{root}/{strategy}", {"a": a, "b": b, "optimizer": opt})
    step(a, b, opt, 2)
    a2, b2 = fresh(1)
    opt2 = loom.setup_optimizers(torch.optim.Adam(chain(a2.parameters(), b2.parameters()), lr=1e-2))
    out: dict = {}
    try:  # the optimizer's parts are named by the modules' keys: other keys cannot find its state
        loom.load(f"{root}/{strategy}", {"x": a2, "y": b2, "optimizer": opt2}, strict=False)
    except CheckpointError as error:
        out["renamed"] = str(error)
    loom.load(f"{root}/{strategy}", {"a": a2, "b": b2, "optimizer": opt2})
    step(a2, b2, opt2, 2)
    out["differ"] = [
        f"{name}.{k}"
        for name, (x, y) in {"a": (a, a2), "b": (b, b2)}.items()
        for k, v in full_state(x).items()
        if not torch.allclose(v, full_state(y)[k], atol=1e-6, rtol=0)
    ]
    return out


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp", "ddp"])
def test_one_optimizer_over_two_set_up_modules(tmp_path, strategy):
    for rank, r in enumerate(run_ranks(_two_modules_body, 2, strategy, str(tmp_path), timeout=180)):
        assert r["differ"] == [], (rank, r)
        assert (
            "saved under the module names ['a', 'b'], but here they are named ['x', 'y']" in r["renamed"]
        ), (
            rank,
            r,
        )
