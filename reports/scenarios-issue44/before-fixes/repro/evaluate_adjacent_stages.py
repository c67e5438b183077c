"""loom.evaluate under interleaved_1f1b at pipeline degree 1 (stages 0 and 1 on one rank): torch's AssertionError
"can't steal_bwd_input if this stage doesn't have backward" (PipelineStrategy names this only for zbv)."""
import torch
from torch import nn
from torchloom import Loom
from torchloom.strategies import PipelineStrategy
from torchloom.testing import run_ranks


def body(rank, world):
    loom = Loom(accelerator="cpu", devices=1, strategy=PipelineStrategy(
        pipeline_parallel_size=1, split_points=["1"], example_input=torch.zeros(2, 8),
        schedule="interleaved_1f1b", stages_per_rank=2, n_microbatches=2))
    loom.launch()
    model = loom.setup_module(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    loom.forward_backward(model, torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
    model.zero_grad(set_to_none=True)
    return float(loom.evaluate(model, torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss))


if __name__ == "__main__":
    print(run_ranks(body, world_size=1))
