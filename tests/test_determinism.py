"""Two runs with the same seed and world size are bit-identical on CPU: every loss and every final parameter.

Each run is its own launch of two gloo ranks (fresh processes, fresh process group). It trains with DDP, then
with FSDP2 over hand-made units with replicated leftovers, through everything that draws random numbers or
reduces across ranks: seeded initialisation, dropout, a shuffled distributed sampler, gradient accumulation
under `no_backward_sync`, global-norm clipping and AdamW.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_models import full_state
from harness import run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchloom import Loom

pytestmark = pytest.mark.timeout(120)

SEED = 1234
WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _train(
    strategy: str, seed: int, world_size: int
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Seed, build, train; this rank's losses, the full final parameters, and this rank's own copies of the
    parameters every rank holds whole (all of them under DDP, the replicated leftovers under FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    loom.seed_everything(seed)
    model = Model()
    if strategy == "fsdp2":
        for block in model.blocks:
            fully_shard(block)  # hand-made units; embed and head stay replicated leftovers
    model = loom.setup_module(model)
    optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.randn(64, 6, generator=torch.Generator().manual_seed(7))
    targets = data.sum(dim=1, keepdim=True).sin()
    loader = loom.setup_dataloaders(DataLoader(TensorDataset(data, targets), batch_size=4, shuffle=True))
    losses = []
    for _epoch in range(2):
        for i, (x, y) in enumerate(loader):
            last_micro = i % 2 == 1
            with loom.no_backward_sync(model, enabled=not last_micro):
                loss = nn.functional.mse_loss(model(x), y)
                loom.backward(loss / 2)
            losses.append(loss.item())
            if last_micro:
                loom.clip_gradients(model, optimizer, max_norm=0.5)
                optimizer.step()
                optimizer.zero_grad()
    own = {n: p.detach().clone() for n, p in model.named_parameters() if not hasattr(p, "to_local")}
    return losses, full_state(model), own


def _runs(rank: int, world_size: int) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    out: dict[str, Any] = {name: _train(name, SEED, world_size) for name in ("ddp", "fsdp2")}
    out["ddp, another seed"] = _train("ddp", SEED + 1, world_size)
    return out


@pytest.fixture(scope="module")
def two_runs() -> list[list[dict[str, Any]]]:
    return [run_ranks(_runs, 2, timeout=100) for _ in range(2)]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, f"{what}: parameters differ: {different}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_same_seed_and_world_size_give_bit_identical_runs(
    strategy: str, two_runs: list[list[dict[str, Any]]]
) -> None:
    first, second = two_runs
    for rank in range(2):
        losses_1, params_1, _ = first[rank][strategy]
        losses_2, params_2, _ = second[rank][strategy]
        assert len(losses_1) == 16
        assert losses_1 == losses_2, f"rank {rank}: losses differ between two runs"
        _assert_same(params_1, params_2, f"rank {rank}, run 1 vs run 2")
    # Within a run the ranks' own copies of what they all hold whole agree (gathered sharded parameters would
    # agree by construction), and each rank trained on its own half of the data.
    own_0, own_1 = first[0][strategy][2], first[1][strategy][2]
    assert set(own_0) >= {"embed.weight", "head.weight"}, sorted(own_0)
    _assert_same(own_0, own_1, "rank 0 vs rank 1")
    assert first[0][strategy][0] != first[1][strategy][0]


def test_the_seed_decides_the_run(two_runs: list[list[dict[str, Any]]]) -> None:
    """The comparison above is not vacuous: another seed changes every loss and the parameters."""
    run = two_runs[0][0]
    same_seed, other_seed = run["ddp"], run["ddp, another seed"]
    assert all(a != b for a, b in zip(same_seed[0], other_seed[0], strict=True))
    assert not torch.equal(same_seed[1]["embed.weight"], other_seed[1]["embed.weight"])
