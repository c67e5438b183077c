"""What the GPU path depends on, checked on the CPU: which device a collective, a gather or a generator is handed.

A CPU machine has one device that holds data, so these check the plumbing (the argument each call gets, the
rule each step applies), with stand-ins only for the CUDA calls; tests/gpu/test_cuda.py runs the same paths on
GPUs, end to end.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from fsdp_models import N_BLOCKS, Block, Net
from torch import nn

from torchloom import Loom
from torchloom.checkpointing import rng
from torchloom.checkpointing.hf import _on_mesh_device
from torchloom.strategies import _sharded, fsdp
from torchloom.strategies._placement import place_state_with_parameters


# ---- broadcasts that start every rank from rank 0's weights ------------------------------------------------
def _setups(flavour: str):
    """Every way setup_module broadcasts: a model built outside init_module with a policy (the whole model,
    before FSDP moves it), meta init (FSDP1's param_init_fn; leftovers), hand-made units and their leftovers."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import wrap

    from torchloom.strategies import FSDP2Strategy, FSDPStrategy

    def policy() -> tuple[Loom, nn.Module]:
        strategy = (
            FSDPStrategy(auto_wrap_policy={Block})
            if flavour == "fsdp"
            else FSDP2Strategy(shard_policy={Block})
        )
        loom = Loom(accelerator="cpu", devices=1, strategy=strategy)
        loom.launch()
        return loom, Net()  # built on the CPU, as a user without init_module builds it

    def meta() -> tuple[Loom, nn.Module]:
        loom = Loom(accelerator="cpu", devices=1, strategy=flavour)
        loom.launch()
        with loom.init_module(empty_init=True):
            model = Net()
        if flavour == "fsdp":
            with loom.init_module():
                for i in range(N_BLOCKS):
                    model.blocks[i] = wrap(model.blocks[i])
        else:
            for block in model.blocks:
                fully_shard(block)
        return loom, model

    def by_hand() -> tuple[Loom, nn.Module]:
        loom = Loom(accelerator="cpu", devices=1, strategy=flavour)
        loom.launch()
        if flavour == "fsdp":
            with loom.init_module():
                model = Net()
                for i in range(N_BLOCKS):
                    model.blocks[i] = wrap(model.blocks[i])
            return loom, model
        model = Net()
        for block in model.blocks:
            fully_shard(block)
        return loom, model

    return {"policy": policy, "meta": meta, "by_hand": by_hand}


@pytest.mark.parametrize("case", ["policy", "meta", "by_hand"])
@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
def test_every_setup_broadcast_goes_through_the_ranks_device(monkeypatch, flavour, case):
    """Under NCCL a broadcast of CPU tensors fails: each broadcast must be told the rank's device, through which
    tensors held elsewhere (a model still on the CPU) travel."""
    calls: list[torch.device | None] = []
    real = _sharded.broadcast_tensors

    def spy(tensors, group=None, src=0, device=None):
        calls.append(device)
        real(tensors, group=group, src=src, device=device)

    monkeypatch.setattr(_sharded, "broadcast_tensors", spy)
    monkeypatch.setattr(fsdp, "broadcast_tensors", spy)
    loom, model = _setups(flavour)[case]()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loom.setup_module(model)
        assert calls, "setup_module broadcasts at least the buffers"
        assert calls == [loom.device] * len(calls), calls
    finally:
        loom.close()


# ---- gathering a shard that offload keeps in host memory ---------------------------------------------------
class _FakeDTensor:
    def __init__(self, device: str, mesh_type: str) -> None:
        self.device = torch.device(device)
        self.device_mesh = types.SimpleNamespace(device_type=mesh_type)
        self.moved_to: str | None = None

    def to(self, device: str) -> _FakeDTensor:
        self.moved_to = device
        return _FakeDTensor(device, self.device_mesh.device_type)


def test_save_raw_gathers_an_offloaded_shard_on_its_meshs_device():
    offloaded = _FakeDTensor("cpu", "cuda")  # cpu_offload: the shard in host memory, the mesh on the GPUs
    gathered = _on_mesh_device(offloaded)
    assert offloaded.moved_to == "cuda" and gathered.device.type == "cuda"
    on_gpu = _FakeDTensor("cuda", "cuda")
    assert _on_mesh_device(on_gpu) is on_gpu and on_gpu.moved_to is None
    on_cpu = _FakeDTensor("cpu", "cpu")  # gloo on CPU: nothing to move
    assert _on_mesh_device(on_cpu) is on_cpu and on_cpu.moved_to is None


# ---- the optimizer state of parameters that a full load moved ---------------------------------------------
@pytest.mark.parametrize("capturable", [False, True])
def test_optimizer_state_follows_its_parameter_as_torch_places_it(capturable):
    """After a full load under cpu_offload, the state of a parameter moved back to the GPU goes with it, except
    Adam's step counter, which torch keeps in host memory unless the optimizer is capturable (checked with the
    "meta" device, the other device a CPU machine has)."""
    param = nn.Parameter(torch.ones(3))
    other = nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([param, other])
    for p in (param, other):
        p.grad = torch.ones_like(p)
    opt.step()  # state as Adam makes it: step a host scalar, moments beside the parameter
    opt.param_groups[0]["capturable"] = capturable  # (a capturable Adam cannot step on a CPU machine)
    torch.utils.swap_tensors(param, nn.Parameter(torch.empty(3, device="meta")))  # where it went back to
    place_state_with_parameters(opt, {id(param)})
    state = opt.state[param]
    assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
    assert state["step"].is_meta == capturable
    assert not any(v.is_meta for v in opt.state[other].values()), "only the parameters named move"


# ---- random generators: the rank's own GPU ----------------------------------------------------------------
def test_the_ranks_own_gpu_generator_is_saved_and_restored(monkeypatch):
    asked: list[torch.device] = []
    restored: list[tuple[torch.Tensor, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: asked.append(device) or torch.tensor([7]))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    monkeypatch.setattr(
        torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's generator is not this rank's")
    )
    gpu = torch.device("cuda", 1)
    state = rng.capture(gpu)
    assert asked == [gpu] and torch.equal(state["cuda"], torch.tensor([7]))
    rng.restore(state, gpu)
    assert len(restored) == 1 and restored[0][1] == gpu and torch.equal(restored[0][0], torch.tensor([7]))
    assert "cuda" not in rng.capture(torch.device("cpu"))


def test_a_checkpoint_with_every_gpus_generator_restores_this_gpus():
    """Checkpoints written before kept every visible GPU's generator, by index: take this GPU's, and none where
    the saving machine had fewer GPUs (restoring them by position crashed with IndexError)."""
    states = [torch.tensor([i]) for i in range(4)]
    assert torch.equal(rng._cuda_state(states, torch.device("cuda", 2)), torch.tensor([2]))
    assert rng._cuda_state(states, torch.device("cuda", 5)) is None
    assert rng._cuda_state(states[:1], torch.device("cuda", 1)) is None
    assert torch.equal(rng._cuda_state(torch.tensor([9]), torch.device("cuda", 3)), torch.tensor([9]))
