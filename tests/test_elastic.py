"""Jobs under torch's own elastic agent (`python -m torch.distributed.run`): restarts after a rank dies.

A restarted attempt meets in the store its failed attempt used (torchrun's agent keeps it), so every key the new
attempt reads must be its own. Each job trains a few steps with a checkpoint per step; rank 1 dies in the first
attempt, the agent restarts both ranks, and the new attempt resumes from the newest checkpoint. The result must be
the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from harness import PYTHON, REPO, TOKEN_ENV, free_port, kill_token, run_job, wait_no_strays

TESTS = Path(__file__).resolve().parent
JOB_TIMEOUT = 150
CHAIN_TIMEOUT = 2 * JOB_TIMEOUT  # a launch whose attempts stand for several jobs
STEPS = 4
DIE_AT = 2  # rank 1 of the first attempt dies at the start of this step, after checkpoint `step-0002`
RESULT_TAG = "TORCHLOOM_ELASTIC_RESULT "
DYING_TAG = "TORCHLOOM_ELASTIC_DYING "

SCRIPT = """\
import json, os, signal, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import torch
from torch import nn
from torchloom import Loom


def say(line):
    # One write per line: the ranks share the job's stdout, where print's separate newline can interleave.
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


ckpt_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", -1))  # -1: the launching process
# Where rank 1 dies in each attempt ("2,4": at step 2 of the first, after the last step of the second).
plan = [int(at) for at in sys.argv[3].split(",")]
die_at = plan[attempt] if 0 <= attempt < len(plan) else None
loom = Loom(accelerator="cpu")  # processes and nodes as the launcher started them
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = loom.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0}
saved = sorted(ckpt_dir.glob("step-*"))
if saved:
    loom.load(saved[-1], state)
resumed_at = state["step"]
for step in range(resumed_at, steps):
    if step == die_at and loom.global_rank == 1:
        say(f"TORCHLOOM_ELASTIC_DYING {step} {time.time()}")
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * step + loom.global_rank))
    loom.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    state["step"] = step + 1
    if step == resumed_at and attempt > 0:
        say(f"TORCHLOOM_FIRST_STEP {time.time()}")
    loom.save(ckpt_dir / f"step-{step + 1:04d}", state, fsync=False)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
report = {"rank": loom.global_rank, "world_size": loom.world_size, "attempt": attempt, "resumed_at": resumed_at,
          "params": params.tolist()}
say("TORCHLOOM_ELASTIC_RESULT " + json.dumps(report))
if die_at == steps and loom.global_rank == 1:
    # After its last step and save, while rank 0 is ending the job.
    say(f"TORCHLOOM_ELASTIC_DYING {steps} {time.time()}")
    os.kill(os.getpid(), signal.SIGKILL)
loom.close()
"""


def _reference(world_size: int, steps: int = STEPS) -> torch.Tensor:
    """Plain torch, never interrupted: each step on the concatenated batches of all ranks."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x = torch.cat(
            [
                torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * step + r))
                for r in range(world_size)
            ]
        )
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _reports(output: str) -> list[dict]:
    found = [
        json.loads(line[len(RESULT_TAG) :]) for line in output.splitlines() if line.startswith(RESULT_TAG)
    ]
    return sorted(found, key=lambda r: r["rank"])


def _torchrun(*args: str) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", *args]


# torchrun's default: the static rendezvous, whose store the agent of node 0 holds.
STATIC = "--max-restarts 1 --master-addr 127.0.0.1 --master-port {port}"
# The elastic one (c10d), through `torchloom run`, which hands these options to torchrun's own `run` in its
# process (test_torchloom_run_passes_elastic_options_to_torchrun checks the LaunchConfig it builds): the agent
# shares a store of its own with the workers, kept across restarts. One job serves three tests: rank 1 dies at
# step 2 of the first attempt (test_a[c10d], test_torchloom_launcher_restarts_a_failed_attempt[torchloom-run])
# and after the last step and save of the second (test_b); the third ends the job.
C10D_RUN = "run --devices 2 --max-restarts 2 --rdzv-backend c10d --monitor-interval 0.1"


def _job_result(proc: subprocess.CompletedProcess, token: str) -> dict:
    return {"proc": proc, "strays": wait_no_strays(token)}


