"""PipelineStrategy, one stage holding both ends of a tied weight, model built with init_module(empty_init=True):
after setup the tie is broken (two tensors, trained apart, silently). Without empty_init the tie holds."""
import torch
from torch import nn
from torchloom import Loom
from torchloom.strategies import PipelineStrategy
from torchloom.testing import run_ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


class Stage(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.emb, self.head = model.emb, model.head

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def body(rank, world, empty):
    loom = Loom(accelerator="cpu", devices=1, strategy=PipelineStrategy(
        pipeline_parallel_size=1, split_fn=lambda m, i, n: Stage(m), schedule="gpipe", n_microbatches=1))
    loom.launch()
    with loom.init_module(empty_init=empty):
        net = Net()
    model = loom.setup_module(net)
    params = dict(model.named_parameters(remove_duplicate=False))
    return params["emb.weight"] is params["head.weight"]


if __name__ == "__main__":
    print("tied after setup, empty_init=False:", run_ranks(body, False, world_size=1))
    print("tied after setup, empty_init=True: ", run_ranks(body, True, world_size=1))
