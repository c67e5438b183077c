"""A pipeline stage whose output is non-contiguous (a transpose, as around a BatchNorm1d over the features)."""
import torch
from torch import nn
from torchloom import Loom
from torchloom.strategies import PipelineStrategy
from torchloom.testing import run_ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):  # x: (batch, seq, 8)
        return self.b(self.a(x).transpose(1, 2).transpose(1, 2).transpose(1, 2)).sum(-1)


def body(rank, world):
    loom = Loom(accelerator="cpu", devices=2, strategy=PipelineStrategy(
        pipeline_parallel_size=2, split_points=["b"], example_input=torch.zeros(4, 8, 8), schedule="gpipe",
        n_microbatches=1))
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    loss = loom.forward_backward(model, torch.randn(4, 8, 8), torch.randn(4, 8), nn.functional.mse_loss)
    return float(loss)


if __name__ == "__main__":
    print(run_ranks(body, world_size=2))
