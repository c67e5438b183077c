"""Refusals of unit layouts the sharded strategies cannot train correctly, checked in `setup_module` before any
collective: FSDP1 and FSDP2 units mixed (or of the other strategy's flavour), and tied parameters split by a unit
boundary, and BatchNorms in units of low-precision parameters."""

from __future__ import annotations

import torch
from torch import nn

from torchloom import _torch_compat
from torchloom._layout import Layout, Unit, clean_name, unit_flavour
from torchloom.errors import MisuseError


def check_flavours(layout: Layout, flavour: str, strategy_name: str) -> None:
    """Refuse units of both flavours, or only of the flavour the strategy `flavour` does not run."""
    other = {"fsdp": "fsdp2", "fsdp2": "fsdp"}[flavour]
    kinds = {"fsdp": "FullyShardedDataParallel (FSDP1)", "fsdp2": "fully_shard (FSDP2)"}
    if len(layout.flavours) > 1:
        raise MisuseError(
            "The model mixes FullyShardedDataParallel (FSDP1) units and fully_shard (FSDP2) units, which "
            "cannot train together. Shard every unit with one of them."
        )
    if layout.flavours == {other}:
        raise MisuseError(
            f"The model's units were made with {kinds[other]}, but the strategy is {strategy_name!r}. Use "
            f"strategy={other!r}."
        )


def check_split_ties(layout: Layout, made_by: str = "") -> None:
    """Refuse a tied parameter that a unit boundary splits (`tests/test_hf_models.py` found it with GPT-2's
    tied embeddings and head): FSDP2 silently trains two copies, FSDP1 crashes with a shape error. Also
    one held by two units (the scenario engine found it): FSDP2 trains two copies, FSDP1 aborts the ranks.
    Runs on the user's units before sharding and again on those the policy made (`made_by`): a policy leaves out
    the modules that would split a tie (`_policies.tie_splitters`), so there it is only a safety net."""
    if layout.ties_across_units:
        first, second = layout.ties_across_units[0]
        users = " and ".join(
            f"module '{_owner_path(name)}' (in unit '{_unit_path(layout, name) or '<root>'}')"
            for name in (first, second)
        )
        fix = (
            "leave both out of the policy, so that the unit of their common parent (the root) shards the "
            "tied weight once"
            if made_by
            else "wrap neither, so that the unit of their common parent shards the tied weight once (the "
            "root: unsharded_params='shard'), or make no unit of either (they stay replicated), or let the "
            "strategy's wrapping policy make the units (it places a tied weight in the unit of all its users)"
        )
        raise MisuseError(
            f"Parameters '{first}' and '{second}' are tied (the same tensor) but sit in two different FSDP "
            f"units{' made by ' + made_by if made_by else ''}: {users}. Each unit shards its own copy, "
            "so the tie would be broken: the copies would train apart (fully_shard) or the ranks would "
            f"crash (FullyShardedDataParallel). Keep every module that uses it in one unit: {fix}. Both "
            "strategy='fsdp' and 'fsdp2' need this (torchloom does not take fully_shard([module_a, "
            "module_b]) as one unit)."
        )
    if not layout.split_ties:
        return
    outside, inside = layout.split_ties[0]
    partner = f"'{inside}' inside an FSDP unit" if inside else "a parameter fully_shard() moved into a unit"
    raise MisuseError(
        f"Parameter '{outside}' is outside every FSDP unit but tied to (the same tensor as) {partner}, e.g. "
        "tied input embeddings and output head with only the embedding in a unit. FSDP shards a parameter "
        "only for the modules of its own unit, so the tie would be broken: the copies would train apart "
        "(fully_shard) or the module outside would see a shard (FullyShardedDataParallel). Keep every "
        "module that uses it on one side: make no unit of the shared module (it stays replicated), or a "
        "unit that contains all its users (e.g. the root: unsharded_params='shard')."
    )


def _owner_path(param_name: str) -> str:
    return param_name.rpartition(".")[0] or "<root>"


