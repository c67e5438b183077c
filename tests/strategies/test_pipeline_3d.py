"""PipelineStrategy in 3-D, pp 2 x tp 2 x dp 2 on 8 CPU ranks (gloo), with a Llama-style model (RMSNorm, rotary
attention, SwiGLU): interleaved 1F1B (2 stages per rank), a tensor-parallel plan, activation checkpointing and
`fully_shard` per block, gradient accumulation under `no_backward_sync`, a global-norm clip and AdamW give one
process's losses on the global batch (fp32, 1e-5); the checkpoint saved there resumes at pp 1 x tp 2 x dp 4 to
the uninterrupted run's losses; a model built on the meta device trains to finite losses.

One launched group of 8 ranks holds every check: starting ranks is the cost (docs/testing.md). The 1F1B schedule
without accumulation is the docs' example (docs/model-parallel.md, run by tests/test_docs.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.strategies import PipelineStrategy

DIM, HEADS, VOCAB, SEQ, LAYERS = 16, 4, 32, 4, 4
STEPS, ACCUM, GLOBAL, MICRO = 4, 2, 8, 2
TOL = 1e-5


def _rope(x: torch.Tensor) -> torch.Tensor:
    t, d = x.shape[-2], x.shape[-1]
    angle = torch.outer(
        torch.arange(t, dtype=x.dtype), 10000.0 ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    )
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack(
        (x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()), -1
    ).flatten(-2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class Stage(nn.Module):
    """The split_fn: the model's own modules of one stage, at their paths in the model."""

    def __init__(self, model: Llama, index: int, num_stages: int) -> None:
        super().__init__()
        per = LAYERS // num_stages
        self.embed = model.embed if index == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(index * per, (index + 1) * per)})
        last = index == num_stages - 1
        self.norm, self.head = (model.norm, model.head) if last else (None, None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.embed(h) if self.embed is not None else h
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


def parallelize(stage: nn.Module, device_mesh) -> nn.Module:
    """Tensor parallel, then activation checkpointing, then one FSDP2 unit per block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"q": col, "k": col, "v": col, "o": row, "gate": col, "up": col, "down": row}
    for name, block in list(stage.layers.items()):
        parallelize_module(block, device_mesh["tensor_parallel"], plan)
        block = checkpoint_wrapper(block)
        fully_shard(block, mesh=device_mesh["data_parallel"])
        stage.layers[name] = block
    return stage


def data() -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (STEPS, ACCUM, GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(3)
    )


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) / ACCUM


def reference() -> list[float]:
    torch.manual_seed(0)
    model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, losses = data(), []
    for step in range(STEPS):
        for micro in range(ACCUM):
            loss = loss_fn(model(tokens[step, micro, :, :-1]), tokens[step, micro, :, 1:])
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses


def _loom(world: int, pp: int, dp: int, **kwargs) -> Loom:
    strategy = PipelineStrategy(
        parallelize,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        tensor_parallel_size=2,
        split_fn=Stage,
        n_microbatches=MICRO,
        **kwargs,
    )
    loom = Loom(strategy=strategy, accelerator="cpu", devices=world)
    loom.launch()
    return loom


def _train(loom: Loom, model, opt, steps: range) -> list[float]:
    """The user's loop; the losses returned are the global batch's (the mean over the data-parallel ranks)."""
    split = loom.strategy.distributed_sampler_kwargs
    per = GLOBAL // split["num_replicas"]
    rows = slice(split["rank"] * per, (split["rank"] + 1) * per)
    tokens, losses = data(), []
    for step in steps:
        for micro in range(ACCUM):
            batch = tokens[step, micro, rows]
            with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = loom.forward_backward(model, batch[:, :-1], batch[:, 1:], loss_fn)
            losses.append(loom.all_reduce(loss, reduce_op="mean").item())
        loom.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
    return losses


def _setup(loom: Loom, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = loom.setup_module(model)
    return model, loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _body(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    loom = _loom(world, pp=2, dp=2, schedule="interleaved_1f1b", stages_per_rank=2)
    torch.manual_seed(0)
    model, opt = _setup(loom, Llama())
    out["3d"] = _train(loom, model, opt, range(2))
    q = next(p for n, p in model.named_parameters() if n.endswith(".q.weight"))
    out["q_mesh"] = q.device_mesh.mesh_dim_names
    loom.save(f"{tmp}/ckpt", {"model": model, "opt": opt})
    loom = _loom(world, pp=1, dp=4)
    torch.manual_seed(0)
    model, opt = _setup(loom, Llama())
    loom.load(f"{tmp}/ckpt", {"model": model, "opt": opt})
    out["resumed"] = _train(loom, model, opt, range(2, STEPS))
    loom = _loom(world, pp=2, dp=2)
    with loom.init_module(empty_init=True):
        meta = Llama()
    model, opt = _setup(loom, meta)
    out["meta"] = _train(loom, model, opt, range(1))
    return out


# 8 ranks on 2 cores: ~25 s at load 12; the rank group's own timeout (400 s) ends it first, with stacks.
@pytest.mark.timeout(450)
def test_pp2_tp2_dp2_interleaved_checkpointed_and_resumed_elsewhere(tmp_path) -> None:
    expected = reference()
    results = run_ranks(_body, 8, str(tmp_path), timeout=400)
    for r in results:
        assert r["3d"] == pytest.approx(expected[: 2 * ACCUM], abs=TOL)
        assert r["resumed"] == pytest.approx(expected[2 * ACCUM :], abs=TOL)
        assert r["q_mesh"] == ("data_parallel", "tensor_parallel")
        assert all(math.isfinite(x) for x in r["meta"])