@pytest.fixture(scope="module")
def c10d_job(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("c10d")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    cmd = [
        PYTHON,
        "-m",
        "torchloom",
        *C10D_RUN.split(),
        str(script),
        str(ckpts),
        str(STEPS),
        f"{DIE_AT},{STEPS}",
    ]
    return _job_result(*run_job(cmd, timeout=CHAIN_TIMEOUT))


def _check_restarted(job: dict, attempt: int, what: str) -> None:
    """Rank 1 died at step DIE_AT of attempt `attempt - 1`: attempt `attempt` resumed from the newest checkpoint
    on both ranks and ended with the uninterrupted run's parameters; the job left no process behind."""
    proc = job["proc"]
    assert proc.returncode == 0, f"{what}: {proc.stdout}"
    assert job["strays"] == [], f"{what}: processes of the job survived it"
    reports = [r for r in _reports(proc.stdout) if r["attempt"] == attempt]
    assert [r["rank"] for r in reports] == [0, 1], f"{what}: {proc.stdout}"
    expected = _reference(2)
    for report in reports:
        # From the checkpoint the failed attempt wrote last (step 2; step 1 at worst when rank 0 was still
        # swapping step 2's file into place when rank 1 died).
        assert report["world_size"] == 2 and 1 <= report["resumed_at"] <= DIE_AT, (what, report)
        assert torch.allclose(torch.tensor(report["params"]), expected, atol=1e-6), (what, report, expected)
    _print_recovery(proc.stdout, what)


@pytest.mark.timeout(CHAIN_TIMEOUT + 30)
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_a_restarted_attempt_resumes_from_its_checkpoint(tmp_path, rendezvous, request):
    """Rank 1 is killed at step 2 of the first attempt; the agent restarts both ranks, which form a new group in
    the store the failed attempt used (its gloo addresses and start-up counters still there), load the newest
    checkpoint and finish: the parameters are those of an uninterrupted run, the job exits 0 and leaves no
    process behind."""
    if rendezvous == "c10d":
        job = request.getfixturevalue("c10d_job")
    else:
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        ckpts = tmp_path / "ckpts"
        ckpts.mkdir()
        cmd = _torchrun("--nproc-per-node", "2", *STATIC.format(port=free_port()).split(), str(script), str(ckpts),
                        str(STEPS), str(DIE_AT))  # fmt: skip
        job = _job_result(*run_job(cmd, timeout=JOB_TIMEOUT))
        assert job["proc"].stdout.count(DYING_TAG) == 1, job["proc"].stdout
    _check_restarted(job, 1, f"rank died ({rendezvous})")


@pytest.mark.timeout(CHAIN_TIMEOUT + 30)
def test_b_a_rank_dies_after_its_last_step_while_the_other_ends_the_job(c10d_job):
    """Issue 25 (b): rank 0 finishes and is ending the job (the exit agreement) when rank 1 dies after its last
    step and save (in the second attempt of the c10d job). The agent restarts both; the restarted attempt,
    meeting in the store where the failed ones left their exit keys, loads the last checkpoint, has nothing left
    to train, ends cleanly (exit 0) with the uninterrupted run's parameters, and leaves no process behind."""
    proc = c10d_job["proc"]
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count(DYING_TAG) == 2, (
        proc.stdout
    )  # at step 2 of attempt 0, after the end of attempt 1
    restarted = [r for r in _reports(proc.stdout) if r["attempt"] == 2]
    assert sorted(r["rank"] for r in restarted) == [0, 1], proc.stdout
    expected = _reference(2)
    for report in restarted:
        assert report["resumed_at"] == STEPS, report
        assert torch.allclose(torch.tensor(report["params"]), expected, atol=1e-6), (report, expected)
    assert c10d_job["strays"] == [], "processes of the job survived it"


def _print_recovery(output: str, what: str) -> None:
    """Seconds from the rank's death to the restarted attempt's first step (the first rank's to get there)."""
    died = float(_tagged(output, "TORCHLOOM_ELASTIC_DYING")[0][1])  # the first death
    first = min(float(t) for t, *_ in _tagged(output, "TORCHLOOM_FIRST_STEP") if float(t) > died)
    print(f"{what}: {first - died:.1f} s from the fault to the first step after resuming")
    assert first - died < 60, output


NODES_SCRIPT = """\
import json, sys
import torch
from torch import nn
from torchloom import Loom
from torchloom.strategies import FSDP2Strategy


def say(line):
    # One write per line: the ranks share the job's stdout, where print's separate newline can interleave.
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


steps = int(sys.argv[1])


def train(loom):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = loom.setup(model, optimizer)
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * step + loom.global_rank))
        loom.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().flatten() for p in full]).tolist()


for name, strategy in (("default", "auto"), ("hybrid", FSDP2Strategy(hybrid=True))):
    loom = Loom(accelerator="cpu", strategy=strategy)  # nodes and processes as torchrun started them
    params = train(loom)
    mesh = list(loom.strategy.device_mesh.mesh.shape) if name == "hybrid" else None
    report = {"case": name, "rank": loom.global_rank, "world_size": loom.world_size,
              "num_nodes": loom.strategy.num_nodes, "node_rank": loom.node_rank, "strategy": loom.strategy.name,
              "mesh": mesh, "params": params}
    say("TORCHLOOM_ELASTIC_RESULT " + json.dumps(report))
    loom.close()
"""


NODE_RENDEZVOUS = {
    # 2 agents x 1 rank on the static rendezvous; (e) 2 agents x 2 ranks meeting in torch's elastic one.
    1: "--nnodes 2 --node-rank {node} --master-addr 127.0.0.1 --master-port {port}",
    2: "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id nodes-test",
}


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@pytest.mark.parametrize("nproc", sorted(NODE_RENDEZVOUS))
def test_two_torchrun_nodes_with_loom_defaults(tmp_path, nproc):
    """Two torchrun agents ("nodes") of `nproc` processes each: `Loom()` takes the node count from torchrun (it
    refused the job before: devices='auto' became the processes of one node, checked against all started), DDP
    trains as one process would on every rank's batch, and hybrid FSDP2 replicates across the 2 nodes and shards
    within each (mesh (2, nproc), not (1, 2 * nproc): sharding across nodes)."""
    script = tmp_path / "nodes.py"
    script.write_text(NODES_SCRIPT)
    port = str(free_port())

    def node(rank: int) -> tuple:
        rendezvous = NODE_RENDEZVOUS[nproc].format(node=rank, port=port).split()
        cmd = _torchrun(*rendezvous, "--nproc-per-node", str(nproc), str(script), str(STEPS))
        return run_job(cmd, timeout=JOB_TIMEOUT)

    with ThreadPoolExecutor(2) as pool:
        jobs = list(pool.map(node, range(2)))
    world = 2 * nproc
    expected = _reference(world)
    reports = []
    for proc, token in jobs:
        assert proc.returncode == 0, proc.stdout
        reports += _reports(proc.stdout)
        assert wait_no_strays(token) == [], "processes of the job survived it"
    assert sorted((r["case"], r["rank"], r["node_rank"]) for r in reports) == [
        (case, rank, rank // nproc) for case in ("default", "hybrid") for rank in range(world)
    ]
    for report in reports:
        assert report["world_size"] == world and report["num_nodes"] == 2, report
        assert report["strategy"] == ("ddp" if report["case"] == "default" else "fsdp2")
        if report["case"] == "hybrid":
            assert report["mesh"] == [2, nproc], report
        assert torch.allclose(torch.tensor(report["params"]), expected, atol=1e-6), (report, expected)


# ---- launching with torchrun's elastic options ----------------------------------------------------------------
def _torchrun_config(argv: list[str], script: Path):
    """The LaunchConfig torch's own torchrun makes of the command line `torchloom run ARGV SCRIPT` produces."""
    from torch.distributed.run import config_from_args, get_args_parser

    from torchloom.cli import _parser, split_run_args
    from torchloom.run import torchrun_args

    ours, _ = split_run_args([*argv, str(script)])
    torchrun_argv = torchrun_args(_parser().parse_args(["run", *ours]))
    config, _, _ = config_from_args(get_args_parser().parse_args(torchrun_argv))
    return config


def test_torchloom_run_passes_elastic_options_to_torchrun(tmp_path):
    """`torchloom run`'s elastic options end up in the LaunchConfig torchrun builds (it pinned max_restarts=0 and
    the static rendezvous before); the fixed-size defaults are unchanged."""
    script = tmp_path / "train.py"
    script.write_text("")
    config = _torchrun_config(
        ["--devices", "1", "--max-restarts", "3", "--nnodes", "1:2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "127.0.0.1:29999", "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=7,last_call_timeout=2",
         "--monitor-interval", "0.5"],
        script,
    )  # fmt: skip
    assert (config.min_nodes, config.max_nodes, config.max_restarts) == (1, 2, 3)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "127.0.0.1:29999", "job7")
    assert config.rdzv_configs["join_timeout"] == "7" and config.rdzv_configs["last_call_timeout"] == "2"
    assert config.monitor_interval == 0.5
    plain = _torchrun_config(["--devices", "1", "--max_restarts=2"], script)
    assert (plain.min_nodes, plain.max_nodes, plain.max_restarts, plain.rdzv_backend) == (1, 1, 2, "static")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "1:2"], "--rdzv-backend c10d"),  # a range on the static rendezvous
        (["--nnodes", "1:2", "--rdzv-backend", "c10d"], "needs --rdzv-endpoint"),
        (["--nnodes", "2:1", "--rdzv-backend", "c10d"], "MIN:MAX"),
        (["--nnodes", "2", "--num-nodes", "3"], "disagree"),
        (["--max-restarts", "-1"], "--max-restarts -1"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "nohost"], "HOST:PORT"),
    ],
)
def test_torchloom_run_refuses_bad_elastic_options(tmp_path, argv, message):
    from torchloom.errors import ConfigurationError

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        _torchrun_config(["--devices", "1", *argv], script)