def _unit_path(layout: Layout, param_name: str) -> str:
    """The path of the innermost unit around the module that holds `param_name` ("" for a root unit)."""
    module = param_name.rpartition(".")[0]
    paths = [
        u.path for u in layout.units if not u.path or module == u.path or module.startswith(u.path + ".")
    ]
    return max(paths, key=len, default="")


# ---- BatchNorm under a unit's mixed precision ------------------------------------------------------------------
def needs_full_precision(module: nn.Module, param_dtype: torch.dtype | None) -> bool:
    """Whether `module` is a BatchNorm that cannot run in a unit whose mixed precision casts parameters to
    `param_dtype`: the unit casts its weight and bias, not its running statistics (buffers), and torch's
    batch_norm refuses a low-precision weight beside full-precision statistics ("expected scalar type BFloat16
    but found Float"). Under one process, autocast leaves BatchNorm in full precision (its input may be low)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    if param_dtype is None or not isinstance(module, _BatchNorm):
        return False
    stats = module.running_mean
    return (
        stats is not None
        and any(True for _ in module.parameters(recurse=False))
        and stats.dtype != param_dtype
    )


def full_precision_batchnorms(
    module: nn.Module, param_dtype: torch.dtype | None
) -> list[tuple[str, nn.Module]]:
    """(path, module) of every BatchNorm in `module` outside every unit that needs a full-precision unit of its
    own under `param_dtype` (see `needs_full_precision`), deepest first; `module` itself ("") included."""
    found: list[tuple[str, nn.Module]] = []

    def visit(mod: nn.Module, path: str) -> None:
        if path and unit_flavour(mod) is not None:
            return  # a unit already: its BatchNorms are its own (see check_batchnorm_units)
        for name, child in mod.named_children():
            visit(child, f"{path}.{name}" if path else name)
        if needs_full_precision(mod, param_dtype):
            found.append((path, mod))

    visit(module, "")
    return found


def unit_param_dtype(unit: Unit) -> torch.dtype | None:
    """The dtype a unit's mixed precision computes its parameters in (None: their own)."""
    if unit.flavour == "fsdp2":
        return _torch_compat.fsdp2_param_dtype(unit.module)
    policy = getattr(unit.module, "mixed_precision", None)
    return getattr(policy, "param_dtype", None)


def check_batchnorm_units(layout: Layout) -> None:
    """Refuse a BatchNorm inside a unit that casts its parameters to a low precision (made by hand: the units
    torchloom makes give each such BatchNorm a full-precision unit of its own, as FSDP1's auto-wrap policy does):
    its first forward would fail in torch's batch_norm."""
    for unit in layout.units:
        dtype = unit_param_dtype(unit)
        if dtype is None:
            continue
        if needs_full_precision(unit.module, dtype):
            found = [("", unit.module)]
        else:  # the unit's own modules, not those of units nested in it
            found = [(p, m) for p, m in full_precision_batchnorms(unit.module, dtype) if p]
        if not found:
            continue
        name = ".".join(n for n in (unit.path, clean_name(found[0][0] + ".")[:-1]) if n) or "<root>"
        raise MisuseError(
            f"The BatchNorm '{name}' sits in the FSDP unit '{unit.path or '<root>'}', whose mixed precision "
            f"casts its weight to {dtype} but not its running statistics (float32): torch's batch_norm would "
            "fail in the first forward ('expected scalar type ... but found Float'). Give each BatchNorm a unit "
            f"of its own in full precision, made before the unit around it (its input stays in {dtype}, as "
            "under autocast): fully_shard(bn, **{**loom.strategy.unit_kwargs(), 'mp_policy': "
            "MixedPrecisionPolicy()}) (FSDP2), FullyShardedDataParallel(bn) without mixed_precision (FSDP1); or "
            "let the strategy make the units (a shard_policy or auto_wrap_policy, or wrap() inside "
            "loom.init_module() under strategy='fsdp'), which does this for you."
        )
