"""Sharded strategies inside replica groups (`torchloom.fault_tolerance`): real jobs of 2 replica groups of 2 CPU
processes (gloo), launched with `torchloom run --replica-groups 2 --devices 2`, healthy and with group 1 losing a
rank to SIGKILL between steps and then in backward.

- "fsdp2": HSDP across the groups: units made by hand (`fully_shard` of two layers) and replicated leftovers (a
  layer and a scalar outside every unit), sharded over the 2 processes of a group;
- "model_parallel_tp": `ModelParallelStrategy` with tensor parallel inside a group (a column- then a row-parallel
  layer, tp 2, plain leftovers after them), data parallel across the groups only;
- "model_parallel_dp": `ModelParallelStrategy` with dp 2 inside a group (`fully_shard` of two layers over
  `device_mesh["data_parallel"]` in `parallelize_fn`), data parallel inside and across the groups.

fsdp2 and tensor parallel run with faults; dp inside runs healthy (its gradients and state are fsdp2's: the same
exchange). The fsdp2 job with faults also serves `loom.save`'s test: both groups save each time two steps in a row
had both, the last time at one step (a healthy job of its own cost a job more).

Every step clips the gradients to a norm of 0.05 with `loom.clip_gradients` (always active on this data), so the
run equals the replay only if the groups clip the average over the groups, not their own gradients. The oracle is
the record of committed steps replayed in one process on plain torch data splitting (`DistributedSampler`) with
`torch.nn.utils.clip_grad_norm_`; the groups' full parameters (gathered from the shards) must end bit-identical.
"""

from __future__ import annotations

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

from torchloom.fault_tolerance import read_record, replay  # noqa: E402

MAX_NORM = 0.05
BATCH = 4

# The user's script, plus what a test needs: group 1 kills one of its ranks as the plan says (one
# "where:after:rank" per attempt of the group: SIGKILL after that many committed steps of the attempt, between
# steps or in backward), and the job ends once 4 steps in a row had both groups (a streak kept in a buffer, so a
# group that heals receives it). At the end each group gathers its full parameters and rank 0 saves them.
_SCRIPT = (
    textwrap.dedent(
        """
    import os, signal, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from torchloom import Loom
    from torchloom import fault_tolerance as ft

    out, kind, plan = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "")


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
            self.scale = nn.Parameter(torch.tensor(1.5))
            self.register_buffer("streak", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x))))) * self.scale


    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4800, 4), torch.randn(4800, 1))
    net = Net()
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        loom = Loom(accelerator="cpu", strategy="fsdp2")
        for block in (net.inp, net.mid):
            fully_shard(block, **loom.strategy.unit_kwargs())
    elif kind == "model_parallel_tp":
        from torchloom.strategies import ModelParallelStrategy

        def parallelize(model, mesh):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            return parallelize_module(
                model, mesh["tensor_parallel"], {"inp": ColwiseParallel(), "mid": RowwiseParallel()}
            )

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=2)
        loom = Loom(accelerator="cpu", strategy=strategy)
    else:
        from torch.distributed.fsdp import fully_shard
        from torchloom.strategies import ModelParallelStrategy

        def parallelize(model, mesh):
            for block in (model.inp, model.mid):
                fully_shard(block, mesh=mesh["data_parallel"])
            return model

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
        loom = Loom(accelerator="cpu", strategy=strategy)
    model = loom.setup_module(net)
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    loader = loom.setup_dataloaders(DataLoader(data, batch_size=4))
    rg = ft.current()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if loom.global_rank == 0:
        open(os.path.join(out, f"group{rg.group}.attempt{attempt}"), "w").close()
    kills = [k.split(":") for k in plan.split(",") if k]
    mine = rg.group == 1 and attempt < len(kills) and int(kills[attempt][2]) == loom.global_rank
    where, after = (kills[attempt][0], int(kills[attempt][1])) if mine else (None, -1)


    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)


    def full_state():
        full = {}
        for name, value in net.state_dict().items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            full[name] = value.detach().clone()
        return full


    done = 0
    for x, y in loader:
        before = rg.step
        hook = None
        if where == "backward" and done == after:
            hook = net.mid.register_forward_hook(lambda m, i, o: (o.register_hook(die), None)[1])
        loss = nn.functional.mse_loss(model(x), y)
        loom.backward(loss)
        loom.clip_gradients(model, opt, max_norm=MAX_NORM)
        opt.step()
        opt.zero_grad()
        if hook is not None:
            hook.remove()
        STREAK
            if int(net.streak) == 2:
                # Every group calls loom.save at the same step (one writes the job's checkpoint), and keeps what
                # it held then. With faults, again after each heal: the last save is both groups' at one step.
                loom.save(os.path.join(out, "checkpoint"), {"model": model, "optimizer": opt})
                held = full_state()
                if loom.global_rank == 0:
                    torch.save(held, os.path.join(out, f"group{rg.group}.at_save.pt"))
            if int(net.streak) >= 4:
                break
    full = full_state()
    if loom.global_rank == 0:
        torch.save({"state": full, "step": rg.step}, os.path.join(out, f"group{rg.group}.pt"))
    """
    )
    .replace("MAX_NORM", repr(MAX_NORM))
    .replace("    STREAK\n", STREAK.lstrip("\n"))
)

