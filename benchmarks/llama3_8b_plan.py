"""Llama 3.1 8B trained as torchtitan's published FSDP benchmark trains it (pytorch/torchtitan,
benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3, torchtitan 9dec370): written from torchloom's docs,
for planning its memory before renting the GPUs.

    torchloom plan benchmarks/llama3_8b_plan.py --devices 8 --device-memory 96GiB              # Table 1
    torchloom plan benchmarks/llama3_8b_plan.py --devices 8 --num-nodes 16 --device-memory 96GiB

The recipe, as torchtitan's `parallelize_llama.py`, `train.py` and `train_configs/llama3_8b.toml` had it then:
`fully_shard` on every transformer block (the last one not resharded after forward) and on the root (not
resharded after forward: the FSDP2 of December 2024 never resharded the root; today's must be told), parameters
in bf16 and gradients reduced in fp32, torchtitan's op-level selective activation checkpointing (`_save_list`:
every matmul but every second one, flash/efficient attention, reduce-scatter), the loss over fp32 logits,
gradient clipping at 1.0 (foreach) and AdamW (foreach; lr 3e-4, betas (0.9, 0.95), weight decay 0.1). Local batch
2 x 8192 tokens. Its figure is `torch.cuda.max_memory_reserved()` on 96 GB H100s (Grand Teton).

`--layers N` (default 32) and `--steps` make smaller runs of the same recipe (the GPU check runs 1 layer).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchloom import Loom


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:  # what `init_module(empty_init=True)` calls on each rank's shard
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_table(head_dim: int, length: int, theta: float = 500000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(length, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)  # complex64


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * table.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = rotate(q, table), rotate(k, table)
        repeat = self.heads // self.kv_heads  # grouped-query attention: each kv head serves `repeat` heads
        k = k.unsqueeze(3).expand(b, s, self.kv_heads, repeat, self.head_dim).reshape(b, s, -1, self.head_dim)
        v = v.unsqueeze(3).expand(b, s, self.kv_heads, repeat, self.head_dim).reshape(b, s, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


_SAVE = {  # torchtitan's `_save_list` (parallelize_llama.py)
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
}


def _selective_policy() -> object:
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: object, func: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"  # type: ignore[attr-defined]
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
        save = func in _SAVE and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def _forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return checkpoint(
            self._forward,
            x,
            table,
            use_reentrant=False,
            context_fn=_selective_policy,
            preserve_rng_state=False,
        )


class Llama(nn.Module):
    def __init__(
        self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int, seq: int
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.head_dim, self.seq = dim // heads, seq
        self.register_buffer("table", rope_table(self.head_dim, seq), persistent=False)

    def reset_parameters(self) -> None:  # the rotary table, a buffer made on the meta device
        self.table.copy_(rope_table(self.head_dim, self.seq).to(self.table.device))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.table)
        return self.output(self.norm(h))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the same recipe on a small Llama (tests)")
    parser.add_argument("--out", help="write the run's max_memory_allocated/reserved here (JSON; on a GPU)")
    args = parser.parse_args()
    # vocabulary, width, heads, key/value heads, feed-forward width: Llama 3.1 8B's, or a small one
    vocab, dim, heads, kv_heads, hidden = (512, 256, 4, 2, 512) if args.tiny else (128256, 4096, 32, 8, 14336)

    loom = Loom(accelerator="cuda", strategy="fsdp2", precision="bf16-mixed")
    loom.launch()
    with loom.init_module(empty_init=True):
        model = Llama(vocab, dim, args.layers, heads, kv_heads, hidden, args.seq)
    kwargs = loom.strategy.unit_kwargs()
    for i, block in enumerate(model.layers):
        # torchtitan: the last block stays gathered after forward (its backward comes at once)
        fully_shard(block, **{**kwargs, "reshard_after_forward": i < len(model.layers) - 1})
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    model = loom.setup_module(model)
    optimizer = loom.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    )
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), device=loom.device)
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
        del logits  # torchtitan frees the bf16 logits before backward
        loom.backward(loss)
        loom.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
    if (
        args.out and loom.global_rank == 0
    ):  # what torchtitan logs (`max_memory_reserved`), and the allocated peak
        import json

        with open(args.out, "w") as f:
            json.dump(
                {
                    "max_memory_allocated": torch.cuda.max_memory_allocated(),
                    "max_memory_reserved": torch.cuda.max_memory_reserved(),
                    "device": torch.cuda.get_device_name(),
                    "total_memory": torch.cuda.get_device_properties(0).total_memory,
                },
                f,
            )


if __name__ == "__main__":
    main()
