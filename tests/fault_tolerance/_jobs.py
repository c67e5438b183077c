"""Running `tests/fault_tolerance/ft_train.py` as a real job (`torchloom run --replica-groups`) and judging it:
the groups end bit-identical, the record's replay in one process (plain torch data splitting, not torchloom's)
ends within 1e-5 of the run, and no committed step averaged partial gradients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from torchloom.fault_tolerance import read_record, replay
from torchloom.fault_tolerance.record import TOLERANCE, Step, partial_steps

SCRIPT = Path(__file__).with_name("ft_train.py")

#: In the tests' embedded scripts (`STREAK` on a line of its own in the loop's body): after a step that committed,
#: count it, keep the streak of steps with every group in a buffer of the model (a healed group receives it),
#: slow down while alone, and die between steps where the plan says.
STREAK = """
    if rg.step > before:
        done += 1
        if len(rg.participants) == rg.groups:
            net.streak += 1
        else:
            net.streak.zero_()
            time.sleep(0.5)  # alone: slow down until the other group is back
        if where == "between" and done == after:
            die()
"""


@dataclass
class Job:
    folder: Path
    groups: int
    per_group: int
    events: list[dict[str, Any]]
    done: subprocess.CompletedProcess[str]

    @property
    def output(self) -> str:
        return self.done.stdout[-3000:] + self.done.stderr[-6000:]

    def steps(self) -> list[Step]:
        return read_record(self.folder / "record.jsonl")

    def fired(self, k: int) -> dict[str, Any]:
        return json.loads((self.folder / f"event{k}.json").read_text())

    def attempts(self, group: int) -> int:
        return len(list(self.folder.glob(f"group{group}.rank0.attempt*")))


def launch_command(
    groups: int,
    per_group: int,
    record: Path,
    script: Path,
    *script_args: str,
    options: tuple[str, ...] = (),
    max_restarts: int = 100,
) -> list[str]:
    """`torchloom run --replica-groups GROUPS` of `script` on CPU, `per_group` processes a group, the record at
    `record`; `options` go before the script (e.g. `--replica-group G --lighthouse ADDRESS` for one group of a
    cluster launch)."""
    return [
        sys.executable, "-m", "torchloom", "run", "--replica-groups", str(groups), "--accelerator", "cpu",
        "--devices", str(per_group), "--max-restarts", str(max_restarts), "--ft-record", str(record),
        *options, str(script), *script_args,
    ]  # fmt: skip


def run_script(
    folder: Path, text: str, groups: int, per_group: int, *args: str, max_restarts: int, timeout: float = 400
) -> subprocess.CompletedProcess[str]:
    """A test's own script `text`, written to `folder/train.py`, run as a job of `groups` replica groups of
    `per_group` processes (its arguments: `folder`, then `args`), the record at `folder/record.jsonl`."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "train.py"
    script.write_text(text)
    command = launch_command(
        groups, per_group, folder / "record.jsonl", script, str(folder), *args, max_restarts=max_restarts
    )
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout)


def ends_bit_identical(folder: Path, groups: int) -> list[dict[str, Any]]:
    """The groups' ends (`folder/group<g>.pt`: the state dict under "state", the step under "step"), checked to
    be at the same step and bit for bit equal."""
    ends = [torch.load(folder / f"group{g}.pt") for g in range(groups)]
    for end in ends[1:]:
        assert end["step"] == ends[0]["step"]
        for key, value in ends[0]["state"].items():
            assert torch.equal(value, end["state"][key]), key  # bit for bit
    return ends