def test_launch_passes_elastic_options_to_the_agent():
    """`Loom(elastic=Elastic(...)).launch()` hands torchrun's options to torch's LaunchConfig."""
    from torchloom import Elastic
    from torchloom.launcher import _launch_config

    elastic = Elastic(max_restarts=2, nnodes="1:3", rdzv_backend="c10d", rdzv_endpoint="10.0.0.1:29400",
                      rdzv_id="job", rdzv_configs={"join_timeout": 5}, monitor_interval=0.2)  # fmt: skip
    config = _launch_config(2, 1, 0, "127.0.0.1", 1234, elastic)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (1, 3, 2, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "10.0.0.1:29400", "job")
    assert config.rdzv_configs["join_timeout"] == 5 and config.monitor_interval == 0.2
    default = _launch_config(2, 1, 0, "127.0.0.1", 1234)
    assert (default.max_restarts, default.rdzv_backend, default.rdzv_endpoint) == (
        0,
        "static",
        "127.0.0.1:1234",
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_restarts": -1}, "max_restarts"),
        ({"nnodes": "1:2"}, "static rendezvous cannot"),
        ({"nnodes": "0:2", "rdzv_backend": "c10d"}, "MIN:MAX"),
        ({"rdzv_backend": "zeus"}, "rendezvous backends"),
        ({"rdzv_backend": "c10d", "rdzv_endpoint": "29400"}, "HOST:PORT"),
    ],
)
def test_elastic_refuses_bad_options(kwargs, message):
    from torchloom import Elastic
    from torchloom.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=re.escape(message)):
        Elastic(**kwargs)


