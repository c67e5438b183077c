"""The cross-group average of `ReplicaGroup` (`torchloom.fault_tolerance.replica`) for parameters without a
gradient: a real job of 2 replica groups of 1 CPU process (gloo, DDP with `find_unused_parameters=True` inside),
AdamW with weight decay, a model with a branch no group uses and a branch only group 0 uses.

A parameter no group had a gradient for keeps none (`p.grad is None`), so AdamW leaves it alone, as in one
process: it ends bit-identical to its initial value, without optimizer state. A parameter some groups had a
gradient for is averaged over every counted group (zeros for the others). The record's replay, which does the
same, equals the run within 1e-5."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

pytest.importorskip("torchft", reason="the `ft` extra (torchft) is not installed")

from _jobs import ends_bit_identical, run_script  # noqa: E402

from torchloom.fault_tolerance import read_record, replay  # noqa: E402

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from torchloom import Loom
    from torchloom import fault_tolerance as ft
    from torchloom.strategies import DDPStrategy


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
            self.unused = nn.Linear(8, 1)  # no group ever uses it
            self.extra = nn.Linear(8, 1)  # group 0 only
            self.register_buffer("streak", torch.zeros((), dtype=torch.long))

        def forward(self, x, group):
            h = torch.tanh(self.inp(x))
            return self.out(h) + (self.extra(h) if group == 0 else 0)


    out = sys.argv[1]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 4), torch.randn(640, 1))
    net = Net()
    loom = Loom(accelerator="cpu", strategy=DDPStrategy(find_unused_parameters=True))
    model = loom.setup_module(net)
    opt = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    loader = loom.setup_dataloaders(DataLoader(data, batch_size=4))
    rg = ft.current()
    for x, y in loader:
        before = rg.step
        loom.backward(nn.functional.mse_loss(model(x, rg.group), y))
        opt.step()
        opt.zero_grad()
        if rg.step > before:
            net.streak.copy_(net.streak + 1 if len(rg.participants) == rg.groups else 0)
            if int(net.streak) >= 6:
                break
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    names = {id(p): n for n, p in net.named_parameters()}
    with_state = sorted(names[id(p)] for p in opt.state if opt.state[p])
    torch.save({"state": state, "step": rg.step, "with_state": with_state}, os.path.join(out, f"group{rg.group}.pt"))
    """
)


class _Net(nn.Module):
    """The script's model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
        self.unused = nn.Linear(8, 1)
        self.extra = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, group: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h) + (self.extra(h) if group == 0 else 0)


def test_a_parameter_no_group_used_is_left_alone_and_the_replay_agrees(tmp_path: Path) -> None:
    done = run_script(tmp_path, _SCRIPT, 2, 1, max_restarts=0, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ends = ends_bit_identical(tmp_path, 2)
    assert ends[0]["step"] >= 6

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 4), torch.randn(640, 1))
    net = _Net()
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
    # No group had a gradient for `unused`: untouched (no weight decay), no optimizer state. `extra` (group 0's
    # only) moved and has state, like every other parameter.
    for key in ("unused.weight", "unused.bias"):
        assert torch.equal(ends[0]["state"][key], initial[key]), key
    assert ends[0]["with_state"] == [
        "extra.bias",
        "extra.weight",
        "inp.bias",
        "inp.weight",
        "out.bias",
        "out.weight",
    ]
    assert not torch.equal(ends[0]["state"]["extra.weight"], initial["extra.weight"])

    shards = [list(DistributedSampler(data, num_replicas=2, rank=g, shuffle=False)) for g in range(2)]
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    steps = replay(
        tmp_path / "record.jsonl",
        net,
        opt,
        batch=lambda group, epoch, index: (*data[shards[group][index * 4 : index * 4 + 4]], group),
        loss=lambda model, xyg: nn.functional.mse_loss(model(xyg[0], xyg[2]), xyg[1]),
    )
    assert steps == ends[0]["step"] == len(read_record(tmp_path / "record.jsonl"))
    assert all(len(s.participants) == 2 for s in read_record(tmp_path / "record.jsonl"))
    for key, value in net.named_parameters():
        torch.testing.assert_close(ends[0]["state"][key], value.detach(), rtol=0, atol=1e-5)
    assert all(opt.state[p] == {} or p not in opt.state for p in net.unused.parameters())


# A script without a set-up loader: each group trains on one fixed batch of its own, and joins each step's quorum
# in its backward (`average_gradients`). Group 1 dies between steps on its first attempt; restarted, it heals in
# its first backward's quorum, so that backward's gradient is stale: the group sends zeros, is not counted, and
# steps with the other's average from the healed weights.
_NO_LOADER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    from torchloom import Loom
    from torchloom import fault_tolerance as ft

    out = sys.argv[1]
    torch.manual_seed(0)
    data = torch.randn(8, 4), torch.randn(8, 1)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    net.register_buffer("streak", torch.zeros((), dtype=torch.long))
    loom = Loom(accelerator="cpu")
    model = loom.setup_module(net)
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    rg = ft.current()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    x, y = data[0][rg.group * 4 : rg.group * 4 + 4], data[1][rg.group * 4 : rg.group * 4 + 4]
    while True:
        before = rg.step
        loom.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if rg.step > before:
            if rg.group == 1 and attempt == 0 and rg.step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            net.streak.copy_(net.streak + 1 if len(rg.participants) == rg.groups else 0)
            if int(net.streak) >= 4:
                break
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save({"state": state, "step": rg.step}, os.path.join(out, f"group{rg.group}.pt"))
    """
)


