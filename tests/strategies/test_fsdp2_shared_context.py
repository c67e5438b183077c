"""FSDP2 units made by hand without a root unit behave as they would under a root unit, so a per-block memory
plan holds: each unit reshards its parameters after forward unless the user chose otherwise (FSDP2 leaves a
root unsharded until backward, and without a root unit every block is a root), and all units share one
communication context, so backward frees each unit's full-size reduce-scatter buffer as the next one starts
instead of keeping all of them to the end. benchmarks/memory.py measures the difference."""

from __future__ import annotations

import pytest
import torch
from fsdp_models import Net
from harness import run_ranks

from torchloom import Loom

share_comm_ctx = getattr(torch.distributed.fsdp, "share_comm_ctx", None)


def _body(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    loom = Loom(accelerator="cpu", devices=world_size, strategy="fsdp2")
    loom.launch()
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks[:-1]:
        fully_shard(block)  # the default: torchloom makes it reshard after forward
    fully_shard(model.blocks[-1], reshard_after_forward=False)  # the user's choice: kept
    model = loom.setup_module(model)
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    blocks = list(model.module.blocks)
    contexts = {id(block._get_fsdp_state()._comm_ctx) for block in blocks}
    retained = []
    for block in blocks:
        # After each unit's backward, count the reduce-scatter buffers its context still holds.
        block.register_full_backward_hook(
            lambda m, gi, go: retained.append(
                # Pinned where share_comm_ctx exists (torch >= 2.10); torch 2.9 runs the rest of the test.
                len(m._get_fsdp_state()._comm_ctx.reduce_scatter_states) if share_comm_ctx else 0
            )
        )
    sharded_after_forward = []
    for _ in range(2):
        out = model(torch.randn(4, 6))
        sharded_after_forward.append([all(isinstance(p, DTensor) for p in b.parameters()) for b in blocks])
        loom.backward(out.sum())
        opt.step()
        opt.zero_grad()
    return {"contexts": len(contexts), "max_retained": max(retained), "sharded": sharded_after_forward}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 2, timeout=120)


def test_hand_made_units_without_a_root_reshard_after_forward(results):
    for result in results:
        for sharded in result["sharded"]:
            assert sharded == [True] * (len(sharded) - 1) + [False]


def test_pin_private_fsdp2_comm_ctx_shared_by_units_without_a_root(results):
    """A pin of FSDP2's private state (`_get_fsdp_state()._comm_ctx.reduce_scatter_states`), which has no public
    view: one communication context for all units, and at most one reduce-scatter buffer held at a time. If a
    torch upgrade renames these, rewrite this test against benchmarks/memory.py's measured peak instead."""
    if share_comm_ctx is None:
        pytest.skip(
            f"torch.distributed.fsdp.share_comm_ctx needs torch >= 2.10 (this is {torch.__version__})"
        )
    for result in results:
        assert result["contexts"] == 1
        assert result["max_retained"] <= 1
