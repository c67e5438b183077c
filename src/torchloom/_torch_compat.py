"""Every private PyTorch API torchloom relies on, in one place, and the lowest torch it supports.

Each accessor checks that its API still exists and fails loudly, naming the torch version, when a torch upgrade
renamed or removed it (never a silent fallback); `tests/test_torch_compat.py` checks each one against the
installed torch. Nothing else in torchloom reaches into torch's private names. Public APIs that only recent
versions have (DCP's `async_stager=`, 2.9) are covered by `MIN_TORCH`; where a supported version lacks one, the
difference is handled here too (`launch_config`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion

#: The lowest torch the test suite passes on; pyproject.toml declares the same.
MIN_TORCH = "2.9"


class TorchAPIMissing(RuntimeError):
    """A private torch API torchloom needs is not there in the installed torch."""


def _missing(what: str) -> TorchAPIMissing:
    return TorchAPIMissing(
        f"torchloom needs {what}, which torch {torch.__version__} does not have (renamed or removed). This torch "
        f"version is not supported yet: install one the README lists as tested (torch>={MIN_TORCH}), or report it."
    )


def check_torch_version(version: str = torch.__version__) -> None:
    if TorchVersion(version) < MIN_TORCH:
        raise ImportError(f"torchloom needs torch>={MIN_TORCH}, but torch {version} is installed.")


check_torch_version()


# ---- flop counting -------------------------------------------------------------------------------------------
def check_flop_counter_count_hook() -> None:
    """`FlopCounterMode._count_flops(func_packet, out, args, kwargs)` and its `flop_registry`: the one place every
    counted op passes, which `torchloom.throughput.count_flops` extends to tell recomputed FLOPs apart."""
    from torch.utils.flop_counter import FlopCounterMode

    if not callable(getattr(FlopCounterMode, "_count_flops", None)) or not hasattr(
        FlopCounterMode(display=False), "flop_registry"
    ):
        raise _missing("torch.utils.flop_counter.FlopCounterMode._count_flops and .flop_registry")


def cuda_memory_history(enabled: bool) -> None:
    """Start (or stop) recording every CUDA allocation with its stack, for `cuda_memory_snapshot`
    (`torch.cuda.memory._record_memory_history`, documented in "Understanding CUDA Memory Usage")."""
    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    if record is None:
        raise _missing("torch.cuda.memory._record_memory_history")
    record(max_entries=100_000) if enabled else record(enabled=None)


def cuda_memory_snapshot(path: str) -> None:
    """Write the recorded allocations to `path` (a pickle https://pytorch.org/memory_viz opens)."""
    dump = getattr(torch.cuda.memory, "_dump_snapshot", None)
    if dump is None:
        raise _missing("torch.cuda.memory._dump_snapshot")
    dump(path)


# ---- autograd ------------------------------------------------------------------------------------------------
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run `callback` once at the end of the current backward pass, after every hook (what DDP's reducer and
    FSDP use). Only valid while a backward pass runs."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        raise _missing("torch.autograd.Variable._execution_engine.queue_callback")
    queue(callback)


def current_graph_task_id() -> int:
    """An id of the backward pass running on this thread (-1 outside one): tells one backward from the next."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    if get is None:
        raise _missing("torch._C._current_graph_task_id")
    return get()


# ---- the elastic agent ----------------------------------------------------------------------------------------
def launch_config(**kwargs: Any) -> Any:
    """`torch.distributed.launcher.api.LaunchConfig(**kwargs)`. `shutdown_timeout` (seconds between SIGTERM and
    SIGKILL when the agent stops the ranks) is a field only of newer torch (not 2.9): there it is left out and
    the agent waits its own fixed 30 s. Every other keyword must exist (a TypeError names it otherwise)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        kwargs.pop("shutdown_timeout", None)
    return LaunchConfig(**kwargs)


# ---- the job's store -----------------------------------------------------------------------------------------
def default_store() -> Any:
    """The key-value store the default process group was made with (None when there is no group)."""
    import torch.distributed as dist

    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise _missing("torch.distributed.distributed_c10d._get_default_store")
    if not dist.is_initialized():
        return None
    return get()


# ---- loss scaling --------------------------------------------------------------------------------------------
def grad_scaler_optimizer_state(scaler: torch.amp.GradScaler, optimizer: Any) -> dict[str, Any]:
    """The scaler's per-optimizer record: {"stage": OptState, "found_inf_per_device": {device: tensor}}."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _missing("GradScaler._per_optimizer_states")
    state = states[id(optimizer)]
    if "stage" not in state or "found_inf_per_device" not in state:
        raise _missing("the 'stage' and 'found_inf_per_device' entries of GradScaler._per_optimizer_states")
    return state


def reset_grad_scaler_optimizer_state(scaler: torch.amp.GradScaler, optimizer: Any) -> None:
    """Forget the scaler's per-optimizer record of this step (as its `update()` does for every optimizer)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _missing("GradScaler._per_optimizer_states")
    states.pop(id(optimizer), None)


def unscale_and_check(tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply `tensors` (one device and dtype) by `inv_scale` in place; set `found_inf` to 1 if any value is
    inf or NaN (GradScaler's own fused kernel)."""
    op = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if op is None:
        raise _missing("torch._amp_foreach_non_finite_check_and_unscale_")
    op(tensors, found_inf, inv_scale)


# ---- FSDP ----------------------------------------------------------------------------------------------------
def fsdp2_auto_reshard_after_forward(unit: Any) -> bool:
    """Whether `fully_shard` left this unit at its default `reshard_after_forward` (None: torch decides; a root
    then keeps its parameters unsharded from forward to backward)."""
    get_state = getattr(unit, "_get_fsdp_state", None)
    state = get_state() if get_state is not None else None
    if state is None or not hasattr(state, "_auto_reshard_after_forward"):
        raise _missing("FSDP2's FSDPState._auto_reshard_after_forward (through FSDPModule._get_fsdp_state())")
    return bool(state._auto_reshard_after_forward)


def fsdp2_param_dtype(unit: Any) -> torch.dtype | None:
    """The dtype an FSDP2 unit's mixed precision computes its parameters in (None: their own). torch keeps the
    policy only on the unit's private state."""
    get_state = getattr(unit, "_get_fsdp_state", None)
    state = get_state() if get_state is not None else None
    if state is None or not hasattr(state, "_mp_policy"):
        raise _missing("FSDP2's FSDPState._mp_policy (through FSDPModule._get_fsdp_state())")
    return state._mp_policy.param_dtype


def fsdp1_flat_params(module: Any) -> list[torch.Tensor]:
    """The flat parameters of every FSDP1 unit in `module` (whose gradients the units' own `.grad` does not
    show)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = FSDP.fsdp_modules(module)
    if any(not hasattr(u, "_flat_param") for u in units):
        raise _missing("FullyShardedDataParallel._flat_param")
    return [u._flat_param for u in units if u._flat_param is not None]


def fsdp1_flat_param_numels(unit: Any) -> list[int] | None:
    """The element counts of the original parameters an FSDP1 unit flattened (None: it manages none)."""
    if not hasattr(unit, "_flat_param"):
        raise _missing("FullyShardedDataParallel._flat_param")
    flat = unit._flat_param
    if flat is None:
        return None
    numels = getattr(flat, "_numels", None)
    if numels is None:
        raise _missing("FlatParameter._numels")
    return [int(n) for n in numels]


def fsdp1_flat_param_originals(unit: Any) -> list[Any]:
    """The original parameters an FSDP1 unit (`use_orig_params=True`) flattened into its one flat parameter."""
    if not hasattr(unit, "_flat_param"):
        raise _missing("FullyShardedDataParallel._flat_param")
    flat = unit._flat_param
    if flat is None:
        return []
    params = getattr(flat, "_params", None)
    if params is None:
        raise _missing("FlatParameter._params (use_orig_params=True)")
    return list(params)


def fsdp2_replaced_by_fully_shard(param: torch.Tensor) -> bool | None:
    """Whether `fully_shard` took `param` into a unit (and gave the unit a sharded copy of it): FSDP2 marks each
    original parameter it shards with `_fsdp_orig_uid`. A model that still holds a marked parameter outside
    every unit had it tied to a unit's parameter, and that tie is now broken. None where this torch's FSDP2
    marks nothing (2.9 does not; 2.13 does), so the caller knows it cannot tell."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    if not hasattr(_fsdp_param, "_get_orig_param_uid"):
        return None
    return hasattr(param, "_fsdp_orig_uid")


def fsdp2_unit_originals(unit: Any) -> list[tuple[Any, str, int]] | None:
    """(module, parameter name, id of the original parameter) for each parameter an FSDP2 unit shards: FSDP2
    gives each original parameter one id (`_fsdp_orig_uid`), the same in every unit that shards it. None where
    this torch's FSDP2 keeps no such id (2.9), so the caller knows it cannot tell."""
    get_state = getattr(unit, "_get_fsdp_state", None)
    if get_state is None:
        raise _missing("FSDPModule._get_fsdp_state")
    group = get_state()._fsdp_param_group
    if group is None:
        return []
    out = []
    for fsdp_param in group.fsdp_params:
        uid = getattr(fsdp_param, "_orig_param_uid", None)
        if uid is None:
            return None
        info = fsdp_param._module_info
        out.append((info.module, info.param_name, uid))
    return out


#: The first torch with `torch.distributed.fsdp.share_comm_ctx` (pytorch/pytorch#165024).
SHARE_COMM_CTX_TORCH = "2.10"


def share_fsdp2_comm_ctx(units: list[Any]) -> bool:
    """Give FSDP2 root units one communication context (`torch.distributed.fsdp.share_comm_ctx`, a public API
    since torch 2.10) and return True; on torch 2.9, which lacks it, leave each its own and return False (the
    roots are still correct; each holds its reduce-scatter input until the end of backward: more memory)."""
    from torch.distributed import fsdp

    share = getattr(fsdp, "share_comm_ctx", None)
    if share is None:
        if TorchVersion(torch.__version__) >= SHARE_COMM_CTX_TORCH:
            raise _missing("torch.distributed.fsdp.share_comm_ctx")
        return False
    share(units)
    return True


# ---- distributed checkpoint ----------------------------------------------------------------------------------
def load_whole_checkpoint(state: dict[str, Any], reader: Any, keys: list[str] | None = None) -> None:
    """Fill `state` with every stored entry (or `keys`) of a DCP checkpoint, whole, in this process and without
    a process group: what torch's own `format_utils.dcp_to_torch_save` does."""
    try:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError:
        raise _missing(
            "torch.distributed.checkpoint's _EmptyStateDictLoadPlanner and state_dict_loader._load_state_dict"
        ) from None
    _load_state_dict(
        state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True
    )


def dcp_metadata_private_globals() -> dict[tuple[str, str], Any]:
    """The private names a DCP `.metadata` file refers to, as (module, name) -> object: the storage record of
    `FileSystemWriter` (`filesystem._StorageInfo`), the memory-format code `TensorProperties` pickles
    (`metadata._MEM_FORMAT_ENCODING`), and the function `torch.layout` pickles through
    (`torch.serialization._get_layout`). torchloom's restricted unpickler admits exactly these and DCP's public
    metadata classes."""
    import torch.serialization
    from torch.distributed.checkpoint import filesystem, metadata

    found = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): getattr(
            filesystem, "_StorageInfo", None
        ),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): getattr(
            metadata, "_MEM_FORMAT_ENCODING", None
        ),
        ("torch.serialization", "_get_layout"): getattr(torch.serialization, "_get_layout", None),
    }
    missing = [".".join(key) for key, value in found.items() if value is None]
    if missing:
        raise _missing(", ".join(missing))
    return found


