"""torchloom's own record in a checkpoint, under the reserved key `__torchloom__`: what wrote it (format version,
format, world size, strategy, precision, the kind of each entry) and the run's state (the loss scaler, every
rank's random generators, and the Loom's counters).

The run's state has one place in both formats: the `__torchloom__` record of the pickle torchloom writes, the
full file itself or a sharded checkpoint's `extra.pt`. The descriptive part of a sharded checkpoint's record is
kept in `torchloom.json` as well, readable without unpickling anything.
"""

from __future__ import annotations

from typing import Any

from torchloom.checkpointing import rng
from torchloom.checkpointing._interface import ScalerState, StateAccess
from torchloom.checkpointing.state import FORMAT_VERSION, META_KEY

#: The keys of the run's state inside the record (tensors and numbers: not JSON).
GRAD_SCALER, RNG, COUNTERS = "grad_scaler", rng.KEY, "counters"
RUN_STATE = (GRAD_SCALER, RNG, COUNTERS)
# Where format version 1 kept the run's state in a sharded checkpoint's extra.pt, as top-level entries.
_V1_SHARDED = {"__grad_scaler__": GRAD_SCALER, "__rng__": RNG}


def describe(io: StateAccess, scaler: ScalerState, fmt: str, kinds: dict[str, str]) -> dict[str, Any]:
    """The descriptive part of the record (plain JSON values)."""
    return {
        "version": FORMAT_VERSION,
        "format": fmt,
        "world_size": io.world_size,
        "strategy": io.name,
        "precision": scaler.name,
        "mesh": mesh_of(io),
        "kinds": kinds,
    }


def mesh_of(io: Any) -> dict[str, int] | None:
    """The device mesh the checkpoint was saved from, dim name -> size outermost first (e.g. {"data_parallel":
    2, "tensor_parallel": 2}, {"replicate": 2, "shard": 4}); None for a layout without one (one device, DDP).
    Read from the strategy's `mesh_shape` where it has one (not part of `StateAccess`: only meshes have it)."""
    shape = getattr(io, "mesh_shape", None)
    if not isinstance(shape, dict):
        return None
    return {str(name): int(size) for name, size in shape.items()}


def run_state(io: StateAccess, scaler: ScalerState, counters: dict[str, int]) -> dict[str, Any]:
    """The loss scaler's state, every rank's generators and the Loom's counters (a collective: every rank calls
    it)."""
    return {GRAD_SCALER: scaler.state_dict(), RNG: rng.gather(io), COUNTERS: dict(counters)}


def restore_run_state(
    io: StateAccess, scaler: ScalerState, counters: dict[str, int], record: dict[str, Any] | None
) -> None:
    if not isinstance(record, dict):
        return
    if record.get(GRAD_SCALER):
        scaler.load_state_dict(record[GRAD_SCALER])
    rng.restore_saved(io, record.get(RNG))
    # Checkpoints written before the counters existed leave them as they are.
    counters.update({k: int(v) for k, v in (record.get(COUNTERS) or {}).items() if k in counters})


def split(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(descriptive part, run state) of a record."""
    return (
        {k: v for k, v in record.items() if k not in RUN_STATE},
        {k: v for k, v in record.items() if k in RUN_STATE},
    )


def pop_from_extra(extra: dict[str, Any], version: int) -> dict[str, Any]:
    """Take the run's state out of a sharded checkpoint's extra.pt contents (format `version` wrote them)."""
    if version >= 2:
        found = extra.pop(META_KEY, None)
        return dict(found) if isinstance(found, dict) else {}
    return {key: extra.pop(old) for old, key in _V1_SHARDED.items() if old in extra}
