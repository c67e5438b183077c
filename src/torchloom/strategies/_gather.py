"""An all-gather that gradients flow back through (`loom.all_gather(..., sync_grads=True)`).

Backward sums every rank's gradient for each gathered piece and hands each rank the sum for its own input.
It uses all_reduce, which every backend has (gloo has no reduce_scatter), and no deprecated PyTorch API.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None


def all_gather_with_grads(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """`tensor` from every rank of `group`, stacked on a new leading dimension, differentiable."""
    return _AllGather.apply(tensor, group)
