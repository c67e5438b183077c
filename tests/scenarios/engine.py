"""Run scenarios on launched rank groups and judge them: the orchestration used by the pytest entry
(tests/test_scenarios.py) and by tests/scenarios/run_many.py.

Phase 1 runs every scenario at its world size, one rank group per world size; phase 2 loads every checkpoint
scenario in a new rank group at its load world size. A group that dies (a rank crashed, a hang past the timeout)
loses only the scenario it was in: that one fails with the group's error, and the rest run in a new group.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchloom.testing import RanksFailed, run_ranks

from .axes import Scenario
from .oracles import judge
from .runner import run_group

SECONDS_PER_SCENARIO = 60  # the per-group timeout is this times the group's size, plus start-up


@dataclass
class Outcome:
    scenario: Scenario
    problems: list[str] = field(default_factory=list)
    refused: str | None = None  # the declared refusal it raised as expected, if any
    metrics: dict = field(default_factory=dict)  # measured errors and seconds

    @property
    def passed(self) -> bool:
        return not self.problems


def _read(outdir: Path, scenario: Scenario, world_size: int) -> list[dict] | None:
    files = [outdir / f"{scenario.id}.r{r}.pt" for r in range(world_size)]
    if not all(f.exists() for f in files):
        return None
    return [torch.load(f, weights_only=False) for f in files]


def run_phase(
    groups: dict[int, list[Scenario]], phase: str, workdir: str, log=print
) -> dict[str, list[dict]]:
    """Run each world size's scenarios on one rank group (more if a group dies); results per scenario id."""
    results: dict[str, list[dict]] = {}
    outdir = Path(workdir, phase)
    for world_size, scenarios in sorted(groups.items()):
        pending = list(scenarios)
        while pending:
            started = time.monotonic()
            try:
                run_ranks(
                    run_group,
                    pending,
                    phase,
                    workdir,
                    world_size=world_size,
                    timeout=30 + SECONDS_PER_SCENARIO * len(pending),
                )
                error = None
            except RanksFailed as exc:
                error = str(exc)
            done = 0
            for scenario in pending:
                got = _read(outdir, scenario, world_size)
                if got is None:
                    break
                results[scenario.id] = got
                done += 1
            log(f"{phase} w{world_size}: {done} scenarios in {time.monotonic() - started:.1f}s")
            if error is None and done == len(pending):
                break
            culprit = pending[done]
            results[culprit.id] = [
                {
                    "ok": False,
                    "group_died": True,
                    "error_type": "RanksFailed",
                    "error_mro": ["RanksFailed"],
                    "error": error or "the group ended without its result",
                    "traceback": error or "",
                }
            ]
            log(f"{phase} w{world_size}: the group died in {culprit.id}; the rest go on in a new group")
            pending = pending[done + 1 :]
    return results


def run_scenarios(scenarios: list[Scenario], workdir: str, log=print) -> list[Outcome]:
    """Both phases and the oracles for `scenarios`; one Outcome each, in the given order."""
    by_size: dict[int, list[Scenario]] = defaultdict(list)
    for s in scenarios:
        by_size[s.ranks("train")].append(s)
    trained = run_phase(by_size, "train", workdir, log)
    to_resume: dict[int, list[Scenario]] = defaultdict(list)
    for s in scenarios:
        if s.saves and all(r.get("ok") for r in trained[s.id]):
            to_resume[s.ranks("resume")].append(s)
    resumed = run_phase(to_resume, "resume", workdir, log)
    outcomes = []
    for s in scenarios:
        metrics = {
            "seconds": sum(
                r.get("seconds", 0.0) for phase in (trained, resumed) for r in phase.get(s.id, [])[:1]
            )
        }
        problems, refused = judge(s, trained[s.id], resumed.get(s.id), metrics)
        outcomes.append(Outcome(s, problems, refused, metrics))
    return outcomes