# ---- preemption: a signal, a checkpoint at the next step boundary, and a restart ------------------------------
# One chain of two launches serves every case (launches dominate the suite's time): `torchloom run` (one rank
# of each attempt signals: the rank itself, then the agent, which passes SIGUSR2 on, then SIGTERM to the agent,
# which stops the ranks and ends), then `python train.py` with `loom.launch()`'s agent (SIGUSR1 to that agent;
# then rank 1 is SIGKILLed: the launcher's restart after a death). Each preemption checkpoints at one step
# boundary on every rank, and the next attempt (or the relaunch, after SIGTERM) resumes from it.
PREEMPT_STEPS = 24  # room for 5 faults, each a few steps after its attempt's first one
PREEMPT_RUN = "rank:SIGUSR1,agent:SIGUSR2,agent:SIGTERM"  # `torchloom run`'s attempts 0, 1, 2
PREEMPT_LAUNCH = "agent:SIGUSR1,rank:SIGKILL"  # `loom.launch()`'s attempts 0, 1; attempt 2 ends the job
PREEMPT_CASES = {
    # (target, signal): the launcher and attempt whose rank 1 sends it
    ("rank", "SIGUSR1"): ("run", 0),
    ("agent", "SIGUSR2"): ("run", 1),
    ("agent", "SIGTERM"): ("run", 2),
    ("launch-agent", "SIGUSR1"): ("launch", 0),
}
PREEMPT_SCRIPT = """\
import json, os, signal, sys, time
import torch
from torch import nn
from torchloom import Elastic, Loom, latest_checkpoint


def say(line):
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


ckpt_dir, steps, launcher, plan = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
if launcher == "launch":
    loom = Loom(accelerator="cpu", devices=2, elastic=Elastic(max_restarts=2, rdzv_backend="c10d"))
    loom.launch()
else:
    loom = Loom(accelerator="cpu")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
target, signame = plan[attempt].split(":") if attempt < len(plan) else (None, None)
loom.on_preempt()
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = loom.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0}
latest = latest_checkpoint(ckpt_dir)
if latest is not None:
    loom.load(latest, state)
resumed_at = state["step"]
say(f"TORCHLOOM_RESUMED {loom.global_rank} {resumed_at} {launcher} {attempt}")
for step in range(resumed_at, steps):
    if target is not None and step == resumed_at + 1 and loom.global_rank == 1:
        tag = "TORCHLOOM_ELASTIC_DYING" if signame == "SIGKILL" else "TORCHLOOM_FAULT"
        say(f"{tag} {launcher}:{attempt} {time.time()}")
        os.kill(os.getpid() if target == "rank" else os.getppid(), getattr(signal, signame))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * step + loom.global_rank))
    loom.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    state["step"] = step + 1
    if step == resumed_at and resumed_at > 0:
        say(f"TORCHLOOM_FIRST_STEP {time.time()}")
    time.sleep(0.1)  # a step long enough for a forwarded signal to land inside it
    if loom.should_stop():
        loom.save(os.path.join(ckpt_dir, f"step-{step + 1:04d}"), state)
        say(f"TORCHLOOM_PREEMPTED {loom.global_rank} {step + 1} {launcher} {attempt}")
        loom.exit_for_restart()
params = torch.cat([p.detach().flatten() for p in model.parameters()])
report = {"rank": loom.global_rank, "world_size": loom.world_size, "attempt": attempt, "launcher": launcher,
          "resumed_at": resumed_at, "params": params.tolist()}
say("TORCHLOOM_ELASTIC_RESULT " + json.dumps(report))
loom.close()
"""


