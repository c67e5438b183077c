"""FSDP options on 2 CPU ranks: sharding strategies, hybrid meshes, activation checkpointing, CPU offload and
mixed precision, each checked for parity with one process on the global batch; and Lightning Fabric's spellings of
them (`CPUOffload` objects, `device_mesh=(replicate, shard)`, `mixed_precision=`, `activation_checkpointing=`)."""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from fsdp_models import ACCUM, N_BLOCKS, Block, Net, full_state, reference, train
from harness import run_ranks
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

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
    # Fabric's spellings. A (replicate, shard) tuple: 2-way sharding, or (FSDP2; FSDP1 refuses it, see below) 2
    # replicas of 1-way sharding.
    "fsdp-mesh-1x2": (
        lambda: FSDPStrategy(
            auto_wrap_policy={Block}, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=(1, 2)
        ),
        "32-true",
    ),
    "fsdp2-mesh-2x1": (lambda: FSDP2Strategy(shard_policy={Block}, device_mesh=(2, 1)), "32-true"),
    # An object that asks for no offload must not count as cpu_offload=True (which CPU jobs refuse).
    "fsdp-cpuoffload-false": (
        lambda: FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=CPUOffload(offload_params=False)),
        "32-true",
    ),
    "fsdp2-offloadpolicy-none": (
        lambda: FSDP2Strategy(shard_policy={Block}, cpu_offload=OffloadPolicy()),
        "32-true",
    ),
    # Policies as callables: a predicate(module) for the units, and FSDP1's (module, recurse, nonwrapped_numel)
    # form (what Fabric's users pass) for checkpointing, size-based and by class.
    "fsdp-checkpointing-policy-callables": (
        lambda: FSDPStrategy(
            auto_wrap_policy=lambda module: isinstance(module, Block),
            activation_checkpointing_policy=functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls={Block}
            ),
        ),
        "32-true",
    ),
    "fsdp2-checkpointing-size-policy": (
        lambda: FSDP2Strategy(
            shard_policy={Block},
            # A Block holds 1072 parameters, its layers 544 at most, the embedding and head fewer: exactly the
            # blocks are wrapped (the ModuleList's remainder is 0, and torch's recursion never wraps the root).
            activation_checkpointing_policy=functools.partial(
                size_based_auto_wrap_policy, min_num_params=1000
            ),
        ),
        "32-true",
    ),
    "fsdp-checkpointing-deprecated": (
        lambda: FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing=Block),
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
        "checkpointed": sorted(
            _class_name(m._checkpoint_wrapped_module)
            for m in model.forward_module.modules()
            if isinstance(m, CheckpointWrapper)
        ),
        "units": _unit_types(model.forward_module),
        "mesh": tuple(loom.strategy.device_mesh.mesh.shape),
        "shard_size": _shard_size(model.forward_module),
        "offload": _offloaded(model.forward_module),
    }


def _shard_size(module: torch.nn.Module) -> int:
    """Over how many ranks the (first) unit really shards its parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    unit = next((m for m in module.modules() if isinstance(m, FSDP)), None)
    if unit is not None:
        return unit.process_group.size()  # FSDP1: its sharding group (within a replica under hybrid)
    param = next(p for p in module.parameters() if isinstance(p, DTensor))
    return math.prod(param.device_mesh.size(i) for i, pl in enumerate(param.placements) if pl.is_shard())


def _unit_types(module: torch.nn.Module) -> list[str]:
    """The class of every module that is an FSDP unit (FSDP1 wrappers or FSDP2-managed modules)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def name(m: torch.nn.Module) -> str:
        inner = m.module if isinstance(m, FSDP) else m
        return _class_name(getattr(inner, "_checkpoint_wrapped_module", inner))

    return sorted(name(m) for m in module.modules() if isinstance(m, (FSDP, FSDPModule)))


def _class_name(module: torch.nn.Module) -> str:
    # fully_shard gives a module the class FSDP<its class>.
    return type(module).__name__.removeprefix("FSDP")


