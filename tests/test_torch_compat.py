"""Each private torch API torchloom uses (src/torchloom/_torch_compat.py) works on the installed torch, and its
absence fails loudly instead of silently doing nothing."""

from __future__ import annotations

import types

import pytest
import torch
from harness import run_ranks

from torchloom import _torch_compat
from torchloom._torch_compat import TorchAPIMissing


def test_version_floor():
    _torch_compat.check_torch_version()  # the installed one passes
    _torch_compat.check_torch_version("2.9.0+cpu")
    with pytest.raises(ImportError, match=r"torch>=2\.9.*2\.8\.1"):
        _torch_compat.check_torch_version("2.8.1")
    with open(f"{__file__.rsplit('/tests/', 1)[0]}/pyproject.toml") as f:
        assert f'"torch>={_torch_compat.MIN_TORCH}"' in f.read()  # pyproject declares the same floor


def test_queue_backward_callback(monkeypatch):
    order = []
    x = torch.ones(3, requires_grad=True)

    def hook(grad):
        order.append("hook")
        _torch_compat.queue_backward_callback(lambda: order.append("end of backward"))
        return grad

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert order == ["hook", "end of backward"]
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", object())
    with pytest.raises(TorchAPIMissing, match="queue_callback"):
        _torch_compat.queue_backward_callback(lambda: None)


def test_current_graph_task_id(monkeypatch):
    seen = []
    x = torch.ones(2, requires_grad=True)
    for _ in range(2):
        y = x * 2
        y.register_hook(lambda g: seen.append(_torch_compat.current_graph_task_id()))
        y.sum().backward()
    assert _torch_compat.current_graph_task_id() == -1
    assert len(seen) == 2 and seen[0] != seen[1] and min(seen) >= 0
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(TorchAPIMissing, match="_current_graph_task_id"):
        _torch_compat.current_graph_task_id()


