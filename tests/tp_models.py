"""A tiny Hugging Face Llama and its tensor-parallel plan (torchtitan's style), shared by the model-parallel
tests and the step-overhead benchmark.

`parallelize_llama(model, device_mesh)` is the user's `parallelize_fn` for `ModelParallelStrategy`: per decoder
layer, Megatron-style tensor parallelism over the mesh's "tensor_parallel" dimension (q/k/v and the MLP's
gate/up split by output features, o and down by input features, so each layer needs one all-reduce in its
attention and one in its MLP), then `fully_shard` of the layer over "data_parallel". The token embedding, the
final norm and the head stay plain: leftovers, which the strategy keeps identical on every rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

VOCAB = 96


def tiny_llama(seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 32) -> nn.Module:
    """A Llama built from a config, nothing downloaded: 4 query heads and 2 key/value heads (grouped-query
    attention), so a tensor-parallel size of 2 gives each rank 2 query heads and their 1 key/value head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=48 * hidden // 32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=64,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def tensor_parallel_llama(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every decoder layer's attention and MLP over `tp_mesh`.

    LlamaAttention (transformers >= 4.48) reshapes its projections with `view(..., -1, head_dim)`: a rank's
    local q/k/v hold its own heads, so no head count needs adjusting; `num_key_value_groups` (query heads per
    key/value head) is the same locally. The split must not cut a head, nor separate a query head from its
    key/value head: both head counts must divide by the tensor-parallel size."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config, tp = model.config, tp_mesh.size()
    if config.num_attention_heads % tp or config.num_key_value_heads % tp:
        raise ValueError(
            f"tensor-parallel size {tp} must divide the {config.num_attention_heads} attention heads and the "
            f"{config.num_key_value_heads} key/value heads"
        )
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)


def parallelize_llama(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """The `parallelize_fn`: tensor parallel inside every decoder layer, then each layer one FSDP2 unit over the
    data-parallel ranks. Embedding, final norm and head are left plain (leftovers)."""
    from torch.distributed.fsdp import fully_shard

    tensor_parallel_llama(model, device_mesh["tensor_parallel"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    return model
