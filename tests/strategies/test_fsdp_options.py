"""FSDP options on 2 CPU ranks: sharding strategies, hybrid meshes, activation checkpointing, CPU offload and
mixed precision, each checked for parity with one process on the global batch."""

from __future__ import annotations

import warnings

import pytest
import torch
from fsdp_models import Block, Net, full_state, reference, train
from harness import run_ranks

from torchloom import Loom
from torchloom.strategies import FSDP2Strategy, FSDPStrategy

# name -> (strategy factory, precision, optimizer, lr)
CONFIGS = {
    "fsdp-shard_grad_op": (
        lambda: FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP"),
        "32-true",
    ),
    "fsdp-no_shard": (
        lambda: FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="NO_SHARD"),
        "32-true",
    ),
    "fsdp-hybrid": (
        lambda: FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD"),
        "32-true",
    ),
    "fsdp-checkpointing": (
        lambda: FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}),
        "32-true",
    ),
    "fsdp2-keep-after-forward": (
        lambda: FSDP2Strategy(shard_policy={Block}, reshard_after_forward=False),
        "32-true",
    ),
    "fsdp2-hybrid": (lambda: FSDP2Strategy(shard_policy={Block}, hybrid=True), "32-true"),
    "fsdp2-checkpointing": (
        lambda: FSDP2Strategy(shard_policy={Block}, activation_checkpointing_policy={Block}),
        "32-true",
    ),
    # Units for the blocks only: the fp32 replicated leftovers must work beside bf16 units.
    "fsdp-bf16-mixed": (lambda: FSDPStrategy(), "bf16-mixed"),
    "fsdp2-bf16-mixed": (lambda: FSDP2Strategy(), "bf16-mixed"),
}


def _body(rank: int, world_size: int, name: str) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import fully_shard

    make_strategy, precision = CONFIGS[name]
    loom = Loom(accelerator="cpu", devices=world_size, strategy=make_strategy(), precision=precision)
    loom.launch()
    torch.manual_seed(0)
    if precision == "bf16-mixed":
        if name.startswith("fsdp2"):
            model = Net()
            for block in model.blocks:
                fully_shard(block, **loom.strategy.unit_kwargs())
        else:
            with loom.init_module():
                model = Net(wrap_blocks=True)
    else:
        model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = loom.setup_module(model)
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    norms = train(loom, model, opt)
    return {
        "params": full_state(model),
        "norms": norms,
        "checkpointed": any(isinstance(m, CheckpointWrapper) for m in model.forward_module.modules()),
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_option_parity(name):
    results = run_ranks(_body, 2, name, timeout=120)
    precision = CONFIGS[name][1]
    bf16 = precision == "bf16-mixed"
    expected, expected_norms = reference(
        Net,
        optimizer_cls=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
        lr=0.1,
        autocast=torch.bfloat16 if bf16 else None,
    )
    # bf16 keeps 8 bits of mantissa (relative error ~4e-3 per op); FSDP casts parameters to bf16 where the
    # reference autocasts only matmul inputs, so elementwise ops differ too. After 5 SGD steps of lr 0.1 the
    # parameters agree to ~1e-2; fp32 must agree to 1e-5.
    tol = 2e-2 if bf16 else 1e-5
    for rank, result in enumerate(results):
        for key, value in expected.items():
            torch.testing.assert_close(
                result["params"][key].float(), value, atol=tol, rtol=tol, msg=f"rank {rank} {key}"
            )
        torch.testing.assert_close(
            torch.tensor(result["norms"]), torch.tensor(expected_norms), atol=tol, rtol=tol
        )
    assert results[0]["checkpointed"] == ("checkpointing" in name)


@pytest.mark.parametrize("cls", [FSDPStrategy, FSDP2Strategy])
def test_cpu_offload_on_cpu_is_refused_before_launch(cls):
    from torchloom import ConfigurationError

    with pytest.raises(ConfigurationError, match="already runs on the CPU"):
        Loom(accelerator="cpu", devices=2, strategy=cls(cpu_offload=True))


def _true_precision_body(rank: int, world_size: int, flavour: str) -> dict:
    from fsdp_models import build_layout, layout_strategy

    loom = Loom(
        accelerator="cpu",
        devices=world_size,
        strategy=layout_strategy(flavour, "units_plus_leftovers"),
        precision="bf16-true",
    )
    loom.launch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = loom.setup_module(build_layout(loom, flavour, "units_plus_leftovers"))
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loom.backward(loss)
        loom.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loom.all_reduce(loss.detach())))  # the global loss: what training lowers
    return {"dtypes": sorted({str(p.dtype) for p in model.parameters()}), "losses": losses}


@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
def test_bf16_true_with_hand_made_units_and_leftovers(flavour):
    for result in run_ranks(_true_precision_body, 2, flavour, timeout=120):
        assert result["dtypes"] == ["torch.bfloat16"]  # units and replicated leftovers alike
        assert result["losses"][-1] < result["losses"][0]
