"""Optimizers that torch's own kernels cannot run right on the parameters they were given: refused by name at
`setup_optimizers` (and at the first step, for an optimizer set up before its model), never trained silently off.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom.errors import MisuseError


def check_fused_kernel(optimizer: Optimizer, params: list[torch.Tensor] | None = None) -> None:
    """Refuse a fused SGD that torch cannot run right on these parameters.

    torch has no DTensor version of fused SGD's kernel: its first step would fail deep inside torch
    ("aten._fused_sgd_.default does not have a sharding strategy registered"; found by the scenario engine with
    "fsdp2", whose sharded parameters are DTensors). Fused Adam and AdamW have one.

    And torch's fused SGD kernel for the CPU (torch 2.12 and 2.13 at least, pytorch/pytorch#191763) skips the
    update of every full SIMD block of a bf16 or fp16 parameter: in one process 0.82 of a bf16 model's update
    was lost after 4 steps (the for-loop: 0.035, the rounding of bf16). Found by the scenario engine under
    "fsdp" with "bf16-true" on 2 ranks, where the flat parameter's views cut the blocks elsewhere than in one
    process; it is wrong in every layout. Fused Adam, AdamW and Adagrad are right, and so is fp32."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    if not any(group.get("fused") for group in optimizer.param_groups):
        return
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(type(p).__name__ == "DTensor" for p in params):
        raise MisuseError(
            "torch.optim.SGD(fused=True) cannot update sharded parameters (DTensors): torch has no DTensor "
            "version of its fused kernel. Use SGD(foreach=True) (or the default) with this strategy."
        )
    kinds = {
        (p.device, p.dtype)
        for group in optimizer.param_groups
        if group.get("fused")
        for p in group["params"]
        if p.dtype in (torch.float16, torch.bfloat16)
    }
    dropped = sorted(
        {str(dtype).removeprefix("torch.") for device, dtype in kinds if fused_sgd_drops(device, dtype)}
    )
    if dropped:
        raise MisuseError(
            f"torch.optim.SGD(fused=True) does not update {' and '.join(dropped)} parameters on the CPU in this "
            f"torch ({torch.__version__}): its fused CPU kernel skips every full SIMD block of half-precision "
            "parameters (pytorch/pytorch#191763), so training would silently go wrong. Use SGD(foreach=True) or "
            "the default for-loop SGD, or keep fp32 parameters (precision='bf16-mixed')."
        )


@functools.cache
def fused_sgd_drops(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused SGD gets two steps with momentum wrong on `dtype` parameters on `device`: asked of
    the installed torch itself, on 64 elements (every SIMD width divides them), once per process. CPU only: the
    defect is in its kernel, and a probe on a GPU would cost a synchronisation."""
    if device.type != "cpu":
        return False
    param = nn.Parameter(torch.zeros(64, dtype=dtype, device=device))
    param.grad = torch.ones_like(param)
    probe = torch.optim.SGD([param], lr=1.0, momentum=0.5, fused=True)
    try:
        probe.step()
        probe.step()
    except (RuntimeError, NotImplementedError):
        return False  # not supported here at all: torch's own error comes at the user's first step
    # -1, then -(1 + 1.5): exact in every floating dtype.
    return not bool((param.detach() == -2.5).all())
