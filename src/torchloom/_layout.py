"""Which FSDP units a model holds, and which parameters lie outside every unit.

Every FSDP feature (setup, gradient sync, clipping, no_backward_sync, checkpoints, the sharding summary) asks
this one module instead of checking `isinstance(root, FSDP)`: a model sharded by hand has no FSDP root, and its
parameters outside every unit need data-parallel treatment of their own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from torchloom import _torch_compat

#: The attribute of a parameter that is a copy of another rank's (a weight tied across pipeline stages: each
#: stage holds a copy, their gradients summed): its gradient is counted there, so gradient norms skip it. Set by
#: `pipelining._ties`, read by `strategies._clipping`.
COUNTED_ELSEWHERE = "_torchloom_counted_elsewhere"

# Wrapper segments that FSDP1 and activation checkpointing insert into parameter names.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name as the user's own module spells it (no wrapper segments)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def unit_flavour(module: nn.Module) -> str | None:
    """ "fsdp" for a FullyShardedDataParallel instance, "fsdp2" for a `fully_shard`-ed module, else None."""
    # Importing torch.distributed.fsdp costs about a second (it pulls in DTensor). A module can only be a unit if
    # something already imported it, so a DDP job, and the launching process, never pay for it here.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    if isinstance(module, fsdp.FullyShardedDataParallel):
        return "fsdp"
    if isinstance(module, fsdp.FSDPModule):
        return "fsdp2"
    return None


@dataclass
class Unit:
    path: str
    module: nn.Module
    flavour: str
    #: Parameters this unit manages itself (not those of units nested inside it).
    num_params: int = 0
    numel: int = 0


@dataclass
class Layout:
    units: list[Unit] = field(default_factory=list)
    #: Units that no other unit contains: what no_backward_sync and FSDP1 root logic act on.
    top_units: list[Unit] = field(default_factory=list)
    #: (clean name, parameter) for every parameter outside all units.
    leftovers: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    leftover_buffers: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    root_is_unit: bool = False
    #: Tied parameters split by a unit boundary: (name outside every unit, name inside a unit, or None where
    #: FSDP2 already replaced the unit's copy and only its mark is left). Nothing can train these correctly.
    split_ties: list[tuple[str, str | None]] = field(default_factory=list)
    #: Tied parameters held by two different units (names in each): nothing can train these correctly either.
    ties_across_units: list[tuple[str, str]] = field(default_factory=list)

    @property
    def flavours(self) -> set[str]:
        return {u.flavour for u in self.units}


def analyze(module: nn.Module) -> Layout:
    """Walk the tree once: units (outermost first) and the parameters/buffers that no unit owns."""
    layout = Layout()
    inside: set[int] = set()  # ids of modules that sit in some unit's subtree

    def visit(mod: nn.Module, path: str, in_unit: Unit | None) -> None:
        flavour = unit_flavour(mod)
        unit = in_unit
        if flavour is not None:
            unit = Unit(clean_name(path + ".")[:-1] if path else "", mod, flavour)
            layout.units.append(unit)
            if in_unit is None:
                layout.top_units.append(unit)
        if unit is not None:
            inside.add(id(mod))
        for name, child in mod.named_children():
            visit(child, f"{path}.{name}" if path else name, unit)

    visit(module, "", None)
    layout.root_is_unit = unit_flavour(module) is not None
    seen: dict[int, tuple[str, bool, Unit | None]] = {}  # id -> (first name, inside a unit, nearest unit)
    owner_unit = {id(u.module): u for u in layout.units}
    fsdp2_units = any(u.flavour == "fsdp2" for u in layout.units)
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, param in mod.named_parameters(recurse=False):
            full = clean_name(f"{mod_name}.{p_name}" if mod_name else p_name)
            unit = _nearest_unit(module, mod_name, owner_unit) if id(mod) in inside else None
            if id(param) in seen:
                # One parameter used by a module inside a unit and by one outside (tied embeddings with only
                # the embedding in an FSDP1 unit): the unit flattens it into its shard, and the outside module
                # would compute with the shard.
                first, first_inside, first_unit = seen[id(param)]
                if first_inside != (id(mod) in inside):
                    layout.split_ties.append((first, full) if not first_inside else (full, first))
                elif first_unit is not None and unit is not None and first_unit is not unit:
                    # Two units each flatten it into their own shard (FSDP1): the ranks crash in a collective.
                    layout.ties_across_units.append((first, full))
                continue
            seen[id(param)] = (full, id(mod) in inside, unit)
            if id(mod) in inside:
                if unit is not None:
                    unit.num_params += 1
                    unit.numel += _global_numel(param)
            else:
                layout.leftovers.append((full, param))
                # FSDP2 gave the unit a sharded copy and left this module the original: the tie is already
                # broken, and the two copies would train apart silently.
                if fsdp2_units and _torch_compat.fsdp2_replaced_by_fully_shard(param):
                    layout.split_ties.append((full, None))
        for b_name, buf in mod.named_buffers(recurse=False):
            if id(mod) not in inside and buf is not None:
                layout.leftover_buffers.append(
                    (clean_name(f"{mod_name}.{b_name}" if mod_name else b_name), buf)
                )
    for unit in layout.units:
        if unit.flavour == "fsdp":
            _fsdp1_unit_size(unit)
    if fsdp2_units:
        _fsdp2_ties_across_units(module, layout)
    return layout


def _fsdp2_ties_across_units(module: nn.Module, layout: Layout) -> None:
    """A parameter tied between two FSDP2 units: `fully_shard` of the first replaced it in its own modules only,
    and `fully_shard` of the second sharded the original again, so each unit trains a copy of its own (found by
    the scenario engine: tied input and output projections, each made a unit by hand). FSDP2 gives every
    original parameter it shards one id, so two units sharding one id are a broken tie."""
    names = {
        id(m): clean_name(n + ".")[:-1] if n else "" for n, m in module.named_modules(remove_duplicate=False)
    }
    first: dict[int, tuple[int, str]] = {}  # original's id -> (its first unit's module id, the name there)
    for unit in layout.units:
        if unit.flavour != "fsdp2":
            continue
        for owner, p_name, uid in _torch_compat.fsdp2_unit_originals(unit.module) or []:
            owner_name = names.get(id(owner), "")
            full = f"{owner_name}.{p_name}" if owner_name else p_name
            if uid in first and first[uid][0] != id(unit.module):
                layout.ties_across_units.append((first[uid][1], full))
            first.setdefault(uid, (id(unit.module), full))


def _nearest_unit(root: nn.Module, mod_name: str, owner_unit: dict[int, Unit]) -> Unit | None:
    """The innermost unit on the path from `root` to the module called `mod_name`."""
    found = owner_unit.get(id(root))
    mod = root
    for part in mod_name.split(".") if mod_name else []:
        mod = getattr(mod, part)
        found = owner_unit.get(id(mod), found)
    return found


def _global_numel(param: torch.Tensor) -> int:
    # FSDP2 parameters are DTensors whose .shape is the global shape.
    return int(torch.Size(param.shape).numel())


def _fsdp1_unit_size(unit: Unit) -> None:
    # FSDP1 (use_orig_params) exposes each original parameter as a 1-D slice of this rank's shard; the flat
    # parameter remembers the original sizes.
    numels = _torch_compat.fsdp1_flat_param_numels(unit.module)
    if numels is not None:
        unit.num_params = len(numels)
        unit.numel = sum(numels)


def describe_layout(module: nn.Module, world_size: int = 1, optimizer_states: int = 2) -> str:
    """A short sharding summary: units, replicated leftovers, and an estimate of per-rank memory.

    The estimate counts parameters + gradients + `optimizer_states` fp32 states per parameter (2 for Adam):
    unit parameters divided by `world_size`, leftovers whole on every rank.
    """
    layout = analyze(module)
    if _placed_beyond_fsdp(module, layout):
        return _describe_distributed(module, layout, world_size, optimizer_states)
    lines = []
    bytes_per = 4
    sharded = sum(u.numel for u in layout.units)
    replicated = sum(p.numel() for _, p in layout.leftovers)
    lines.append(f"Sharding summary ({world_size} rank{'s' if world_size != 1 else ''}):")
    if layout.units:
        flavour = "FullyShardedDataParallel" if layout.flavours == {"fsdp"} else "fully_shard"
        root = "the root is a unit" if layout.root_is_unit else "the root is not a unit"
        lines.append(f"  {len(layout.units)} {flavour} unit(s), {root}:")
        for unit in layout.units:
            lines.append(
                f"    {unit.path or '<root>'}: {unit.num_params} parameters, {unit.numel:,} elements"
            )
    else:
        lines.append("  no FSDP units")
    if layout.leftovers:
        lines.append(
            f"  replicated on every rank (outside all units): {len(layout.leftovers)} parameters, "
            f"{replicated:,} elements"
        )
        for name, param in layout.leftovers[:12]:
            lines.append(f"    {name} {tuple(param.shape)}")
        if len(layout.leftovers) > 12:
            lines.append(f"    ... and {len(layout.leftovers) - 12} more")
    per_rank_elems = sharded / max(world_size, 1) + replicated
    mib = per_rank_elems * bytes_per / 2**20
    lines.append(
        f"  estimated per rank (fp32): parameters {mib:.2f} MiB, gradients {mib:.2f} MiB, "
        f"optimizer state {mib * optimizer_states:.2f} MiB"
    )
    return "\n".join(lines)


# ---- the summary of a model holding DTensors (tensor parallel, FSDP2 over a named mesh) --------------------------
def _placed_beyond_fsdp(module: nn.Module, layout: Layout) -> bool:
    """Whether some parameter is placed by more than 1-D FSDP2 sharding (tensor parallel, HSDP): a DTensor
    outside every unit or on a mesh of 2+ dims. Plain FSDP2 keeps the shorter summary."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return False
    if any(isinstance(p, dtensor.DTensor) for _, p in layout.leftovers):
        return True
    return any(isinstance(p, dtensor.DTensor) and p.device_mesh.ndim > 1 for p in module.parameters())