def _offloaded(module: torch.nn.Module) -> set[bool]:
    """Whether the FSDP1 units offload their parameters (empty under FSDP2)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return {m.cpu_offload.offload_params for m in module.modules() if isinstance(m, FSDP)}


# name -> (mesh shape, shard group size) the run must have used.
MESHES = {
    "fsdp-shard_grad_op": ((2,), 2),
    "fsdp-hybrid": ((1, 2), 2),
    "fsdp-mesh-1x2": ((1, 2), 2),
    "fsdp2-hybrid": ((1, 2), 2),
    "fsdp2-mesh-2x1": ((2, 1), 1),
    "fsdp2-keep-after-forward": ((2,), 2),
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
    # A checkpointing policy wraps exactly the blocks.
    assert results[0]["checkpointed"] == (["Block"] * N_BLOCKS if "checkpointing" in name else [])
    if "policy" in name:
        assert results[0]["units"] == ["Block"] * N_BLOCKS + ["Net"], results[0]["units"]
    if name in MESHES:
        assert (results[0]["mesh"], results[0]["shard_size"]) == MESHES[name]
    if name.startswith("fsdp-"):
        assert results[0]["offload"] == {False}


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


# ---- mixed_precision= --------------------------------------------------------------------------------------
BF16 = torch.bfloat16
# name -> (strategy factory, precision, the dtype units must compute in, the dtype FSDP1 must reduce in)
MIXED = {
    # "32-true" leaves the units' dtypes to mixed_precision alone.
    "fsdp-32-true": (
        lambda: FSDPStrategy(
            auto_wrap_policy={Block}, mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=BF16)
        ),
        "32-true",
        BF16,
        BF16,
    ),
    # torchloom's own choice for "bf16-mixed" reduces in fp32: the explicit policy's bf16 reduction wins.
    "fsdp-bf16-mixed": (
        lambda: FSDPStrategy(
            auto_wrap_policy={Block}, mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=BF16)
        ),
        "bf16-mixed",
        BF16,
        BF16,
    ),
    "fsdp2-32-true": (
        lambda: FSDP2Strategy(shard_policy={Block}, mixed_precision=MixedPrecisionPolicy(param_dtype=BF16)),
        "32-true",
        BF16,
        None,
    ),
    "fsdp2-bf16-mixed": (
        lambda: FSDP2Strategy(
            shard_policy={Block}, mixed_precision=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
        ),
        "bf16-mixed",
        BF16,
        None,
    ),
}


def _mixed_body(rank: int, world_size: int, name: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    make_strategy, precision, _, _ = MIXED[name]
    loom = Loom(accelerator="cpu", devices=world_size, strategy=make_strategy(), precision=precision)
    loom.launch()
    torch.manual_seed(0)
    model = Net()
    seen: set[tuple[str, str]] = set()
    for block in model.blocks:
        # Inside the unit during forward: the unsharded weight FSDP computes with, and the input it gets.
        block.fc1.register_forward_pre_hook(
            lambda m, args: seen.add((str(m.weight.dtype), str(args[0].dtype)))
        )
    model = loom.setup_module(model)
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    before = full_state(model)
    # The loss in fp32: with "32-true" the units' bf16 output reaches the loss as it is, and torch 2.9's mse_loss
    # backward fails on a bf16 input with an fp32 target ("Found dtype Float but expected BFloat16"; 2.13 is fine).
    train(
        loom, model, opt, loss=lambda out, target: torch.nn.functional.mse_loss(out.float(), target) / ACCUM
    )
    after = full_state(model)
    return {
        "compute": sorted(seen),
        "stored": sorted({str(p.dtype) for p in model.parameters()}),
        "reduce": sorted(
            {str(m.mixed_precision.reduce_dtype) for m in model.modules() if isinstance(m, FSDP)}
        ),
        "moved": max(float((after[k] - before[k]).abs().max()) for k in before),
    }


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_precision_is_what_the_units_use(name):
    _, _, compute, reduce = MIXED[name]
    for result in run_ranks(_mixed_body, 2, name, timeout=120):
        assert result["compute"] == [(str(compute), str(compute))], result
        assert result["stored"] == ["torch.float32"], result  # sharded master weights stay fp32
        if reduce is not None:
            assert result["reduce"] == [str(reduce)], result
        assert result["moved"] > 1e-3, result


@pytest.mark.parametrize(
    ("make", "precision"),
    [
        (lambda: FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.float16)), "bf16-mixed"),
        (lambda: FSDP2Strategy(mixed_precision=MixedPrecisionPolicy(param_dtype=BF16)), "16-mixed"),
        (lambda: FSDP2Strategy(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float32)), "bf16-true"),
    ],
)
def test_mixed_precision_that_contradicts_precision_is_refused(make, precision):
    from torchloom import ConfigurationError

    with pytest.raises(ConfigurationError, match=f"but precision='{precision}' computes in"):
        Loom(accelerator="cpu", devices=2, strategy=make(), precision=precision)


def test_mixed_precision_that_agrees_with_precision_is_taken():
    strategy = FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=BF16))
    Loom(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed")
    assert strategy._mixed_precision_for_units() is strategy.mixed_precision
    assert FSDP2Strategy(mixed_precision=None).mixed_precision is None


# ---- the other Fabric spellings, in one process --------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "value", "offload"),
    [
        (FSDPStrategy, False, False),
        (FSDPStrategy, True, True),
        (FSDPStrategy, CPUOffload(offload_params=False), False),
        (FSDPStrategy, CPUOffload(offload_params=True), True),
        (FSDP2Strategy, CPUOffload(offload_params=False), False),
        (FSDP2Strategy, CPUOffloadPolicy(pin_memory=False), True),
        (FSDP2Strategy, OffloadPolicy(), False),
    ],
)
def test_cpu_offload_spellings(cls, value, offload):
    assert cls(cpu_offload=value).cpu_offload is offload


@pytest.mark.parametrize(
    ("cls", "value", "accepted"),
    [
        (FSDPStrategy, "yes", "torch.distributed.fsdp.CPUOffload"),
        (FSDPStrategy, CPUOffloadPolicy(), "torch.distributed.fsdp.CPUOffload, got CPUOffloadPolicy"),
        (FSDP2Strategy, 1, "CPUOffloadPolicy, torch.distributed.fsdp.OffloadPolicy, got int"),
    ],
)
def test_cpu_offload_of_another_type_is_a_type_error(cls, value, accepted):
    with pytest.raises(TypeError, match=f"cpu_offload must be a bool or one of .*{accepted}"):
        cls(cpu_offload=value)


def test_options_of_other_types_are_type_errors():
    with pytest.raises(
        TypeError, match="mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy"
    ):
        FSDP2Strategy(mixed_precision=MixedPrecision())
    with pytest.raises(TypeError, match=r"device_mesh must be a tuple \(replicate, shard\)"):
        FSDPStrategy(device_mesh=[2, 0])


def test_fsdp1_hybrid_over_one_process_per_replica_is_refused():
    # Raw FSDP1 runs this, but falls back to NO_SHARD inside each one-process replica and never all-reduces
    # across replicas: with device_mesh=(2, 1) on 2 ranks the ranks ended 0.03 apart after 5 steps.
    from torchloom import ConfigurationError

    strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 1))
    with pytest.raises(ConfigurationError, match="silently stops averaging gradients across the replicas"):
        Loom(accelerator="cpu", devices=2, strategy=strategy)
    with pytest.raises(ConfigurationError, match="Use sharding_strategy='NO_SHARD'"):
        Loom(
            accelerator="cpu", devices=1, num_nodes=2, strategy=FSDPStrategy(sharding_strategy="HYBRID_SHARD")
        )


def test_module_wrap_policy_selects_modules_for_checkpointing_and_sharding():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    checkpointed = FSDPStrategy(activation_checkpointing_policy=ModuleWrapPolicy({Block}))
    sharded = FSDP2Strategy(shard_policy=ModuleWrapPolicy({Block}))
    for policy in (checkpointed.activation_checkpointing_policy, sharded.shard_policy):
        assert policy(Block()) and not policy(Net()) and not policy(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("value", [ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD_OP", "shard_grad_op"])
def test_sharding_strategy_as_enum_or_string(value):
    assert FSDPStrategy(sharding_strategy=value).sharding_strategy == "SHARD_GRAD_OP"


def test_deprecated_activation_checkpointing_warns_with_fabrics_text():
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy

    def message(cls, value) -> str:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(activation_checkpointing=value)
        [warning] = [w for w in caught if "deprecated" in str(w.message)]
        assert issubclass(warning.category, (DeprecationWarning, FutureWarning))
        return str(warning.message)

    for value in (Block, [Block, torch.nn.Linear]):
        assert message(FSDPStrategy, value) == message(FabricFSDPStrategy, value)
    with pytest.warns(FutureWarning, match="is deprecated") as caught:
        strategy = FSDPStrategy(activation_checkpointing=[Block])
    assert caught[0].filename == __file__  # points at the caller's line, as Fabric's does
    assert strategy.activation_checkpointing_policy(Block()) and not strategy.activation_checkpointing_policy(
        Net()
    )


def test_a_strategy_is_completed_once_by_loom():
    from torchloom import ConfigurationError, MisuseError
    from torchloom.accelerators import CPUAccelerator
    from torchloom.precision import Precision

    strategy = FSDP2Strategy(shard_policy={Block})
    with pytest.raises(MisuseError, match="not part of a Loom yet"):
        strategy.precision  # noqa: B018
    # A check that fails while binding leaves the strategy unbound, so the fixed call can use it.
    with pytest.raises(ConfigurationError, match="computes in"):
        Loom(
            accelerator="cpu",
            devices=2,
            strategy=FSDP2Strategy(mixed_precision=MixedPrecisionPolicy(BF16)),
            precision="16-mixed",
        )
    loom = Loom(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed")
    assert isinstance(strategy.accelerator, CPUAccelerator) and isinstance(strategy.precision, Precision)
    assert strategy.precision.name == "bf16-mixed" and strategy.world_size == 2 and loom.strategy is strategy
    with pytest.raises(ConfigurationError, match="already belongs to another Loom"):
        Loom(accelerator="cpu", devices=2, strategy=strategy)


def test_a_rejected_binding_can_be_retried():
    from torchloom import ConfigurationError

    strategy = FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.float16))
    with pytest.raises(ConfigurationError, match="computes in"):
        Loom(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed")
    Loom(accelerator="cpu", devices=2, strategy=strategy, precision="16-mixed")
    assert strategy.precision.name == "16-mixed"


@pytest.mark.parametrize(
    "offload",  # FSDP1 offloads only sharded units (on one GPU it is NO_SHARD: refused, see tests/gpu/test_cuda.py)
    [pytest.param(False, marks=pytest.mark.cuda), pytest.param(True, marks=pytest.mark.cuda(min_devices=2))],
)
def test_cpu_offload_object_places_the_shards(offload):
    results = run_ranks(_offload_body, min(2, torch.cuda.device_count()), offload, timeout=180)
    for result in results:
        assert result == {"cpu" if offload else "cuda"}, result


def _offload_body(rank: int, world_size: int, offload: bool) -> set[str]:
    loom = Loom(
        accelerator="cuda",
        devices=world_size,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=CPUOffload(offload_params=offload)),
    )
    loom.launch()
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    train(loom, model, opt)
    return {p.device.type for p in model.parameters()}


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_the_one_unit_warning_points_at_the_users_line(strategy):
    loom = Loom(accelerator="cpu", devices=1, strategy=strategy)
    loom.launch()
    with pytest.warns(UserWarning, match="makes the whole model one unit") as caught:
        loom.setup_module(torch.nn.Linear(2, 2))
    assert [w.filename for w in caught if "one unit" in str(w.message)] == [__file__]