def _tagged(output: str, tag: str) -> list[list[str]]:
    return [line.split()[1:] for line in output.splitlines() if line.startswith(tag + " ")]


@pytest.fixture(scope="module")
def preempted_job(tmp_path_factory) -> dict:
    """The two launches of the chain; checks what every case relies on: how each launch ended, no process
    left, and the final attempt's parameters."""
    tmp_path = tmp_path_factory.mktemp("preempt")
    script = tmp_path / "train.py"
    script.write_text(PREEMPT_SCRIPT)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    run = [PYTHON, "-m", "torchloom", "run", "--devices", "2", "--max-restarts", "2", "--rdzv-backend", "c10d",
           str(script), str(ckpts), str(PREEMPT_STEPS), "run", PREEMPT_RUN]  # fmt: skip
    proc, token = run_job(run, timeout=CHAIN_TIMEOUT, env={"TORCHLOOM_SHUTDOWN_TIMEOUT": "20"})
    output = proc.stdout
    assert wait_no_strays(token) == [], "processes of the `torchloom run` job survived it"
    # torch's agent ends on SIGTERM (no restart): the job is started again, as SLURM's requeue would.
    assert proc.returncode == 128 + signal.SIGTERM, output
    proc, token = run_job([PYTHON, str(script), str(ckpts), str(PREEMPT_STEPS), "launch", PREEMPT_LAUNCH],
                          timeout=CHAIN_TIMEOUT)  # fmt: skip
    output += proc.stdout
    assert wait_no_strays(token) == [], "processes of the `loom.launch()` job survived it"
    assert proc.returncode == 0, output
    reports = _reports(output)
    assert [(r["rank"], r["launcher"], r["attempt"]) for r in reports] == [(0, "launch", 2), (1, "launch", 2)]
    expected = _reference(2, PREEMPT_STEPS)
    for report in reports:
        assert torch.allclose(torch.tensor(report["params"]), expected, atol=1e-6), (report, expected)
    return {"output": output, "ckpts": sorted(p.name for p in ckpts.iterdir()), "reports": reports}


def _resumed(output: str, launcher: str, attempt: int) -> list[int]:
    return [
        int(at)
        for rank, at, who, n in _tagged(output, "TORCHLOOM_RESUMED")
        if (who, int(n)) == (launcher, attempt)
    ]


