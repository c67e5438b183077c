"""Models, layouts and the single-process reference shared by the FSDP tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp.wrap import wrap

D_IN, D, N_BLOCKS = 6, 16, 3
STEPS, ACCUM, MICRO = 5, 2, 8  # optimizer steps, micro-batches per step, global micro-batch size
MAX_NORM = 0.5


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """An input projection and a head around blocks; `wrap()` is a no-op outside `loom.init_module()`."""

    def __init__(self, wrap_blocks: bool = False, wrap_all: bool = False) -> None:
        super().__init__()
        maybe = wrap if (wrap_blocks or wrap_all) else (lambda m: m)
        edge = wrap if wrap_all else (lambda m: m)
        self.embed = edge(nn.Linear(D_IN, D))
        self.blocks = nn.ModuleList(maybe(Block()) for _ in range(N_BLOCKS))
        self.head = edge(nn.Linear(D, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def torch_built_model() -> nn.Module:
    """A model made only of PyTorch's own modules (no torchloom or test classes)."""
    return nn.Sequential(
        nn.Linear(D_IN, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 1)
    )


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS, ACCUM, MICRO, D_IN, generator=g)
    y = torch.randn(STEPS, ACCUM, MICRO, 1, generator=g)
    return x, y


def reference(
    make_model, optimizer_cls=torch.optim.Adam, lr: float = 1e-2, autocast: torch.dtype | None = None
):
    """One process training on the whole global batch: final parameters and the norm before each clip."""
    import contextlib

    torch.manual_seed(0)
    model = make_model()
    opt = optimizer_cls(model.parameters(), lr=lr)
    x, y = data()
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                out = model(x[step, micro])
            loss = nn.functional.mse_loss(out.float(), y[step, micro]) / ACCUM
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train(loom, model, opt, loss=None, max_norm=MAX_NORM):
    """The distributed loop: each rank takes its slice of every global micro-batch (moved to `loom.device`).
    `loss(output, target)` is the micro-batch's loss (default: MSE / ACCUM). Returns the norm before each clip."""
    loss = loss or (lambda out, target: nn.functional.mse_loss(out, target) / ACCUM)
    x, y = data()
    rank, per = loom.global_rank, MICRO // loom.world_size
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            xs = x[step, micro, rank * per : (rank + 1) * per].to(loom.device)
            ys = y[step, micro, rank * per : (rank + 1) * per].to(loom.device)
            with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loom.backward(loss(model(xs), ys))
        norms.append(float(loom.clip_gradients(model, opt, max_norm=max_norm)))
        opt.step()
        opt.zero_grad()
    return norms


def full_state(model) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters, by PyTorch's own state-dict API, under the original names."""
    module = model.forward_module
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def build_layout(loom, flavour: str, layout: str, seed: int = 0) -> nn.Module:
    """The model as each layout's user would build it (seed 0: the reference's initialisation)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    if layout == "torch_built":
        model = torch_built_model()
        for i in (2, 4):  # PyTorch's own APIs, called directly: two non-root units, leftovers around them
            model[i] = (
                FSDP(model[i], device_id=loom.device, use_orig_params=True) if flavour == "fsdp" else model[i]
            )
            if flavour == "fsdp2":
                fully_shard(model[i])
        return model
    if layout == "wrapped_root":
        return Net()
    everything = layout == "units_no_root"
    if flavour == "fsdp":
        with loom.init_module():
            return Net(wrap_blocks=True, wrap_all=everything)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    if everything:
        fully_shard(model.embed)
        fully_shard(model.head)
    return model


def layout_strategy(flavour: str, layout: str, **options):
    """The strategy each layout's user would pick: a policy where torchloom makes the units, none otherwise."""
    from torchloom.strategies import FSDP2Strategy, FSDPStrategy

    cls = FSDPStrategy if flavour == "fsdp" else FSDP2Strategy
    if layout == "wrapped_root":
        policy = {"auto_wrap_policy": {Block}} if flavour == "fsdp" else {"shard_policy": {Block}}
        return cls(**policy, **options)
    return cls(unsharded_params="shard" if layout == "leftovers_sharded" else "replicate", **options)
