"""Every rank's random generators in a checkpoint, so a resumed run draws what the uninterrupted one would have.

What is saved: Python's `random`, NumPy's global generator (if NumPy is installed), torch's CPU generator and
every CUDA generator, for every rank (gathered to the rank that writes). They are restored only at the world size
they were saved at: on another, rank r's generators would be another rank's, and dropout and augmentation would
not continue the same stream anyway, so the log says what was not restored.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchloom.checkpointing._interface import StateAccess

log = logging.getLogger("torchloom")

#: Where the generators are kept: a key of the full format's metadata, an entry of the sharded format's extras.
KEY = "rng"


def capture() -> dict[str, Any]:
    """This process's generators, as values `torch.load(weights_only=True)` reads (tensors, lists, numbers)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [
            kind,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather(io: StateAccess) -> list[dict[str, Any]]:
    """Every rank's generators, in rank order (a collective: every rank calls it)."""
    mine = capture()
    return io.all_gather_object(mine) if io.is_distributed else [mine]


def restore_saved(io: StateAccess, saved: list[dict[str, Any]] | None) -> None:
    """Give this rank the generators it had when `saved` was written, if the world size is the same."""
    if not saved:
        return
    if len(saved) != io.world_size:
        if io.global_rank == 0:
            log.warning(
                "torchloom: the checkpoint holds the random generators of %d ranks, this run has %d: they were "
                "not restored (Python, NumPy, torch and CUDA generators start as this run seeded them), so "
                "dropout and random augmentation do not continue the saved streams.",
                len(saved),
                io.world_size,
            )
        return
    restore(saved[io.global_rank])
