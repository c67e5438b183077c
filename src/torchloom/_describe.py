"""`torchloom.describe(model)`: the sharding summary as a string, before or after setup, with where each tied
weight went and what it costs."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from torchloom import _torch_compat
from torchloom._layout import Unit, analyze, clean_name, describe_layout
from torchloom.wrappers import LoomModule


def describe(model: nn.Module, world_size: int | None = None) -> str:
    """The FSDP units of `model` (path, parameter count), the parameters outside every unit (replicated on every
    rank), the estimated per-rank memory for parameters, gradients and Adam state, and for each tied weight
    (one parameter under several names) the unit that shards it and what that costs.

    Works on a plain model, on one sharded by hand, and on the module returned by `loom.setup_module`.
    `world_size` defaults to the current process group's size (1 without one).
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    # A set-up model's forward module includes a wrapped root, which the user's original module does not.
    module = model.forward_module if isinstance(model, LoomModule) else model
    return summary(module, world_size)


def summary(module: nn.Module, world_size: int, skipped: Sequence[str] = ()) -> str:
    """`describe`'s text; `skipped`: the modules a wrapping policy picked that were made no unit, because each
    holds some but not all users of a tied weight (said at setup)."""
    lines = [describe_layout(module, world_size), *_tie_lines(module, world_size)]
    if skipped:
        lines.append(
            f"  not made units although the wrapping policy picks them: {', '.join(skipped)} (each holds part of "
            "a tied weight's users; their parameters are sharded by the unit above them)"
        )
    return "\n".join(lines)


def _tie_lines(module: nn.Module, world_size: int) -> list[str]:
    """Each tied weight: its names, the unit that shards it (the innermost one holding every user) and its cost
    per rank: its share at rest, the whole weight while that unit computes."""
    layout = analyze(module)
    by_id: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), (p, []))[1].append(clean_name(name))
    lines = []
    for p, names in by_id.values():
        names = list(dict.fromkeys(names))
        if len(names) < 2:
            continue
        owners = [n.rpartition(".")[0] for n in names]
        units = [
            u
            for u in layout.units
            if all(not u.path or o == u.path or o.startswith(u.path + ".") for o in owners)
        ]
        numel = _full_numel(p, units)
        mib = numel * p.element_size() / 2**20
        tied = " = ".join(repr(n) for n in names)
        if not units:
            lines.append(
                f"  tied weight {tied}: outside every unit, replicated ({mib:.2f} MiB on every rank)"
            )
            continue
        unit = max(units, key=lambda u: len(u.path))
        lines.append(
            f"  tied weight {tied} ({numel:,} elements): sharded once by unit '{unit.path or '<root>'}', the "
            f"innermost holding every user; {mib / max(world_size, 1):.2f} MiB per rank at rest, {mib:.2f} MiB "
            "while that unit computes (its forward and backward)"
        )
    return lines


def _full_numel(p: nn.Parameter, units: Sequence[Unit]) -> int:
    """The weight's whole size: a DTensor's global shape; FSDP1's view of a shard (use_orig_params) from the size
    its unit's flat parameter records for it."""
    for unit in units:
        if unit.flavour == "fsdp":
            originals = [id(q) for q in _torch_compat.fsdp1_flat_param_originals(unit.module)]
            if id(p) in originals:
                numels = _torch_compat.fsdp1_flat_param_numels(unit.module) or []
                return numels[originals.index(id(p))]
    return int(p.shape.numel())