@pytest.mark.timeout(2 * CHAIN_TIMEOUT + 30)
@pytest.mark.parametrize(("target", "signame"), sorted(PREEMPT_CASES))
def test_preempted_job_saves_at_one_step_and_resumes(preempted_job, target, signame):
    """SLURM's warning (SIGUSR1/SIGUSR2, `--signal=USR1@N`) reaches one rank, or the agent that passes it on
    (`torchloom run`'s, or `loom.launch()`'s in `python train.py`); SIGTERM reaches the agent, which stops the
    ranks. Every rank checkpoints at the same step boundary and exits; the restart (the agent's, with restarts
    allowed, or a relaunch after SIGTERM ended the agent) resumes from `latest_checkpoint`, and the job ends with
    the uninterrupted run's parameters (checked by the fixture)."""
    output = preempted_job["output"]
    launcher, attempt = PREEMPT_CASES[(target, signame)]
    case = f"{target} {signame} ({launcher}, attempt {attempt}):\n"
    preempted = [(rank, int(step)) for rank, step, who, n in _tagged(output, "TORCHLOOM_PREEMPTED")
                 if (who, int(n)) == (launcher, attempt)]  # fmt: skip
    assert sorted(rank for rank, _ in preempted) == ["0", "1"], case + output
    stopped_at = {step for _, step in preempted}
    assert len(stopped_at) == 1, case + output
    stopped = stopped_at.pop()
    # The signal was sent at the start of the attempt's second step: the checkpoint is at a later boundary.
    (started,) = set(_resumed(output, launcher, attempt))
    assert started + 1 < stopped < PREEMPT_STEPS, case + output
    # What resumed next: the agent's next attempt, or after SIGTERM ended `torchloom run`, the relaunch.
    after = ("launch", 0) if signame == "SIGTERM" else (launcher, attempt + 1)
    assert _resumed(output, *after) == [stopped, stopped], case + output
    # One checkpoint per preemption, nothing else.
    every = sorted(
        f"step-{int(step):04d}" for rank, step, _, _ in _tagged(output, "TORCHLOOM_PREEMPTED") if rank == "0"
    )
    assert preempted_job["ckpts"] == every and len(every) == len(PREEMPT_CASES), case + output


@pytest.mark.timeout(2 * CHAIN_TIMEOUT + 30)
@pytest.mark.parametrize("how", ["launch", "torchloom-run"])
def test_torchloom_launcher_restarts_a_failed_attempt(how, request):
    """A job torchloom launches with restarts allowed: rank 1 dies, the agent restarts both ranks, the next
    attempt resumes from the newest checkpoint and ends with the uninterrupted run's parameters (before,
    max_restarts was pinned to 0 and the job failed). `torchloom run`: the c10d job of test_a (its attempt 1);
    `python train.py` with `Loom(elastic=...).launch()`: the preemption chain's (its attempt 1 is SIGKILLed
    after resuming from the SIGUSR1 checkpoint; attempt 2 ends the job)."""
    if how == "torchloom-run":
        _check_restarted(request.getfixturevalue("c10d_job"), 1, "rank died (torchloom-run)")
        return
    job = request.getfixturevalue("preempted_job")
    output = job["output"]
    assert len(_tagged(output, "TORCHLOOM_ELASTIC_DYING")) == 1, output
    (newest,) = set(_resumed(output, "launch", 1))  # attempt 1 resumed from the SIGUSR1 checkpoint, then died
    for report in job["reports"]:  # attempt 2, checked against the uninterrupted run by the fixture
        assert report["attempt"] == 2 and report["resumed_at"] == newest, report
    assert f"step-{newest:04d}" == job["ckpts"][-1], output
    _print_recovery(output, "rank died (launch)")


# ---- a changed world size: a node lost, a node joining ---------------------------------------------------------
GLOBAL_BATCH = 8
SAMPLES = 48  # 6 global batches an epoch
WORLD_STEPS = 12  # two epochs
# Small bounds for a fast test (see docs: resuming): a dead node is dropped after 3 missed 1-s heartbeats.
RDZV_CONF = (
    "join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
)
WORLD_SCRIPT = """\
import json, sys, time
started = time.time()
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchloom import Loom, latest_checkpoint, rotate_checkpoints, seed_everything


def say(line):
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


ckpt_dir, steps, global_batch, samples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
delay, wait_for_peer_at = float(sys.argv[5]), int(sys.argv[6])
loom = Loom(accelerator="cpu")  # world size and nodes: whatever this attempt's rendezvous gave
seed_everything(42)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = loom.setup(model, optimizer)
data = TensorDataset(torch.randn(samples, 4, generator=torch.Generator().manual_seed(7)))
# The global batch is the job's; each rank reads its share of it.
loader = loom.setup_dataloaders(DataLoader(data, batch_size=global_batch // loom.world_size, shuffle=True))
state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
latest = latest_checkpoint(ckpt_dir)
if latest is not None:
    loom.load(latest, state)
resumed_at = state["step"]
while state["step"] < steps:
    for (x,) in loader:
        step = state["step"]
        if step >= steps:
            break
        loom.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if step == resumed_at and resumed_at > 0:
            say(f"TORCHLOOM_FIRST_STEP {time.time()} {loom.world_size} {started}")
        loom.save(f"{ckpt_dir}/step-{step + 1:04d}.pt", state, fsync=False)
        if loom.is_global_zero:
            rotate_checkpoints(ckpt_dir, keep_last=2)
        say(f"TORCHLOOM_STEP {loom.global_rank} {loom.world_size} {step + 1}")
        if loom.world_size == 1 and step + 1 == wait_for_peer_at:
            time.sleep(120)  # alone until the second node joins: its agent then restarts this one
        time.sleep(delay)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
report = {"rank": loom.global_rank, "world_size": loom.world_size, "resumed_at": resumed_at, "params": params.tolist()}
say("TORCHLOOM_ELASTIC_RESULT " + json.dumps(report))
loom.close()
"""


