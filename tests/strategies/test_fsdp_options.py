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


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Net().state_dict().items()}


def _largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_option_parity(name):
    results = run_ranks(_body, 2, name, timeout=120)
    precision = CONFIGS[name][1]
    bf16 = precision == "bf16-mixed"

    def sgd(p, lr):
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    expected, expected_norms = reference(
        Net, optimizer_cls=sgd, lr=0.1, autocast=torch.bfloat16 if bf16 else None
    )
    if not bf16:
        for rank, result in enumerate(results):
            for key, value in expected.items():
                torch.testing.assert_close(
                    result["params"][key], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {key}"
                )
            torch.testing.assert_close(
                torch.tensor(result["norms"]), torch.tensor(expected_norms), atol=1e-5, rtol=1e-5
            )
    else:
        # bf16 keeps 8 bits of mantissa, and FSDP casts parameters to bf16 where the reference autocasts only
        # matmul inputs, so the runs cannot agree to fp32 precision. Judge the gap against how far training moved
        # the weights, and show that bf16 really ran: the result is much closer to the bf16 reference than the
        # fp32 reference is.
        fp32, _ = reference(Net, optimizer_cls=sgd, lr=0.1)
        moved = _largest_gap(expected, _initial())
        bf16_effect = _largest_gap(fp32, expected)
        assert moved > 0.1, moved  # 5 steps moved the weights far more than the tolerances below
        for rank, result in enumerate(results):
            gap = _largest_gap(result["params"], expected)
            assert gap < 0.05 * moved, (rank, gap, moved)
            assert _largest_gap(result["params"], fp32) > 0.5 * bf16_effect, (rank, bf16_effect)
            norms, ref = torch.tensor(result["norms"]), torch.tensor(expected_norms)
            assert float((norms - ref).abs().max()) < 0.02 * float(ref.abs().max()), (norms, ref)
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
    x, y = _true_data()
    per = x.shape[0] // world_size
    for _ in range(TRUE_STEPS):
        out = model(x[rank * per : (rank + 1) * per].to(torch.bfloat16))
        loss = torch.nn.functional.mse_loss(out.float(), y[rank * per : (rank + 1) * per])
        loom.backward(loss)
        loom.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
    return {"dtypes": sorted({str(p.dtype) for p in model.parameters()}), "params": full_state(model)}


TRUE_STEPS = 5


def _true_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)


def _true_reference(
    dtype: torch.dtype, created_in_bf16: bool, steps: int = TRUE_STEPS
) -> dict[str, torch.Tensor]:
    """One process, the whole model in `dtype`, on the global batch. `created_in_bf16`: initialised as
    `loom.init_module()` does under bf16-true (torch's initialisers draw other values in bf16 than in fp32)."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if created_in_bf16 else torch.float32)
    try:
        model = Net().to(dtype)
    finally:
        torch.set_default_dtype(previous)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _true_data()
    for _ in range(steps):
        torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
def test_bf16_true_with_hand_made_units_and_leftovers(flavour):
    # FSDP1's units are made with wrap() inside loom.init_module(), which creates them in bf16 directly.
    in_bf16 = flavour == "fsdp"
    expected, fp32 = _true_reference(torch.bfloat16, in_bf16), _true_reference(torch.float32, in_bf16)
    moved = _largest_gap(expected, _true_reference(torch.bfloat16, in_bf16, steps=0))
    bf16_effect = _largest_gap(fp32, expected)
    assert moved > 0.1, moved
    for rank, result in enumerate(run_ranks(_true_precision_body, 2, flavour, timeout=120)):
        assert result["dtypes"] == ["torch.bfloat16"]  # units and replicated leftovers alike
        # bf16 sums in a different order on 2 ranks than in one process: judge against the distance moved.
        gap = _largest_gap(result["params"], expected)
        assert gap < 0.05 * moved, (rank, gap, moved)
        assert _largest_gap(result["params"], fp32) > 0.5 * bf16_effect, (rank, bf16_effect)
