"""The 2-process job of the install check (tests/install/install_check.sh): what a user's first script does,
run from outside the source tree against torchloom installed without extras, so that a runtime dependency
missing from pyproject.toml fails here. Run as `python job.py OUT_DIR`: `loom.launch()` starts the second rank.

It covers the paths that reach PyTorch's object collectives (which need numpy) and DCP: FSDP2 with units made by
hand and a replicated head, a distributed data loader, accumulation, clipping, a sharded and a full checkpoint,
each saved and loaded back into a fresh model, and `loom.broadcast` of a Python object.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from torchloom import Loom
from torchloom.strategies import FSDP2Strategy


def build(loom: Loom, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)]
    model = nn.Sequential(nn.Linear(4, 16), *blocks, nn.Linear(16, 1))
    for block in blocks:
        # units made by hand; the first and last Linear stay replicated
        fully_shard(block, **loom.strategy.unit_kwargs())
    model = loom.setup_module(model)
    return model, loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter (its shard for a DTensor), copied."""
    return {
        k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def check_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    differing = sorted(k for k in expected if not torch.equal(expected[k], got[k]))
    if differing:
        raise SystemExit(f"{what}: parameters differ after loading: {differing}")


def main(out: Path) -> None:
    loom = Loom(accelerator="cpu", devices=2, strategy=FSDP2Strategy(state_dict_type="sharded"))
    loom.launch()
    loom.seed_everything(0)
    model, optimizer = build(loom, seed=0)
    x = torch.randn(64, 4)
    loader = loom.setup_dataloaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    for i, (xb, yb) in enumerate(loader):
        with loom.no_backward_sync(model, enabled=i % 2 == 0):
            loom.backward(F.mse_loss(model(xb), yb) / 2)
        if i % 2 == 1:
            loom.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    ranks = loom.all_gather(loom.global_rank)
    assert ranks.tolist() == [0, 1], ranks
    assert loom.broadcast({"from": loom.global_rank}) == {"from": 0}  # an object collective
    trained = local_state(model)

    loom.save(out / "sharded", {"model": model, "optimizer": optimizer, "step": i})
    fresh, fresh_opt = build(loom, seed=1)
    left = loom.load(out / "sharded", {"model": fresh, "optimizer": fresh_opt})
    check_same(trained, local_state(fresh), "sharded checkpoint")
    assert left == {"step": i}, left

    full = Loom(accelerator="cpu", devices=2, strategy=FSDP2Strategy(state_dict_type="full"))
    full.launch()
    model_b, opt_b = build(full, seed=2)
    full.load(out / "sharded", {"model": model_b, "optimizer": opt_b})
    full.save(out / "full.pt", {"model": model_b, "optimizer": opt_b})
    model_c, opt_c = build(full, seed=3)
    full.load(out / "full.pt", {"model": model_c, "optimizer": opt_c})
    check_same(trained, local_state(model_c), "full checkpoint")
    loom.print(
        f"install check job: {loom.world_size} ranks, {i + 1} micro-batches, both checkpoint formats: ok"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
