"""Meta-device initialisation and placement under "fsdp" and "fsdp2" on 2 CPU ranks.

- `init_module(empty_init=True)` puts parameters on meta but computes buffers for real, so a non-persistent
  buffer computed in `__init__` (rotary `inv_freq`) keeps its value;
- materialisation touches only what is on meta: a block built for real and put into a meta model keeps its
  weights (FSDP2 used to run `to_empty` on the whole model and wipe them);
- `setup_module` moves exactly the parameters and buffers outside the units to the device (checked by moving
  them to "meta", the one other device a CPU machine has).
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from fsdp_models import full_state
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom._layout import analyze

D = 8


def _inv_freq() -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


class Rotary(nn.Module):
    """A layer whose non-persistent buffer is computed in __init__ and never by reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.register_buffer("inv_freq", _inv_freq(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * torch.cos(self.inv_freq).repeat(2)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.norm = nn.BatchNorm1d(D)  # a leftover with buffers of its own
        self.blocks = nn.ModuleList(Rotary() for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _real_block() -> Rotary:
    torch.manual_seed(123)
    return Rotary()


def _body(rank: int, world_size: int, flavour: str) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import wrap

    from torchloom.strategies._sharded import ShardedStrategy

    loom = Loom(accelerator="cpu", devices=world_size, strategy=flavour)
    loom.launch()
    out: dict = {}
    with loom.init_module(empty_init=True):
        model = Model()
    out["params_meta"] = all(p.is_meta for p in model.parameters())
    out["buffers_real"] = not any(b.is_meta for b in model.buffers())
    out["inv_freq_at_init"] = model.blocks[1].inv_freq.clone()
    # A block built for real (e.g. loaded weights) in the otherwise empty model.
    model.blocks[0] = _real_block()
    out["real_block"] = {k: v.clone() for k, v in model.blocks[0].state_dict().items()}
    if flavour == "fsdp":
        with loom.init_module():
            for i in range(3):
                model.blocks[i] = wrap(model.blocks[i])
    else:
        for block in model.blocks:
            fully_shard(block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = loom.setup_module(model)
    state = full_state(wrapped)
    out["block0_after_setup"] = {
        k: state[f"blocks.0.{k}"] for k in out["real_block"] if f"blocks.0.{k}" in state
    }
    out["block1_weight"] = state["blocks.1.proj.weight"]
    opt = loom.setup_optimizers(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    loss = wrapped(torch.randn(4, 4)).pow(2).mean()
    loom.backward(loss)
    opt.step()
    out["finite_loss"] = bool(torch.isfinite(loss))
    out["inv_freq_after"] = [b.inv_freq.clone() for b in wrapped.module.modules() if isinstance(b, Rotary)]
    out["any_meta"] = any(t.is_meta for t in [*wrapped.parameters(), *wrapped.buffers()])

    # Placement: exactly the tensors outside the units move (to "meta" here, to the GPU in real use).
    fake = types.SimpleNamespace(root_device=torch.device("meta"))
    ShardedStrategy._place_outside_units(fake, wrapped.forward_module, analyze(wrapped.forward_module))  # type: ignore[arg-type]
    layout = analyze(wrapped.forward_module)
    outside = [t for _, t in [*layout.leftovers, *layout.leftover_buffers]]
    out["leftover_names"] = sorted(n for n, _ in [*layout.leftovers, *layout.leftover_buffers])
    out["outside_moved"] = all(t.is_meta for t in outside)
    out["units_stayed"] = all(
        not t.is_meta for t in [*wrapped.parameters(), *wrapped.buffers()] if all(t is not o for o in outside)
    )
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
def test_meta_init_keeps_real_tensors_and_buffers_and_places_leftovers(flavour):
    results = run_ranks(_body, 2, flavour, timeout=200)
    expected = _inv_freq()
    for rank, r in enumerate(results):
        where = f"{flavour} rank {rank}"
        assert r["params_meta"] and r["buffers_real"], where
        assert torch.equal(r["inv_freq_at_init"], expected), where
        assert len(r["inv_freq_after"]) == 3, where
        for value in r["inv_freq_after"]:
            assert torch.equal(value, expected), (where, value)
        assert r["finite_loss"] and not r["any_meta"], where
        # The block built for real kept its weights; the meta ones were initialised (and the same on both ranks).
        assert r["block0_after_setup"].keys() == {"proj.weight", "proj.bias"}, where
        for name, value in r["block0_after_setup"].items():
            assert torch.equal(value, r["real_block"][name]), (where, name)
        assert torch.isfinite(r["block1_weight"]).all() and r["block1_weight"].abs().sum() > 0, where
        assert torch.equal(r["block1_weight"], results[0]["block1_weight"]), where
        assert r["outside_moved"] and r["units_stayed"], where
        assert r["leftover_names"] == sorted(
            [
                "embed.weight",
                "embed.bias",
                "head.weight",
                "head.bias",
                "norm.weight",
                "norm.bias",
                "norm.running_mean",
                "norm.running_var",
                "norm.num_batches_tracked",
            ]
        ), where
