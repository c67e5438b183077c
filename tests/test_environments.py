"""Where a rank learns its place: torchrun's and SLURM's variables, faked in this process (`Loom(...)` only reads
them; no process group is made). Real jobs under each launcher are in test_launcher.py and test_elastic.py."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from torchloom import ConfigurationError, Loom
from torchloom.environments import LocalEnvironment, SLURMEnvironment, TorchElasticEnvironment
from torchloom.strategies import FSDP2Strategy, FSDPStrategy

_LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "GROUP_", "ROLE_", "TORCHLOOM_")
_LAUNCHER_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
)


@pytest.fixture
def launched(monkeypatch):
    """Replace every launcher variable of this process with the given ones."""

    def set_env(**values: str) -> None:
        for key in list(os.environ):
            if key.startswith(_LAUNCHER_PREFIXES) or key in _LAUNCHER_NAMES:
                monkeypatch.delenv(key)
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


# ---- torchrun: the node count is the launcher's ---------------------------------------------------------------
def _torchrun_node(launched, group_world_size: bool = True) -> None:
    """Rank 2 of 4: local rank 0 of the second of two torchrun nodes, two processes each."""
    extra = {"GROUP_WORLD_SIZE": "2"} if group_world_size else {}
    launched(
        RANK="2", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", GROUP_RANK="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500", TORCHELASTIC_RUN_ID="job", **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "group_world_size", [True, False], ids=["GROUP_WORLD_SIZE", "WORLD/LOCAL_WORLD_SIZE"]
)
def test_loom_defaults_take_the_node_count_from_torchrun(launched, group_world_size):
    """`Loom()` on a 2-node torchrun job (refused before: devices='auto' became the 2 local processes, checked
    against the default num_nodes=1, so 2 expected and 4 started). An elastic job cannot know its node count in
    advance, so it must not have to pass one."""
    _torchrun_node(launched, group_world_size)
    loom = Loom(accelerator="cpu")
    assert isinstance(loom.strategy.cluster_environment, TorchElasticEnvironment)
    assert (loom.world_size, loom.strategy.num_nodes, len(loom.strategy.parallel_devices)) == (4, 2, 2)
    assert loom.node_rank == 1


def test_hybrid_sharding_replicates_across_the_launched_nodes(launched):
    """With num_nodes left out, hybrid sharding's mesh is (nodes, processes per node) of the real job; it was
    (1, 4), sharding across nodes, with num_nodes at its old default of 1."""
    _torchrun_node(launched)
    assert Loom(accelerator="cpu", strategy=FSDP2Strategy(hybrid=True)).strategy._mesh_shape() == (2, 2)
    fsdp1 = FSDPStrategy(sharding_strategy="HYBRID_SHARD")
    assert Loom(accelerator="cpu", strategy=fsdp1).strategy._mesh_shape() == (2, 2)


def test_a_given_node_count_must_match_torchruns(launched):
    _torchrun_node(launched)
    assert Loom(accelerator="cpu", num_nodes=2).strategy.num_nodes == 2
    for wrong in (1, 3):
        with pytest.raises(ConfigurationError, match=f"num_nodes={wrong}.*started this job on 2 nodes"):
            Loom(accelerator="cpu", num_nodes=wrong)


# ---- SLURM ----------------------------------------------------------------------------------------------------
def _srun_task(launched, job_name: str = "train", **overrides: str) -> None:
    """Task 3 of an srun step of 4 tasks on 2 nodes (2 each), in an allocation of 4 tasks."""
    env = {
        "SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": job_name, "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "node[07-08]", "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    }  # fmt: skip
    launched(**{**env, **overrides})


def test_python_without_srun_in_a_batch_script_runs_alone_and_says_so(launched):
    """A batch script (or salloc shell) running `python train.py` where SLURM allocated 4 tasks: srun did not
    start the other 3, so waiting for them (as before) hangs until the start-up timeout. It is a local job, and a
    warning says to use srun."""
    launched(
        SLURM_JOB_ID="1234", SLURM_JOB_NAME="train", SLURM_NTASKS="4", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="2",
        SLURM_NODELIST="node[07-08]", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
    )  # fmt: skip
    with pytest.warns(
        UserWarning, match=r"SLURM allocated 4 tasks, but srun did not start.*srun python train.py"
    ):
        loom = Loom(accelerator="cpu")
    assert isinstance(loom.strategy.cluster_environment, LocalEnvironment)
    assert loom.world_size == 1


@pytest.mark.parametrize("job_name", ["bash", "interactive", "train"])
def test_srun_tasks_make_one_job_whatever_the_allocations_name(launched, job_name):
    """`srun python train.py` in an salloc allocation (named "bash" or "interactive") started 4 tasks that each
    ran a job of their own, all writing the same checkpoint paths. They are ranks of one job."""
    _srun_task(launched, job_name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loom = Loom(accelerator="cpu")
    assert isinstance(loom.strategy.cluster_environment, SLURMEnvironment)
    assert (loom.world_size, loom.global_rank, loom.local_rank, loom.node_rank) == (4, 3, 1, 1)
    assert (loom.strategy.num_nodes, len(loom.strategy.parallel_devices)) == (2, 2)
    assert loom.strategy.cluster_environment.main_address == "node07"


def test_one_task_step_lets_loom_start_its_processes(launched):
    """`srun --pty bash` (or `srun -n1 python ...`): a step of one task. Loom(devices=2) starts 2 processes, as
    in any shell; it was refused (SLURM "started 1") unless the allocation happened to be named "bash"."""
    _srun_task(
        launched, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NUM_NODES="1", SLURM_STEP_TASKS_PER_NODE="1",
        SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
    )  # fmt: skip
    loom = Loom(accelerator="cpu", devices=2)
    assert isinstance(loom.strategy.cluster_environment, LocalEnvironment)
    assert loom.world_size == 2


@pytest.mark.parametrize(
    ("step_tasks", "node", "local", "nodes", "tasks"),
    [("3,1", 0, 3, 2, 4), ("3,1", 1, 1, 2, 4), ("2(x2)", 1, 2, 2, 4), ("1(x3),2", 3, 2, 4, 5)],
)
def test_tasks_per_node_are_the_steps_not_the_jobs_request(launched, step_tasks, node, local, nodes, tasks):
    """SLURM_NTASKS_PER_NODE is what the job asked for (here 4); `srun -n 4` over 2 nodes may place them 3 + 1.
    The processes on this node are the step's count for this node (SLURM_STEP_TASKS_PER_NODE)."""
    _srun_task(
        launched, SLURM_NTASKS_PER_NODE="4", SLURM_STEP_TASKS_PER_NODE=step_tasks, SLURM_NODEID=str(node),
        SLURM_STEP_NUM_TASKS=str(tasks), SLURM_NTASKS=str(tasks), SLURM_STEP_NUM_NODES=str(nodes),
        SLURM_LOCALID="0", SLURM_PROCID="0",
    )  # fmt: skip
    env = SLURMEnvironment()
    assert (env.local_world_size(), env.num_nodes(), env.world_size()) == (local, nodes, tasks)
    loom = Loom(accelerator="cpu")
    assert (len(loom.strategy.parallel_devices), loom.strategy.num_nodes) == (local, nodes)