_STAGER_REUSABLE: list[bool] = []


def dcp_stager_reusable() -> bool:
    """Whether DCP's `DefaultStager` stages more than once. torch 2.11 closes its inner state-dict stager at the
    end of every `stage()` (a memory-leak fix), so the next stage fails (`KeyError: <class 'type'>`: the
    deep-copy table it cleared); 2.9, 2.13 and 2.14 keep it usable. Probed once per process, with a one-tensor
    dict staged twice on the CPU, so versions not read here are answered by what they do."""
    if not _STAGER_REUSABLE:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        try:
            for _ in range(2):
                stager.stage({"probe": torch.zeros(1)})
            _STAGER_REUSABLE.append(True)
        except KeyError:
            _STAGER_REUSABLE.append(False)
        finally:
            stager.close()
    return _STAGER_REUSABLE[0]


#: The first torch whose `set_optimizer_state_dict` loads a state dict with no state for some parameters
#: (`StateDictOptions(strict=False)`); older ones raise KeyError naming the parameter (pytorch/pytorch#165228).
PARTIAL_OPTIMIZER_STATE_TORCH = "2.10"


def optimizer_state_to_load(state: dict[str, Any], version: str = torch.__version__) -> dict[str, Any]:
    """`state`, a name-keyed optimizer state dict, made loadable by this torch's `set_optimizer_state_dict` when
    some of its parameters have no state (they never got a gradient before the save). torch 2.10 and later load
    it as it is. torch 2.9 reads the state of every trainable parameter its groups name, so each one without
    state gets an empty entry, which loads as an empty state; the caller then drops that entry as it drops the
    state newer torch initialises for it. A state dict with no state at all is left alone: 2.9 loads that."""
    if TorchVersion(version) >= PARTIAL_OPTIMIZER_STATE_TORCH:
        return state
    saved, groups = state.get("state"), state.get("param_groups")
    if not isinstance(saved, dict) or not saved or not isinstance(groups, list):
        return state
    names = [name for group in groups if isinstance(group, dict) for name in group.get("params", [])]
    missing = {name: {} for name in names if isinstance(name, str) and name not in saved}
    return {**state, "state": {**saved, **missing}} if missing else state


