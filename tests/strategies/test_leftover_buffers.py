"""Buffers of modules outside every unit (a BatchNorm's running statistics) under "fsdp", "fsdp2" and
ModelParallelStrategy get DDP's semantics: rank 0's values before each forward that follows a forward with
gradients outside `no_backward_sync`. Compared with raw `DistributedDataParallel` on the same data, rank by rank,
on 2 ranks; `forward_sync_buffers=False` leaves each rank its own statistics, as DDP's opt-out does."""

from __future__ import annotations

import inspect

import pytest
import torch
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.errors import ConfigurationError
from torchloom.strategies import FSDP2Strategy, FSDPStrategy, ModelParallelStrategy

D, BATCH, STEPS, ACCUM = 4, 6, 3, 2
STRATEGIES = ("fsdp", "fsdp2", "model_parallel")


class Net(nn.Module):
    """A block (the unit) between a plain input layer and a BatchNorm'd head (leftovers)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.block = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.bn = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.block(self.inp(x))))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """Per step, micro-batch and rank: each rank its own data, with its own scale, so the statistics differ."""
    g = torch.Generator().manual_seed(5)
    scale = torch.tensor([1.0, 3.0]).view(1, 1, 2, 1, 1)
    x = torch.randn(STEPS, ACCUM, 2, BATCH, D, generator=g) * scale + scale
    return x, torch.randn(STEPS, ACCUM, 2, BATCH, 1, generator=g)


def _train(model, rank: int, no_sync, backward) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    for step in range(STEPS):
        for micro in range(ACCUM):
            with no_sync(micro < ACCUM - 1):
                loss = nn.functional.mse_loss(model(x[step, micro, rank]), y[step, micro, rank])
                backward(loss)
        opt.step()
        opt.zero_grad()


def _stats(model) -> dict[str, torch.Tensor]:
    return {
        "running_mean": model.bn.running_mean.clone(),
        "running_var": model.bn.running_var.clone(),
        "batches": model.bn.num_batches_tracked.clone(),
    }


def _evaluate(model, inner: nn.Module, rank: int) -> dict:
    """An evaluation forward through `model`: under DDP's rule it starts with rank 0's buffers (the previous
    forward trained). The statistics are read from `inner`, the user's module; "broadcasts" counts the
    broadcasts the forward made."""
    import torch.distributed as dist

    calls = []
    broadcast = dist.broadcast

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return broadcast(*args, **kwargs)

    model.eval()
    dist.broadcast = counting
    try:
        with torch.no_grad():
            model(data()[0][0, 0, rank])
    finally:
        dist.broadcast = broadcast
    model.train()
    return {**_stats(inner), "broadcasts": len(calls)}


def _ddp(rank: int, sync: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    if sync:
        opt_out = {}
    elif "forward_sync_buffers" in inspect.signature(DDP).parameters:
        opt_out = {"forward_sync_buffers": False}
    else:
        opt_out = {"broadcast_buffers": False}  # its name before torch 2.13
    model = DDP(Net(), **opt_out)

    def no_sync(active: bool):
        return model.no_sync() if active else torch.enable_grad()

    _train(model, rank, no_sync, lambda loss: loss.backward())
    trained = _stats(model.module)
    return {"trained": trained, "evaluated": _evaluate(model, model.module, rank)}


def _loom(kind: str, sync: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    def parallelize(model, device_mesh):
        fully_shard(model.block, mesh=device_mesh["data_parallel"])
        return model

    if kind == "fsdp":
        strategy = FSDPStrategy(forward_sync_buffers=sync)
    elif kind == "fsdp2":
        strategy = FSDP2Strategy(forward_sync_buffers=sync)
    else:
        strategy = ModelParallelStrategy(parallelize, 2, 1, forward_sync_buffers=sync)
    loom = Loom(accelerator="cpu", devices=2, strategy=strategy)
    loom.launch()
    torch.manual_seed(0)
    model = Net()
    if kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model.block = FSDP(model.block, device_id=loom.device, use_orig_params=True)
    elif kind == "fsdp2":
        fully_shard(model.block)
    model = loom.setup_module(model)

    def no_sync(active: bool):
        return loom.no_backward_sync(model, enabled=active)

    _train(model, loom.global_rank, no_sync, loom.backward)
    trained = _stats(model.module)
    return {"trained": trained, "evaluated": _evaluate(model, model.module, loom.global_rank)}


def _body(rank: int, world_size: int) -> dict:
    out = {}
    for kind in STRATEGIES:
        out[kind] = _loom(kind, True)
        out[f"{kind}_opt_out"] = _loom(kind, False)
    # In the process group the Looms started.
    out["ddp"], out["ddp_opt_out"] = _ddp(rank, True), _ddp(rank, False)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 2, timeout=240)


def _assert_same(got: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        if name == "broadcasts":
            continue
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=0, msg=f"{what}: {name}")


@pytest.mark.parametrize("kind", STRATEGIES)
def test_leftover_buffers_follow_ddp_rank_by_rank(results, kind):
    for rank, out in enumerate(results):
        # After the last training forward each rank holds its own update (as under DDP), which the next
        # forward replaces by rank 0's: identical on every rank.
        _assert_same(out[kind]["trained"], out["ddp"]["trained"], f"{kind} rank {rank} trained")
        _assert_same(out[kind]["evaluated"], out["ddp"]["evaluated"], f"{kind} rank {rank} evaluated")
        _assert_same(out[kind]["evaluated"], results[0][kind]["evaluated"], f"{kind} rank {rank} vs rank 0")
        # One broadcast carries the float statistics and the int64 batch count together.
        assert out[kind]["evaluated"]["broadcasts"] == 1
    # The data differ: without the broadcast the ranks' statistics would too.
    spread = (
        results[0]["ddp"]["trained"]["running_mean"] - results[1]["ddp"]["trained"]["running_mean"]
    ).abs()
    assert spread.max() > 0.01


@pytest.mark.parametrize("kind", STRATEGIES)
def test_opting_out_leaves_each_rank_its_own_statistics(results, kind):
    for rank, out in enumerate(results):
        _assert_same(
            out[f"{kind}_opt_out"]["evaluated"], out["ddp_opt_out"]["evaluated"], f"{kind} rank {rank}"
        )
    assert all(out[f"{kind}_opt_out"]["evaluated"]["broadcasts"] == 0 for out in results)
    mean = [out[f"{kind}_opt_out"]["evaluated"]["running_mean"] for out in results]
    assert (mean[0] - mean[1]).abs().max() > 0.01


def test_forward_sync_buffers_must_be_a_bool():
    with pytest.raises(ConfigurationError, match="forward_sync_buffers"):
        FSDP2Strategy(forward_sync_buffers="yes")
