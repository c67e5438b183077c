"""`OmniglotFC(input_size, output_size)`: learn2learn's layer sizes (256, 128, 64, 64), without batch norm."""

from __future__ import annotations

import torch
from torch import nn


class OmniglotFC(nn.Module):
    def __init__(
        self, input_size: int, output_size: int, sizes: tuple[int, ...] = (256, 128, 64, 64)
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for width in sizes:
            layers += [nn.Linear(input_size, width), nn.ReLU()]
            input_size = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(input_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.reshape(len(x), -1)))
