"""The transforms the examples compose, on the uint8 tensors of the stand-in data sets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """uint8 HxW or CxHxW -> float CxHxW in [0, 1] (as torchvision does for a PIL image)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().div(255)
        return x.unsqueeze(0) if x.dim() == 2 else x


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class Resize:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[-2:]) == self.size:
            return x
        return F.interpolate(x.float().unsqueeze(0), size=self.size).squeeze(0)


class CenterCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return x[..., top : top + self.size, left : left + self.size]
