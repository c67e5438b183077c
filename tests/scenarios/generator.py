"""Which scenarios to run: a seeded set covering every feasible pair of axis values (greedy, AETG-style), or a
seeded random sample of any size."""

from __future__ import annotations

import itertools
import random
from typing import Any

from .axes import AXES, Scenario, conflicts

Pair = tuple[tuple[str, Any], tuple[str, Any]]


def feasible_pairs() -> set[Pair]:
    """Every pair of values on two different axes that some scenario can hold."""
    pairs = set()
    for a, b in itertools.combinations(AXES, 2):
        for va in AXES[a]:
            for vb in AXES[b]:
                if not conflicts({a: va, b: vb}):
                    pairs.add(((a, va), (b, vb)))
    return pairs


def pairs_of(values: dict[str, Any]) -> set[Pair]:
    return {((a, values[a]), (b, values[b])) for a, b in itertools.combinations(AXES, 2)}


def _complete(rng: random.Random, start: dict[str, Any], uncovered: set[Pair]) -> dict[str, Any] | None:
    """Fill the remaining axes, each with the value that covers the most uncovered pairs (ties at random)."""
    values = dict(start)
    axes = [a for a in AXES if a not in values]
    rng.shuffle(axes)
    for axis in axes:
        best, best_gain = [], -1
        for value in AXES[axis]:
            trial = {**values, axis: value}
            if conflicts(trial):
                continue
            gain = sum(
                (((a, trial[a]), (b, trial[b])) in uncovered)
                for a, b in itertools.combinations(AXES, 2)
                if axis in (a, b) and a in trial and b in trial
            )
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
    chosen: list[Scenario] = []
    while uncovered:
        best, best_gain = None, 0
        ordered = sorted(uncovered, key=repr)
        for _ in range(candidates):
            (a, va), (b, vb) = rng.choice(ordered)
            values = _complete(rng, {a: va, b: vb}, uncovered)
            if values is None:
                continue
            gain = len(pairs_of(values) & uncovered)
            if gain > best_gain:
                best, best_gain = values, gain
        if best is None:
            raise RuntimeError("pairwise generation is stuck; a constraint in axes.conflicts is not pairwise")
        uncovered -= pairs_of(best)
        chosen.append(Scenario.of(**best))
    return chosen


def random_sample(count: int, seed: int) -> list[Scenario]:
    """`count` distinct scenarios drawn uniformly among the feasible ones (rejection sampling)."""
    rng = random.Random(seed)
    seen: dict[str, Scenario] = {}
    tries = 0
    while len(seen) < count and tries < 200 * count:
        tries += 1
        values = {axis: rng.choice(options) for axis, options in AXES.items()}
        if conflicts(values):
            continue
        scenario = Scenario.of(**values)
        seen.setdefault(scenario.id, scenario)
    return list(seen.values())


def baselines() -> list[Scenario]:
    """For each strategy and world size, its plainest and most sensitive run: fp32 SGD (whose step scales with
    the gradient, where Adam's does not), no clipping (which hides a gradient's scale), no accumulation, layers
    outside the units (replicated) where there are units. Pairs alone do not hold this triple together."""
    plain = {
        "units": "none",
        "leftovers": False,
        "tied": False,
        "optimizer": "sgd",
        "impl": "foreach",
        "n_opt": 1,
        "groups": 1,
        "scheduler": False,
        "precision": "32-true",
        "accum": "none",
        "set_to_none": True,
        "clip": "none",
        "loop": "epoch",
        "checkpoint": "none",
        "save_step": 1,
        "load_world_size": 1,
    }
    out = []
    for strategy in AXES["strategy"]:
        for world_size in AXES["world_size"]:
            values = {**plain, "strategy": strategy, "world_size": world_size}
            if strategy in ("fsdp", "fsdp2"):
                values.update(units="hand", leftovers=True)
            if not conflicts(values):
                out.append(Scenario.of(**values))
    return out


def regressions() -> list[Scenario]:
    """Scenarios of the random sample that found a defect, kept in `make test` once it was fixed."""
    base = {**baselines()[-2].as_dict()}  # fsdp2 on 2 ranks, units by hand, replicated leftovers, fp32 SGD
    return [
        # clip_gradients(clip_val=) under fsdp2 with one optimizer over sharded and replicated parameters:
        # torch's clip_grad_value_ refused the mix ("aten._foreach_clamp_min_.Scalar got mixed torch.Tensor
        # and DTensor").
        Scenario.of(**{**base, "clip": "value"}),
    ]


def make_test_set(seed: int = 0) -> list[Scenario]:
    """What `make test` runs: the pairwise set, the baselines and the regressions."""
    chosen = pairwise(seed)
    ids = {s.id for s in chosen}
    extra = [s for s in [*baselines(), *regressions()] if s.id not in ids]
    return chosen + extra
