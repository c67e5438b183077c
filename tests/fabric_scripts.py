"""Small training scripts written against Lightning Fabric's API, run unchanged through Fabric and through
torchloom (`Loom` imported as `Fabric`) by the differential tests in test_fabric_compat.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def make_fabric(kind: str, **kwargs: Any) -> Any:
    if kind == "fabric":
        from lightning.fabric import Fabric
    else:
        from torchloom import Loom as Fabric
    return Fabric(**kwargs)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(5, 16), nn.Tanh())
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x)).softmax(-1)


def training_script(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """DDP on 2 CPU ranks: training_step, clip_gradients with a positional clip value, collectives on numbers
    and nested collections, a marked method and all_gather with sync_grads."""
    fabric = make_fabric(kind, accelerator="cpu", devices=world_size, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(42)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(100 + fabric.global_rank)  # each rank its own data
    out: dict[str, Any] = {"losses": []}
    for step in range(4):
        x, y = torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
        loss = model.training_step((x, y))
        optimizer.zero_grad()
        fabric.backward(loss)
        if step % 2:
            fabric.clip_gradients(model, optimizer, 0.05)  # positional: clip_val in Fabric
        else:
            out[f"norm{step}"] = fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        out["losses"].append(fabric.all_reduce(loss.item()))  # a Python number
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.mark_forward_method("score")
    out["score"] = fabric.all_gather(model.score(torch.ones(2, 5)).detach())
    out["reduced"] = fabric.all_reduce(
        {"n": fabric.global_rank + 1, "v": [1.5 * fabric.global_rank, 2.0]}, reduce_op="sum"
    )
    out["max"] = fabric.all_reduce(float(fabric.global_rank), reduce_op=torch.distributed.ReduceOp.MAX)
    out["gathered"] = fabric.all_gather(
        {"loss": 0.25 * fabric.global_rank, "pair": (fabric.global_rank, 7.0)}
    )
    x = torch.tensor([1.0, 2.0]) * (fabric.global_rank + 1)
    x.requires_grad_(True)
    gathered = fabric.all_gather(x * x, sync_grads=True)
    (gathered * torch.arange(1.0, 5.0).view(2, 2)).sum().backward()
    out["sync_grads"] = (gathered.detach(), x.grad.clone())
    return out


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def loader_script(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """DDP on 2 CPU ranks: a shuffled DataLoader set up by the Fabric object feeds a model with dropout for two
    epochs. The same data order and the same dropout masks give the same losses: the random stream the loop
    sees must not depend on which library prepared the loader."""
    fabric = make_fabric(kind, accelerator="cpu", devices=world_size, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(7)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g)
    )
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    model = Dropper()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
    losses, seen = [], []
    for _ in range(2):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
            seen.append(y)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": torch.stack(losses), "labels": torch.cat(seen), "params": params}


class StepRecorder:
    """A callback keeping what the optimizer wrapper hands Fabric's `on_after_optimizer_step` hook."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        self.calls.append((strategy, optimizer))


def callback_script(kind: str) -> list[tuple[bool, bool]]:
    """One process: a callback's on_after_optimizer_step runs after every optimizer.step(), with the strategy and
    the user's own (unwrapped) optimizer."""
    recorder = StepRecorder()
    fabric = make_fabric(kind, accelerator="cpu", devices=1, callbacks=[recorder])
    torch.manual_seed(0)
    model = Classifier()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    for _ in range(3):
        loss = model(torch.ones(2, 5)).sum()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    return [(s is fabric.strategy, o is optimizer.optimizer) for s, o in recorder.calls]