def _store_body(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    store = _torch_compat.default_store()
    store.set(f"k{rank}", "v")
    store.wait([f"k{1 - rank}"])
    value = store.get(f"k{1 - rank}").decode()
    dist.destroy_process_group()
    return value


@pytest.mark.timeout(120)
def test_default_store(monkeypatch):
    assert _torch_compat.default_store() is None  # no process group in this process
    assert run_ranks(_store_body, 2, timeout=100) == ["v", "v"]
    import torch.distributed as dist

    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(TorchAPIMissing, match="_get_default_store"):
        _torch_compat.default_store()


def test_grad_scaler_optimizer_state():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert _torch_compat.grad_scaler_optimizer_state(scaler, opt)["stage"].name == "READY"
    scaler.unscale_(opt)
    state = _torch_compat.grad_scaler_optimizer_state(scaler, opt)
    assert state["stage"].name == "UNSCALED" and list(state["found_inf_per_device"]) == [torch.device("cpu")]
    with pytest.raises(TorchAPIMissing, match="_per_optimizer_states"):
        _torch_compat.grad_scaler_optimizer_state(types.SimpleNamespace(), opt)


def test_unscale_and_check():
    a, b = torch.tensor([2.0, 4.0]), torch.tensor([8.0])
    found = torch.zeros(())
    _torch_compat.unscale_and_check([a, b], found, torch.tensor(0.5))
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [4.0] and found.item() == 0.0
    _torch_compat.unscale_and_check([torch.tensor([float("inf")])], found, torch.tensor(0.5))
    assert found.item() == 1.0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_load_whole_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "nested": {"b": torch.ones(2)}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    out: dict = {}
    _torch_compat.load_whole_checkpoint(out, dcp.FileSystemReader(str(tmp_path)))
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["nested"]["b"], state["nested"]["b"])
    only: dict = {}
    _torch_compat.load_whole_checkpoint(only, dcp.FileSystemReader(str(tmp_path)), keys=["w"])
    assert list(only) == ["w"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_private_globals(tmp_path, monkeypatch):
    """The private names are exactly those this torch's DCP metadata pickles under (`torch.layout` pickles
    through `_get_layout`), and each one's absence is named."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata

    dcp.save({"w": torch.ones(2, 3), "lr": 0.1}, checkpoint_id=str(tmp_path), no_dist=True)
    used = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            used.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / ".metadata", "rb") as f:
        Recording(f).load()
    private = _torch_compat.dcp_metadata_private_globals()
    assert set(private) == {(m, n) for m, n in used if n.startswith("_")}
    for (module, name), obj in private.items():
        assert getattr(__import__(module, fromlist=[name]), name) is obj
    monkeypatch.delattr(metadata, "_MEM_FORMAT_ENCODING")
    with pytest.raises(TorchAPIMissing, match="_MEM_FORMAT_ENCODING"):
        _torch_compat.dcp_metadata_private_globals()


def test_optimizer_state_to_load_with_parameters_without_state():
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def make():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, opt = make()
    model["used"](torch.ones(1, 3)).sum().backward()
    opt.step()  # state for used.weight and used.bias only
    saved = get_optimizer_state_dict(model, opt)
    assert sorted(saved["state"]) == ["used.bias", "used.weight"]

    # On the installed torch, the state dict as made for it loads, and the stepped parameters get their state.
    model2, opt2 = make()
    set_optimizer_state_dict(
        model2, opt2, _torch_compat.optimizer_state_to_load(saved), options=StateDictOptions(strict=False)
    )
    for name in ("weight", "bias"):
        got, want = opt2.state[getattr(model2["used"], name)], opt.state[getattr(model["used"], name)]
        assert all(torch.equal(got[k], want[k]) for k in want)

    # torch 2.9 gets an empty state for each parameter without state; newer torch gets the state dict unchanged.
    old = _torch_compat.optimizer_state_to_load(saved, version="2.9.1+cu128")
    assert old["state"]["unused.weight"] == {} and old["state"]["unused.bias"] == {}
    assert (
        old["state"]["used.weight"] is saved["state"]["used.weight"]
        and old["param_groups"] is saved["param_groups"]
    )
    assert _torch_compat.optimizer_state_to_load(saved, version="2.10.0") is saved
    empty = {
        "state": {},
        "param_groups": saved["param_groups"],
    }  # before the first step: 2.9 loads it as it is
    assert _torch_compat.optimizer_state_to_load(empty, version="2.9.1") is empty


def test_share_fsdp2_comm_ctx(monkeypatch):
    from torch.distributed import fsdp

    # The real call, on FSDP2 roots of 2 ranks, is tests/strategies/test_fsdp2_shared_context.py.
    calls = []
    monkeypatch.setattr(fsdp, "share_comm_ctx", calls.append, raising=False)
    assert _torch_compat.share_fsdp2_comm_ctx(["a", "b"]) is True and calls == [["a", "b"]]
    monkeypatch.delattr(fsdp, "share_comm_ctx")
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    assert (
        _torch_compat.share_fsdp2_comm_ctx(["a", "b"]) is False
    )  # 2.9 never had it: each root keeps its own
    monkeypatch.setattr(torch, "__version__", "2.14.1")
    with pytest.raises(TorchAPIMissing, match="share_comm_ctx"):
        _torch_compat.share_fsdp2_comm_ctx(["a", "b"])


def _fsdp_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    out = {}
    default = fully_shard(torch.nn.Linear(3, 4))
    explicit = fully_shard(torch.nn.Linear(3, 4), reshard_after_forward=True)
    out["auto_default"] = _torch_compat.fsdp2_auto_reshard_after_forward(default)
    out["auto_explicit"] = _torch_compat.fsdp2_auto_reshard_after_forward(explicit)
    linear = torch.nn.Linear(3, 4)
    original = linear.weight
    fully_shard(linear)
    out["marked"] = [
        _torch_compat.fsdp2_replaced_by_fully_shard(original),
        _torch_compat.fsdp2_replaced_by_fully_shard(torch.nn.Parameter(torch.ones(2))),
    ]
    # One original parameter sharded by two units (a tie across units): both units report its one id.
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    second.weight = first.weight
    fully_shard(first)
    fully_shard(second)
    originals = [_torch_compat.fsdp2_unit_originals(u) for u in (first, second)]
    out["originals"] = [
        [(m is u, name) for m, name, _ in got] for u, got in zip((first, second), originals, strict=True)
    ]
    out["same_uid"] = [originals[0][0][2] == originals[1][0][2], originals[0][1][2] == originals[1][1][2]]
    out["numels"] = _torch_compat.fsdp1_flat_param_numels(
        FSDP(torch.nn.Linear(3, 4), device_id=cpu, use_orig_params=True)
    )
    flat_unit = FSDP(torch.nn.Linear(3, 4), device_id=cpu, use_orig_params=True)
    out["originals1"] = [tuple(p.shape) for p in _torch_compat.fsdp1_flat_param_originals(flat_unit)]
    out["flat"] = [t.numel() for t in _torch_compat.fsdp1_flat_params(torch.nn.Sequential(flat_unit))]
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = fully_shard(torch.nn.Linear(3, 4), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out["param_dtype"] = [_torch_compat.fsdp2_param_dtype(u) for u in (bf16, default)]
    out["no_params"] = _torch_compat.fsdp1_flat_param_numels(
        FSDP(torch.nn.ReLU(), device_id=cpu, use_orig_params=True)
    )
    for name, fn in (
        ("fsdp2_missing", _torch_compat.fsdp2_auto_reshard_after_forward),
        ("fsdp2_dtype_missing", _torch_compat.fsdp2_param_dtype),
        ("fsdp1_missing", _torch_compat.fsdp1_flat_param_numels),
        ("fsdp1_originals_missing", _torch_compat.fsdp1_flat_param_originals),
        ("fsdp2_originals_missing", _torch_compat.fsdp2_unit_originals),
    ):
        try:
            fn(torch.nn.Linear(1, 1))
            out[name] = None
        except TorchAPIMissing as exc:
            out[name] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_fsdp_private_state():
    (got,) = run_ranks(_fsdp_body, 1, timeout=100)
    assert got["auto_default"] is True and got["auto_explicit"] is False
    assert got["numels"] == [12, 4] and got["no_params"] is None
    assert got["flat"] == [16] and got["param_dtype"] == [torch.bfloat16, None]
    assert "_mp_policy" in got["fsdp2_dtype_missing"]
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    # FSDP2 marks the parameters it replaced (torch 2.13; 2.9 does not, and there nothing can be told).
    marks = hasattr(_fsdp_param, "_get_orig_param_uid")
    assert got["marked"] == ([True, False] if marks else [None, None])
    assert "_auto_reshard_after_forward" in got["fsdp2_missing"]
    assert "_flat_param" in got["fsdp1_missing"]
    assert "_get_fsdp_state" in got["fsdp2_originals_missing"]
    assert got["originals1"] == [(4, 3), (4,)] and "_flat_param" in got["fsdp1_originals_missing"]
    if marks:  # the ids that tell a tie across units (weight: one id in both; bias: each its own)
        assert got["originals"] == [[(True, "weight"), (True, "bias")]] * 2
        assert got["same_uid"] == [True, False]


def _local_shape_and_offset_body(rank: int, world_size: int) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for rows in (5, 1):  # uneven, and a rank left with nothing
        dt = distribute_tensor(torch.arange(rows * 3.0).reshape(rows, 3), mesh, [Shard(0)])
        shape, offset = _torch_compat.local_shape_and_offset(dt)
        assert shape == tuple(dt.to_local().shape)
        out.append((shape, offset))
    return out


def test_local_shape_and_offset(monkeypatch):
    results = run_ranks(_local_shape_and_offset_body, 2)
    assert results == [[((3, 3), (0, 0)), ((1, 3), (0, 0))], [((2, 3), (3, 0)), ((0, 3), (1, 0))]]
    import torch.distributed.tensor._utils as utils

    monkeypatch.delattr(utils, "compute_local_shape_and_global_offset")
    with pytest.raises(TorchAPIMissing, match="compute_local_shape_and_global_offset"):
        _torch_compat.local_shape_and_offset(object())


def test_launch_config_shutdown_timeout_only_where_torch_has_it(monkeypatch):
    import dataclasses

    import torch.distributed.launcher.api as launcher_api

    base = dict(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="x", rdzv_backend="static")
    config = _torch_compat.launch_config(**base, shutdown_timeout=7)
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(launcher_api.LaunchConfig)}:
        assert config.shutdown_timeout == 7
    assert config.nproc_per_node == 2

    @dataclasses.dataclass
    class OldLaunchConfig:  # torch 2.9's LaunchConfig has no shutdown_timeout
        min_nodes: int
        max_nodes: int
        nproc_per_node: int
        run_id: str = ""
        rdzv_backend: str = "etcd"

    monkeypatch.setattr(launcher_api, "LaunchConfig", OldLaunchConfig)
    old = _torch_compat.launch_config(**base, shutdown_timeout=7)
    assert old.nproc_per_node == 2 and not hasattr(old, "shutdown_timeout")
    with pytest.raises(TypeError, match="no_such_option"):
        _torch_compat.launch_config(**base, no_such_option=1)


def test_compiled_parts():
    model = torch.nn.Linear(2, 2)
    assert _torch_compat.compiled_parts(model) is None
    compiled = torch.compile(model, backend="eager")
    original, compile_like = _torch_compat.compiled_parts(compiled)
    assert original is model
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    again = compile_like(other)
    assert (
        type(again) is type(compiled) and again._orig_mod is other and again.dynamo_ctx is compiled.dynamo_ctx
    )


def test_dcp_stager_reusable_is_what_a_stager_does():
    """torch 2.11's DefaultStager closes itself after each stage (torchloom then makes one per async save); 2.9,
    2.13 and 2.14 stage again with the same one (kept between saves: no new staging buffers)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = []
    try:
        for value in (1.0, 2.0):
            staged.append(stager.stage({"x": torch.full((2,), value)}))
    except KeyError:
        pass
    finally:
        stager.close()
    assert _torch_compat.dcp_stager_reusable() is (len(staged) == 2)
    assert torch.equal(staged[0]["x"], torch.ones(2))  # the first stage works on every version


def test_clear_dtensor_caches(monkeypatch):
    import torch.distributed.tensor  # noqa: F401 - the caches exist once DTensor is imported
    import torch.distributed.tensor.debug as debug
    from torch.distributed.tensor import DTensor

    _torch_compat.clear_dtensor_caches()
    assert DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize == 0
    monkeypatch.delattr(debug, "_clear_sharding_prop_cache")
    with pytest.raises(TorchAPIMissing, match="_clear_sharding_prop_cache"):
        _torch_compat.clear_dtensor_caches()


def test_planning_apis():
    # The planner's private APIs (the fake process group is exercised by tests/planning/test_plan.py).
    with _torch_compat.fake_tensor_mode():
        fake = torch.empty(4)
        with _torch_compat.unset_fake_temporarily():
            real = torch.empty(4)
    assert _torch_compat.is_fake(fake) and not _torch_compat.is_fake(real)
    tracker = _torch_compat.module_tracker()
    with tracker:
        assert "Global" in tracker.parents
    assert callable(_torch_compat.storage_resize())
