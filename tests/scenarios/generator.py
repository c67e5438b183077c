"""Which scenarios to run: a seeded set covering every feasible pair of axis values (greedy, AETG-style), or a
seeded random sample of any size."""

from __future__ import annotations

import itertools
import random
from typing import Any

from .axes import AXES, COSTLY, PIPELINE_AXES, WEIGHTS, Scenario, conflicts

Pair = tuple[tuple[str, Any], tuple[str, Any]]

# The axes of the pairwise set: every value but the costly ones (run by `extras` instead). The pipeline's own
# axes are left out (pinned to their values outside "pipeline"), so the set stays the one it was before them.
# Replica groups are pinned too (to none): `replica_scenarios` crosses them with every strategy.
PAIRWISE_AXES = {
    axis: tuple(v for v in values if v not in COSTLY.get(axis, ()))
    for axis, values in AXES.items()
    if axis not in PIPELINE_AXES and axis != "replicas"
}
NO_PIPELINE = {"pp": 1, "schedule": "none", "microbatches": 1, "load_pp": 1, "split": "fn", "replicas": 1}


def feasible_pairs(axes: dict[str, tuple[Any, ...]] = PAIRWISE_AXES) -> set[Pair]:
    """Every pair of values on two different axes that some scenario can hold."""
    pairs = set()
    for a, b in itertools.combinations(axes, 2):
        for va in axes[a]:
            for vb in axes[b]:
                if not conflicts({a: va, b: vb}):
                    pairs.add(((a, va), (b, vb)))
    return pairs


def pairs_of(values: dict[str, Any]) -> set[Pair]:
    axes = [a for a in AXES if a in values]  # the pairwise set's values lack the pipeline's axes
    return {((a, values[a]), (b, values[b])) for a, b in itertools.combinations(axes, 2)}


def _complete(rng: random.Random, start: dict[str, Any], partners: dict) -> dict[str, Any] | None:
    """Fill the remaining axes, each with the value that covers the most uncovered pairs (ties at random).
    `partners[(axis, value)]`: the (axis, value)s it still forms an uncovered pair with."""
    values = dict(start)
    axes = [a for a in PAIRWISE_AXES if a not in values]
    rng.shuffle(axes)
    for axis in axes:
        best, best_gain = [], -1
        for value in PAIRWISE_AXES[axis]:
            trial = {**values, axis: value}
            if conflicts(trial):
                continue
            gain = len(partners.get((axis, value), set()).intersection(values.items()))
            if gain > best_gain:
                best, best_gain = [value], gain
            elif gain == best_gain:
                best.append(value)
        if not best:
            return None
        values[axis] = rng.choice(best)
    return values


def pairwise(seed: int = 0, candidates: int = 20) -> list[Scenario]:
    """A list of scenarios in which every feasible pair of axis values occurs at least once."""
    rng = random.Random(seed)
    uncovered = feasible_pairs()
    partners: dict = {}
    for x, y in uncovered:
        partners.setdefault(x, set()).add(y)
        partners.setdefault(y, set()).add(x)
    chosen: list[Scenario] = []
    while uncovered:
        best, best_gain = None, 0
        ordered = sorted(uncovered, key=repr)
        for _ in range(candidates):
            (a, va), (b, vb) = rng.choice(ordered)
            values = _complete(rng, {a: va, b: vb}, partners)
            if values is None:
                continue
            gain = len(pairs_of(values) & uncovered)
            if gain > best_gain:
                best, best_gain = values, gain
        if best is None:
            raise RuntimeError("pairwise generation is stuck; a constraint in axes.conflicts is not pairwise")
        for x, y in pairs_of(best) & uncovered:
            partners[x].discard(y)
            partners[y].discard(x)
        uncovered -= pairs_of(best)
        chosen.append(Scenario.of(**best, **NO_PIPELINE))
    return chosen