def run_job(
    folder: Path,
    *,
    groups: int,
    events: list[dict[str, Any]],
    per_group: int = 1,
    min_steps: int = 0,
    options: tuple[str, ...] = (),
    timeout: float = 280,
    cluster: bool = False,
) -> Job:
    """`cluster`: launched as on a cluster, each group its own `torchloom run --replica-group G --lighthouse
    ADDRESS`, with the lighthouse started here (as a user runs `torchft_lighthouse`)."""
    folder.mkdir(parents=True)
    plan = folder / "plan.json"
    plan.write_text(json.dumps({"groups": groups, "events": events, "min_steps": min_steps}))
    if cluster:
        return _run_cluster_job(folder, plan, groups, per_group, events, options, timeout)
    command = launch_command(
        groups, per_group, folder / "record.jsonl", SCRIPT, str(folder), str(plan), options=options
    )
    # A new session: past the timeout, the whole job (lighthouse, agents, ranks) is killed, not only its top.
    with subprocess.Popen(
        command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            err += f"\n[the job ran past {timeout} s and was killed]"
    done = subprocess.CompletedProcess(command, process.returncode, out, err)
    (folder / "stderr.txt").write_text(err)
    return Job(folder, groups, per_group, events, done)


def _run_cluster_job(
    folder: Path,
    plan: Path,
    groups: int,
    per_group: int,
    events: list[dict[str, Any]],
    options: tuple[str, ...],
    timeout: float,
) -> Job:
    from torchft.coordination import LighthouseServer

    from torchloom.fault_tolerance import launch

    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=launch.JOIN_TIMEOUT_MS,
        quorum_tick_ms=launch.QUORUM_TICK_MS,
        heartbeat_timeout_ms=launch.HEARTBEAT_TIMEOUT_MS,
    )
    address = lighthouse.address().split("://", 1)[-1]  # HOST:PORT, as a user passes it
    processes = []
    try:
        for group in range(groups):
            command = launch_command(
                groups, per_group, folder / "record.jsonl", SCRIPT, str(folder), str(plan),
                options=("--replica-group", str(group), "--lighthouse", address, *options),
            )  # fmt: skip
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=folder,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )  # fmt: skip
            )
        outs, errs, codes = [], [], []
        for process in processes:
            try:
                out, err = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p in processes:
                    os.killpg(p.pid, signal.SIGKILL)
                out, err = process.communicate()
                err += f"\n[the job ran past {timeout} s and was killed]"
            outs.append(out)
            errs.append(err)
            codes.append(process.returncode)
    finally:
        lighthouse.shutdown()
    err = "".join(f"--- group {g}:\n{e}" for g, e in enumerate(errs))
    (folder / "stderr.txt").write_text(err)
    done = subprocess.CompletedProcess(["cluster"], max(codes, key=abs), "".join(outs), err)
    return Job(folder, groups, per_group, events, done)


def replayed(job: Job) -> tuple[dict[str, torch.Tensor], int]:
    """The record replayed in one process from the script's initial model; the groups' batches from torch's
    `DistributedSampler` over groups x processes per group (a group's batch: its processes' batches)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24000, 4), torch.randn(24000, 1))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    readers = job.groups * job.per_group
    shards = [
        list(DistributedSampler(data, num_replicas=readers, rank=r, shuffle=False)) for r in range(readers)
    ]

    def batch(group: int, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert epoch == 0
        rows = [
            i
            for r in range(job.per_group)
            for i in shards[group * job.per_group + r][index * 4 : index * 4 + 4]
        ]
        return data[rows]

    def loss(model: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(xy[0]), xy[1])

    steps = replay(job.folder / "record.jsonl", net, opt, batch, loss)
    return {k: v.detach() for k, v in net.named_parameters()}, steps


#: What a group prints (or raises) when the groups of a step computed their gradients on different weights.
DIVERGED = "The replica groups' weights differ"


def check_exact(job: Job) -> list[Step]:
    """What every job must show: it ended, every event fired, the groups ended bit-identical at the same step,
    no step averaged partial gradients, the groups that wrote a step's line applied the same average, no group's
    weights parted from the others' (unless the plan made them: a `perturb` event), and the replay equals the run
    within 1e-5."""
    assert job.done.returncode == 0, job.output
    for k in range(len(job.events)):
        assert (job.folder / f"event{k}.json").exists(), (k, job.output)
    perturbed = any(event["where"] == "perturb" for event in job.events)
    assert (DIVERGED in job.done.stderr) == perturbed, job.output
    ends = ends_bit_identical(job.folder, job.groups)
    assert disagreeing_lines(job.folder / "record.jsonl") == []
    steps = job.steps()
    assert partial_steps(steps) == []
    expected, replayed_steps = replayed(job)
    assert replayed_steps == ends[0]["step"] == len(steps)
    for key, value in expected.items():
        torch.testing.assert_close(ends[0]["state"][key], value, rtol=0, atol=1e-5)
    return steps


def disagreeing_lines(path: Path) -> list[int]:
    """The steps whose lines (one per group that committed it, of one chain) hold different applied averages: a
    group that applied another update than its peers shows here, at the step it did so, and not only at its
    next gradient (`read_record` keeps one line per chain)."""
    applied: dict[str, list[float]] = {}
    scales: dict[str, float] = {}
    steps: dict[str, int] = {}
    for text in path.read_text().splitlines():
        if text.strip():
            line = json.loads(text)
            applied.setdefault(line["chain"], []).append(line["applied"])
            scales[line["chain"]] = max(p["scale"] for p in line["participants"])
            steps[line["chain"]] = line["step"]
    return sorted(
        steps[chain]
        for chain, values in applied.items()
        if max(values) - min(values) > TOLERANCE * scales[chain]
    )


def without(steps: list[Step], group: int) -> list[int]:
    """The steps that `group` did not take part in."""
    return [s.step for s in steps if all(p.group != group for p in s.participants)]


def first_commit_after(steps: list[Step], t: float, group: int | None = None) -> Step | None:
    """The first step committed after time `t` (with `group` among its participants, if given)."""
    for s in steps:
        if (
            s.time is not None
            and s.time > t
            and (group is None or any(p.group == group for p in s.participants))
        ):
            return s
    return None
