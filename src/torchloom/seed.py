"""Seeding every random number generator a training script touches."""

from __future__ import annotations

import os
import random

import torch


def seed_everything(seed: int) -> int:
    """Seed Python's `random`, NumPy (if installed) and torch (CPU and every GPU); returns `seed`.

    The seed is also exported as `TORCHLOOM_SEED`, so ranks started later by `loom.launch()` see it.
    """
    seed = int(seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}.")
    os.environ["TORCHLOOM_SEED"] = str(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
    return seed
