"""The axes of a scenario: one value on each is one way a user can set up a training run.

A scenario is a frozen mapping axis -> value. `conflicts` says which combinations cannot be written down at all
(a sharded checkpoint under DDP has no meaning); those are never generated. Combinations that can be written
but that torchloom must refuse are declared in `refusals.py`, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

AXES: dict[str, tuple[Any, ...]] = {
    "strategy": ("single", "ddp", "fsdp", "fsdp2"),
    "world_size": (1, 2, 3),
    # FSDP layouts: "hand" = units made by the user (wrap()/fully_shard on the blocks), "root" = the root is a
    # unit around the blocks' units (a policy, or unsharded_params="shard"), "none" = no unit but the root.
    "units": ("hand", "root", "none"),
    # Parameters outside every block unit (the input and output projections) stay outside every unit.
    "leftovers": (True, False),
    "tied": (False, True),  # the output projection's weight is the input projection's
    "optimizer": ("sgd", "adam", "adamw"),
    "impl": ("forloop", "foreach", "fused"),
    "n_opt": (1, 2),  # one optimizer, or one for the blocks and one for the rest
    "groups": (1, 2),  # param groups per optimizer: weights, and biases at half the lr without decay
    "scheduler": (False, True),
    "precision": ("32-true", "bf16-mixed", "16-mixed", "bf16-true"),
    "accum": ("none", "no_backward_sync", "plain"),  # 2 micro-batches per step, with or without the context
    "set_to_none": (True, False),
    "clip": ("none", "norm", "value"),
    # "subset": epochs over a loader whose sampler is a SubsetRandomSampler with its own generator (one device
    # reads it as it is, DDP and FSDP draw it whole each pass and split it, as Fabric's DistributedSamplerWrapper).
    "loop": ("endless", "epoch", "break", "two_loaders", "subset"),
    "checkpoint": ("none", "full", "sharded", "async"),
    "save_step": (1, 3),
    "load_world_size": (1, 2, 3),
}

SHARDED = ("fsdp", "fsdp2")


def conflicts(values: Mapping[str, Any]) -> bool:
    """True when a (partial) assignment cannot be written down as a run. Every rule names two axes, so a
    partial assignment that passes can always be completed."""
    get = values.get
    strategy = get("strategy")
    if strategy == "single" and get("world_size") not in (None, 1):
        return True
    # Units and leftovers are FSDP notions; a model under one process or DDP is "no units, no leftovers".
    if strategy in ("single", "ddp") and get("units") not in (None, "none"):
        return True
    if get("units") == "none" and get("leftovers") is True:
        return True
    if strategy in ("single", "ddp") and get("leftovers") is True:
        return True
    if get("checkpoint") == "sharded" and strategy in ("single", "ddp"):
        return True
    # Without a checkpoint, when and where it would load means nothing: pin them.
    if get("checkpoint") == "none" and (
        get("save_step") not in (None, 1) or get("load_world_size") not in (None, 1)
    ):
        return True
    return False


@dataclass(frozen=True)
class Scenario:
    """One value on each axis (see AXES)."""

    values: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, **values: Any) -> Scenario:
        missing = set(AXES) - set(values)
        unknown = set(values) - set(AXES)
        if missing or unknown:
            raise ValueError(f"scenario axes missing {sorted(missing)}, unknown {sorted(unknown)}")
        for axis, value in values.items():
            if value not in AXES[axis]:
                raise ValueError(f"{axis}={value!r} is not one of {AXES[axis]}")
        if conflicts(values):
            raise ValueError(f"conflicting axis values: {values}")
        return cls(tuple((axis, values[axis]) for axis in AXES))

    def __getattr__(self, name: str) -> Any:
        for axis, value in object.__getattribute__(self, "values"):
            if axis == name:
                return value
        raise AttributeError(name)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    @property
    def saves(self) -> bool:
        return self.checkpoint != "none"

    @property
    def id(self) -> str:
        """A short readable name, unique per scenario (used as the pytest id and in reports)."""
        v = self.as_dict()
        layout = (
            "" if v["strategy"] in ("single", "ddp") else f"-{v['units']}{'+lo' if v['leftovers'] else ''}"
        )
        opt = (
            f"{v['optimizer']}.{v['impl']}"
            + ("x2" if v["n_opt"] == 2 else "")
            + ("g2" if v["groups"] == 2 else "")
        )
        opt += ".sched" if v["scheduler"] else ""
        ckpt = (
            ""
            if v["checkpoint"] == "none"
            else f"-{v['checkpoint']}@{v['save_step']}>w{v['load_world_size']}"
        )
        return (
            f"{v['strategy']}.w{v['world_size']}{layout}{'-tied' if v['tied'] else ''}-{opt}-{v['precision']}"
            f"-acc.{v['accum']}-{'none' if v['set_to_none'] else 'zeros'}-clip.{v['clip']}-{v['loop']}{ckpt}"
        )
