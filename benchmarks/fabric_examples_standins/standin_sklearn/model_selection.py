"""`KFold(n_splits)` without shuffling, as scikit-learn splits: consecutive folds, the first `n % k` one longer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


class KFold:
    def __init__(self, n_splits: int = 5, shuffle: bool = False, random_state: Any = None) -> None:
        if shuffle:
            raise NotImplementedError("stand-in KFold: shuffle=True is not needed by the examples")
        self.n_splits = n_splits

    def split(self, X: Any, y: Any = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        n = len(X)
        indices = np.arange(n)
        sizes = np.full(self.n_splits, n // self.n_splits, dtype=int)
        sizes[: n % self.n_splits] += 1
        start = 0
        for size in sizes:
            val = indices[start : start + size]
            yield np.concatenate([indices[:start], indices[start + size :]]), val
            start += size
