"""The record of a fault-tolerant job: one JSON line per committed step and per group that committed it,
`{"step": S, "participants": [{"group": G, "epoch": E, "batch": B}, ...], "chain": H, "parent": P}`, appended
by rank 0 of every group (the lines of one step agree; a group that dies after committing may leave none, its
peers' lines stand).

Two quorums may commit the same step apart (torchft with `min_replicas=1`: at the start, whichever group asks
first trains alone until the other joins; the one that is behind then heals and its own steps are dropped).
So each line carries a hash chain: `chain` hashes the `parent` line's chain with the step and its
participants, and a group that heals takes its peer's chain. The run's history is the chain of its last step,
followed back through the parents; lines off it are steps no surviving state holds.

The participants come from the all-reduce that averaged the step's gradients: each group adds a one in its own
slot and the epoch and batch index it read, so the record holds what the sum really held, not what the groups
meant to send. `read` gives one entry per committed step, in order; `torchloom.fault_tolerance.replay` replays it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from torchloom.errors import TorchloomError


@dataclass(frozen=True)
class Participant:
    """A group that took part in a committed step, and the batch it used: `batch` is the index of the batch in
    the group's own shard of epoch `epoch` (-1 and the step where no set-up loader handed it out)."""

    group: int
    epoch: int
    batch: int


@dataclass(frozen=True)
class Step:
    step: int
    participants: tuple[Participant, ...]


def participants_of(sources: torch.Tensor | None, groups: int) -> list[int]:
    if sources is None:
        return []
    return [g for g in range(groups) if round(float(sources[g])) == 1]


def participants_with_batches(sources: torch.Tensor, groups: int) -> list[dict[str, int]]:
    """The groups the sums count, each with the epoch and batch it read."""
    return [
        {
            "group": g,
            "epoch": round(float(sources[groups + g])),
            "batch": round(float(sources[2 * groups + g])),
        }
        for g in participants_of(sources, groups)
    ]


def append(path: str, step: int, sources: torch.Tensor, groups: int, parent: str) -> str:
    """Add committed step `step` (the sums of the groups' slots, see the module docstring), which follows the
    chain `parent`, to the record; return the step's chain."""
    participants = participants_with_batches(sources, groups)
    chain = chained(parent, step, participants)
    line = json.dumps({"step": step, "participants": participants, "chain": chain, "parent": parent})
    # One write of one line with O_APPEND: the groups' lines never interleave (a single write to a local file).
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    return chain


def chained(parent: str, step: int, participants: list[dict[str, int]]) -> str:
    """The chain of a step: the same in every group of its quorum (they share the parent and the sums)."""
    text = json.dumps([parent, step, participants], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read(path: str | os.PathLike[str]) -> list[Step]:
    """The committed steps of the run's history in the record at `path`, in order: the chain of its last step
    followed back to the first (see the module docstring). Raises when the record ends in two histories or has
    a gap."""
    lines: dict[str, tuple[str, Step]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            data = json.loads(line)
            entry = Step(int(data["step"]), tuple(Participant(**p) for p in data["participants"]))
            lines[data["chain"]] = (data["parent"], entry)
    if not lines:
        return []
    last = max(entry.step for _, entry in lines.values())
    ends = {chain for chain, (_, entry) in lines.items() if entry.step == last}
    if len(ends) > 1:
        raise TorchloomError(
            f"The record {str(path)!r} ends in {len(ends)} different histories at step {last} (groups that never "
            "met again, or two jobs writing to one record: give each job its own --ft-record)."
        )
    steps: list[Step] = []
    chain = ends.pop()
    while chain:
        if chain not in lines:
            raise TorchloomError(
                f"The record {str(path)!r} has no line for the step before step {steps[-1].step} (every group "
                "that committed it died before writing it), so it cannot be replayed."
            )
        chain, entry = lines[chain]
        steps.append(entry)
    steps.reverse()
    if [s.step for s in steps] != list(range(len(steps))):
        raise TorchloomError(f"The record {str(path)!r} does not hold steps 0..{last} in one history.")
    return steps
