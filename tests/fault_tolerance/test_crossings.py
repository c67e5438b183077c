"""Fault tolerance where it meets the older features: one real job of 2 replica groups of 1 CPU process
(`torchloom run --replica-groups 2`) whose model and loop hold them all at once, with group 1 SIGKILLed in the
synchronising backward of an accumulated step (the survivor's all-reduce fails and it retries the step), then,
restarted, between steps:

- `precision="16-mixed"`: the loss scaler heals with the model (a healed group started at the initial scale
  before), a step that did not commit is unscaled again when retried (it was applied at the loss scale), and a
  step the scaler skips on overflow is in the record as skipped;
- gradient accumulation (`no_backward_sync` on the first of 2 micro-batches): a retried step reads both of its
  micro-batches again (it read the last one twice);
- a BatchNorm: its running statistics are the mean over the step's participants (they followed each group's own
  batches, and the groups parted);
- an LR scheduler handed to `loom.setup(..., scheduler=)`: it heals (a healed group restarted it at step 0) and
  does not step after a step that did not commit;
- a weight tied between two layers, a frozen layer, clipping by norm every step, AdamW with weight decay.

The oracle: the record replayed in one process with plain torch (`DistributedSampler` shards, `torch.autocast`,
`clip_grad_norm_`, the scheduler stepped after each step), within 1e-5; the groups end bit-identical, buffers
included. A second job leaves the scheduler out of `loom.setup`: after the heal every group refuses the step,
naming the fix, instead of parting silently.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

pytest.importorskip("torchft", reason="the `ft` extra (torchft) is not installed")

from _jobs import STREAK, ends_bit_identical, run_script  # noqa: E402

from torchloom.fault_tolerance import replay  # noqa: E402

MICRO = 2
BATCH = 4
MAX_NORM = 0.05

_MODEL = textwrap.dedent(
    """
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8, bias=False)  # (a bias before a BatchNorm has no gradient: Adam moves noise)
            self.bn = nn.BatchNorm1d(8)
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b.weight = self.a.weight
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.out = nn.Linear(8, 1)
            self.register_buffer("streak", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            h = torch.tanh(self.bn(self.inp(x)))
            h = torch.tanh(self.b(torch.tanh(self.a(h))))
            return self.out(torch.tanh(self.frozen(h)))
    """
)

# The user's loop, plus the kills: group 1 dies as the plan says (one "where:after" per attempt: in the
# synchronising backward of its step `after`, or between steps after `after` committed steps), and the job ends
# once 4 steps in a row had both groups (a streak kept in a buffer, so a group that heals receives it).
_SCRIPT = (
    (
        textwrap.dedent(
            """
    import os, signal, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from torchloom import Loom
    from torchloom import fault_tolerance as ft
    from torchloom.errors import MisuseError

    out, precision, plan = sys.argv[1:4]
    heal_scheduler, lose_all = sys.argv[4] == "1", sys.argv[5] == "1"
    """
        )
        + _MODEL
        + textwrap.dedent(
            """
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4800, 4), torch.randn(4800, 1))
    net = Net()
    loom = Loom(accelerator="cpu", precision=precision)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if heal_scheduler:
        model, opt, sched = loom.setup(net, opt, scheduler=sched)
    else:
        model, opt = loom.setup(net, opt)
    loader = loom.setup_dataloaders(DataLoader(data, batch_size=BATCH))
    rg = ft.current()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    checkpoint = os.path.join(out, "checkpoint")
    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    if lose_all and os.path.exists(checkpoint):
        loom.load(checkpoint, state)
    open(os.path.join(out, f"group{rg.group}.attempt{attempt}"), "w").close()
    kills = [k.split(":") for k in plan.split(",") if k]
    where, after = (kills[attempt][0], int(kills[attempt][1])) if rg.group == 1 and attempt < len(kills) else ("", -1)


    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)


    done = micro = 0
    for x, y in loader:
        micro += 1
        sync = micro % MICRO == 0
        before = rg.step
        hook = None
        if where == "backward" and done == after and sync:
            hook = net.a.register_forward_hook(lambda m, i, o: (o.register_hook(die), None)[1])
        try:
            with loom.no_backward_sync(model, enabled=not sync):
                loom.backward(nn.functional.mse_loss(model(x), y) / MICRO)
        except MisuseError as refused:  # (the test's: a job ends here, and the test reads why)
            open(os.path.join(out, f"group{rg.group}.refused"), "w").write(str(refused))
            sys.exit(0)
        if not sync:
            continue
        loom.clip_gradients(model, opt, max_norm=MAX_NORM)
        opt.step()
        opt.zero_grad()
        sched.step()
        if hook is not None:
            hook.remove()
        STREAK
            if lose_all and attempt == 0 and rg.step == 3:
                loom.save(checkpoint, state)
            if lose_all and attempt == 0 and rg.step == 5:
                die()  # every group, after the same step: the whole job is lost
            if int(net.streak) >= 4 and rg.step > 5:
                break
    scaler = loom._strategy.precision.scaler
    end = {
        "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "step": rg.step,
        "lr": opt.param_groups[0]["lr"],
        "scale": None if scaler is None else scaler.get_scale(),
    }
    torch.save(end, os.path.join(out, f"group{rg.group}.pt"))
    """
        )
    )
    .replace("BATCH", str(BATCH))
    .replace("MICRO", str(MICRO))
    .replace("MAX_NORM", repr(MAX_NORM))
    .replace("    STREAK\n", STREAK.lstrip("\n"))
)

# precision, group 1's kills, whether the scheduler goes to loom.setup, whether the whole job is lost.
_JOBS = {
    "crossings": ("16-mixed", "backward:2,between:3", "1", "0"),
    "scheduler_left_out": ("32-true", "between:2", "0", "0"),
    "job_lost": ("16-mixed", "", "1", "1"),
}


def _job(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_script(folder, _SCRIPT, 2, 1, *args, max_restarts=3)


@pytest.fixture(scope="module")
def jobs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Both jobs at once: starting processes dominates."""
    base = tmp_path_factory.mktemp("ft_crossings")
    with ThreadPoolExecutor(len(_JOBS)) as pool:
        futures = {name: pool.submit(_job, base / name, *args) for name, args in _JOBS.items()}
        return {name: (base / name, future.result()) for name, future in futures.items()}