def random_sample(
    count: int, seed: int, strategy: str | None = None, fixed: dict[str, Any] | None = None
) -> list[Scenario]:
    """`count` distinct scenarios: a strategy drawn uniformly (or the one given), then the other axes among the
    feasible values (rejection sampling, values weighted by axes.WEIGHTS); `fixed` axes keep the values given.
    Uniform over all feasible scenarios would give fsdp2, whose layouts are most numerous, half of them and one
    process a handful."""
    rng = random.Random(seed)
    seen: dict[str, Scenario] = {}
    tries = 0
    given = {**(fixed or {}), **({} if strategy is None else {"strategy": strategy})}
    while len(seen) < count and tries < 200 * count:
        tries += 1
        values: dict[str, Any] = dict(given)
        for axis, options in AXES.items():
            if axis in values:
                continue  # each axis among the values the earlier ones leave feasible
            feasible = [v for v in options if not conflicts({**values, axis: v})]
            if not feasible:
                break
            weights = [WEIGHTS.get(axis, {}).get(v, 1.0) for v in feasible]
            values[axis] = rng.choices(feasible, weights=weights)[0]
        if len(values) < len(AXES) or conflicts(values):
            continue
        scenario = Scenario.of(**values)
        seen.setdefault(scenario.id, scenario)
    return list(seen.values())


def baselines() -> list[Scenario]:
    """For each strategy and world size, its plainest and most sensitive run: fp32 SGD (whose step scales with
    the gradient, where Adam's does not), no clipping (which hides a gradient's scale), no accumulation, layers
    outside the units (replicated) where there are units. Pairs alone do not hold this triple together."""
    plain = {
        "mesh": "flat",
        "units": "none",
        "leftovers": False,
        "tied": False,
        "frozen": False,
        "batchnorm": False,
        "empty_init": False,
        "evaluate": False,
        "seq_parallel": False,
        "act_ckpt": False,
        "compile": False,
        "offload": False,
        "optimizer": "sgd",
        "impl": "foreach",
        "n_opt": 1,
        "groups": 1,
        "scheduler": False,
        "precision": "32-true",
        "accum": "none",
        "set_to_none": True,
        "clip": "none",
        "sampler": "auto",
        "loop": "epoch",
        "checkpoint": "none",
        "ckpt_state": "all",
        "save_step": 1,
        "load_world_size": 1,
        "load_tp": 1,
    }
    out = []
    for strategy in PAIRWISE_AXES["strategy"]:
        for world_size in PAIRWISE_AXES["world_size"]:
            values = {**plain, **NO_PIPELINE, "strategy": strategy, "world_size": world_size}
            if strategy in ("fsdp", "fsdp2", "model_parallel"):
                values.update(units="hand", leftovers=True)
            if strategy == "model_parallel":
                values.update(mesh="1x2")
            if not conflicts(values):
                out.append(Scenario.of(**values))
    return out


def regressions() -> list[Scenario]:
    """Scenarios of the random sample that found a defect, kept in `make test` once it was fixed."""
    # fsdp2 on 2 ranks, units by hand, replicated leftovers, fp32 SGD
    base = next(s for s in baselines() if s.strategy == "fsdp2" and s.world_size == 2).as_dict()
    return [
        # clip_gradients(clip_val=) under fsdp2 with one optimizer over sharded and replicated parameters:
        # torch's clip_grad_value_ refused the mix ("aten._foreach_clamp_min_.Scalar got mixed torch.Tensor
        # and DTensor").
        Scenario.of(**{**base, "clip": "value"}),
        # Issue 34 item 1 (a known failure until its fix is merged): dp 1 x tp 2 with the final norm
        # SequenceParallel outside every unit, norm clipping; the norm clipping read the norm's Partial gradients
        # as reduced.
        Scenario.of(
            **{
                **next(s for s in baselines() if s.strategy == "model_parallel").as_dict(),
                "seq_parallel": "blocks+norm",
                "clip": "norm",
            }
        ),
    ]


def extras() -> list[Scenario]:
    """The costly values the pairwise set leaves out (axes.COSTLY) that `make test` still runs, in scenarios of
    their own: the 4-rank meshes (one shared rank group at 4 ranks), offload. Compile (10-15 s a scenario on
    the loaded 2-core machine) and loads on 4 ranks are left to the random samples (RANDOM_ONLY)."""
    mp = {
        **baselines()[0].as_dict(),
        "strategy": "model_parallel",
        "units": "hand",
        "leftovers": True,
        "world_size": 4,
        "mesh": "2x2",
    }
    return [
        # dp 2 x tp 2 with sequence parallel, activation checkpointing, accumulation and norm clipping, saved
        # sharded and resumed on 2 ranks at dp 2 x tp 1 (the resumes stay off 4 ranks: a 4-rank group costs
        # the most; random samples resume on (4, 1) too).
        Scenario.of(
            **{
                **mp,
                "seq_parallel": "blocks+norm",
                "leftovers": False,  # the sequence-parallel norm in a unit: dp 2 needs it there
                "act_ckpt": True,
                "accum": "no_backward_sync",
                "clip": "norm",
                "checkpoint": "sharded",
                "save_step": 1,
                "load_world_size": 2,
            }
        ),
        # HSDP: fsdp2 over 2 replicas of 2 shards, Adam, bf16-mixed, a full checkpoint resumed 1-D on 2.
        Scenario.of(
            **{
                **mp,
                "strategy": "fsdp2",
                "optimizer": "adam",
                "precision": "bf16-mixed",
                "checkpoint": "full",
                "save_step": 3,
                "load_world_size": 2,
            }
        ),
        # cpu_offload on a CPU job: refused.
        Scenario.of(**{**mp, "strategy": "fsdp2", "world_size": 2, "mesh": "flat", "offload": True}),
    ]


