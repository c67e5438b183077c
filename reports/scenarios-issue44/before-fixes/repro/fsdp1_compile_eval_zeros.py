"""strategy='fsdp', a torch.compile'd model, zero_grad(set_to_none=False), then loom.evaluate (a no_grad forward):
dynamo raises 'attempting to assign a gradient of size [..] to a tensor of size [..]'."""
import torch
from torch import nn
from torchloom import Loom
from torchloom.strategies import FSDPStrategy
from torchloom.testing import run_ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(self.norm(x))


def body(rank, world):
    loom = Loom(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    loom.launch()
    with loom.init_module():
        net = nn.Sequential(nn.Linear(8, 8), Block(), Block(), nn.Linear(8, 8))
    model = loom.setup_module(torch.compile(net, backend="aot_eager"))
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        loom.forward_backward(model, torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
        opt.step()
        opt.zero_grad(set_to_none=False)
    model.eval()
    return float(loom.evaluate(model, torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss))


if __name__ == "__main__":
    print(run_ranks(body, world_size=2))
