"""The planner's memory account labels what it counts: under activation checkpointing the forward recomputed in
the backward is temporary memory, and only the checkpointed blocks' inputs stay as activations."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchloom import _torch_compat
from torchloom.planning.tracker import MemoryAccount

BATCH, DIM, BLOCKS = 1024, 256, 4
INPUT = BATCH * DIM * 4  # one block's input (fp32)
HIDDEN = BATCH * 4 * DIM * 4  # one block's fc1 output, and its GELU


def _peak_breakdown(ac: bool, use_reentrant: bool) -> dict[str, int]:
    fake = _torch_compat.fake_tensor_mode()
    with fake:
        net = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
                for _ in range(BLOCKS)
            ]
        )
        x = torch.randn(BATCH, DIM, requires_grad=use_reentrant)
    account = MemoryAccount(fake=True)
    with fake, account:
        h = x
        for block in net:
            h = checkpoint(block, h, use_reentrant=use_reentrant) if ac else block(h)
        h.sum().backward()
        account.note([net], [])
    assert account.peak.phase == "backward"
    return account.breakdown()


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_recomputed_forward_is_temporary(use_reentrant):
    kinds = _peak_breakdown(ac=True, use_reentrant=use_reentrant)
    # What is saved across the step: each checkpointed block's input (and the model's input), no more.
    assert kinds["activations"] <= (BLOCKS + 1) * INPUT, kinds
    # The recomputed block's hidden activations (fc1's output and the GELU's) are held at the peak, as temporaries.
    assert kinds["temporaries"] >= 2 * HIDDEN, kinds


def test_without_checkpointing_the_forward_is_activations():
    kinds = _peak_breakdown(ac=False, use_reentrant=False)
    assert kinds["activations"] >= BLOCKS * 2 * HIDDEN, kinds
