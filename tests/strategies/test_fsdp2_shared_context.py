"""FSDP2 units made by hand without a root unit share one communication context, so that backward frees each
unit's full-size reduce-scatter buffer as the next one starts instead of keeping all of them to the end (the
whole model's gradients, unsharded; benchmarks/memory.py measures the difference)."""

from __future__ import annotations

import pytest
import torch
from fsdp_models import Net
from harness import run_ranks

from torchloom import Loom

share_comm_ctx = getattr(torch.distributed.fsdp, "share_comm_ctx", None)


def _body(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    loom = Loom(accelerator="cpu", devices=world_size, strategy="fsdp2")
    loom.launch()
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    model = loom.setup_module(model)
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    retained = []
    contexts = {id(block._get_fsdp_state()._comm_ctx) for block in model.module.blocks}
    for block in model.module.blocks:
        # After each unit's backward, count the reduce-scatter buffers its context still holds.
        block.register_full_backward_hook(
            lambda m, gi, go: retained.append(len(m._get_fsdp_state()._comm_ctx.reduce_scatter_states))
        )
    for _ in range(2):
        loom.backward(model(torch.randn(4, 6)).sum())
        opt.step()
        opt.zero_grad()
    return {"contexts": len(contexts), "max_retained": max(retained)}


@pytest.mark.skipif(share_comm_ctx is None, reason="torch.distributed.fsdp.share_comm_ctx needs torch >= 2.8")
def test_hand_made_units_share_one_context():
    for result in run_ranks(_body, 2, timeout=120):
        assert result["contexts"] == 1
        assert result["max_retained"] <= 1
