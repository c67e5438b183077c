"""A set-up model's parameters, buffers and state dict under the user's own module's names, never under the
strategy wrapper's ("_forward_module.module."): the base of `LoomModule`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class OriginalNames(nn.Module):
    """Parameters, buffers and `state_dict()` read from (and `load_state_dict` written to) the module in
    `_original_module`, under its own key names."""

    _original_module: nn.Module

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self._original_module.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._original_module.parameters(recurse=recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self._original_module.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self._original_module.buffers(recurse=recurse)
