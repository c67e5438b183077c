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

No step is committed with partial gradients, and the record proves it: each group also adds, in its own slot, a
fingerprint of the gradient it sent (`fingerprint`: a fixed random projection, linear in the gradient, with its
scale), and each line holds the fingerprint of the averaged gradient the optimizer applied (`applied`). A whole
average has `applied` equal to the mean of the participants' fingerprints (`partial_steps` lists the steps
where it is not); the replay recomputes each participant's gradient on the batch it read and checks it against
the fingerprint that group sent, so a group counted with a gradient it did not compute (zeros, a stale one) is
caught too (where the fingerprints are of the whole gradient: under `fsdp2` or tensor parallelism inside a
group they are of the recording rank's local pieces, `"whole": false`, and only the first check applies). Each
line also holds the wall-clock `time` of the commit (for the figures of a fault's cost).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchloom.errors import TorchloomError

#: Slots per group in the sums that carry the sources: taking part (1), epoch, batch, the gradient's
#: fingerprint and its scale, a number standing for the group's optimizer hyperparameters, and a fingerprint of
#: the weights the gradient was computed on (the groups must agree on both: `fault_tolerance.replica`).
SLOTS = 7
#: Elements of a gradient the fingerprint reads (evenly strided): a fixed cost however large the model.
_PROBES = 4096
#: How far a fingerprint may be from the one it is checked against, as a share of its scale (fp32 sums of a few
#: groups differ from float64 ones by about 1e-7 of the scale; a missing group's share is far above this).
TOLERANCE = 1e-4
_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


@dataclass(frozen=True)
class Participant:
    """A group that took part in a committed step, and the batch it used: `batch` is the index of the batch in
    the group's own shard of epoch `epoch` (-1 and the step where no set-up loader handed it out). `grad` and
    `scale`: the fingerprint of the gradient the group sent, and its scale (None in records without them)."""

    group: int
    epoch: int
    batch: int
    grad: float | None = None
    scale: float | None = None


@dataclass(frozen=True)
class Step:
    step: int
    participants: tuple[Participant, ...]
    #: The fingerprint of the averaged gradient the optimizer applied (None in records without it).
    applied: float | None = None
    #: Wall-clock time of the step's first commit by a group (seconds since the epoch; None in records without
    #: it).
    time: float | None = field(default=None, compare=False)
    #: Whether the fingerprints are of the whole gradient (False: of the recording rank's local pieces, under a
    #: strategy that shards the model inside a group; the replay then cannot check each participant's).
    whole: bool = True
    #: The loss scale of the step (16-mixed; 1.0 otherwise): the replay scales its losses alike, so that its
    #: fp16 backward rounds (and underflows) as the run's did.
    loss_scale: float = 1.0


def flats(grads: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients as one flat tensor per dtype, in order of first appearance: the layout the groups average
    and `fingerprint` reads."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad.reshape(-1))
    return [torch.cat(parts) for parts in by_dtype.values()]


def fingerprint(grads: Sequence[torch.Tensor]) -> tuple[float, float]:
    """A gradient's fingerprint and its scale: `sum(w * g)` and `sum(|w * g|)` over up to 4,096 evenly strided
    elements `g` of the gradient's one flat tensor per dtype (`flats`), with fixed random weights `w` in [-1, 1].
    `grads`: that flat layout's parts in order (the flat tensors themselves, or the per-parameter gradients they
    concatenate: the fingerprint is the same). Linear in the gradient: the fingerprint of an average is the
    average of the fingerprints; and a sum over the parts (`probes`, `fingerprint_part`)."""
    value = scale = 0.0
    for grad, probe in zip(grads, probes(grads), strict=True):
        part_value, part_scale = fingerprint_part(grad, probe)
        value += float(part_value)
        scale += float(part_scale)
    return value, scale


def probes(parts: Sequence[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """Per part of `fingerprint`'s layout (only their dtype, size and device matter): the first element it
    reads, the stride, and the weights of the elements it reads."""
    totals: dict[torch.dtype, int] = {}
    for part in parts:
        totals[part.dtype] = totals.get(part.dtype, 0) + part.numel()
    offsets = dict.fromkeys(totals, 0)
    found = []
    for part in parts:
        total, offset = totals[part.dtype], offsets[part.dtype]
        stride = max(1, -(-total // _PROBES))
        first = -offset % stride  # the first element of this part on the stride
        count = len(range(first, part.numel(), stride))
        start = (offset + first) // stride
        weights = _weights(-(-total // stride), part.device)[start : start + count]
        found.append((first, stride, weights))
        offsets[part.dtype] = offset + part.numel()
    return found


def fingerprint_part(
    part: torch.Tensor, probe: tuple[int, int, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One part's terms of `fingerprint` (value and scale, float64 scalars), read where `probes` says."""
    first, stride, weights = probe
    weighted = part.detach().reshape(-1)[first::stride].to(torch.float64) * weights
    return weighted.sum(), weighted.abs().sum()


def _weights(probes: int, device: torch.device) -> torch.Tensor:
    key = (probes, str(device))
    if key not in _WEIGHTS:
        generator = torch.Generator().manual_seed(probes)
        weights = torch.rand(probes, generator=generator, dtype=torch.float64) * 2 - 1
        _WEIGHTS[key] = weights.to(device)
    return _WEIGHTS[key]


def sources(
    groups: int,
    group: int,
    epoch: int,
    batch: int,
    grads: Sequence[torch.Tensor],
    had: Sequence[bool] = (),
    fingerprinted: tuple[float, float] | None = None,
    hyperparameters: float = 0.0,
    weights: float = 0.0,
) -> torch.Tensor:
    """This group's addend to the sums that say what a step's average held (see the module docstring): its
    `SLOTS` slots, then one slot per parameter, 1 where the group had a gradient for it (`had`; `gradient_counts`
    reads the sums). `fingerprinted`: the fingerprint of `grads` when taken already (before the sums overwrote
    them). `weights`: `weights_fingerprint` of the parameters the gradient was computed on."""
    value, scale = fingerprint(grads) if fingerprinted is None else fingerprinted
    slots = torch.zeros(SLOTS * groups + len(had), dtype=torch.float64)
    for k, number in enumerate((1.0, epoch, batch, value, scale, hyperparameters, weights)):
        slots[k * groups + group] = number
    slots[SLOTS * groups :] = torch.tensor([float(h) for h in had], dtype=torch.float64)
    return slots


def hyperparameters_of(sources: torch.Tensor, groups: int) -> list[float]:
    """Per group, the number that stands for its optimizer's hyperparameters (0 for a group not summed)."""
    return [float(v) for v in sources[5 * groups : 6 * groups].tolist()]


def weights_of(sources: torch.Tensor, groups: int) -> list[float]:
    """Per group, the fingerprint of the weights its gradient was computed on (0 for a group not summed)."""
    return [float(v) for v in sources[6 * groups : 7 * groups].tolist()]


def weights_fingerprint(params: Sequence[torch.Tensor]) -> float:
    """`fingerprint`'s value for the parameters themselves (their local pieces), read from the device once. The
    same weights give the same number bit for bit, so groups whose weights differ anywhere it reads (up to
    4,096 evenly strided elements per dtype) disagree on it (a step applied differently moves every element it
    reads that had a gradient)."""
    if not params:
        return 0.0
    positions, weights = _weights_layout(params)
    # Per dtype, the strided views gathered by one `cat`, the layout kept: a few kernels however many parameters
    # (144 parameters on these shared CPUs: 0.6-0.9 ms a step, against 3 ms and more part by part).
    samples: dict[torch.dtype, list[torch.Tensor]] = {}
    for p, (first, stride) in zip(params, positions, strict=True):
        samples.setdefault(p.dtype, []).append(p.detach().reshape(-1)[first::stride])
    total = sum(
        (torch.cat(parts).to(torch.float64) * weights[dtype]).sum() for dtype, parts in samples.items()
    )
    return float(total)


_LAYOUTS: dict[tuple[object, ...], tuple[list[tuple[int, int]], dict[torch.dtype, torch.Tensor]]] = {}


def _weights_layout(
    params: Sequence[torch.Tensor],
) -> tuple[list[tuple[int, int]], dict[torch.dtype, torch.Tensor]]:
    """`probes` for `params` (each one's first element read and stride; per dtype, the weights of the elements
    read, in order), kept per layout: the same every step."""
    key = (params[0].device, *((p.dtype, p.numel()) for p in params))
    if key not in _LAYOUTS:
        found = probes(params)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p, (_, _, w) in zip(params, found, strict=True):
            by_dtype.setdefault(p.dtype, []).append(w)
        _LAYOUTS[key] = (
            [(first, stride) for first, stride, _ in found],
            {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()},
        )
    return _LAYOUTS[key]


def gradient_counts(sources: torch.Tensor, groups: int) -> list[int]:
    """Per parameter, how many of the summed groups had a gradient for it (from `sources`' last slots)."""
    return [round(n) for n in sources[SLOTS * groups :].tolist()]


def participants_of(sources: torch.Tensor | None, groups: int) -> list[int]:
    if sources is None:
        return []
    return [g for g in range(groups) if round(float(sources[g])) == 1]


def participants_with_batches(sources: torch.Tensor, groups: int) -> list[dict[str, int]]:
    """The groups the sums count, each with the epoch and batch it read (what the record's chain hashes)."""
    return [
        {
            "group": g,
            "epoch": round(float(sources[groups + g])),
            "batch": round(float(sources[2 * groups + g])),
        }
        for g in participants_of(sources, groups)
    ]


def append(
    path: str,
    step: int,
    sources: torch.Tensor,
    groups: int,
    parent: str,
    applied: float,
    whole: bool = True,
    loss_scale: float = 1.0,
) -> str:
    """Add committed step `step` (the sums of the groups' slots, see the module docstring; `applied`: the
    fingerprint of the averaged gradient; `loss_scale`: the scale the step's loss was multiplied by under
    16-mixed), which follows the chain `parent`, to the record; return the step's chain."""
    participants = participants_with_batches(sources, groups)
    chain = chained(parent, step, participants)
    described = [
        dict(p, grad=float(sources[3 * groups + p["group"]]), scale=float(sources[4 * groups + p["group"]]))
        for p in participants
    ]
    line = json.dumps(
        {
            "step": step,
            "participants": described,
            "applied": applied,
            "whole": whole,
            **({} if loss_scale == 1.0 else {"loss_scale": loss_scale}),
            "time": time.time(),
            "chain": chain,
            "parent": parent,
        }
    )
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
    a gap.

    A job that lost every group without a checkpoint started over from step 0 in the same record: its history is
    the one whose end was written last (the state the job holds), not the longest."""
    lines: dict[str, tuple[str, Step]] = {}
    written: dict[str, int] = {}  # each chain's last line, in the order the lines were written
    text = Path(path).read_text()
    # A line without its newline is one a group is writing now (a record read during the run, as `torchloom
    # replay` may be): a reader can see part of one write. Its step is read once the line is whole.
    complete = text[: text.rfind("\n") + 1]
    for number, line in enumerate(complete.splitlines()):
        if line.strip():
            data = json.loads(line)
            written[data["chain"]] = number
            entry = Step(
                int(data["step"]),
                tuple(Participant(**p) for p in data["participants"]),
                data.get("applied"),
                data.get("time"),
                bool(data.get("whole", True)),
                float(data.get("loss_scale", 1.0)),
            )
            seen = lines.get(data["chain"])
            if seen is not None and seen[1].time is not None and entry.time is not None:
                # The step's groups each wrote a line: its time is the first commit's.
                entry = dataclasses.replace(entry, time=min(seen[1].time, entry.time))
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
    continued = {parent for parent, _ in lines.values()}
    latest = max((c for c in lines if c not in continued), key=written.__getitem__)
    if written[latest] > written[chain]:
        # Written after the end of the longest history, which nothing continues: the job started over.
        chain = latest
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


def skipped(entry: Step) -> bool:
    """Whether the loss scaler skipped the step (16-mixed: the average overflowed, so nothing was applied; the
    step still counts, as in a job without fault tolerance, and the buffers its forwards left are kept)."""
    return entry.applied is not None and not math.isfinite(entry.applied)


def partial_steps(steps: Sequence[Step]) -> list[int]:
    """The steps whose applied gradient was not the whole average of their participants' gradients: the
    fingerprint of what the optimizer applied is not the mean of the fingerprints the participants sent (an
    empty list for a record without fingerprints)."""
    partial = []
    for entry in steps:
        sent = [p.grad for p in entry.participants]
        scales = [p.scale for p in entry.participants]
        if entry.applied is None or None in sent or None in scales or skipped(entry):
            continue
        mean = math.fsum(sent) / len(sent)  # type: ignore[arg-type]
        scale = math.fsum(scales) / len(scales)  # type: ignore[arg-type]
        if not abs(entry.applied - mean) <= TOLERANCE * scale + 1e-30:
            partial.append(entry.step)
    return partial