def _replayed(record: Path) -> tuple[dict[str, torch.Tensor], float, int]:
    """The record replayed in one process: each group's step reads micro-batches index-1 and index of its shard
    (the record names a step's last batch), under fp16 autocast, clipped, then the scheduler steps."""
    namespace: dict[str, object] = {"torch": torch, "nn": nn}
    exec(_MODEL, namespace)  # noqa: S102 - the script's own model, defined once for both
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4800, 4), torch.randn(4800, 1))
    net = namespace["Net"]()  # type: ignore[operator]
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    shards = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=False)) for r in range(2)]

    def batch(group: int, epoch: int, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert epoch == 0
        return [data[shards[group][i * BATCH : (i + 1) * BATCH]] for i in range(index - MICRO + 1, index + 1)]

    def loss(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        total = torch.zeros(())
        for x, y in micro_batches:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            total = total + nn.functional.mse_loss(out.float(), y) / MICRO
        return total

    steps = replay(
        record,
        net,
        opt,
        batch,
        loss,
        before_step=lambda m: torch.nn.utils.clip_grad_norm_(trained, MAX_NORM),
        after_step=lambda m: sched.step(),
    )
    return net.state_dict(), opt.param_groups[0]["lr"], steps


def _check_against_the_replay(folder: Path) -> None:
    ends = ends_bit_identical(folder, 2)  # the BatchNorm's buffers too
    assert ends[0]["scale"] == ends[1]["scale"] and ends[0]["lr"] == ends[1]["lr"]
    expected, lr, steps = _replayed(folder / "record.jsonl")
    assert steps == ends[0]["step"]
    assert lr == pytest.approx(ends[0]["lr"], rel=1e-12)
    for name, value in expected.items():
        if name == "streak":
            continue  # the script's own counter, not the training's
        torch.testing.assert_close(ends[0]["state"][name].float(), value.float(), rtol=0, atol=1e-5)


def test_every_crossing_heals_and_equals_the_replay(jobs) -> None:
    folder, done = jobs["crossings"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert sorted(p.name for p in folder.glob("group1.attempt*")) == [f"group1.attempt{i}" for i in range(3)]
    _check_against_the_replay(folder)


def test_a_job_that_loses_every_group_resumes_from_its_checkpoint_and_equals_the_replay(jobs) -> None:
    """Both groups die after 5 committed steps; restarted, both load the checkpoint written after 3 (the model,
    optimizer, scheduler and the loader's position) and go on numbering from it. The record's history is the
    whole run (the lines of the steps lost with the job are off it), so the replay from the initial model equals
    the resumed run."""
    folder, done = jobs["job_lost"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for group in range(2):
        assert sorted(p.name for p in folder.glob(f"group{group}.attempt*")) == [
            f"group{group}.attempt{i}" for i in range(2)
        ]
    lines = [json.loads(line) for line in (folder / "record.jsonl").read_text().splitlines()]
    # Step 3 (the first after the checkpoint) committed twice, before the loss and after it, from the same parent:
    # the resumed run goes on from the checkpoint's place in the record, and from its data position (its batches
    # those the lost steps read, micro-batches 6 and 7 of each group's shard).
    third = {line["chain"]: line for line in lines if line["step"] == 3}
    assert len(third) == 2, lines
    assert len({line["parent"] for line in third.values()}) == 1
    assert {p["batch"] for line in third.values() for p in line["participants"]} == {7}
    _check_against_the_replay(folder)


def test_a_scheduler_that_does_not_heal_is_refused_on_every_group(jobs) -> None:
    """Group 1 is killed after 2 steps and heals: its scheduler restarted at step 0, so its learning rate is
    not the survivor's. Both groups refuse the step (the script ends there and writes why)."""
    folder, done = jobs["scheduler_left_out"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for group in range(2):
        refused = (folder / f"group{group}.refused").read_text()
        assert "hold different hyperparameters" in refused
        assert "pass it to loom.setup(model, optimizer, scheduler=scheduler)" in refused
    assert not (folder / "group0.pt").exists()  # the survivor did not train on apart


def test_the_mean_of_equal_buffers_is_exact() -> None:
    """`first + sum(x - first) / n`: a buffer no forward changed stays bit for bit what it was (a plain mean of
    three equal floats need not), and an integer counter advanced alike stays exact."""
    from torchloom.fault_tolerance.buffers import mean

    x = torch.tensor([0.1, 1 / 3, 2.0e-7, 12345.678], dtype=torch.float32)
    assert torch.equal(mean([x, x.clone(), x.clone()]), x)
    counts = torch.tensor([7])
    assert torch.equal(mean([counts, counts.clone(), counts.clone()]), counts)
    assert torch.equal(
        mean([torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([6.0])]), torch.tensor([3.0])
    )
