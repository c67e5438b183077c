"""Fault tolerance through torchft (`torchloom.fault_tolerance`): real jobs of 2 replica groups of 1 CPU process
(gloo), launched with `torchloom run --replica-groups 2`, one group SIGKILLed between steps, in backward and in
the all-reduce. The oracle is the record of committed steps replayed in one process with plain torch data
splitting (`DistributedSampler`), and the groups must end bit-identical."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

pytest.importorskip("torchft", reason="the `ft` extra (torchft) is not installed")

from torchloom.fault_tolerance import read_record, replay  # noqa: E402

# The user's script, unchanged by fault tolerance, plus what a test needs: group 1 kills itself as the plan says
# (one "where:after" per attempt: SIGKILL after that many committed steps of the attempt, between steps, in
# backward or right after entering the all-reduce), and the job ends once 4 steps in a row had both groups (a
# streak kept in a buffer, so a group that heals receives it).
_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from torchloom import Loom
    from torchloom import fault_tolerance as ft

    out, plan = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4800, 4), torch.randn(4800, 1))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    net.register_buffer("streak", torch.zeros((), dtype=torch.long))
    loom = Loom(accelerator="cpu")
    model, opt = loom.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    loader = loom.setup_dataloaders(DataLoader(data, batch_size=4))
    rg = ft.current()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    open(os.path.join(out, f"group{rg.group}.attempt{attempt}"), "w").close()
    kills = [k.split(":") for k in plan.split(",") if k]
    mine = rg.group == 1 and attempt < len(kills)
    where, after = (kills[attempt][0], int(kills[attempt][1])) if mine else (None, -1)

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    done = 0
    for x, y in loader:
        before = rg.step
        if where == "backward" and done == after:
            net[0].weight.register_hook(die)
        if where == "allreduce" and done == after:
            real = rg._manager.allreduce
            def allreduce(*args, **kwargs):
                real(*args, **kwargs)
                die()
            rg._manager.allreduce = allreduce
        loss = nn.functional.mse_loss(model(x), y)
        loom.backward(loss)
        opt.step()
        opt.zero_grad()
        if rg.step > before:
            done += 1
            if len(rg.participants) == rg.groups:
                net.streak += 1
            else:
                net.streak.zero_()
                time.sleep(0.5)  # alone: slow down until the other group is back
            if where == "between" and done == after:
                die()
            if int(net.streak) >= 4:
                break
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save({"state": state, "step": rg.step}, os.path.join(out, f"group{rg.group}.pt"))
    """
)


def _job(folder: Path, plan: str) -> subprocess.CompletedProcess[str]:
    folder.mkdir()
    script = folder / "train.py"
    script.write_text(_SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torchloom",
        "run",
        "--replica-groups",
        "2",
        "--accelerator",
        "cpu",
        "--devices",
        "1",
        "--max-restarts",
        "4",
        "--ft-record",
        str(folder / "record.jsonl"),
        str(script),
        str(folder),
        plan,
    ]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def jobs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Both jobs at once (a healthy one and one with three faults): starting processes dominates."""
    base = tmp_path_factory.mktemp("ft")
    plans = {"healthy": "", "faults": "between:2,backward:2,allreduce:2"}
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = {name: pool.submit(_job, base / name, plan) for name, plan in plans.items()}
        return {name: (base / name, future.result()) for name, future in futures.items()}


def _replayed(record: Path) -> tuple[dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4800, 4), torch.randn(4800, 1))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    shards = [list(DistributedSampler(data, num_replicas=2, rank=g, shuffle=False)) for g in range(2)]

    def batch(group: int, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert epoch == 0
        return data[shards[group][index * 4 : index * 4 + 4]]

    def loss(model: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(xy[0]), xy[1])

    steps = replay(record, net, opt, batch, loss)
    return dict(net.named_parameters()), steps


@pytest.mark.parametrize("name", ["healthy", "faults"])
def test_run_equals_the_replay_and_groups_end_bit_identical(jobs, name: str) -> None:
    folder, done = jobs[name]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ends = [torch.load(folder / f"group{g}.pt") for g in range(2)]
    assert ends[0]["step"] == ends[1]["step"]
    for key, value in ends[0]["state"].items():
        assert torch.equal(value, ends[1]["state"][key]), key  # bit for bit
    expected, steps = _replayed(folder / "record.jsonl")
    assert steps == ends[0]["step"]
    for key, value in expected.items():
        torch.testing.assert_close(ends[0]["state"][key], value.detach(), rtol=0, atol=1e-5)


def test_faults_were_survived_and_healed(jobs) -> None:
    """The killed group was started four times (three kills, then a run to the end) and came back into the
    steps (the record has steps without it, then with it again), and the survivor never stopped: once both
    groups ran, group 0 took part in every committed step. How many of the kills show as a gap in the record
    depends on timing (a restarted group may commit its steps before the survivor's next quorum), so the test
    counts the starts, and at least one gap."""
    folder, done = jobs["faults"]
    assert done.returncode == 0, done.stderr[-5000:]
    assert sorted(p.name for p in folder.glob("group1.attempt*")) == [f"group1.attempt{i}" for i in range(4)]
    assert sorted(p.name for p in folder.glob("group0.attempt*")) == ["group0.attempt0"]
    steps = read_record(folder / "record.jsonl")
    together = [len(s.participants) == 2 for s in steps]
    first = together.index(True)
    assert all(any(p.group == 0 for p in s.participants) for s in steps[first:])
    rejoins = sum(1 for a, b in zip(together[first:], together[first + 1 :], strict=False) if not a and b)
    assert rejoins >= 1, together


def test_without_torchft_replica_groups_name_the_extra(tmp_path: Path) -> None:
    """`--replica-groups` without torchft installed: a clear error naming `pip install torchloom[ft]`."""
    blocker = tmp_path / "torchft.py"
    blocker.write_text("raise ImportError('torchft is not installed here')\n")
    (tmp_path / "train.py").write_text("print('never runs')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{Path(__file__).parents[1] / 'src'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "torchloom", "run", "--replica-groups", "2", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    assert "pip install torchloom[ft]" in done.stderr
    assert "never runs" not in done.stdout


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--replica-groups", "2", "--replica-group", "0"], "--replica-group needs --lighthouse"),
        (["--replica-groups", "2", "--lighthouse", "127.0.0.1:1"], "--lighthouse needs --replica-group"),
        (["--replica-groups", "2", "--lighthouse", "h:1", "--replica-group", "2"], "must be in 0..1"),
        (["--replica-groups", "2", "--strategy", "fsdp"], "use strategy='fsdp2'"),
        (["--replica-groups", "0"], "--replica-groups 0 is not valid"),
    ],
)
def test_replica_group_options_are_checked_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], words: str
) -> None:
    from torchloom.cli import main

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never runs')\n")
    assert main(["run", *options, str(script)]) == 2
    assert words in capsys.readouterr().err
