"""The Fabric switch (`torchloom.lightning_compat`) and what Fabric programs torchloom does not own need from
torchloom itself (issue 39): Lightning's strategy objects accepted, `init_module(empty_init=True)` as Fabric's,
and a one-device Loom made inside a running job. litgpt itself runs in tests/clients (`make clients`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.errors import ConfigurationError
from torchloom.strategies import DDPStrategy, FSDP2Strategy, FSDPStrategy

lightning = pytest.importorskip("lightning")

SRC = Path(__file__).resolve().parents[1] / "src"


# The switch's own checks, run by the program below in its main process once its ranks are done: the program runs
# under `python -m torchloom.lightning_compat` (the switch installed before it imports Lightning), so one
# interpreter importing torch and Lightning serves both tests (each such interpreter costs seconds of CPU).
_SWITCH_CHECKS = """
def check_switch():
    import pickle
    import pytest
    import torch
    from torch import nn
    import torchloom
    from torchloom import lightning_compat, strategies
    from torchloom.errors import ConfigurationError

    lightning_compat.install()
    import lightning as L
    import lightning.fabric
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
    from lightning.fabric.utilities import ThroughputMonitor, measure_flops
    from lightning.fabric.utilities.throughput import ThroughputMonitor as TM2

    assert L.Fabric is torchloom.Loom and lightning.fabric.Fabric is torchloom.Loom
    # litgpt's pretrain and LoRA strategies, as litgpt writes them.
    pre = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full", sharding_strategy="HYBRID_SHARD")
    lora = FSDPStrategy(auto_wrap_policy={nn.Linear}, activation_checkpointing_policy={nn.Sequential},
                        state_dict_type="full", limit_all_gathers=True, cpu_offload=False)
    for s in (pre, lora):
        assert type(s) is strategies.FSDPStrategy and isinstance(s, FSDPStrategy)
        assert not isinstance(s, DDPStrategy) and not isinstance(s, ModelParallelStrategy)
        assert s.state_dict_type == "full"
        pickle.loads(pickle.dumps(s))  # launch(fn) pickles it for spawned ranks
    assert pre.sharding_strategy == "HYBRID_SHARD" and lora._unit_options["limit_all_gathers"] is True
    ddp = DDPStrategy(find_unused_parameters=True, start_method="spawn")
    assert type(ddp) is strategies.DDPStrategy and isinstance(ddp, DDPStrategy)
    with pytest.raises(ConfigurationError, match="DeepSpeedStrategy has no torchloom counterpart"):
        DeepSpeedStrategy()
    with pytest.raises(ConfigurationError, match=r"FSDPStrategy\\(precision=...\\) cannot be translated"):
        FSDPStrategy(precision=object())
    assert callable(measure_flops) and ThroughputMonitor.__name__ == TM2.__name__ == "ThroughputMonitor"

    lightning_compat.install(fsdp="fsdp2")
    two = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full", sharding_strategy="HYBRID_SHARD",
                       limit_all_gathers=True, activation_checkpointing_policy={nn.Linear})
    assert type(two) is strategies.FSDP2Strategy and isinstance(two, FSDPStrategy)
    assert two.hybrid and two.reshard_after_forward is True and two.state_dict_type == "full"
    pickle.loads(pickle.dumps(two))
    with pytest.raises(ConfigurationError, match=r"FSDPStrategy\\(forward_prefetch=...\\) cannot run as 'fsdp2'"):
        FSDPStrategy(forward_prefetch=True)
    with pytest.raises(ConfigurationError, match="NO_SHARD"):
        FSDPStrategy(sharding_strategy="NO_SHARD")
    with pytest.raises(ConfigurationError, match="use_orig_params=False"):
        FSDPStrategy(use_orig_params=False)
    print("switch checks ok")
"""

_SPAWNED = """
from lightning.fabric.strategies import FSDPStrategy  # bound when the rank imports this module


def check(fabric):
    return type(fabric).__name__, isinstance(fabric.strategy, FSDPStrategy), FSDPStrategy.__module__
