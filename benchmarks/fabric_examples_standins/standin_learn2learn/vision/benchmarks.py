"""Synthetic few-shot tasks: 1x28x28 class prototypes from a fixed generator (disjoint classes for train /
validation / test); a task picks `ways` classes and `samples` noisy images of each with torch's global generator,
as learn2learn's samplers draw from the global random state."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


class _Tasks:
    def __init__(self, classes: int, ways: int, samples: int, seed: int) -> None:
        self.prototypes = torch.rand((classes, 1, 28, 28), generator=torch.Generator().manual_seed(seed))
        self.ways, self.samples = ways, samples

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = torch.randperm(len(self.prototypes))[: self.ways]
        labels = torch.arange(self.ways).repeat_interleave(self.samples)
        data = self.prototypes[chosen[labels]] + 0.5 * torch.randn(len(labels), 1, 28, 28)
        return data, labels


def get_tasksets(
    name: str,
    train_ways: int = 5,
    train_samples: int = 10,
    test_ways: int = 5,
    test_samples: int = 10,
    num_tasks: int = -1,
    root: Any = None,
    **_: Any,
) -> SimpleNamespace:
    return SimpleNamespace(
        train=_Tasks(64, train_ways, train_samples, seed=11),
        validation=_Tasks(16, test_ways, test_samples, seed=12),
        test=_Tasks(20, test_ways, test_samples, seed=13),
    )
