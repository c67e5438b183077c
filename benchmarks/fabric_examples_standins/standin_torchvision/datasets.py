"""Synthetic MNIST and CelebA: class-dependent patterns plus noise from a fixed generator, so they can be learned
and are identical in every run."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset


def _images(n: int, classes: int, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.rand((classes, *shape), generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    noise = torch.rand((n, *shape), generator=g)
    pixels = (0.6 * prototypes[labels] + 0.4 * noise) * 255
    return pixels.to(torch.uint8), labels


class MNIST(Dataset):
    """`len` from $STANDIN_MNIST_TRAIN / $STANDIN_MNIST_TEST (default 2048 / 512); items (image, int label)."""

    def __init__(
        self,
        root: Any = None,
        train: bool = True,
        transform: Callable | None = None,
        download: bool = False,
        **_: Any,
    ) -> None:
        n = int(
            os.environ.get("STANDIN_MNIST_TRAIN" if train else "STANDIN_MNIST_TEST", 2048 if train else 512)
        )
        self.data, self.targets = _images(n, 10, (28, 28), seed=1 if train else 2)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = self.data[index]
        return (self.transform(image) if self.transform else image), int(self.targets[index])


class CelebA(Dataset):
    """3x64x64 images; `len` from $STANDIN_CELEBA (default 160); items (image, attribute tensor)."""

    def __init__(
        self,
        root: Any = None,
        split: str = "all",
        transform: Callable | None = None,
        download: bool = False,
        **_: Any,
    ) -> None:
        n = int(os.environ.get("STANDIN_CELEBA", 160))
        self.data, self.targets = _images(n, 4, (3, 64, 64), seed=3)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        image = self.data[index]
        return (self.transform(image) if self.transform else image), self.targets[index : index + 1]
