"""PipelineStrategy: a frozen parameter in a fully_shard unit of its own; loom.save refuses the optimizer on one
rank while the other waits for the collective timeout."""
import sys
import tempfile
from datetime import timedelta

import torch
from torch import nn
from torchloom import Loom
from torchloom.strategies import PipelineStrategy
from torchloom.testing import run_ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.emb.requires_grad_(False)  # frozen
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(self.emb(x)))


def body(rank, world, path):
    holder = []

    def parallelize(stage, mesh):
        from torch.distributed.fsdp import fully_shard

        for child in stage.children():
            fully_shard(child, **holder[0].unit_kwargs())
        return stage

    holder.append(PipelineStrategy(parallelize, pipeline_parallel_size=2, split_points=["a"],
                                   example_input=torch.zeros(2, 8), schedule="gpipe", n_microbatches=2))
    loom = Loom(accelerator="cpu", devices=2, strategy=holder[0], timeout=timedelta(seconds=20))
    loom.launch()
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loom.forward_backward(model, torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
    opt.step()
    loom.save(path, {"model": model, "opt": opt})
    return "saved"


if __name__ == "__main__":
    print(run_ranks(body, tempfile.mkdtemp() + "/ck", world_size=2))