def _global_batches_reference() -> torch.Tensor:
    """Plain torch on one process, never interrupted: the global batches of torchloom's loader (the order
    DistributedSampler draws from seed + epoch), GLOBAL_BATCH samples each."""
    torch.manual_seed(42)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(7))
    per_epoch = SAMPLES // GLOBAL_BATCH
    for step in range(WORLD_STEPS):
        epoch, batch = divmod(step, per_epoch)
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(42 + epoch))
        x = data[order[batch * GLOBAL_BATCH : (batch + 1) * GLOBAL_BATCH]]
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class _Agent:
    """One `torchloom run` agent standing for one node (its own session; output to a file)."""

    def __init__(self, tmp_path: Path, name: str, port: int, ckpts: Path, script: Path, delay: float,
                 wait_for_peer_at: int, host: bool) -> None:  # fmt: skip
        self.log = tmp_path / f"{name}.log"
        self.token = f"{name}-{uuid.uuid4().hex}"
        cmd = [PYTHON, "-m", "torchloom", "run", "--devices", "1", "--nnodes", "1:2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--max-restarts", "2",
               "--rdzv-conf", RDZV_CONF + ("" if host else ",is_host=false"), str(script), str(ckpts),
               str(WORLD_STEPS), str(GLOBAL_BATCH), str(SAMPLES), str(delay), str(wait_for_peer_at)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID")}  # fmt: skip
        env.update({TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1"})
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_token(self.token)
            raise AssertionError(f"agent did not finish within {timeout}s:\n{self.output()}") from None

    def stop(self) -> None:
        kill_token(self.token)
        self.proc.kill()
        self.proc.wait()


def _wait_for(condition, timeout: float, what: str, *agents: _Agent) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s:\n" + "\n".join(a.output() for a in agents))
        time.sleep(0.05)


def _steps_done(agent: _Agent, world_size: int) -> int:
    done = [int(s) for _, w, s in _tagged(agent.output(), "TORCHLOOM_STEP") if int(w) == world_size]
    return max(done, default=0)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_c_survivor_of_a_lost_node_continues_alone(tmp_path):
    """Two agents of one rank each (c10d rendezvous on localhost, --nnodes 1:2); the one that does not hold the
    rendezvous store is SIGKILLed mid-training (its rank dies with it). The survivor's agent restarts its rank,
    the rendezvous closes with one node, and the rank continues alone from the newest checkpoint with the same
    global batches (8 samples: 4 per rank before, 8 after), ending with the uninterrupted run's parameters."""
    script = tmp_path / "train.py"
    script.write_text(WORLD_SCRIPT)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    port = free_port()
    survivor = _Agent(tmp_path, "survivor", port, ckpts, script, delay=0.3, wait_for_peer_at=0, host=True)
    lost = _Agent(tmp_path, "lost", port, ckpts, script, delay=0.3, wait_for_peer_at=0, host=False)
    try:
        _wait_for(lambda: _steps_done(survivor, 2) >= 2, JOB_TIMEOUT, "2 steps on 2 nodes", survivor, lost)
        lost.proc.kill()  # SIGKILL: the node is gone
        fault = time.time()
        assert survivor.wait(JOB_TIMEOUT) == 0, survivor.output()
    finally:
        lost.stop()
        survivor.stop()
    output = survivor.output()
    assert wait_no_strays(lost.token) == [] and wait_no_strays(survivor.token) == []
    (first_step,) = [(float(t), int(w), float(s)) for t, w, s in _tagged(output, "TORCHLOOM_FIRST_STEP")]
    assert first_step[1] == 1, output
    recovery = first_step[0] - fault
    print(
        f"node lost: {recovery:.1f} s from the SIGKILL to the first step on 1 node "
        f"(the restarted rank's script began {first_step[2] - fault:.1f} s after the SIGKILL)"
    )
    assert recovery < 60, output
    (report,) = _reports(output)
    assert report["world_size"] == 1 and 2 <= report["resumed_at"] < WORLD_STEPS, report
    expected = _global_batches_reference()
    assert torch.allclose(torch.tensor(report["params"]), expected, atol=1e-5), (report, expected)
    assert len(list(ckpts.iterdir())) == 2  # rotation kept the last 2


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_d_a_second_node_joins_a_running_job(tmp_path):
    """One agent of an --nnodes 1:2 job trains alone; a second agent joins: torch's agent sees it waiting,
    restarts its rank, and both resume from the newest checkpoint at world size 2 (4 samples per rank, the
    same global batches), ending with the uninterrupted run's parameters."""
    script = tmp_path / "train.py"
    script.write_text(WORLD_SCRIPT)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    port = free_port()
    first = _Agent(tmp_path, "first", port, ckpts, script, delay=0.0, wait_for_peer_at=3, host=True)
    second = None
    try:
        _wait_for(lambda: _steps_done(first, 1) >= 3, JOB_TIMEOUT, "3 steps on 1 node", first)
        second = _Agent(tmp_path, "second", port, ckpts, script, delay=0.0, wait_for_peer_at=3, host=False)
        joined = time.time()
        assert first.wait(JOB_TIMEOUT) == 0, first.output()
        assert second.wait(JOB_TIMEOUT) == 0, second.output()
    finally:
        for agent in (first, second):
            if agent is not None:
                agent.stop()
    outputs = first.output() + second.output()
    reports = _reports(outputs)
    assert [r["rank"] for r in reports] == [0, 1], outputs
    expected = _global_batches_reference()
    for report in reports:
        assert report["world_size"] == 2 and report["resumed_at"] == 3, report
        assert torch.allclose(torch.tensor(report["params"]), expected, atol=1e-5), (report, expected)
    starts = [(float(t), float(s)) for t, w, s in _tagged(outputs, "TORCHLOOM_FIRST_STEP") if int(w) == 2]
    print(
        f"node joined: {min(starts)[0] - joined:.1f} s from starting its agent to the first step on 2 nodes "
        f"(the ranks' scripts began {min(s for _, s in starts) - joined:.1f} s after it)"
    )


def test_exit_for_restart_requeues_the_slurm_job_when_asked(tmp_path, monkeypatch):
    """`on_preempt(requeue=True)`: `exit_for_restart()` runs `scontrol requeue $SLURM_JOB_ID` (a stand-in
    scontrol here) and exits 75; outside SLURM it refuses, naming the problem; without requeue it only exits."""
    from torchloom import ConfigurationError, Loom

    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    caught = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    previous = {sig: signal.getsignal(sig) for sig in caught}
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        loom = Loom(accelerator="cpu", devices=1)
        loom.on_preempt(requeue=True)
        assert all(signal.getsignal(sig) == loom._note_preemption for sig in caught)
        with pytest.raises(SystemExit) as stopped:
            loom.exit_for_restart()
        assert stopped.value.code == 75 and calls.read_text() == "requeue 4242\n"
        monkeypatch.delenv("SLURM_JOB_ID")
        outside = Loom(accelerator="cpu", devices=1)
        with pytest.raises(ConfigurationError, match="not a SLURM job"):
            outside.on_preempt(requeue=True)  # at the call, not when the job is already stopping
        plain = Loom(accelerator="cpu", devices=1)
        plain.on_preempt()
        with pytest.raises(SystemExit):
            plain.exit_for_restart()
        assert calls.read_text() == "requeue 4242\n"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _requeue_outside_slurm(rank: int, world_size: int) -> str:
    from torchloom import ConfigurationError, Loom

    os.environ.pop("SLURM_JOB_ID", None)
    loom = Loom(accelerator="cpu", devices=world_size)
    loom.launch()
    before = signal.getsignal(signal.SIGUSR1)
    try:
        loom.on_preempt(requeue=True)
    except ConfigurationError as error:
        assert signal.getsignal(signal.SIGUSR1) == before  # nothing installed by a refused call
        return str(error)
    return "accepted"


@pytest.mark.timeout(120)
def test_requeue_outside_slurm_is_refused_at_the_call_on_every_rank():
    """Before, every rank accepted `on_preempt(requeue=True)` and only rank 0 failed, in `exit_for_restart()`,
    after the preemption checkpoint."""
    from harness import run_ranks

    for message in run_ranks(_requeue_outside_slurm, 2, timeout=60):
        assert "SLURM_JOB_ID is not set" in message, message