def pipeline_scenarios() -> list[Scenario]:
    """`make test`'s pipeline scenarios, in the rank groups the others start (2 and 4 ranks): each against one
    process on the global batch, its checkpoints against the uninterrupted run, or a declared refusal. Together
    they hold every value of every axis that the pipeline can take, but the random samples' (RANDOM_ONLY) and the
    costly ones (COSTLY): the pairwise set leaves the pipeline out, these scenarios cross it with every axis
    (tests/test_scenarios.py checks it)."""
    base = next(s for s in baselines() if s.strategy == "model_parallel").as_dict()
    pp = {**base, "strategy": "pipeline", "mesh": "flat", "pp": 2, "schedule": "1f1b", "microbatches": 2}
    return [
        # pp 2, 1F1B, activation checkpointing, accumulation without sync, norm clipping, two optimizers, saved
        # sharded and resumed at pp 1 on 2 ranks (dp 2). (The checkpoint_wrapper'd blocks restarted their
        # optimizer state from nothing at the load: 0.013 off the uninterrupted run, silently.) An evaluation
        # after step 2, in the resumed run.
        Scenario.of(
            **{
                **pp,
                "act_ckpt": True,
                "accum": "no_backward_sync",
                "clip": "norm",
                "n_opt": 2,
                "checkpoint": "sharded",
                "load_world_size": 2,
                "load_pp": 1,
                "evaluate": True,
                "sampler": "user_dist",
                "loop": "endless",
            }
        ),
        # interleaved 1F1B (4 stages on 2 ranks), Adam, the blocks and edges in units, the model built on the meta
        # device, bf16-mixed, a full checkpoint resumed in fsdp2.
        Scenario.of(
            **{
                **pp,
                "schedule": "interleaved_1f1b",
                "microbatches": 4,
                "leftovers": False,
                "empty_init": True,
                "optimizer": "adam",
                "impl": "forloop",
                "precision": "bf16-mixed",
                "checkpoint": "full",
                "load_world_size": 2,
                "load_pp": "fsdp2",
                "sampler": "custom",
                "groups": 2,
            }
        ),
        # pp 2 x dp 2 (4 ranks), GPipe, value clipping, the epoch loop with accumulation, a filtered sharded save
        # (each pipeline rank filters its own stages' names: refused as "different items on different ranks"
        # before) resumed in ddp on 2.
        Scenario.of(
            **{
                **pp,
                "world_size": 4,
                "schedule": "gpipe",
                "accum": "plain",
                "clip": "value",
                "checkpoint": "sharded",
                "ckpt_state": "filter",
                "save_step": 3,
                "load_world_size": 2,
                "load_pp": "ddp",
                "set_to_none": False,
            }
        ),
        # pp 2 x tp 2 (4 ranks), zero bubble in a V, no fully_shard unit (with units: a known failure), norm
        # clipping, the position embedding frozen.
        Scenario.of(
            **{
                **pp,
                "world_size": 4,
                "mesh": "1x2",
                "schedule": "zbv_zero_bubble",
                "microbatches": 4,
                "units": "none",
                "leftovers": False,
                "clip": "norm",
                "optimizer": "adamw",
                "loop": "two_loaders",
                "frozen": True,
            }
        ),
        # pp 2 x tp 2 (4 ranks), the blocks' norms SequenceParallel, every module in a unit (so the norm clipping
        # is right: issue 44 item 3 needs a norm outside the units), AdamW with a scheduler, an evaluation between steps, the user's BatchSampler, a save by an asynchronous
        # writer after step 3 resumed at pp 1 on 2 ranks.
        Scenario.of(
            **{
                **pp,
                "world_size": 4,
                "mesh": "1x2",
                "seq_parallel": "blocks",
                "leftovers": False,
                "clip": "norm",
                "optimizer": "adamw",
                "scheduler": True,
                "evaluate": True,
                "sampler": "batch_sampler",
                "loop": "break",
                "checkpoint": "async",
                "save_step": 3,
                "load_world_size": 2,
                "load_pp": 1,
            }
        ),
        # fp16's loss scaling through the schedule (refused before), SGD without momentum (no optimizer state);
        # traced split_points with the units in parallelize_fn, bf16-true, the subset loop, a checkpoint without
        # the optimizers resumed at pp 2.
        Scenario.of(**{**pp, "precision": "16-mixed", "optimizer": "plain_sgd", "groups": 2}),
        Scenario.of(
            **{
                **pp,
                "split": "points",
                "precision": "bf16-true",
                "optimizer": "adam",
                "loop": "subset",
                "checkpoint": "sharded",
                "ckpt_state": "partial",
                "load_world_size": 2,
                "load_pp": 2,
            }
        ),
        # pp 1 x dp 3, fused AdamW over the units, a full checkpoint resumed at pp 2 x dp 1 on 2 ranks, and one
        # saved at pp 2 resumed at pp 1 x dp 3.
        Scenario.of(
            **{
                **pp,
                "world_size": 3,
                "pp": 1,
                "schedule": "gpipe",
                "optimizer": "adamw",
                "impl": "fused",
                "checkpoint": "full",
                "save_step": 3,
                "load_world_size": 2,
                "load_pp": 2,
            }
        ),
        # the weights through save_raw at pp 2 (each stage its own files) and load_raw at pp 1 x dp 3
        Scenario.of(
            **{
                **pp,
                "checkpoint": "sharded",
                "ckpt_state": "raw",
                "load_world_size": 3,
                "load_pp": 1,
                "accum": "plain",
            }
        ),
        # Refused: 1F1B with 1 micro-batch for 2 stages; a zero-bubble schedule with fully_shard units (hung until
        # the timeout before).
        Scenario.of(**{**pp, "microbatches": 1}),
        Scenario.of(**{**pp, "schedule": "interleaved_zero_bubble", "microbatches": 4}),
        # tensor-parallel DTensors (a tensor-parallel mesh of 1) outside every unit at dp 2: refused (ran silently
        # wrong before, the replicas 0.04 apart).
        Scenario.of(**{**pp, "pp": 1, "schedule": "gpipe", "units": "none", "leftovers": False}),
        # a weight tied between two units (the projections, each made a unit in parallelize_fn): refused (trained
        # two copies apart before).
        Scenario.of(**{**pp, "pp": 1, "schedule": "gpipe", "tied": True, "leftovers": False}),
        # Issue 44's pipeline defects (known failures until their fixes are merged): item 1, a model built empty
        # with a position embedding of torch.arange, split_points; item 2, the frozen position embedding plain at
        # dp 2 (traced stages, no unit: no tensor-parallel DTensors either); item 3, the final norm sequence-parallel
        # outside the units and norm clipping; item 4, BatchNorm (one micro-batch: its statistics are the batch's); item 5, a full
        # checkpoint of SGD without momentum loaded at pp 2.
        Scenario.of(**{**pp, "split": "points", "empty_init": True}),
        Scenario.of(
            **{
                **pp,
                "pp": 1,
                "schedule": "gpipe",
                "split": "points",
                "units": "none",
                "leftovers": False,
                "frozen": True,
                "optimizer": "adamw",
            }
        ),
        Scenario.of(
            **{
                **pp,
                "world_size": 4,
                "mesh": "1x2",
                "seq_parallel": "blocks+norm",
                "clip": "norm",
            }
        ),
        Scenario.of(
            **{
                **pp,
                "world_size": 1,
                "pp": 1,
                "schedule": "gpipe",
                "microbatches": 1,
                "batchnorm": True,
                "evaluate": True,
            }
        ),
        Scenario.of(
            **{
                **pp,
                "optimizer": "plain_sgd",
                "impl": "forloop",
                "checkpoint": "full",
                "load_world_size": 2,
                "load_pp": 2,
            }
        ),
    ]


