"""Oracle (c): the combinations that must raise, each with its reason and the error it must raise.

A scenario that matches a refusal must fail on every rank with that error type (or a subclass) and a message
containing the fragment; a scenario that matches none may not raise at all. To declare one, add a `Refusal`
whose `applies` is a predicate over the scenario, and say why the combination cannot be right.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .axes import Scenario
from .model import EVALUATE_AFTER


@dataclass(frozen=True)
class Refusal:
    name: str
    applies: Callable[[Scenario], bool]
    error: str  # the class name that must be in the raised error's MRO
    fragment: str  # a piece of the message
    reason: str
    phase: str = "train"  # where the refusal happens: "train" (set-up or training) or "resume" (the load)


REFUSALS: list[Refusal] = []


def declared_all(scenario: Scenario, phase: str) -> list[Refusal]:
    """Every refusal that applies to the scenario in that phase."""
    return [r for r in REFUSALS if r.phase == phase and r.applies(scenario)]


def declared(scenario: Scenario, phase: str) -> Refusal | None:
    """The first refusal that applies (any of `declared_all` may be the one raised)."""
    found = declared_all(scenario, phase)
    return found[0] if found else None


REFUSALS.append(
    Refusal(
        name="tie across units",
        applies=lambda s: (
            s.strategy in ("fsdp", "fsdp2", "model_parallel", "pipeline")
            and s.tied
            and s.units == "hand"
            and not s.leftovers
            # Under a pipeline of several stages the two units lie on different stages: each stage holds a copy,
            # their gradients summed (issue 44 item 16); in one stage it is a tie across units as under fsdp2.
            and not (s.strategy == "pipeline" and s.num_stages("train") > 1)
        ),
        error="MisuseError",
        fragment="sit in two different FSDP units",
        reason="the tied input and output projections are each made a unit: each unit would shard its own copy "
        "of the shared weight (fully_shard trains two copies apart; FSDP1 aborts the ranks in a collective)",
    )
)


REFUSALS.append(
    Refusal(
        name="BatchNorm in a hand-made fully_shard unit under mixed precision",
        applies=lambda s: (
            s.batchnorm
            and s.precision in ("bf16-mixed", "16-mixed")
            and s.strategy in ("fsdp2", "model_parallel", "pipeline")
            and s.units == "hand"
            and not s.leftovers  # then the BatchNorm is a replicated leftover, under autocast: fine
        ),
        error="MisuseError",
        fragment="Give each BatchNorm a unit of its own in full precision",
        reason="the user's fully_shard(bn, **unit_kwargs()) casts the BatchNorm's weight to the compute dtype, "
        "not its running statistics: torch's batch_norm fails in the first forward. The units torchloom makes "
        "(a policy, the root, FSDP1's wrap()) give a BatchNorm a full-precision unit of its own",
    )
)


def _dtensors(s: Scenario, phase: str) -> bool:
    """Whether the phase's parameters are DTensors: every fsdp2 and model_parallel parameter (fsdp2's "none" puts
    everything in the root unit); under the pipeline, split_fn's tensor-parallel blocks or fully_shard units
    (traced stages without units are plain)."""
    if s.pipelined(phase):
        return s.split == "fn" or s.units == "hand"
    return (s.strategy if phase == "train" else _load_strategy(s)) in ("fsdp2", "model_parallel")


for _phase in ("train", "resume"):
    REFUSALS.append(
        Refusal(
            name="fused SGD on DTensors",
            # at the load only where training ran (a pipeline without DTensors resumed in fsdp2)
            applies=lambda s, phase=_phase: (
                s.optimizer in ("sgd", "plain_sgd")
                and s.impl == "fused"
                and _dtensors(s, phase)
                and (phase == "train" or not _dtensors(s, "train"))
            ),
            error="MisuseError",
            fragment="SGD(fused=True) cannot update sharded parameters",
            reason="torch has no DTensor version of fused SGD's kernel (aten._fused_sgd_); fused Adam/AdamW have "
            "one",
            phase=_phase,
        )
    )
REFUSALS.append(
    Refusal(
        name="fused SGD on bf16 CPU parameters",
        # Every scenario runs on the CPU; fsdp2 is refused above (DTensors). Asked of the installed torch's kernel.
        applies=lambda s: (
            s.strategy != "fsdp2"
            and s.optimizer in ("sgd", "plain_sgd")
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

    from torchloom._optimizer_checks import fused_sgd_drops

    return fused_sgd_drops(torch.device("cpu"), torch.bfloat16)


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

for _phase in ("train", "resume"):
    REFUSALS.append(
        Refusal(
            name="tensor-parallel DTensors outside units in a data-parallel pipeline",
            # _parallelize makes split_fn's blocks' MLPs tensor-parallel DTensors (also on a tensor-parallel mesh of
            # 1); traced stages (split_points) get no tensor-parallel plan.
            applies=lambda s, phase=_phase: (
                s.pipelined(phase) and s.split == "fn" and s.units == "none" and s.dp(phase) > 1
            ),
            error="MisuseError",
            fragment="are tensor-parallel DTensors outside every fully_shard unit",
            reason="no unit reduces their gradients over the data-parallel ranks, and the plain-gradient "
            "averaging leaves DTensors alone: the replicas trained apart (0.04 off one process, silently)",
            phase=_phase,
        )
    )

REFUSALS.append(
    Refusal(
        name="cpu_offload on a CPU job",
        applies=lambda s: s.offload,
        error="ConfigurationError",
        fragment="but this job already runs on the CPU",
        reason="cpu_offload moves sharded parameters from the GPU to host memory: on a CPU job there is nothing "
        "to offload (the CUDA suite runs offload)",
    )
)

for _phase in ("train", "resume"):
    REFUSALS.append(
        Refusal(
            name="tensor-parallel leftovers with data parallel",
            # The sequence-parallel final norm outside every unit is a tensor-parallel DTensor that no unit
            # averages over the data-parallel ranks.
            applies=lambda s, phase=_phase: (
                (s.strategy == "model_parallel" or s.pipelined(phase))
                and s.seq_parallel == "blocks+norm"
                and s.leftovers
                and s.dp(phase) > 1
            ),
            error="MisuseError",
            fragment="are tensor-parallel DTensors outside every fully_shard unit",
            reason="parameters that parallelize_fn made tensor-parallel but left outside every fully_shard unit "
            "have no data-parallel gradient averaging (the user must put them in a unit)",
            phase=_phase,
        )
    )


REFUSALS.append(
    Refusal(
        name="a strategy without a data-parallel dimension across replica groups",
        applies=lambda s: s.replicas > 1 and s.strategy in ("single", "fsdp", "pipeline"),
        error="ConfigurationError",
        fragment="inside a replica group",
        reason="the groups average their gradients and heal piece by piece: one process has no group to run in "
        "(a group of one runs ddp), FSDP1's flat parameters hold no piece a peer shares, and a pipeline's "
        "gradients and state are its stages' (not averaged or healed across groups in this version)",
    )
)


# ---- pipeline ----------------------------------------------------------------------------------------------------
def _per_rank_batch(s: Scenario, phase: str) -> int:
    from .model import GLOBAL_BATCH

    return GLOBAL_BATCH // s.readers(phase) * (2 if s.loop == "two_loaders" else 1)


for _phase in ("train", "resume"):
    REFUSALS += [
        Refusal(
            name="zero-bubble schedules with fully_shard units",
            applies=lambda s, phase=_phase: (
                s.pipelined(phase)
                and s.schedule in ("interleaved_zero_bubble", "zbv_zero_bubble")
                and s.units == "hand"
            ),
            error="MisuseError",
            fragment="with fully_shard units in the stages",
            reason="the zero-bubble schedules compute weight gradients in a pass of their own, after FSDP2 has "
            "resharded the unit (torch raised in stage_backward_weight while the peers waited for the timeout)",
            phase=_phase,
        ),
        Refusal(
            name="1f1b with fewer micro-batches than stages",
            applies=lambda s, phase=_phase: (
                s.pipelined(phase) and s.schedule == "1f1b" and s.microbatches < s.num_stages(phase)
            ),
            error="ConfigurationError",
            fragment="needs at least as many micro-batches as stages",
            reason="torch's 1F1B cannot fill its warm-up with fewer micro-batches than stages",
            phase=_phase,
        ),
        Refusal(
            name="micro-batches that do not divide the batch",
            applies=lambda s, phase=_phase: s.pipelined(phase) and _per_rank_batch(s, phase) % s.microbatches,
            error="MisuseValueError",
            fragment="micro-batches do not divide",
            reason="unequal micro-batches would weigh their samples unequally in the mean loss",
            phase=_phase,
        ),
        Refusal(
            name="evaluate through a V schedule",
            # the evaluate axis runs after step 2: in the resume phase only when the checkpoint came before it
            applies=lambda s, phase=_phase: (
                s.pipelined(phase)
                and s.schedule == "zbv_zero_bubble"
                and s.evaluate
                and (phase == "train" or s.save_step < EVALUATE_AFTER)
            ),
            error="MisuseError",
            fragment="loom.evaluate cannot run through schedule='zbv_zero_bubble'",
            reason="torch 2.13's schedule.eval of a V-shaped schedule runs its backward actions and fails where the "
            "two stages of a rank meet",
            phase=_phase,
        ),
        Refusal(
            name="split_points through a model built empty with a BatchNorm",
            applies=lambda s, phase=_phase: (
                s.pipelined(phase) and s.split == "points" and s.batchnorm and s.empty_init
            ),
            error="MisuseError",
            fragment="torch's tracer failed",
            reason="init_module(empty_init=True) puts parameters on the meta device and keeps buffers real (the "
            "BatchNorm's statistics), and torch's tracer cannot run a forward that mixes the two: refused at "
            "setup_module naming split_fn as the fix (tracing with the buffers on meta is the open fix)",
            phase=_phase,
        ),
        Refusal(
            name="model.eval() on traced stages with a BatchNorm",
            applies=lambda s, phase=_phase: (
                s.pipelined(phase)
                and s.split == "points"
                and s.batchnorm
                and s.evaluate
                and (phase == "train" or s.save_step < EVALUATE_AFTER)
            ),
            error="MisuseError",
            fragment="The model is in eval mode, but the traced pipeline stages run",
            reason="torch's tracer fixes BatchNorm's training flag in the traced graph: under model.eval() the "
            "stage would still update its running statistics and normalise with the batch's",
            phase=_phase,
        ),
    ]


@dataclass(frozen=True)
class KnownFailure:
    """A defect the engine found and that is not fixed yet: its scenarios are reported as expected failures
    (and not run, where running one costs a dead rank group)."""

    name: str
    applies: Callable[[Scenario], bool]
    reason: str
    runs: bool = True  # False: running it kills its rank group, so it is not run
    phase: str = "train"  # where it fails: "resume" ones are preempted by a declared refusal of the load


KNOWN_FAILURES: list[KnownFailure] = [
    KnownFailure(
        name="zero-bubble schedules with compiled blocks",
        applies=lambda s: (
            s.strategy == "pipeline"
            and s.schedule in ("interleaved_zero_bubble", "zbv_zero_bubble")
            and s.compile
            and s.units != "hand"  # with units: the declared refusal
        ),
        reason="with torch.compile'd blocks (aot_eager) under ZBV, the last stage's ranks raise in the input-gradient "
        "action (1I0, step 16 of the schedule) and their pipeline peers wait in their receive for the collective "
        "timeout (pp 2 flat and pp 2 x tp 2; activation checkpointing on or off). Not reproduced by a 4-block "
        "Linear model compiled the same way (3 steps of Adam at 4 micro-batches pass): cause not found yet",
        runs=False,
    ),
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


# The defects the engine found beside issue 44's items (reports/scenarios-issue44/) are fixed; a new one goes
# here with its reproduction until it is.
KNOWN_FAILURES.append(
    KnownFailure(
        name="ModelParallelStrategy, compiled blocks with activation checkpointing",
        applies=lambda s: s.strategy == "model_parallel" and s.compile and s.act_ckpt,
        reason="found by issue 44's long run (seeds 44-46), torch's: blocks compiled (aot_eager) and checkpointed "
        "in parallelize_fn fail in torch, at dp 2 x tp 2 with 'RecursionError: maximum recursion depth exceeded' "
        "in aot_eager, and on a resume at tp 2 with torch.utils.checkpoint's 'Recomputed values ... have "
        "different metadata' (the recomputation picked another compiled graph: torch's issue 166926). One "
        "rank group runs many compiled scenarios in one process, so dynamo's caches may carry over; not "
        "reduced outside the engine yet",
    )
)


def _load_strategy(s: Scenario) -> str:
    if s.strategy == "pipeline":
        return "pipeline" if s.pipelined("resume") else s.load_pp
    return s.strategy


def known_failure(scenario: Scenario) -> KnownFailure | None:
    matching = [k for k in KNOWN_FAILURES if k.applies(scenario)]
    fatal = [k for k in matching if not k.runs]
    if fatal:
        return fatal[0]  # the ranks die before the declared refusal (or another known failure) can show
    known = matching[0] if matching else None
    if declared(scenario, "train") is not None:
        return None  # refused before the defect could show
    if known is not None and known.phase == "resume" and declared(scenario, "resume") is not None:
        return None  # the load is refused before the defect could show
    return known
