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


def test_peak_that_ends_with_a_storage_shrinking_in_place():
    """A peak ended by a storage resized to 0 in place (FSDP's reshard after forward), not by a free, is kept
    whole: its bytes and what it held."""
    fake = _torch_compat.fake_tensor_mode()
    account = MemoryAccount(fake=True)
    with fake, account:
        kept = torch.empty(1000)  # 4,000 B
        unit = torch.empty(25_000)  # 100,000 B: a gathered unit
        unit.untyped_storage().resize_(0)  # resharded: the peak ends here
        later = torch.empty(10)  # 40 B, then a free
        del kept
    assert account.peak.bytes == 104_000, account.peak
    assert sum(account.breakdown().values()) == 104_000, account.breakdown()
    assert later.numel() == 10 and unit.numel() == 25_000


def test_peak_phase_is_where_it_rose_when_the_script_fails():
    """A run that fails in forward (the script's error unwinds its frames before the account closes) labels its
    peak with the phase and module where memory rose to it, not with where the account closed."""
    fake = _torch_compat.fake_tensor_mode()
    with fake:
        net = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU())
    account = MemoryAccount(fake=True)

    def fail(module, args, output):
        raise RuntimeError("stop")

    net[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="stop"), fake, account:
        net(torch.randn(BATCH, DIM))
    assert (account.peak.phase, account.peak.module) == ("forward", "Sequential.1"), account.peak


class _Positions(nn.Module):
    """A GPT-style position embedding: its forward builds the positions (`torch.arange(..., device=x.device)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return x


def test_pipeline_trace_of_a_tensor_built_in_forward():
    """torch's pipeline tracer (torch.export, with a fake mode of its own) traces a forward that builds an
    integer tensor under the plan: the plan runs integer work for real on its own fake tensors only, so the
    tracer's tensors stay its fake ones."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    fake = _torch_compat.fake_tensor_mode()
    with fake, MemoryAccount(fake=True, fake_mode=fake):
        with torch.device("meta"):  # init_module(empty_init=True): the model on the meta device
            model = _Positions()
            example = torch.zeros(2, 16, 32)
        pipe = pipeline(model, mb_args=(example,), split_spec={"blocks.1": SplitPoint.BEGINNING})
        # The data's integer work still runs for real (a sampler's permutation can be read).
        assert not _torch_compat.is_fake(torch.randperm(8))
    assert pipe.num_stages == 2
