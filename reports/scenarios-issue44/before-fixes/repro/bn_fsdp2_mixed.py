"""BatchNorm inside a fully_shard unit, bf16-mixed: the first forward fails (FSDP2 casts its weight, not its
running statistics)."""
import torch
from torch import nn
from torchloom import Loom
from torchloom.testing import run_ranks


def body(rank, world):
    loom = Loom(accelerator="cpu", devices=world, strategy="fsdp2", precision="bf16-mixed")
    loom.launch()
    model = loom.setup_module(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))  # root unit
    return float(model(torch.randn(4, 8)).sum())


if __name__ == "__main__":
    print(run_ranks(body, world_size=1))
