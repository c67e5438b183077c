"""A weight tied between pipeline stages (an input embedding and the output head), trained as Megatron trains it:
each stage that uses it holds a copy of its own, all copies start from one value, and after each synchronising
backward the copies' gradients are summed over a process group of exactly the ranks that hold one, so every copy
takes the same step and they stay equal. The copy of the lowest stage stands for the weight in the gradient norm
and in checkpoints, which hold it once, under the model's names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchloom._layout import COUNTED_ELSEWHERE, clean_name


@dataclass
class Tie:
    """One tied weight: its names in the model (model order: `names[0]` is the name `named_parameters()` and one
    process's optimizer state use), the stages that hold a copy, and this rank's copies."""

    names: list[str]
    stages: list[int]
    pp_ranks: list[int]
    trainable: bool
    #: This rank's copies, (stage, parameter), one per stage (the names of one stage share one parameter).
    copies: list[tuple[int, nn.Parameter]] = field(default_factory=list)
    #: The ranks of the copies at this rank's data- and tensor-parallel place (None: all copies on this rank).
    group: dist.ProcessGroup | None = None
    #: The global rank holding the lowest stage's copy at this rank's place.
    source: int = 0

    @property
    def spans_ranks(self) -> bool:
        return len(self.pp_ranks) > 1

    @property
    def lowest(self) -> int:
        return self.stages[0]


def plan(
    groups: list[list[str]],
    trainable: list[bool],
    holdings: Sequence[dict[int, list[tuple[int, list[str], bool]]]],
    pp_rank_of: dict[int, int],
) -> list[Tie]:
    """The ties held on two or more stages (a tie inside one stage is one parameter there, as in the model), from
    every rank's `_split.tie_holdings`."""
    where: dict[int, set[int]] = {}
    for rank_holdings in holdings:
        for stage, touched in rank_holdings.items():
            for g, _, _ in touched:
                where.setdefault(g, set()).add(stage)
    ties = []
    for g, stages in sorted(where.items()):
        if len(stages) > 1:
            ordered = sorted(stages)
            ranks = sorted({pp_rank_of[s] for s in ordered})
            ties.append(Tie(list(groups[g]), ordered, ranks, trainable[g]))
    return ties


def _slots(stage: nn.Module, names: Sequence[str]) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(name, owning module, attribute, parameter) for each name of a tie that `stage` holds, in the tie's order."""
    found = {}
    for name, p in stage.named_parameters(remove_duplicate=False):
        clean = clean_name(name)
        if clean in names and clean not in found:
            owner, _, leaf = name.rpartition(".")
            found[clean] = (clean, stage.get_submodule(owner), leaf, p)
    return [found[n] for n in names if n in found]


def drop_unused(stages: dict[int, nn.Module], groups: list[list[str]]) -> None:
    """Take out of a traced stage the copies of a tied weight that its graph never reads: torch's tracer moves a
    tied weight under its other names into a stage that uses only one of them (the head's name into the
    embedding's stage), and such a copy would be trained and saved like a real one."""
    for stage in stages.values():
        if not isinstance(stage, torch.fx.GraphModule):
            continue
        targets = [str(n.target) for n in stage.graph.nodes if n.op in ("call_module", "get_attr")]
        for names in groups:
            slots = _slots(stage, names)
            unused = [s for s in slots if not any(s[0] == t or s[0].startswith(t + ".") for t in targets)]
            if len(unused) < len(slots):  # the stage reads the weight by another name: the others go
                for _, owner, leaf, _ in unused:
                    del owner._parameters[leaf]


def retie(stages: dict[int, nn.Module], groups: list[list[str]]) -> None:
    """Each stage holds one parameter per tied weight, under every name of it the stage has (torch's tracer
    copies a tied weight into each stage that touches it, as separate tensors; `materialize` allocates each
    module's own), and no parameter is shared between two stages (a split_fn that hands the model's own modules
    to two stages of one rank): each stage trains a copy of its own, summed with the others by `sum_grads`."""
    taken: set[int] = set()
    for i in sorted(stages):
        for names in groups:
            slots = _slots(stages[i], names)
            if not slots:
                continue
            first = slots[0][3]
            if id(first) in taken:  # another stage of this rank holds this very parameter: a copy of its own
                first = nn.Parameter(first.detach().clone(), requires_grad=first.requires_grad)
            taken.add(id(first))
            for _, owner, leaf, _ in slots:
                owner._parameters[leaf] = first


def make_groups(ties: list[Tie], mesh: Any, backend: str | None) -> None:
    """One process group per tie and data/tensor-parallel place, of the ranks holding a copy there; made on every
    rank in the same order (`new_group` is collective), once, at setup."""
    grid = mesh.mesh  # (pipeline, data, tensor) -> global rank
    me = dist.get_rank()
    for tie in ties:
        places = [
            [int(grid[r, d, t]) for r in tie.pp_ranks]
            for d in range(grid.shape[1])
            for t in range(grid.shape[2])
        ]
        if tie.spans_ranks:
            tie.group, _ = dist.new_subgroups_by_enumeration(places, backend=backend)
        mine = next((place for place in places if me in place), None)
        tie.source = mine[0] if mine is not None else me


def collect(ties: list[Tie], stages: dict[int, nn.Module]) -> None:
    """This rank's copies of each tie (again after parallelize_fn, which may replace parameters), the lowest
    stage's standing for the weight in the norm and every other marked as counted elsewhere."""
    for tie in ties:
        tie.copies = []
        for i in sorted(stages):
            slots = _slots(stages[i], tie.names)
            if slots:
                p = slots[0][3]
                tie.copies.append((i, p))
                if i != tie.lowest:
                    setattr(p, COUNTED_ELSEWHERE, True)


@torch.no_grad()
def sync_values(ties: list[Tie]) -> None:
    """Every copy takes the lowest stage's values (one process's model holds one tensor: a meta-device model
    initialises each user's copy by its own module, and only the first user's draw is the weight's)."""
    for tie in ties:
        if not tie.copies:
            continue
        first = tie.copies[0][1]
        if tie.group is not None:
            dist.broadcast(first.data, src=tie.source, group=tie.group)
        for _, p in tie.copies[1:]:
            p.data.copy_(first.data)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


Bases = list[list[torch.Tensor | None]]


@torch.no_grad()
def window_start(ties: list[Tie]) -> Bases:
    """Each copy's gradient as an accumulation window starts (the first batch after a sum): the last sum's (equal
    on every copy), zeros, or none. `sum_grads` adds up only what the batches since then brought: summing the
    accumulated gradients themselves would count an earlier batch's sum once per copy again (accumulation
    without `no_backward_sync` syncs, and sums, at every batch)."""
    return [
        [_local(p.grad).clone() if p.grad is not None else None for _, p in tie.copies]
        if tie.trainable
        else []
        for tie in ties
    ]


@torch.no_grad()
def sum_grads(ties: list[Tie], bases: Bases) -> None:
    """Each copy's gradient becomes its window's start plus the sum of every copy's increment since: what the one
    tied parameter of one process gets (a copy without a gradient adds zeros, so every rank of the group issues
    the same all-reduce)."""
    for tie, start in zip(ties, bases, strict=True):
        if not tie.trainable or not tie.copies:
            continue
        grads = []
        for _, p in tie.copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        total = torch.zeros_like(grads[0])
        for g, base in zip(grads, start, strict=True):
            total.add_(g)
            if base is not None:
                total.sub_(base)
        if tie.group is not None:
            dist.all_reduce(total, group=tie.group)
        for g, base in zip(grads, start, strict=True):
            if base is None:
                g.copy_(total)
            else:
                torch.add(base, total, out=g)


def layout_problems(ties: list[Tie]) -> list[tuple[int, int, str]]:
    """(tie, stage, how the copy is laid out) for this rank's copies: gathered from every rank, the copies of a
    tie must be laid out alike for their local gradients to be summed."""
    return [(k, stage, _layout_text(p)) for k, tie in enumerate(ties) for stage, p in tie.copies]


def _layout_text(p: torch.Tensor) -> str:
    if hasattr(p, "placements"):
        mesh = p.device_mesh  # type: ignore[attr-defined]
        dims = mesh.mesh_dim_names or ()
        placed = ", ".join(f"{d} {pl}" for d, pl in zip(dims, p.placements, strict=False))  # type: ignore[attr-defined]
        return f"a DTensor ({placed}) of shape {tuple(p.shape)}"
    return f"a plain tensor of shape {tuple(p.shape)}"


def mismatches(ties: list[Tie], everyone: Sequence[list[tuple[int, int, str]]]) -> list[str]:
    """The ties whose copies are laid out differently on their stages (one sharded by fully_shard, the other
    plain; or split unlike by tensor parallelism): refused on every rank together."""
    layouts: dict[int, dict[int, str]] = {}
    for rank_layouts in everyone:
        for k, stage, text in rank_layouts:
            layouts.setdefault(k, {})[stage] = text
    problems = []
    for k, by_stage in sorted(layouts.items()):
        if len(set(by_stage.values())) > 1:
            tied = " and ".join(repr(n) for n in ties[k].names)
            placed = "; ".join(f"stage {s}: {text}" for s, text in sorted(by_stage.items()))
            problems.append(
                f"the model ties {tied}, and each stage that uses it trains a copy whose gradients are summed "
                f"over the stages; parallelize_fn laid the copies out differently ({placed}), so their local "
                "gradients cannot be summed. Treat every module that uses the tied weight alike in "
                "parallelize_fn: fully_shard each of them (or none), with the same tensor-parallel style"
            )
    return problems


# ---- checkpoints: the weight once, under the model's names -------------------------------------------------------
def alias_names(state: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """A whole model's state dict with every name of a tied weight holding one tensor (the first name's, as one
    process's state dict does: `torch.save` writes it once); names missing from `state` filled the same way."""
    for names in groups:
        present = next((n for n in names if n in state), None)
        if present is not None:
            for n in names:
                state[n] = state[present]
    return state


def optimizer_to_model_names(state: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """A stage's optimizer state dict with each copy's state under the weight's first name (as one process's
    optimizer state dict holds it): the copies' states are equal, so the stages' pieces merge into one."""
    rename = {n: names[0] for names in groups for n in names[1:]}
    if not rename:
        return state
    return {
        **state,
        "state": {rename.get(k, k): v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": list(dict.fromkeys(rename.get(n, n) for n in g["params"]))}
            for g in state["param_groups"]
        ],
    }


def optimizer_to_stage_names(state: dict[str, Any], groups: list[list[str]], own: set[str]) -> dict[str, Any]:
    """A whole model's optimizer state dict, saved under each weight's first name, with the state a stage's copy
    needs under the name the stage holds it by (e.g. the head's copy of a tied embedding)."""
    out = {**state, "state": dict(state["state"]), "param_groups": [dict(g) for g in state["param_groups"]]}
    listed = {n for g in out["param_groups"] for n in g["params"]}
    for names in groups:
        # Found by its param group too: an optimizer without state (SGD without momentum) saves none for it.
        saved = next((n for n in names if n in out["state"]), None) or next(
            (n for n in names if n in listed), None
        )
        mine = [n for n in names if n in own and n != saved]
        for name in mine:
            if saved in out["state"]:  # a copy of its own: two copies on one rank step their own state
                out["state"][name] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out["state"][saved].items()
                }
            for g in out["param_groups"]:
                if saved in g["params"] and name not in g["params"]:
                    g["params"] = [*g["params"], name]
    return out