def test_a_group_that_heals_in_its_backward_is_not_counted_and_the_replay_agrees(tmp_path: Path) -> None:
    done = run_script(tmp_path, _NO_LOADER, 2, 1, max_restarts=2, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ends = ends_bit_identical(tmp_path, 2)
    steps = read_record(tmp_path / "record.jsonl")
    assert any(len(s.participants) == 1 for s in steps)  # group 1 away, then healed and not counted

    torch.manual_seed(0)
    data = torch.randn(8, 4), torch.randn(8, 1)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    replayed = replay(
        tmp_path / "record.jsonl",
        net,
        torch.optim.Adam(net.parameters(), lr=0.01),
        batch=lambda group, epoch, index: (
            data[0][group * 4 : group * 4 + 4],
            data[1][group * 4 : group * 4 + 4],
        ),
        loss=lambda model, xy: nn.functional.mse_loss(model(xy[0]), xy[1]),
    )
    assert replayed == ends[0]["step"] == len(steps)
    for key, value in net.state_dict().items():
        torch.testing.assert_close(ends[0]["state"][key], value, rtol=0, atol=1e-5)


# Two optimizers (AdamW for the first layer, SGD with momentum for the last), both stepped after each backward, as
# a user of Muon plus AdamW does. Group 1 dies in its backward at step 3 of its first attempt: group 0's step fails
# and is retried alone. The first `step()` asks the groups' vote and the second follows its answer, so a failed
# step moves neither optimizer (the retried step applies each once).
_TWO_OPTIMIZERS = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from torchloom import Loom
    from torchloom import fault_tolerance as ft

    out = sys.argv[1]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 4), torch.randn(640, 1))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    net.register_buffer("streak", torch.zeros((), dtype=torch.long))
    loom = Loom(accelerator="cpu")
    model, first, last = loom.setup(
        net,
        torch.optim.AdamW(net[0].parameters(), lr=0.01, weight_decay=0.1),
        torch.optim.SGD(net[2].parameters(), lr=0.05, momentum=0.9),
    )
    loader = loom.setup_dataloaders(DataLoader(data, batch_size=4))
    rg = ft.current()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    failed = 0
    done = False
    while not done:  # until 4 steps together after group 1 is back (the streak is a buffer: the groups agree)
        for x, y in loader:
            before = rg.step
            hook = None
            if rg.group == 1 and attempt == 0 and before == 3:
                die = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
                hook = net[0].register_forward_hook(lambda m, i, o: (o.register_hook(die), None)[1])
            loom.backward(nn.functional.mse_loss(model(x), y))
            first.step()
            last.step()
            first.zero_grad()
            last.zero_grad()
            if rg.step == before:
                failed += 1
                continue
            together = len(rg.participants) == rg.groups
            net.streak.copy_(net.streak + 1 if together else 0)
            if not together:
                time.sleep(0.1)  # alone: wait for the other
            if rg.step > 5 and int(net.streak) >= 4:
                done = True
                break
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save({"state": state, "step": rg.step, "failed": failed}, os.path.join(out, f"group{rg.group}.pt"))
    """
)


class _Both:
    """The replay's optimizer for the script's two: each steps on its own parameters."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def test_two_optimizers_follow_one_vote_and_the_replay_agrees(tmp_path: Path) -> None:
    done = run_script(tmp_path, _TWO_OPTIMIZERS, 2, 1, max_restarts=2, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ends = ends_bit_identical(tmp_path, 2)
    assert ends[0]["failed"] >= 1  # group 0 retried the step group 1 died in
    steps = read_record(tmp_path / "record.jsonl")
    assert any(len(s.participants) == 1 for s in steps)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 4), torch.randn(640, 1))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    both = _Both(
        torch.optim.AdamW(net[0].parameters(), lr=0.01, weight_decay=0.1),
        torch.optim.SGD(net[2].parameters(), lr=0.05, momentum=0.9),
    )
    shards = [list(DistributedSampler(data, num_replicas=2, rank=g, shuffle=False)) for g in range(2)]
    replayed = replay(
        tmp_path / "record.jsonl",
        net,
        both,  # type: ignore[arg-type]
        batch=lambda group, epoch, index: data[shards[group][index * 4 : index * 4 + 4]],
        loss=lambda model, xy: nn.functional.mse_loss(model(xy[0]), xy[1]),
    )
    assert replayed == ends[0]["step"] == len(steps)
    for key, value in net.named_parameters():
        torch.testing.assert_close(ends[0]["state"][key], value.detach(), rtol=0, atol=1e-5)
