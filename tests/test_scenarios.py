"""The scenario engine's seeded pairwise set: every pair of axis values (tests/scenarios/axes.py) in at least
one scenario, but the costly values (4 ranks, compile, offload: axes.COSTLY), which a few scenarios of their own
hold (generator.extras), plus one plain baseline per strategy and world size, plus a few pipeline scenarios
(generator.pipeline_scenarios: the pipeline's axes are left out of the pairs); each scenario its own test, judged
against plain torch on the global batch, the uninterrupted run
(checkpoint scenarios) or a declared refusal. All of them run in a few launched rank groups (one per world
size and phase), started by the first test; the rest read their results. The long random sample:
`make scenarios` or `python tests/scenarios/run_many.py --count N --seed S --report PATH`."""

from __future__ import annotations

import pytest
from scenarios.axes import AXES, COSTLY, conflicts
from scenarios.engine import run_scenarios
from scenarios.generator import RANDOM_ONLY, feasible_pairs, make_test_set, pairs_of
from scenarios.refusals import known_failure

SCENARIOS = make_test_set()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    runnable = [s for s in SCENARIOS if (k := known_failure(s)) is None or k.runs]
    workdir = tmp_path_factory.mktemp("scenarios")
    return {o.scenario.id: o for o in run_scenarios(runnable, str(workdir), log=lambda line: None)}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_scenario(scenario, outcomes):
    known = known_failure(scenario)
    if known is not None and not known.runs:
        pytest.xfail(f"known failure, not run ({known.name}): {known.reason}")
    outcome = outcomes[scenario.id]
    if known is not None:
        assert not outcome.passed, f"known failure '{known.name}' now passes: remove it from KNOWN_FAILURES"
        pytest.xfail(f"known failure ({known.name}): {known.reason}\n" + "\n".join(outcome.problems))
    assert outcome.passed, f"{scenario.id}:\n" + "\n".join(outcome.problems)


def test_the_set_covers_every_feasible_pair():
    covered = set().union(*(pairs_of(s.as_dict()) for s in SCENARIOS))
    assert feasible_pairs() <= covered
    # Every value of every axis occurs (the pairs imply it; this names an axis value that cannot occur), but
    # those left to the random samples.
    for axis, values in AXES.items():
        expected = set(values) - set(RANDOM_ONLY.get(axis, ()))
        assert {getattr(s, axis) for s in SCENARIOS} == expected, axis


def test_every_axis_meets_every_strategy():
    """The crossings: every value of every axis that a strategy can take occurs with that strategy (the pipeline
    included, whose scenarios are generator.pipeline_scenarios), but the costly values and those left to the
    random samples."""
    missing = [
        (strategy, axis, value)
        for strategy in AXES["strategy"]
        for axis, values in AXES.items()
        for value in values
        if axis != "strategy"
        and value not in RANDOM_ONLY.get(axis, ()) + COSTLY.get(axis, ())
        and not conflicts({"strategy": strategy, axis: value})
        and not any(s.strategy == strategy and getattr(s, axis) == value for s in SCENARIOS)
    ]
    assert not missing
