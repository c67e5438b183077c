"""Precision: parameter dtype, autocast during forward, and loss scaling for fp16.

Strategies that own their own mixed precision (FSDP) read `param_dtype` / `reduce_dtype` from here instead of
using autocast; see the precision table in README.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom.errors import ConfigurationError

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")

_ALIASES = {
    "32": "32-true",
    "64": "64-true",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    32: "32-true",
    64: "64-true",
}


def _apply_to_floats(data: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nested structure to `dtype`."""

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and torch.is_floating_point(t) else t

    return torch.utils._pytree.tree_map(cast, data)


class Precision:
    """One of the precision strings. `param_dtype` is the dtype parameters live in; `autocast_dtype` the dtype
    forward computes in (None: no autocast)."""

    def __init__(self, name: str, device_type: str) -> None:
        self.name = name
        self.device_type = device_type
        self.param_dtype: torch.dtype = {
            "32-true": torch.float32,
            "64-true": torch.float64,
            "bf16-true": torch.bfloat16,
            "16-true": torch.float16,
        }.get(name, torch.float32)
        self.autocast_dtype: torch.dtype | None = {
            "bf16-mixed": torch.bfloat16,
            "16-mixed": torch.float16,
        }.get(name)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device_type) if name == "16-mixed" else None
        )

    @property
    def is_mixed(self) -> bool:
        return self.autocast_dtype is not None

    @contextlib.contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        """Create parameters directly in `param_dtype`, so a bf16-true model never exists in fp32."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.param_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.param_dtype != torch.float32:
            return module.to(self.param_dtype)
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            yield

    def convert_input(self, data: Any) -> Any:
        # "true" precisions run the whole forward in param_dtype, so float inputs must match it.
        if self.autocast_dtype is None and self.param_dtype != torch.float32:
            return _apply_to_floats(data, self.param_dtype)
        return data

    def convert_output(self, data: Any) -> Any:
        # Under autocast, outputs come back in half precision; losses and metrics are safer in fp32.
        if self.autocast_dtype is not None:
            return _apply_to_floats(data, torch.get_default_dtype())
        return data

    def backward(self, tensor: torch.Tensor, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(**kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring fp16-scaled gradients back to true scale before clipping (once per step)."""
        if self.scaler is None:
            return
        state = self.scaler._per_optimizer_states[id(optimizer)]
        if state["stage"].name != "UNSCALED":
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"


def select_precision(precision: str | int, accelerator_name: str) -> Precision:
    """Validate `precision=` against the accelerator and build it."""
    name = _ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise ConfigurationError(
            f"Unknown precision {precision!r}. Valid precisions: {', '.join(repr(p) for p in PRECISIONS)}."
        )
    if name == "16-mixed" and accelerator_name == "cpu":
        raise ConfigurationError(
            "precision='16-mixed' (fp16 autocast with loss scaling) is not supported on CPU. "
            "Use precision='bf16-mixed' on CPU, or run on CUDA."
        )
    if name == "16-mixed" and accelerator_name == "mps":
        raise ConfigurationError("precision='16-mixed' is not supported on MPS. Use '16-true' or '32-true'.")
    if (
        name in ("bf16-mixed", "bf16-true")
        and accelerator_name == "cuda"
        and not torch.cuda.is_bf16_supported()
    ):
        raise ConfigurationError(
            f"precision={name!r} needs a GPU with bfloat16 support (Ampere or newer). Use '16-mixed' instead."
        )
    if name == "64-true" and accelerator_name == "mps":
        raise ConfigurationError("precision='64-true' is not supported on MPS (no float64). Use '32-true'.")
    return Precision(name, "cuda" if accelerator_name == "cuda" else accelerator_name)
