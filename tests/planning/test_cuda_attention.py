"""`scaled_dot_product_attention` planned as CUDA's kernel (`torchloom.planning._cuda_attention`): the kernel
chosen as CUDA's dispatch chooses it, the op a checkpointing policy sees is CUDA's (so torchtitan's `_save_list`
saves it), and what autograd keeps is the output and the logsumexp, not the scores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchloom import _torch_compat
from torchloom.planning._cuda_attention import choose, install


def _qkv(dtype=torch.bfloat16, head_dim=64, kv_heads=4):
    q = torch.randn(2, 4, 32, head_dim, dtype=dtype)
    k = torch.randn(2, kv_heads, 32, head_dim, dtype=dtype)
    return q, k, torch.randn(2, kv_heads, 32, head_dim, dtype=dtype)


@pytest.mark.parametrize(
    ("capability", "dtype", "head_dim", "mask", "kernel"),
    [
        ((9, 0), torch.bfloat16, 128, False, "flash"),
        ((8, 0), torch.float16, 256, False, "flash"),
        ((9, 0), torch.float32, 64, False, "efficient"),  # flash takes fp16/bf16 only
        ((9, 0), torch.bfloat16, 64, True, "efficient"),  # an explicit mask: not flash
        ((9, 0), torch.bfloat16, 320, False, "efficient"),  # head dim over 256: not flash
        ((7, 5), torch.float16, 64, False, "efficient"),  # Turing: no flash
        ((7, 5), torch.bfloat16, 64, False, "math"),  # bf16 before sm80: neither
        ((9, 0), torch.float32, 30, False, "math"),  # fp32 rows of 30: not 16-byte aligned
    ],
)
def test_the_kernel_cuda_would_choose(capability, dtype, head_dim, mask, kernel) -> None:
    q, k, v = _qkv(dtype, head_dim)
    attn_mask = torch.ones(32, 32, dtype=torch.bool) if mask else None
    assert choose(q, k, v, attn_mask, capability)[0] == kernel


def test_the_backend_switches_are_obeyed() -> None:
    q, k, v = _qkv()
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
        assert choose(q, k, v, None, (9, 0))[0] == "efficient"
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        assert choose(q, k, v, None, (9, 0))[0] == "math"


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _saving_attention(ctx, func, *args, **kwargs):
    flash = func == torch.ops.aten._scaled_dot_product_flash_attention.default
    return CheckpointPolicy.MUST_SAVE if flash else CheckpointPolicy.PREFER_RECOMPUTE


def test_attention_runs_cudas_op_and_a_policy_keyed_on_it_saves_it() -> None:
    calls: dict = {}
    undo = install((9, 0), calls)
    try:
        with _torch_compat.fake_tensor_mode():
            q, k, v = (t.requires_grad_() for t in _qkv())
            ops = _Ops()
            with ops:
                out = checkpoint(
                    lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                    q,
                    k,
                    v,
                    use_reentrant=False,
                    context_fn=lambda: create_selective_checkpoint_contexts(_saving_attention),
                )
                out.sum().backward()
    finally:
        undo()
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # undone
    assert calls["flash"]["calls"] == 2  # the forward and its recomputation (which takes the saved result)
    assert calls["flash"]["op"] == "aten._scaled_dot_product_flash_attention"
    # run once (saved: the recomputation takes the saved result) and its CUDA backward once; never the CPU op
    assert ops.seen.count("aten._scaled_dot_product_flash_attention") == 1
    assert ops.seen.count("aten._scaled_dot_product_flash_attention_backward") == 1
    assert not any("for_cpu" in op for op in ops.seen)


def test_flash_saves_the_output_and_the_logsumexp_not_the_scores() -> None:
    undo = install((9, 0), {})
    try:
        with _torch_compat.fake_tensor_mode():
            q, k, v = (t.requires_grad_() for t in _qkv(head_dim=64))
            saved: list[torch.Size] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        undo()
    assert torch.Size([2, 4, 32, 32]) not in saved  # no (batch, heads, seq, seq) scores
    assert torch.Size([2, 4, 32]) in saved  # the logsumexp, fp32 per row
    assert torch.Size([2, 4, 32, 64]) in saved  # q, k, v and the output


def test_grouped_query_attention_keeps_the_shared_heads_under_flash() -> None:
    undo = install((9, 0), calls := {})
    try:
        with _torch_compat.fake_tensor_mode():
            q, k, v = (t.requires_grad_() for t in _qkv(kv_heads=2))
            saved: list[torch.Size] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    finally:
        undo()
    assert set(calls) == {"flash"} and out.shape == (2, 4, 32, 64)
    assert torch.Size([2, 2, 32, 64]) in saved  # the 2 key/value heads, not repeated to 4


def test_flash_backwards_own_buffers_by_the_kernels_rules() -> None:
    from torchloom.planning._cuda_attention import flash_backward_scratch

    q, k, _ = _qkv(head_dim=72, kv_heads=2)  # batch 2, 4 heads, 32 rows, head dim 72; 2 key/value heads
    # softmax_d: 2 x 4 x 128 (32 rounded up to 128) fp32; dq_accum: 2 x 128 x 4 x 96 (72 rounded up to 32) fp32;
    # grouped-query: dk and dv at all 4 heads, 2 x 32 x 4 x 72 bf16 each
    assert flash_backward_scratch(q, k, 132, False) == [4096, 393216, 36864, 36864]
    # deterministic: ceil(132 SMs / (2 x 4)) = 17 accumulators of dq
    assert flash_backward_scratch(q, k, 132, True)[1] == 17 * 393216


def _flash_step_peak(scratch: bool) -> int:
    from torchloom.planning._cuda_attention import backward_scratch
    from torchloom.planning.tracker import MemoryAccount

    undo = install((9, 0), {})
    try:
        fake = _torch_compat.fake_tensor_mode()
        account = MemoryAccount(fake=True, fake_mode=fake)
        if scratch:
            account.after_op.append(backward_scratch(account, (9, 0)))
        with fake, account:
            q, k, v = (t.requires_grad_() for t in _qkv(head_dim=64))
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    finally:
        undo()
    return account.peak.bytes


def test_flash_backwards_buffers_are_live_while_it_runs() -> None:
    # at the backward's call its outputs and inputs are live, and its own buffers on top of them: softmax_d
    # (2 x 4 x 128 fp32) and dq_accum (2 x 128 x 4 x 64 fp32), which outweigh everything else of this step
    assert _flash_step_peak(True) - _flash_step_peak(False) == 2 * 4 * 128 * 4 + 2 * 128 * 4 * 64 * 4
