"""`scaled_dot_product_attention` planned as the CUDA kernel the planned device runs.

On the plan's CPU tensors, `F.scaled_dot_product_attention` would run the CPU's kernel
(`_scaled_dot_product_flash_attention_for_cpu`), whose op a selective activation-checkpointing policy keyed on
CUDA's op names (torchtitan's `_save_list`) does not save. While a CUDA job is planned, the call goes to the CUDA
kernel's own op instead, chosen as torch's CUDA dispatch chooses it (aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp: flash, then memory-efficient, then math, each taken when its checks pass and
`torch.backends.cuda.*_sdp_enabled()` allows it): the op's fake kernel gives the shapes CUDA's returns (the
output and the logsumexp for flash and memory-efficient attention; math materialises the scores), autograd saves
what CUDA's saves, and the policy sees CUDA's op name.

Flash attention's backward allocates buffers of its own for the length of its call (torch's FlashAttention-2,
aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, `mha_bwd`), which the op's fake kernel does not:
`backward_scratch` counts them (see there).

Not modelled: cuDNN attention (opt-in in torch's priority order), the memory-efficient kernel's backward
workspace (its per-block gradient accumulators, sized by the kernel's tiling), nested tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: The op each kernel is planned with, as `aten` names it (what a checkpointing policy compares against).
OPS = {
    "flash": "aten._scaled_dot_product_flash_attention",
    "efficient": "aten._scaled_dot_product_efficient_attention",
    "math": "aten._scaled_dot_product_attention_math",
}


def choose(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    capability: tuple[int, int],
    enable_gqa: bool = False,
) -> tuple[str, str]:
    """The kernel CUDA runs for these inputs on a device of `capability`, and why (for the plan's report)."""
    backends = torch.backends.cuda
    half = query.dtype in (torch.float16, torch.bfloat16)
    dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    head_dim = query.shape[-1]
    dense = query.dim() == 4 and all(t.stride(-1) == 1 for t in (query, key, value))
    same_heads = query.shape[-3] == key.shape[-3] == value.shape[-3]
    reasons = []
    if not backends.flash_sdp_enabled():
        reasons.append("flash disabled")
    elif capability < (8, 0):
        reasons.append(f"flash needs sm80 or later (sm{capability[0]}{capability[1]})")
    elif not half:
        reasons.append(f"flash needs fp16/bf16 ({query.dtype})")
    elif attn_mask is not None:
        reasons.append("flash takes no attn_mask")
    elif len(dims) != 1 or head_dim > 256:
        reasons.append(f"flash needs one head dim of at most 256 ({sorted(dims)})")
    elif not dense:
        reasons.append("flash needs 4-D inputs with the last dim contiguous")
    elif not same_heads and not enable_gqa:
        reasons.append("flash needs as many key/value heads as query heads")
    else:
        return "flash", "fp16/bf16, head dim <= 256, no mask, sm80+"
    alignment = 16 // query.element_size()  # the memory-efficient kernel reads 16-byte aligned rows
    if not backends.mem_efficient_sdp_enabled():
        reasons.append("memory-efficient disabled")
    elif capability < (5, 0) or (query.dtype == torch.bfloat16 and capability < (8, 0)):
        reasons.append("memory-efficient needs sm50 (bf16: sm80)")
    elif query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"memory-efficient needs fp16/bf16/fp32 ({query.dtype})")
    elif any(d % alignment for d in dims):
        reasons.append(f"memory-efficient needs head dims divisible by {alignment}")
    elif not dense:
        reasons.append("memory-efficient needs 4-D inputs with the last dim contiguous")
    elif not same_heads and not enable_gqa:
        reasons.append("memory-efficient needs as many key/value heads as query heads")
    else:
        return "efficient", "; ".join(reasons)
    return "math", "; ".join(reasons)


def install(capability: tuple[int, int], calls: dict[str, dict[str, Any]]) -> Callable[[], None]:
    """Route `torch.nn.functional.scaled_dot_product_attention` to the CUDA kernel `choose` picks; `calls`
    collects, per kernel, the number of calls (recomputations included) and why the faster kernels were not
    taken. Returns a function that undoes it."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        kernel, why = choose(query, key, value, attn_mask, capability, enable_gqa)
        entry = calls.setdefault(kernel, {"calls": 0, "op": OPS[kernel], "why": why})
        entry["calls"] += 1
        aten = torch.ops.aten
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if kernel == "efficient":
            if enable_gqa and query.shape[-3] != key.shape[-3]:
                # grouped-query attention: flash reads the shared key/value heads as they are; CUDA's
                # memory-efficient path repeats them first (attention.cpp's pre_process_group_query_attention)
                repeat = query.shape[-3] // key.shape[-3]
                key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
            needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]

    functional.scaled_dot_product_attention = scaled_dot_product_attention

    def undo() -> None:
        functional.scaled_dot_product_attention = original

    return undo


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flash_backward_scratch(
    query: torch.Tensor, key: torch.Tensor, multiprocessors: int, deterministic: bool
) -> list[int]:
    """The bytes flash attention's backward allocates for itself, in its order, for `query` (batch, heads,
    query length, head dim) and `key` (batch, key/value heads, key length, head dim) as SDPA passes them:

    - the softmax gradient's row sums (`softmax_d`): fp32, batch x heads x the query length rounded up to 128;
    - the fp32 accumulator of dq (`dq_accum`): batch x the query length rounded up to 128 x heads x the head dim
      (rounded up to 8) rounded up to 32; with deterministic algorithms, one per split, ceil(SMs / (batch x
      heads)) splits;
    - with fewer key/value heads than heads (grouped-query attention), dk and dv at every head (batch x key
      length x heads x head dim, in the inputs' dtype), summed into the grouped ones at the end."""
    batch, heads, length_q, head_dim = query.shape
    heads_k, length_k = key.shape[1], key.shape[2]
    head_size = _round_up(head_dim, 8)
    rows = _round_up(length_q, 128)
    splits = -(-multiprocessors // (batch * heads)) if deterministic else 1
    sizes = [batch * heads * rows * 4, splits * batch * rows * heads * _round_up(head_size, 32) * 4]
    if heads_k != heads:
        sizes += 2 * [batch * length_k * heads * head_size * query.element_size()]
    return sizes


def backward_scratch(account: Any, capability: tuple[int, int]) -> Callable[[str, str, Any], None]:
    """What the account calls after every op (`MemoryAccount.after_op`): flash attention's backward holds its
    own buffers (`flash_backward_scratch`) beside its outputs while it runs."""
    from torchloom.planning._cuda_device import multiprocessors

    def seen(namespace: str, op: str, args: Any) -> None:
        if namespace == "aten" and op == "_scaled_dot_product_flash_attention_backward":
            deterministic = torch.are_deterministic_algorithms_enabled()
            account.scratch(
                flash_backward_scratch(args[1], args[2], multiprocessors(capability), deterministic)
            )

    return seen