# Group 1 loses rank 1 between steps (after 2 committed steps), then, restarted, rank 0 in backward.
_FAULTS = "between:2:1,backward:2:0"
_JOBS = {
    ("fsdp2", "faults"): _FAULTS,
    ("model_parallel_dp", "healthy"): "",
    ("model_parallel_tp", "faults"): _FAULTS,
}


def _job(folder: Path, kind: str, plan: str) -> subprocess.CompletedProcess[str]:
    return run_script(folder, _SCRIPT, 2, 2, kind, plan, max_restarts=4)


@pytest.fixture(scope="module")
def jobs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, str], tuple[Path, subprocess.CompletedProcess[str]]]:
    """Every job at once: starting processes dominates."""
    base = tmp_path_factory.mktemp("ft_strategies")
    with ThreadPoolExecutor(len(_JOBS)) as pool:
        futures = {key: pool.submit(_job, base / "_".join(key), key[0], plan) for key, plan in _JOBS.items()}
        return {key: (base / "_".join(key), future.result()) for key, future in futures.items()}


class _Net(nn.Module):
    """The script's model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("streak", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x))))) * self.scale


def _shards(data: TensorDataset, readers: int) -> list[list[int]]:
    return [
        list(DistributedSampler(data, num_replicas=readers, rank=r, shuffle=False)) for r in range(readers)
    ]


def _replayed(record: Path, kind: str) -> tuple[dict[str, torch.Tensor], int]:
    """The record replayed on the script's model, data and optimizer in one process. Each group's batch is what
    its readers read together: under "fsdp2" its 2 processes read shards 2g and 2g + 1 of 4 (their batches'
    mean losses averaged is the loss of the concatenation), as under dp 2 inside a group; under tensor parallel
    both read shard g of 2."""

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4800, 4), torch.randn(4800, 1))
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    per_group = 1 if kind == "model_parallel_tp" else 2
    shards = _shards(data, 2 * per_group)

    def batch(group: int, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert epoch == 0
        rows = [
            i
            for reader in range(group * per_group, (group + 1) * per_group)
            for i in shards[reader][index * BATCH : (index + 1) * BATCH]
        ]
        return data[rows]

    def loss(model: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(xy[0]), xy[1])

    def clip(model: nn.Module) -> None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert norm > MAX_NORM  # the clipping is active: the test can tell the average's from a group's own

    steps = replay(record, net, opt, batch, loss, before_step=clip)
    return dict(net.named_parameters()), steps


@pytest.mark.parametrize("key", list(_JOBS), ids=["_".join(k) for k in _JOBS])
def test_run_equals_the_replay_and_groups_end_bit_identical(jobs, key: tuple[str, str]) -> None:
    folder, done = jobs[key]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ends = ends_bit_identical(folder, 2)  # every full parameter
    expected, steps = _replayed(folder / "record.jsonl", key[0])
    assert steps == ends[0]["step"]
    for name, value in expected.items():
        torch.testing.assert_close(ends[0]["state"][name], value.detach(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("key", [("fsdp2", "faults"), ("model_parallel_dp", "healthy")], ids="_".join)
def test_loom_save_writes_the_job_state_once(jobs, key: tuple[str, str]) -> None:
    """Both groups called `loom.save` at the same step: one wrote the checkpoint, whole, and it loads in one
    process to what every group held then, bit for bit. Under fsdp2, in the job with faults: the groups saved
    again after each heal, the last time both at once."""
    from torchloom import Loom

    folder, done = jobs[key]
    assert done.returncode == 0, done.stderr[-5000:]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".checkpoint")] == []  # no temporaries left
    held = [torch.load(folder / f"group{g}.at_save.pt") for g in range(2)]
    loom = Loom(accelerator="cpu", devices=1)
    net = _Net()
    loom.load(folder / "checkpoint", {"model": net})
    for name, value in net.state_dict().items():
        assert torch.equal(value, held[0][name]) and torch.equal(value, held[1][name]), name


@pytest.mark.parametrize("kind", ["fsdp2", "model_parallel_tp"])
def test_the_killed_group_came_back_and_healed(jobs, kind: str) -> None:
    """Group 1 was started three times (two kills, then a run to the end) and group 0 once, and group 1 came
    back into the steps: the last committed steps had both groups, after steps without group 1. The number of
    gaps depends on timing (a restarted group can be back before the survivor's next quorum), so the test asks
    for at least one."""
    folder, done = jobs[(kind, "faults")]
    assert done.returncode == 0, done.stderr[-5000:]
    assert sorted(p.name for p in folder.glob("group1.attempt*")) == [f"group1.attempt{i}" for i in range(3)]
    assert sorted(p.name for p in folder.glob("group0.attempt*")) == ["group0.attempt0"]
    together = [len(s.participants) == 2 for s in read_record(folder / "record.jsonl")]
    assert together[-4:] == [True] * 4
    first = together.index(True)
    assert not all(together[first:]), together


@pytest.mark.parametrize(
    ("strategy", "words"),
    [
        ("fsdp", "use strategy='fsdp2'"),
        ("fsdp_cpu_offload", "use strategy='fsdp2'"),
        ("single_device", "it runs one process"),
        ("model_parallel", "Pass an instance"),
    ],
)
def test_strategies_that_cannot_run_in_a_group_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], strategy: str, words: str
) -> None:
    from torchloom.cli import main

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never runs')\n")
    assert main(["run", "--replica-groups", "2", "--strategy", strategy, str(script)]) == 2
    err = capsys.readouterr().err
    assert f"--strategy {strategy}" in err and words in err


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "ddp_spawn", "auto"])
def test_strategies_that_run_in_a_group_pass_the_command_line_check(strategy: str) -> None:
    from torchloom.fault_tolerance.launch import _strategy_refusal

    assert _strategy_refusal(strategy) is None


def _split(model: nn.Module, stage: int, stages: int) -> nn.Module:
    return model


def test_a_script_whose_strategy_cannot_run_in_a_group_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`Loom(strategy=...)` in a rank of a replica group: the strategies without a data-parallel dimension that
    the groups can average piece by piece say so, and what to use, before any process group is made."""
    from torchloom import Loom, _run_protocol
    from torchloom.errors import ConfigurationError
    from torchloom.strategies import FSDPStrategy, PipelineStrategy

    monkeypatch.setenv(_run_protocol.REPLICA_GROUPS_ENV, "2")
    monkeypatch.setenv(_run_protocol.REPLICA_GROUP_ENV, "0")
    monkeypatch.setenv(_run_protocol.LIGHTHOUSE_ENV, "127.0.0.1:1")
    refused = {
        PipelineStrategy(split_fn=_split): "use ModelParallelStrategy",
        FSDPStrategy(): "use strategy='fsdp2'",
    }
    for strategy, words in refused.items():
        with pytest.raises(
            ConfigurationError, match=f"cannot run {type(strategy).__name__} inside"
        ) as caught:
            Loom(accelerator="cpu", devices=2, strategy=strategy)
        assert words in str(caught.value)


class _QuorumOnly:
    """torchft's Manager as far as a refused step reaches it: a quorum, and never a commit vote."""

    def start_quorum(self) -> None:
        pass

    def should_commit(self) -> bool:
        raise AssertionError("a step without the cross-group average must not reach the commit vote")

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_a_step_whose_gradients_were_not_averaged_across_groups_is_refused() -> None:
    """`optimizer.step()` after a plain `loss.backward()` (or only backwards under `no_backward_sync`): the groups
    would step with their own gradients and part silently, so the step is refused, naming `loom.backward`."""
    from torchloom.errors import MisuseError
    from torchloom.fault_tolerance import ReplicaGroup

    group = ReplicaGroup(
        2,
        0,
        "127.0.0.1:1",
        None,
        group_rank=0,
        group_size=1,
        all_gather_object=lambda x: [x],
        device=torch.device("cpu"),
    )
    group._manager = _QuorumOnly()
    try:
        with pytest.raises(MisuseError, match=r"call loom\.backward\(loss\)"):
            group.should_commit()
    finally:
        group.close()