# ---- DTensor -------------------------------------------------------------------------------------------------
def local_shape_and_offset(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of a DTensor's local piece on this rank and where it starts in the global tensor, as DTensor
    itself computes them (uneven shards included). Loading a checkpoint slice by slice needs exactly this."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        raise _missing("torch.distributed.tensor._utils.compute_local_shape_and_global_offset") from None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def local_indices(tensor: Any) -> tuple[torch.Tensor | None, ...]:
    """For each dimension of DTensor `tensor`: the global indices this rank's local piece holds along it, in the
    local piece's order (None where it holds the whole dimension).

    The piece is the product of these index sets. `local_shape_and_offset` gives only where the piece starts,
    which describes it only when it is one contiguous block; with `_StridedShard` (FSDP2 over tensor parallel
    records it) placed after another split of the same dimension it is not. So the indices come from DTensor's
    own splitting (`Placement._split_tensor`, what `distribute_tensor` does), applied to `arange` of each
    dimension's size, mesh dimension by mesh dimension, left to right: uneven and empty shards included."""
    try:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        raise _missing("torch.distributed.tensor.placement_types._StridedShard") from None
    shape, mesh = tuple(tensor.shape), tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # a mesh without this rank: it holds nothing of the tensor
        return tuple(torch.arange(0) for _ in shape)
    indices: list[torch.Tensor | None] = [None] * len(shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise ValueError(
                f"placement {placement} ({type(placement).__name__}) on mesh dimension {mesh_dim} splits no dimension of the tensor (a partial "
                "sum holds no slice of it); only Shard and Replicate placements hold slices of a full tensor."
            )
        dim = placement.dim
        current = indices[dim] if indices[dim] is not None else torch.arange(shape[dim])
        if not hasattr(placement, "_split_tensor"):
            raise _missing(f"{type(placement).__name__}._split_tensor")
        # Shaped so that `dim` is the split dimension, as the placement expects.
        chunks, _ = placement._split_tensor(
            current.view([1] * dim + [-1]), mesh.size(mesh_dim), with_padding=False
        )
        indices[dim] = chunks[coordinate[mesh_dim]].reshape(-1)
    return tuple(indices)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions (its Python and C++ sharding-propagation caches).

    They hold the device meshes of the DTensors they were computed for, and `DeviceMesh` equality ignores the
    process groups a mesh uses. After the process group is destroyed, a new mesh equal to an old one (same ranks,
    shape and dim names) would get the old mesh back from the cache, naming groups that no longer exist, or that
    are now other groups: a later collective then fails ("Could not resolve the process group"), or runs over
    the wrong ranks. Nothing to do where DTensor was never imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        raise _missing("torch.distributed.tensor.debug._clear_sharding_prop_cache") from None
    _clear_sharding_prop_cache()


# ---- torch.compile -------------------------------------------------------------------------------------------
def compiled_parts(module: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """For a module `torch.compile` returned: (the module it compiled, a function that compiles another module
    the same way: same backend, mode and options). None for any other module.

    A compiled module is an `OptimizedModule` holding the original as `_orig_mod` and its compile context as
    `dynamo_ctx`; calling that context on a module is what `torch.compile` does itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return None  # nothing was compiled in this process
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is None:
        raise _missing("torch._dynamo.eval_frame.OptimizedModule")
    if not isinstance(module, optimized):
        return None
    original, context = getattr(module, "_orig_mod", None), getattr(module, "dynamo_ctx", None)
    if original is None or not callable(context):
        raise _missing("OptimizedModule._orig_mod and OptimizedModule.dynamo_ctx")
    return original, context


# ---- memory planning: fake tensors, the fake process group, the module tracker -------------------------------
def fake_tensor_mode() -> Any:
    """`torch._subclasses.fake_tensor.FakeTensorMode`, taking real tensors in (converted to fake ones): tensors
    with shapes, dtypes and devices but no memory, so a training step runs without computing anything."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        raise _missing("torch._subclasses.fake_tensor.FakeTensorMode") from None
    return FakeTensorMode(allow_non_fake_inputs=True)


def unset_fake_temporarily() -> Any:
    """A context in which the active FakeTensorMode is off (`torch._subclasses.fake_tensor.unset_fake_temporarily`):
    the planner runs the data pipeline's small integer operations (samplers, seeds) for real there."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily as unset
    except ImportError:
        raise _missing("torch._subclasses.fake_tensor.unset_fake_temporarily") from None
    return unset()


def is_fake(tensor: Any) -> bool:
    """Whether `tensor` is one of FakeTensorMode's tensors."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        raise _missing("torch._subclasses.fake_tensor.FakeTensor") from None
    return isinstance(tensor, FakeTensor)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make the default process group torch's fake one (`torch.testing._internal.distributed.fake_pg`): every
    collective returns at once without communicating, so one process plays one rank of a world of any size."""
    import torch.distributed as dist

    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    except ImportError:
        raise _missing("torch.testing._internal.distributed.fake_pg") from None
    if not hasattr(dist.Backend, "FAKE"):
        raise _missing("torch.distributed.Backend.FAKE")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())


def module_tracker() -> Any:
    """`torch.distributed._tools.mod_tracker.ModTracker()`: which modules' forward or backward runs now
    (`parents`, `is_bw`); the planner names the module where memory peaks with it."""
    try:
        from torch.distributed._tools.mod_tracker import ModTracker
    except ImportError:
        raise _missing("torch.distributed._tools.mod_tracker.ModTracker") from None
    tracker = ModTracker()
    if not hasattr(tracker, "parents") or not hasattr(type(tracker), "is_bw"):
        raise _missing("ModTracker.parents and ModTracker.is_bw")
    return tracker


def storage_resize() -> Callable[..., Any]:
    """`torch.UntypedStorage.resize_` as torch defines it: FSDP frees and re-allocates gathered parameters by
    resizing their storages, which no dispatched operation shows, so memory trackers wrap this method."""
    resize = getattr(torch.UntypedStorage, "resize_", None)
    if resize is None:
        raise _missing("torch.UntypedStorage.resize_")
    return resize
