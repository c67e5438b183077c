"""Checkpoints: "full" (one file, rank 0) and "sharded" (a DCP directory, every rank), written atomically.

`Checkpointer` (held by `Loom`) owns them: it saves in the format the strategy asks for, detects the format when
loading (so either loads into any strategy and any world size), and owns the asynchronous save's life. The
package depends on the strategy only through the protocols of `_interface` (`StateAccess`, `ScalerState`):

    checkpointer.py   Checkpointer: save/load/load_raw/save_raw, the pending async save, close
    state.py          the user's `state` resolved into entries; collecting and restoring each
    record.py         torchloom's `__torchloom__` record: metadata, loss scaler and random generators
    full.py           the full format (one torch.save file)
    sharded.py        the sharded format (DCP directory + torchloom.json + extra.pt); imported on first use
    hf.py             Hugging Face safetensors checkpoints (load_raw / save_raw)
    rng.py, atomic.py every rank's generators; atomic, durable writes and swaps
    tools.py          `torchloom inspect` / `consolidate`, offline
"""

from __future__ import annotations

from torchloom.checkpointing import hf
from torchloom.checkpointing._interface import ScalerState, StateAccess
from torchloom.checkpointing.checkpointer import Checkpointer
from torchloom.checkpointing.state import (
    FORMAT_VERSION,
    META_KEY,
    load_module,
    torch_internal_warnings_filtered,
)

__all__ = [
    "Checkpointer",
    "StateAccess",
    "ScalerState",
    "load_module",
    "hf",
    "torch_internal_warnings_filtered",
    "FORMAT_VERSION",
    "META_KEY",
]
