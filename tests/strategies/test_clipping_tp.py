"""Clipping under tensor parallel with a sequence-parallel plan (ModelParallelStrategy, dp 1 x tp 2, 2 CPU ranks).

`SequenceParallel` norms keep Replicate weights, but each tensor-parallel rank computes their gradient from its own
share of the sequence: the gradients reach `clip_gradients` as `Partial(sum)` DTensors, whose local pieces are
addends, not the gradient. And a `RowwiseParallel` embedding gets a Replicate gradient on its row-sharded weight.
The norm and the clamp must read the gradients' placements and reduce the pending sums first; the result is
compared with one process training on the same global batch with torch's own `clip_grad_norm_` /
`clip_grad_value_`.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.strategies import ModelParallelStrategy

VOCAB, DIM, SEQ = 16, 8, 4  # the sequence splits over the 2 tensor-parallel ranks
STEPS, ACCUM, BATCH = 4, 2, 4
CLIP_VALUE = 0.01


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sequence_parallel(model: nn.Module, device_mesh, sequence: bool = True) -> nn.Module:
    """torchtitan's layout: activations between the layers are split along the sequence (dim 1); the norms run
    on sequence shards (`SequenceParallel`), the linear layers gather them (Colwise) and scatter back (Rowwise).
    `sequence=False`: plain tensor parallel, whole sequences everywhere, the norms left plain (replicated).
    `model` is a `Net`, or a pipeline stage holding some of its modules (`blocks` a ModuleDict, the others None
    where another stage holds them)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = device_mesh["tensor_parallel"]
    if sequence:
        top = {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        inner = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        top = {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        }
        inner = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    top = {name: style for name, style in top.items() if getattr(model, name, None) is not None}
    if top:
        parallelize_module(model, tp, top)
    blocks = model.blocks
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        parallelize_module(block, tp, inner)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (STEPS, ACCUM, BATCH, SEQ)
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / ACCUM


def make_optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


# (clip, optimizer, norm type, max norm): each max norm below every step's norm, so clipping acts on every step.
CASES = (("norm", "adam", 2.0, 0.5), ("norm", "sgd", 1.0, 1.0), ("value", "sgd", None, None))
# Plain tensor parallel (no sequence parallel): the embedding's gradient alone is not placed as its weight.
PLAIN_TP = ("norm", "adam", 2.0, 0.5)


def reference(clip: str, kind: str, norm_type: float | None, max_norm: float | None) -> dict:
    """One process on the global batch, torch's own clipping; the clipped gradients of the first step too."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(model.parameters(), kind)
    x, y = data()
    norms, first_grads = [], {}
    for step in range(STEPS):
        for micro in range(ACCUM):
            loss_of(model(x[step, micro]), y[step, micro]).backward()
        if clip == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "grads": first_grads}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _body(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    out: dict = {}
    x, y = data()
    for sequence, (clip, kind, norm_type, max_norm) in [*((True, case) for case in CASES), (False, PLAIN_TP)]:
        plan = functools.partial(sequence_parallel, sequence=sequence)
        strategy = ModelParallelStrategy(plan, data_parallel_size=1, tensor_parallel_size=2)
        loom = Loom(strategy=strategy, accelerator="cpu", devices=world_size)
        loom.launch()
        torch.manual_seed(0)
        model = loom.setup_module(Net())
        opt = loom.setup_optimizers(make_optimizer(model.parameters(), kind))
        norms, placements, grads = [], {}, {}
        for step in range(STEPS):
            for micro in range(ACCUM):
                with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                    loom.backward(loss_of(model(x[step, micro]), y[step, micro]))
            if step == 0:
                placements = {
                    n: (tuple(map(repr, p.placements)), tuple(map(repr, p.grad.placements)))
                    for n, p in model.module.named_parameters()
                    if isinstance(p.grad, DTensor)
                }
            if clip == "norm":
                norms.append(float(loom.clip_gradients(model, opt, max_norm=max_norm, norm_type=norm_type)))
            else:
                loom.clip_gradients(model, opt, clip_val=CLIP_VALUE)
            if step == 0:
                # What the optimizer is handed: the clipped gradients, as whole tensors.
                grads = {n: _full(p.grad) for n, p in model.module.named_parameters()}
            opt.step()
            opt.zero_grad()
        params = {n: _full(p) for n, p in model.module.named_parameters()}
        result = {"params": params, "norms": norms, "grads": grads, "placements": placements}
        out[sequence, clip, kind] = result
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 2, timeout=300)


def _assert_parity(got: dict, expected: dict, max_norm: float | None, rank: int) -> None:
    if max_norm is not None:
        assert min(expected["norms"]) > max_norm  # clipping acts on every step
        torch.testing.assert_close(
            torch.tensor(got["norms"]), torch.tensor(expected["norms"]), atol=1e-5, rtol=1e-5
        )
    for name, value in expected["grads"].items():
        torch.testing.assert_close(
            got["grads"][name], value, atol=1e-6, rtol=1e-5, msg=f"rank {rank} gradient {name}"
        )
    for name, value in expected["params"].items():
        torch.testing.assert_close(
            got["params"][name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}"
        )


@pytest.mark.parametrize(
    ("clip", "kind", "norm_type", "max_norm"), CASES, ids=["norm2-adam", "norm1-sgd", "value-sgd"]
)
def test_clipping_reduces_pending_partial_gradients(results, clip, kind, norm_type, max_norm):
    expected = reference(clip, kind, norm_type, max_norm)
    for rank, result in enumerate(results):
        got = result[True, clip, kind]
        # The case under test: the sequence-parallel norms' gradients are pending sums when clipping starts.
        for name in ("norm.weight", "blocks.0.norm.bias"):
            assert got["placements"][name] == (("Replicate()",), ("Partial(sum)",)), got["placements"]
        _assert_parity(got, expected, max_norm if clip == "norm" else None, rank)


def test_norm_reads_the_gradients_placements_not_the_parameters(results):
    """A `RowwiseParallel` embedding's weight is split by rows, its gradient is whole on every rank: counted once
    (counted on each rank, as the weight's placement says, the norm came out 0.008-0.012 too large)."""
    clip, kind, norm_type, max_norm = PLAIN_TP
    expected = reference(clip, kind, norm_type, max_norm)  # one process: no plan
    for rank, result in enumerate(results):
        got = result[False, clip, kind]
        assert got["placements"]["embed.weight"] == (("Shard(dim=0)",), ("Replicate()",)), got["placements"]
        _assert_parity(got, expected, max_norm, rank)