def _placement_text(param: torch.Tensor) -> str:
    """'data_parallel Shard(0), tensor_parallel Shard(0)': the placement on each dim of the parameter's mesh."""
    mesh = param.device_mesh  # type: ignore[attr-defined]
    dims = mesh.mesh_dim_names or tuple(f"dim {i}" for i in range(mesh.ndim))
    parts = []
    for dim, placement in zip(dims, param.placements, strict=True):  # type: ignore[attr-defined]
        if placement.is_shard() or type(placement).__name__ == "_StridedShard":
            # FSDP2 over a tensor-parallel Shard is a _StridedShard: to the reader, a Shard of that tensor dim.
            text = f"Shard({placement.dim})"
        elif placement.is_replicate():
            text = "Replicate"
        else:
            text = type(placement).__name__.lstrip("_")
        parts.append(f"{dim} {text}")
    return ", ".join(parts)


def _local_numel(param: torch.Tensor) -> int:
    dtensor = sys.modules["torch.distributed.tensor"]
    return param.to_local().numel() if isinstance(param, dtensor.DTensor) else param.numel()


def _describe_distributed(module: nn.Module, layout: Layout, world_size: int, optimizer_states: int) -> str:
    """The summary for DTensor parameters: each parameter's placement on its mesh, the units, the tensor-parallel
    parameters outside every unit and the plain (replicated) ones, with this rank's element counts beside the
    totals (this rank's: an uneven split gives the last ranks less)."""
    import re

    dtensor = sys.modules["torch.distributed.tensor"]
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    meshes: dict[str, int] = {}
    named = []  # (clean name, parameter), each parameter once
    seen: set[int] = set()
    for name, param in module.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        named.append((clean_name(name), param))
        if isinstance(param, dtensor.DTensor) and param.device_mesh.mesh_dim_names:
            for dim, size in zip(param.device_mesh.mesh_dim_names, param.device_mesh.shape, strict=True):
                meshes.setdefault(dim, size)
    total = sum(_global_numel(p) for _, p in named)
    local = sum(_local_numel(p) for _, p in named)
    mesh_text = " x ".join(f"{dim} {size}" for dim, size in meshes.items())
    lines = [
        f"Sharding summary ({world_size} rank{'s' if world_size != 1 else ''}, mesh {mesh_text}; "
        f"'per rank' counts are rank {rank}'s):"
    ]
    # One line per parameter name with the block index as '*': a 32-layer model gives one line per weight kind.
    groups: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], int] = {}
    for name, param in named:
        if isinstance(param, dtensor.DTensor):
            key = (
                re.sub(r"\.\d+\.", ".*.", name),
                tuple(param.shape),
                tuple(param.to_local().shape),
                _placement_text(param),
            )
            groups[key] = groups.get(key, 0) + 1
    lines.append("  placements (global shape -> this rank's piece: placement on each mesh dim):")
    for (name, shape, piece, placement), n in groups.items():
        lines.append(f"    {name}{f' x{n}' if n > 1 else ''} {shape} -> {piece}: {placement}")
    if layout.units:
        root = "the root is a unit" if layout.root_is_unit else "the root is not a unit"
        lines.append(f"  {len(layout.units)} fully_shard unit(s), {root}:")
        for unit in layout.units:
            own = [p for p in unit.module.parameters() if _owner_unit(layout, unit, p)]
            lines.append(
                f"    {unit.path or '<root>'}: {unit.num_params} parameters, {unit.numel:,} elements, "
                f"{sum(_local_numel(p) for p in own):,} per rank"
            )
    else:
        lines.append("  no FSDP units")
    split = [(n, p) for n, p in layout.leftovers if isinstance(p, dtensor.DTensor)]
    plain = [(n, p) for n, p in layout.leftovers if not isinstance(p, dtensor.DTensor)]
    if split:
        lines.append(
            f"  tensor-parallel outside all units (split as placed above, not sharded further): {len(split)} "
            f"parameters, {sum(_global_numel(p) for _, p in split):,} elements, "
            f"{sum(_local_numel(p) for _, p in split):,} per rank"
        )
    if plain:
        lines.append(
            f"  replicated on every rank (outside all units): {len(plain)} parameters, "
            f"{sum(p.numel() for _, p in plain):,} elements"
        )
        for name, param in plain[:12]:
            lines.append(f"    {name} {tuple(param.shape)}")
        if len(plain) > 12:
            lines.append(f"    ... and {len(plain) - 12} more")
    lines.append(f"  per rank: {local:,} of {total:,} parameter elements")
    mib = local * 4 / 2**20
    lines.append(
        f"  per rank (fp32): parameters {mib:.2f} MiB, gradients {mib:.2f} MiB, "
        f"optimizer state {mib * optimizer_states:.2f} MiB"
    )
    return "\n".join(lines)


def _owner_unit(layout: Layout, unit: Unit, param: torch.Tensor) -> bool:
    """Whether `unit` itself manages `param` (not a unit nested inside it)."""
    inner = [u for u in layout.units if u is not unit and any(m is u.module for m in unit.module.modules())]
    return not any(any(q is param for q in u.module.parameters()) for u in inner)
