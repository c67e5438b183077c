"""Oracle (c): the combinations that must raise, each with its reason and the error it must raise.

A scenario that matches a refusal must fail on every rank with that error type (or a subclass) and a message
containing the fragment; a scenario that matches none may not raise at all. To declare one, add a `Refusal`
whose `applies` is a predicate over the scenario, and say why the combination cannot be right.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .axes import Scenario


@dataclass(frozen=True)
class Refusal:
    name: str
    applies: Callable[[Scenario], bool]
    error: str  # the class name that must be in the raised error's MRO
    fragment: str  # a piece of the message
    reason: str
    phase: str = "train"  # where the refusal happens: "train" (set-up or training) or "resume" (the load)


REFUSALS: list[Refusal] = []


def declared(scenario: Scenario, phase: str) -> Refusal | None:
    for refusal in REFUSALS:
        if refusal.phase == phase and refusal.applies(scenario):
            return refusal
    return None


REFUSALS.append(
    Refusal(
        name="tie across units",
        applies=lambda s: (
            s.strategy in ("fsdp", "fsdp2") and s.tied and s.units == "hand" and not s.leftovers
        ),
        error="MisuseError",
        fragment="sit in two different FSDP units",
        reason="the tied input and output projections are each made a unit: each unit would shard its own copy "
        "of the shared weight (fully_shard trains two copies apart; FSDP1 aborts the ranks in a collective)",
    )
)
REFUSALS.append(
    Refusal(
        name="fused SGD on DTensors",
        # Under fsdp2 every parameter in a unit is a DTensor; "none" puts everything in the root unit.
        applies=lambda s: s.strategy == "fsdp2" and s.optimizer == "sgd" and s.impl == "fused",
        error="MisuseError",
        fragment="SGD(fused=True) cannot update sharded parameters",
        reason="torch has no DTensor version of fused SGD's kernel (aten._fused_sgd_); fused Adam/AdamW have one",
    )
)
REFUSALS.append(
    Refusal(
        name="fused SGD on bf16 CPU parameters",
        # Every scenario runs on the CPU; fsdp2 is refused above (DTensors). Asked of the installed torch's kernel.
        applies=lambda s: (
            s.strategy != "fsdp2"
            and s.optimizer == "sgd"
            and s.impl == "fused"
            and s.precision == "bf16-true"
            and _fused_sgd_drops_bf16()
        ),
        error="MisuseError",
        fragment="torch.optim.SGD(fused=True) does not update bfloat16 parameters",
        reason="torch's fused CPU SGD kernel skips every full SIMD block of bf16/fp16 parameters "
        "(pytorch/pytorch#191763): found under fsdp at 2 ranks (2.3-2.9x the update off one process), as wrong "
        "in one process",
    )
)


def _fused_sgd_drops_bf16() -> bool:
    import torch

    from torchloom.loom import _fused_sgd_drops

    return _fused_sgd_drops(torch.device("cpu"), torch.bfloat16)


REFUSALS.append(
    Refusal(
        name="FSDP1 unit split between optimizers",
        # "none": the root is the one unit, holding the blocks (first optimizer) and the rest (second).
        applies=lambda s: s.strategy == "fsdp" and s.n_opt == 2 and s.units == "none",
        error="MisuseError",
        fragment="Under strategy='fsdp' each unit's parameters are one flattened tensor",
        reason="FSDP1 flattens a unit's parameters into one tensor; torch cannot give the state of an optimizer "
        "that holds part of it, so saving failed on some ranks and left the others waiting",
    )
)


@dataclass(frozen=True)
class KnownFailure:
    """A defect the engine found and that is not fixed yet: its scenarios are reported as expected failures
    (and not run, where running one costs a dead rank group)."""

    name: str
    applies: Callable[[Scenario], bool]
    reason: str
    runs: bool = True  # False: running it kills its rank group, so it is not run


KNOWN_FAILURES: list[KnownFailure] = [
    KnownFailure(
        name="FSDP1 NO_SHARD tied mixed-precision accumulation",
        applies=lambda s: (
            s.strategy == "fsdp"
            and s.tied
            and s.precision in ("bf16-mixed", "16-mixed")
            and s.accum == "no_backward_sync"
            and not (s.units == "hand" and s.leftovers)  # then the tied weight is a replicated leftover: fine
            and (s.world_size == 1 or (s.saves and s.load_world_size == 1))
        ),
        reason="under strategy='fsdp' on one process (FSDP1 runs its units NO_SHARD), a weight tied inside a "
        "unit, mixed precision and no_backward_sync: the forward after an accumulated backward raises torch's "
        "'attempting to assign a gradient with dtype Half/BFloat16 to a tensor with grad_dtype Float' "
        "(FSDP1's _use_sharded_flat_param); 2 ranks pass",
    ),
]


def known_failure(scenario: Scenario) -> KnownFailure | None:
    known = next((k for k in KNOWN_FAILURES if k.applies(scenario)), None)
    if known is not None and not known.runs:
        return known  # the ranks die before the declared refusal can be raised
    if declared(scenario, "train") is not None:
        return None  # refused before the defect could show
    return known
