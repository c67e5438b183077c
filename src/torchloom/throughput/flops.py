"""FLOPs: what a model needs (`measure_flops`, `count_flops`) and what a device can do (`get_available_flops`).

Peak FLOPs are **dense** figures from the vendors' datasheets: the "with sparsity" figures NVIDIA prints first
for Ampere and later are twice the dense ones and apply only to 2:4 structured-sparse matmuls (Lightning used
them for H100/H200 until its fix #21743, which halved every MFU it reported). `Throughput(using_sparse_model=True)`
applies the factor for a model that really is sparse.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from torchloom._torch_compat import check_flop_counter_count_hook
from torchloom.errors import MisuseValueError, warn_user

_TF32 = "tfloat32"
_FP8 = getattr(torch, "float8_e4m3fn", "float8")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _warn_rank_zero(message: str) -> None:
    """Warn on global rank 0 only (every rank computes the same peak), at the user's line, so Python's warning
    filter shows it once per line of the user's code, as Fabric's `rank_zero_warn`."""
    if _rank() == 0:
        warn_user(message)


def _hopper(fp64: float, fp32: float, tf32: float, half: float) -> dict[Any, float]:
    return {
        torch.float64: fp64,
        torch.float32: fp32,
        _TF32: tf32,
        torch.bfloat16: half,
        torch.float16: half,
        torch.int8: 2 * half,
        _FP8: 2 * half,
    }


def _consumer(
    fp32: float, tf32: float, half: float, int8: float, int4: float | None = None
) -> dict[Any, float]:
    table: dict[Any, float] = {
        torch.float32: fp32,
        _TF32: tf32,
        torch.bfloat16: half,
        torch.float16: half,
        torch.int8: int8,
    }
    if int4 is not None:
        table["int4"] = int4
    return table


# Dense peak FLOPs per device (per GPU of a board or superchip), by chip and dtype. "tfloat32" is fp32 matmuls
# on tensor cores (`torch.set_float32_matmul_precision("high")` on Ampere or later).
_CUDA_FLOPS: dict[str, dict[Any, float]] = {
    # Blackwell: HGX B200 and GB200 NVL72 datasheets (per GPU, dense = half the sparse figure)
    "b200": _hopper(fp64=3.7e13, fp32=7.5e13, tf32=1.125e15, half=2.25e15),
    "gb200": _hopper(fp64=4.5e13, fp32=8.0e13, tf32=1.25e15, half=2.5e15),
    # Hopper: H100 and H200 datasheets; H200 and GH200 compute as H100 SXM (more and faster memory only)
    "h200 sxm": _hopper(fp64=3.4e13, fp32=6.7e13, tf32=4.945e14, half=9.895e14),
    "h200 nvl": _hopper(fp64=3.0e13, fp32=6.0e13, tf32=4.175e14, half=8.355e14),
    "h100 sxm": _hopper(fp64=3.4e13, fp32=6.7e13, tf32=4.945e14, half=9.895e14),
    "h100 nvl": _hopper(fp64=3.0e13, fp32=6.0e13, tf32=4.175e14, half=8.355e14),
    "h100 pcie": _hopper(fp64=2.56e13, fp32=5.12e13, tf32=3.78e14, half=7.56e14),
    # Ada
    "rtx 4090": _consumer(8.26e13, 8.26e13, 8.26e13, 6.606e14, 1.3212e15),
    "rtx 4080 super": _consumer(5.22e13, 5.22e13, 5.22e13, 4.176e14, 8.352e14),
    "rtx 4080": _consumer(4.87e13, 4.87e13, 4.87e13, 3.899e14, 7.798e14),
    "l4": _consumer(3.03e13, 6.0e13, 1.21e14, 2.42e14, 4.84e14),
    "l40": _consumer(9.05e13, 9.05e13, 1.81e14, 3.62e14, 7.24e14),
    "l40s": _consumer(9.16e13, 1.83e14, 3.66e14, 7.33e14, 7.33e14),
    # Ampere (A100 SXM and PCIe have the same peaks)
    "a100": {**_consumer(1.95e13, 1.56e14, 3.12e14, 6.24e14), torch.float64: 9.7e12},
    "a6000": _consumer(3.87e13, 7.74e13, 3.87e13, 3.097e14, 6.193e14),
    "a40": _consumer(3.74e13, 7.48e13, 1.497e14, 2.993e14, 5.987e14),
    "a10g": _consumer(3.12e13, 6.25e13, 1.25e14, 2.5e14, 5.0e14),
    "rtx 3090 ti": _consumer(4.0e13, 4.0e13, 4.0e13, 3.2e14, 6.4e14),
    "rtx 3090": _consumer(3.56e13, 3.56e13, 3.56e13, 2.84e14, 5.68e14),
    "rtx 3080 ti": _consumer(3.41e13, 3.41e13, 3.41e13, 2.728e14, 5.466e14),
    "rtx 3080": _consumer(2.98e13, 2.98e13, 2.98e13, 2.38e14, 4.76e14),
    "rtx 3070": _consumer(2.03e13, 2.03e13, 2.03e13, 1.626e14, 3.252e14),
    # Turing (no bf16)
    "t4": {torch.float32: 8.1e12, torch.float16: 6.5e13, torch.int8: 1.3e14, "int4": 2.6e14},
    "quadro rtx 5000": {torch.float32: 1.12e13, torch.float16: 8.92e13},
    "rtx 2080 super": {
        torch.float32: 1.12e13,
        torch.float16: 2.23e13,
        torch.int8: 1.784e14,
        "int4": 3.568e14,
    },
    "rtx 2080 ti": {torch.float32: 1.42e13, torch.float16: 2.85e13, torch.int8: 2.277e14, "int4": 4.554e14},
    "rtx 2080": {torch.float32: 1.06e13, torch.float16: 2.12e13, torch.int8: 1.696e14, "int4": 3.391e14},
    "rtx 2070 super": {torch.float32: 9.1e12, torch.float16: 1.81e13, torch.int8: 1.45e14, "int4": 2.9e14},
    "titan rtx": {torch.float32: 1.63e13, torch.float16: 3.26e13, torch.int8: 2.61e14, "int4": 5.22e14},
    # Volta
    "v100 sxm": {torch.float64: 7.8e12, torch.float32: 1.57e13, torch.float16: 1.25e14},
    "v100 pcie": {torch.float64: 7.0e12, torch.float32: 1.4e13, torch.float16: 1.12e14},
    "v100s pcie": {torch.float64: 8.2e12, torch.float32: 1.64e13, torch.float16: 1.3e14},
}


def _chip(device_name: str) -> str | None:
    """The `_CUDA_FLOPS` key of a `torch.cuda.get_device_name()` result, or None when unrecognised."""
    name = device_name.lower()
    if "gb200" in name:
        return "gb200"
    if "b200" in name:
        return "b200"
    if "h200" in name:  # "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA GH200 480GB"
        return "h200 nvl" if "nvl" in name else "h200 sxm"
    if "h100" in name:  # "NVIDIA H100 80GB HBM3" is the SXM part
        if "nvl" in name:
            return "h100 nvl"
        return "h100 pcie" if "pcie" in name or "hbm2e" in name else "h100 sxm"
    if "geforce rtx" in name:
        words = name.split()
        number = words[words.index("rtx") + 1] if words.index("rtx") + 1 < len(words) else ""
        extra = " super" if "super" in words else " ti" if "ti" in words else ""
        return f"rtx {number}{extra}"
    for needle, chip in (
        ("l40s", "l40s"),
        ("l40", "l40"),
        ("l4", "l4"),
        ("a6000", "a6000"),
        ("a100", "a100"),
        ("a40", "a40"),
        ("a10g", "a10g"),
        ("quadro rtx 5000", "quadro rtx 5000"),
        ("titan rtx", "titan rtx"),
        ("v100s-pcie", "v100s pcie"),
        ("v100-sxm", "v100 sxm"),
        ("v100-pcie", "v100 pcie"),
        ("t4", "t4"),
    ):
        if needle in name:
            return chip
    return None


def _uses_tf32(device: torch.device) -> bool:
    return (
        torch.cuda.get_device_capability(device)[0] >= 8 and torch.get_float32_matmul_precision() != "highest"
    )


def get_available_flops(device: torch.device, dtype: torch.dtype | str) -> int | None:
    """The dense peak FLOPs per second of one `device` computing in `dtype` (Fabric's `get_available_flops`).

    fp32 on an Ampere-or-later GPU counts as TF32 unless `torch.get_float32_matmul_precision()` is "highest".
    Returns None, with a warning naming the fix, for a GPU not in the table, a dtype the GPU has no figure for,
    and every non-CUDA device (a CPU's peak depends on its cores, clock and vector units: measure it and pass
    `available_flops=` to `Throughput` or `ThroughputMonitor`). The figures are an upper limit only large
    matmuls approach."""
    device = torch.device(device)
    if device.type != "cuda":
        _warn_rank_zero(
            f"No peak FLOPs are known for a {device.type!r} device, so MFU is not computed: pass "
            "available_flops= (the measured peak of one device) to Throughput or ThroughputMonitor."
        )
        return None
    device_name = torch.cuda.get_device_name(device)
    chip = _chip(device_name)
    if chip is None or chip not in _CUDA_FLOPS:
        _warn_rank_zero(
            f"FLOPs not found for {device_name!r}{f', chip is {chip!r}' if chip else ''}: MFU is not computed. "
            "Pass available_flops= (the dense peak from its datasheet) to Throughput or ThroughputMonitor."
        )
        return None
    table = _CUDA_FLOPS[chip]
    if dtype is torch.float32 and _uses_tf32(device):
        dtype = _TF32
    if dtype not in table:
        _warn_rank_zero(
            f"{device_name!r} does not support {dtype} (no peak FLOPs known): MFU is not computed."
        )
        return None
    return int(table[dtype])


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """The FLOPs `forward_fn()` runs (and, with `loss_fn`, `loss_fn(output).backward()`), counted by torch's
    `FlopCounterMode` (Fabric's `measure_flops`). Build the model and its input on the meta device, so nothing
    is allocated or computed:

        with torch.device("meta"):
            model = MyModel()
            x = torch.randn(2, 32)
        flops = measure_flops(model, lambda: model(x), lambda y: y.sum())

    The count is what the hardware runs: with activation checkpointing it includes the forward recomputed in
    the backward. `count_flops` separates the two (model FLOPs for MFU, hardware FLOPs for utilisation)."""
    counter = FlopCounterMode(display=False)
    with counter:
        if loss_fn is None:
            forward_fn()
        else:
            loss_fn(forward_fn()).backward()
    return counter.get_total_flops()


@dataclass(frozen=True)
class FlopCount:
    """The FLOPs of one training step of one device.

    `model`: what the model mathematically needs (forward and backward, each once): the numerator of MFU.
    `hardware`: what the device runs, the forward recomputed by activation checkpointing included (HFU).
    `recomputed`: `hardware - model`."""

    model: int
    hardware: int

    @property
    def recomputed(self) -> int:
        return self.hardware - self.model


class _SplitCounter(FlopCounterMode):
    """`FlopCounterMode` that also sums, apart, the FLOPs recomputed in a backward pass. The backward runs with
    grad mode off; activation checkpointing (reentrant or not) switches it on to recompute the forward. So an
    op dispatched during the backward with grad mode on is recomputation."""

    def __init__(self) -> None:
        check_flop_counter_count_hook()
        super().__init__(display=False)
        self.in_backward = False
        self.recomputed = 0

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        if self.in_backward and torch.is_grad_enabled() and func_packet in self.flop_registry:
            self.recomputed += self.flop_registry[func_packet](*args, **kwargs, out_val=out)
        return super()._count_flops(func_packet, out, args, kwargs)


def count_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    tensor_parallel_size: int = 1,
) -> FlopCount:
    """Model and hardware FLOPs of one device for one `forward_fn()` (and `loss_fn(output).backward()`).

    Run it on a meta copy of the whole (unsharded) model with one rank's batch. `tensor_parallel_size`: the size
    of the tensor-parallel dimension the real model is split over; every device of a tensor-parallel group runs
    1/`tensor_parallel_size` of the model's FLOPs on the same batch, so both counts are divided by it (data-
    parallel and FSDP ranks each run the whole model on their own batch: no division)."""
    if tensor_parallel_size < 1:
        raise MisuseValueError(
            f"tensor_parallel_size={tensor_parallel_size}: give the size of the tensor-parallel mesh dimension "
            "(1 without tensor parallelism)."
        )
    counter = _SplitCounter()
    with counter:
        output = forward_fn()
        if loss_fn is not None:
            loss = loss_fn(output)
            counter.in_backward = True
            loss.backward()
    hardware = counter.get_total_flops()
    return FlopCount(
        model=(hardware - counter.recomputed) // tensor_parallel_size,
        hardware=hardware // tensor_parallel_size,
    )