def test_concurrent_steps_of_one_job_meet_on_different_ports(launched):
    """Two `srun ... &` steps of one batch job ran their stores on the same port of the same first node: the
    second failed to bind, or its ranks joined the first step's store. Every task of one step still agrees."""
    ports = {}
    for step in ("0", "1", "2"):
        for task in ("0", "3"):
            _srun_task(launched, SLURM_STEP_ID=step, SLURM_PROCID=task)
            ports[step, task] = SLURMEnvironment().main_port
    assert all(ports[step, "0"] == ports[step, "3"] for step in ("0", "1", "2"))
    assert len({ports[step, "0"] for step in ("0", "1", "2")}) == 3
    assert all(10000 <= port < 30000 for port in ports.values())


# ---- a notebook: a second Loom after a one-process run that was never closed ---------------------------------------
def _world_size(loom: Loom) -> int:
    return loom.world_size


def test_a_later_loom_is_not_fooled_by_the_variables_an_unclosed_one_process_run_set(launched):
    """A one-process DDP run exports RANK/WORLD_SIZE/... for its group; left unclosed (a notebook cell), those
    variables must not make the next Loom(devices=2) believe torchrun started it: it starts its 2 ranks."""
    launched()
    first = Loom(accelerator="cpu", devices=1, strategy="ddp")
    first.launch()
    first.setup_module(torch.nn.Linear(2, 2))
    assert os.environ.get("RANK") == "0"  # what the first run exported, still there
    second = Loom(accelerator="cpu", devices=2, strategy="ddp")
    assert isinstance(second._strategy.cluster_environment, LocalEnvironment)
    assert second.launch(_world_size) == 2
    # Variables a launcher set are still the launcher's, even where a one-process Loom exports the same.
    launched(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    assert TorchElasticEnvironment.detect()
    first.close()


# ---- SLURM host lists ---------------------------------------------------------------------------------------
# Each expansion written out by hand from SLURM's grammar (what `scontrol show hostnames` prints).
HOSTLISTS = [
    ("gpu1", ["gpu1"]),
    ("node[07-08]", ["node07", "node08"]),
    ("node[1,3,5-7]", ["node1", "node3", "node5", "node6", "node7"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),  # the width of "08" kept past 9
    ("n[9-11]x", ["n9x", "n10x", "n11x"]),  # no padding written: none added; text after the group kept
    (
        "rack[1-2]-node[01-04]",
        [f"rack{r}-node0{n}" for r in (1, 2) for n in (1, 2, 3, 4)],  # the last group varies fastest
    ),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("node[03-05,07],gpu1", ["node03", "node04", "node05", "node07", "gpu1"]),
    ("r[2,1]n[1-2],x[5]", ["r2n1", "r2n2", "r1n1", "r1n2", "x5"]),  # the order as written, not sorted
    ("c[001-002]-g[0-1]-s[7]", ["c001-g0-s7", "c001-g1-s7", "c002-g0-s7", "c002-g1-s7"]),
]


@pytest.mark.parametrize("hostlist,hosts", HOSTLISTS)
def test_slurm_host_lists_expand_in_full(launched, hostlist, hosts):
    from torchloom.environments import expand_slurm_hostlist

    assert expand_slurm_hostlist(hostlist) == hosts
    # The step's main address is its first host (before: "rack1-node[01-04]" for the third case).
    _srun_task(launched, SLURM_STEP_NODELIST=hostlist)
    assert SLURMEnvironment().main_address == hosts[0]


@pytest.mark.parametrize(
    "hostlist", ["node[1-", "node[2-1]", "node[[1]]", "node]1", "node[a]", "node[]", ","]
)
def test_a_malformed_slurm_host_list_is_refused_by_name(hostlist):
    from torchloom.environments import expand_slurm_hostlist

    with pytest.raises(ConfigurationError, match="SLURM host list"):
        expand_slurm_hostlist(hostlist)