def replica_scenarios() -> list[Scenario]:
    """`make test`'s replica-group scenarios (fault tolerance's groups, without a fault: 2 groups, each reading
    its share of every global batch): each against one process on the global batch, its checkpoint against the
    uninterrupted run, or a declared refusal, with every strategy. The pairwise set pins replica groups off;
    these cross them with the axes that meet their own code (the cross-group average of sharded, tensor-parallel,
    tied, frozen and unused parameters; the loss scaler and the schedulers they heal; accumulation; clipping after
    the average; the data split over the groups; checkpoints written by one group and resumed at another size).
    BatchNorm's statistics are each group's batch's (axes: a conflict, like data parallel)."""
    plain = next(s for s in baselines() if s.strategy == "ddp" and s.world_size == 1).as_dict()
    base = {**plain, "replicas": 2}
    sharded = {**base, "units": "hand", "leftovers": True}
    return [
        # The plainest: fp32 SGD (its step scales with the gradient: an average divided wrongly shows), the
        # two-loader loop, gradients zeroed in place.
        Scenario.of(**{**base, "loop": "two_loaders", "set_to_none": False}),
        # DDP in groups of 2: a tied and a frozen weight, fp16 with its loss scaler, AdamW with a scheduler,
        # accumulation without sync, norm clipping, the user's sampler; a full checkpoint resumed in groups of 1.
        Scenario.of(
            **{
                **base,
                "world_size": 2,
                "tied": True,
                "frozen": True,
                "precision": "16-mixed",
                "optimizer": "adamw",
                "scheduler": True,
                "accum": "no_backward_sync",
                "clip": "norm",
                "sampler": "custom",
                "checkpoint": "full",
            }
        ),
        # HSDP across the groups: fsdp2 sharded over each group's 2 ranks (units by hand, leftovers replicated),
        # built on the meta device, bf16-mixed Adam, plain accumulation, value clipping, an evaluation, the
        # user's DistributedSampler over the job's readers, a cap per epoch; sharded, resumed in groups of 1, the
        # weights through save_raw (one group writes) and load_raw (every group reads its slices).
        Scenario.of(
            **{
                **sharded,
                "strategy": "fsdp2",
                "world_size": 2,
                "empty_init": True,
                "evaluate": True,
                "precision": "bf16-mixed",
                "optimizer": "adam",
                "accum": "plain",
                "clip": "value",
                "sampler": "user_dist",
                "loop": "break",
                "checkpoint": "sharded",
                "ckpt_state": "raw",
                "save_step": 3,
            }
        ),
        # ModelParallelStrategy in groups of dp 1 x tp 2: sequence-parallel norms (the final one in a unit),
        # activation checkpointing, AdamW over two param groups with a scheduler, norm clipping (over every
        # group's average); an asynchronous save resumed in groups of one process (tp 1).
        Scenario.of(
            **{
                **sharded,
                "strategy": "model_parallel",
                "world_size": 2,
                "mesh": "1x2",
                "leftovers": False,
                "seq_parallel": "blocks+norm",
                "act_ckpt": True,
                "optimizer": "adamw",
                "groups": 2,
                "scheduler": True,
                "clip": "norm",
                "checkpoint": "async",
            }
        ),
        # Two optimizers (the blocks' and the rest's): the first step() asks the groups' vote, the other follows.
        Scenario.of(**{**base, "n_opt": 2}),
        # Refused: one process, FSDP1 and the pipeline inside a replica group.
        Scenario.of(**{**base, "strategy": "single"}),
        Scenario.of(**{**sharded, "strategy": "fsdp"}),
        Scenario.of(
            **{
                **sharded,
                "strategy": "pipeline",
                "world_size": 2,
                "pp": 2,
                "schedule": "1f1b",
                "microbatches": 2,
            }
        ),
    ]


# Values only the random samples hold (`make test`'s set has no scenario with them).
RANDOM_ONLY: dict[str, tuple[Any, ...]] = {
    "compile": (True,),
    "load_world_size": (4,),
    "schedule": ("looped_bfs",),
}

# The seed of `make test`'s set: among the first 25, the one whose greedy set is smallest (38 scenarios).
PAIRWISE_SEED = 16


def make_test_set(seed: int = PAIRWISE_SEED) -> list[Scenario]:
    """What `make test` runs: the pairwise set, the baselines, the costly values' scenarios, the regressions, the
    pipeline's scenarios and the replica groups'."""
    chosen = pairwise(seed)
    ids = {s.id for s in chosen}
    extra = [
        s
        for s in [*baselines(), *extras(), *regressions(), *pipeline_scenarios(), *replica_scenarios()]
        if s.id not in ids
    ]
    return chosen + extra
