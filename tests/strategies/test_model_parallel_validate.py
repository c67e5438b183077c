"""ModelParallelStrategy's mesh check in every rank: a rank learns the world of its attempt only when it starts
(an elastic agent may start it on another number of nodes than the launching process planned for)."""

from __future__ import annotations

import os

import pytest
from harness import run_ranks

from torchloom import Loom
from torchloom.errors import ConfigurationError
from torchloom.strategies import ModelParallelStrategy

_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _keep(model, mesh):
    return model


def _attempt_on_two_nodes(rank: int, world_size: int) -> str:
    # The launching process: one node of 2 processes, planned as a 1 x 2 mesh (data_parallel_size="auto" is the
    # node count), which fits.
    launched = {
        k: os.environ.pop(k) for k in list(os.environ) if k in _LAUNCHER_NAMES or k.startswith("TORCH")
    }
    loom = Loom(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=ModelParallelStrategy(_keep, data_parallel_size="auto", tensor_parallel_size=2),
    )
    # The attempt the elastic agent started: the same 2 processes, one on each of 2 nodes, so "auto" is now 2.
    os.environ.update(
        launched, GROUP_WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", GROUP_RANK=str(rank)
    )
    try:
        loom._setup_rank()  # what each rank of launch(fn) runs first (launcher._run_function)
    except ConfigurationError as error:
        return str(error)
    return "accepted"


@pytest.mark.timeout(120)
def test_a_node_count_change_is_refused_on_every_rank_at_launch():
    """Before, only the launching process checked the mesh: the ranks of an attempt on 2 nodes joined the group
    and failed later, inside torch's mesh code."""
    messages = run_ranks(_attempt_on_two_nodes, 2, timeout=60)
    assert len(messages) == 2
    for message in messages:
        assert "makes a mesh of 2 x 2 = 4 ranks, but this job has 2 processes on 2 nodes" in message, message
