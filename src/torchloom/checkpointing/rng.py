"""Every rank's random generators in a checkpoint, so a resumed run draws what the uninterrupted one would have.

What is saved: Python's `random`, NumPy's global generator (if NumPy is installed), torch's CPU generator and
the generator of the rank's own GPU, for every rank (gathered to the rank that writes). They are restored only at the world size
they were saved at: on another, rank r's generators would be another rank's, and dropout and augmentation would
not continue the same stream anyway, so the log says what was not restored.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import torch

from torchloom._text import count

if TYPE_CHECKING:
    from torchloom.checkpointing._interface import StateAccess

log = logging.getLogger("torchloom")

#: Where the generators are kept: a key of the full format's metadata, an entry of the sharded format's extras.
KEY = "rng"


def capture(device: torch.device | None = None) -> dict[str, Any]:
    """This process's generators, as values `torch.load(weights_only=True)` reads (tensors, lists, numbers);
    `device`: the rank's device, whose generator is saved when it is a GPU."""
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
    if device is not None and device.type == "cuda":
        # This rank's GPU only. Every visible GPU's generator (`get_rng_state_all`), restored by position, gave a
        # rank the generator of whichever GPU had its index on the machine that saved, and crashed (IndexError)
        # where fewer GPUs are visible, e.g. one per task under SLURM after a save under torchrun.
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _cuda_state(saved: Any, device: torch.device) -> torch.Tensor | None:
    """This rank's GPU generator out of a saved `cuda` entry: the one state saved for the rank's GPU, or, from a
    checkpoint written before that (every visible GPU's state, by index), the state at this GPU's index."""
    if isinstance(saved, torch.Tensor):
        return saved
    if isinstance(saved, (list, tuple)) and device.index is not None and device.index < len(saved):
        return saved[device.index]
    return None


def restore(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put back the generators `capture(device)` saved (the GPU's onto `device`, this rank's GPU)."""
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
    if device is not None and device.type == "cuda" and "cuda" in state:
        cuda = _cuda_state(state["cuda"], device)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def gather(io: StateAccess) -> list[dict[str, Any]]:
    """Every rank's generators, in rank order (a collective: every rank calls it)."""
    mine = capture(io.root_device)
    return io.all_gather_object(mine) if io.is_distributed else [mine]


def restore_saved(io: StateAccess, saved: list[dict[str, Any]] | None) -> None:
    """Give this rank the generators it had when `saved` was written, if the world size is the same."""
    if not saved:
        return
    if len(saved) != io.world_size:
        if io.global_rank == 0:
            log.warning(
                "The checkpoint holds the random generators of %s, this run has %d: they were "
                "not restored (Python, NumPy, torch and CUDA generators start as this run seeded them), so "
                "dropout and random augmentation do not continue the saved streams.",
                count(len(saved), "rank"),
                io.world_size,
            )
        return
    restore(saved[io.global_rank], io.root_device)
