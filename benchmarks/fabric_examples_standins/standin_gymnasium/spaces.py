from __future__ import annotations

from typing import Any

import numpy as np


class Space:
    shape: tuple[int, ...] = ()

    def seed(self, seed: Any = None) -> None:
        self.np_random = np.random.default_rng(seed)


class Discrete(Space):
    def __init__(self, n: int) -> None:
        self.n, self.shape = n, ()
        self.seed()

    def sample(self) -> int:
        return int(self.np_random.integers(self.n))


class Box(Space):
    def __init__(self, low: Any, high: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> None:
        self.low, self.high, self.shape, self.dtype = low, high, tuple(shape), dtype
        self.seed()