"""


@pytest.fixture(scope="module")
def switched_program(tmp_path_factory) -> str:
    """The output of a program run through the switch: launch(fn) spawns 2 ranks, then the switch's checks."""
    tmp_path = tmp_path_factory.mktemp("switched")
    (tmp_path / "spawned_program.py").write_text(_SPAWNED)
    (tmp_path / "switch_checks.py").write_text(_SWITCH_CHECKS)
    program = tmp_path / "main.py"
    program.write_text(
        textwrap.dedent(
            """
            import lightning as L
            from lightning.fabric.strategies import FSDPStrategy
            from spawned_program import check

            if __name__ == "__main__":
                fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type="full"))
                print("result", fabric.launch(check), flush=True)
                from switch_checks import check_switch

                check_switch()
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(tmp_path)])}
    env.pop("TORCHLOOM_FABRIC_COMPAT", None)
    done = subprocess.run(
        [sys.executable, "-m", "torchloom.lightning_compat", str(program)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    return f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"


def test_switch_maps_fabric_names_and_translates_strategies(switched_program):
    assert "switch checks ok" in switched_program, switched_program


def test_spawned_ranks_are_switched_before_the_program_imports_lightning(switched_program):
    # launch(fn) spawns ranks that import the program's modules before anything of torchloom: they must see the
    # switch too (litgpt's LoRA script checks isinstance(fabric.strategy, FSDPStrategy) in its ranks).
    assert "result ('Loom', True, 'torchloom.lightning_compat')" in switched_program, switched_program
    assert switched_program.startswith("exit 0\n"), switched_program


def test_switch_without_lightning_says_so(monkeypatch):
    from torchloom import lightning_compat

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a)
    )
    with pytest.raises(ConfigurationError, match="Lightning is not installed"):
        lightning_compat.install()


def test_lightning_strategy_instances_are_translated():
    from lightning.fabric.strategies import DDPStrategy as LightningDDP
    from lightning.fabric.strategies import FSDPStrategy as LightningFSDP

    given = LightningFSDP(
        auto_wrap_policy={nn.Linear},
        activation_checkpointing_policy={nn.Linear},
        state_dict_type="full",
        limit_all_gathers=True,
        cpu_offload=False,
    )
    loom = Loom(accelerator="cpu", devices=1, strategy=given)
    assert type(loom.strategy) is FSDPStrategy
    assert loom.strategy.state_dict_type == "full" and loom.strategy.sharding_strategy == "FULL_SHARD"
    assert loom.strategy._unit_options["limit_all_gathers"] is True
    assert loom.strategy.activation_checkpointing_policy is not None
    ddp = Loom(accelerator="cpu", devices=1, strategy=LightningDDP(find_unused_parameters=True))
    assert type(ddp.strategy) is DDPStrategy and ddp.strategy.ddp_kwargs == {"find_unused_parameters": True}

    class Mine(LightningFSDP):
        pass

    with pytest.raises(ConfigurationError, match="subclasses Lightning's FSDPStrategy"):
        Loom(accelerator="cpu", devices=1, strategy=Mine())
    assert not isinstance(loom.strategy, FSDP2Strategy)


def _after_empty_init(rank: int, world_size: int, fabric: bool, strategy: str) -> tuple:
    from lightning.fabric import Fabric

    runner = (Fabric if fabric else Loom)(accelerator="cpu", devices=1, strategy=strategy)
    runner.launch()
    torch.manual_seed(0)
    with runner.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(3, 4))
    drawn = torch.rand(3)
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return drawn, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_empty_init_skips_initialisation_as_fabric_does(strategy):
    # Fabric's init_module(empty_init=True) skips torch.nn.init on one device and under DDP: no random numbers are
    # drawn, so litgpt's reset_parameters() afterwards gives Fabric's weights (it initialised them: issue 39).
    # Each in its own process (one rank of a torchrun-like job): DDP's launch() joins a process group.
    ((fabric,),) = [run_ranks(_after_empty_init, 1, True, strategy)]
    ((loom,),) = [run_ranks(_after_empty_init, 1, False, strategy)]
    assert torch.equal(loom[0], fabric[0]) and torch.equal(loom[1], fabric[1])
    torch.manual_seed(0)
    assert torch.equal(loom[0], torch.rand(3))  # nothing was drawn


def _lone_loom_in_job(rank: int, world_size: int) -> tuple:
    with pytest.raises(ConfigurationError, match="expects 1 process"):
        Loom(accelerator="cpu", devices=1)  # no job running yet: every process would train alone
    job = Loom(accelerator="cpu", devices=world_size, strategy="ddp")
    job.launch()
    result: tuple = ()
    if rank == 0:  # as litgpt's merge_lora at the end of its LoRA scripts
        lone = Loom(accelerator="cpu", devices=1)
        layer = nn.Linear(2, 1)
        model, optimizer = lone.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
        lone.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        lone.barrier()
        result = (lone.world_size, lone.global_rank, lone.local_rank, lone.is_global_zero)
    total = job.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    return result, float(total)


def test_one_device_loom_inside_a_running_job():
    results = run_ranks(_lone_loom_in_job, 2)
    assert results[0] == ((1, 0, 0, True), 3.0)
    assert results[1] == ((), 3.0)


def test_positional_arguments_are_bound_as_lightning_binds_them():
    """Lightning's strategies take accelerator, parallel_devices, ... first: a positional argument gets the name
    Lightning gives its position (the table is checked against the installed Lightning's signatures), so a
    Loom decision given positionally is refused by name and the rest reaches torchloom's parameter of that name."""
    import inspect
    from datetime import timedelta

    import lightning.fabric.strategies as lightning_strategies

    from torchloom import _fabric_strategies
    from torchloom.lightning_compat import _stand_in
    from torchloom.strategies import ModelParallelStrategy, SingleDeviceStrategy

    ddp = _stand_in("DDPStrategy")(None, None, None, None, None, "gloo", timedelta(minutes=5), "fork")
    assert type(ddp) is DDPStrategy and ddp.process_group_backend == "gloo" and ddp.start_method == "fork"
    assert ddp._timeout == timedelta(minutes=5)
    with pytest.raises(ConfigurationError, match=r"DDPStrategy\(parallel_devices=...\).*Loom\(devices=...\)"):
        _stand_in("DDPStrategy")(None, [torch.device("cpu")] * 2)
    with pytest.raises(ConfigurationError, match="at most 8 positional"):
        _stand_in("DDPStrategy")(*[None] * 9)
    with pytest.raises(ConfigurationError, match="two values for 'accelerator'"):
        _stand_in("DDPStrategy")(None, accelerator=None)
    fsdp = _stand_in("FSDPStrategy")(None, None, None, None, None, None, False, None, {nn.Linear})
    assert type(fsdp) is FSDPStrategy and fsdp.auto_wrap_policy is not None
    with pytest.raises(ConfigurationError, match=r"FSDPStrategy\(precision=...\)"):
        _stand_in("FSDPStrategy")(None, None, None, "bf16-mixed")
    with pytest.raises(ConfigurationError, match=r"SingleDeviceStrategy\(accelerator=...\)"):
        _stand_in("SingleDeviceStrategy")("cpu", object())
    assert type(_stand_in("SingleDeviceStrategy")("cpu")) is SingleDeviceStrategy
    model_parallel = _stand_in("ModelParallelStrategy")(lambda model, mesh: model, 1, 1, False, "gloo")
    assert type(model_parallel) is ModelParallelStrategy and not model_parallel.save_distributed_checkpoint
    assert model_parallel.process_group_backend == "gloo"

    # the table is Lightning's own order
    for name, order in _fabric_strategies.POSITIONAL.items():
        parameters = inspect.signature(getattr(lightning_strategies, name).__init__).parameters.values()
        positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"]
        assert tuple(positional) == order, name
