"""`ModelParallelStrategy`: the user's own parallelism (tensor parallel with FSDP2) on a named device mesh, in
Fabric's spelling, with torchloom's guarantees in 2-D.

The user's `parallelize_fn(model, device_mesh)` applies `parallelize_module` over `device_mesh["tensor_parallel"]`
and `fully_shard` over `device_mesh["data_parallel"]`; torchloom calls it in `setup_module` and then treats the
result as "fsdp2" treats hand-made units: parameters left plain (embeddings, head, norms) are kept identical on
every rank and their gradients averaged, the gradient norm is the global one, and data is split over the
data-parallel ranks only (the ranks of one tensor-parallel group read the same batch).
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchloom import _run_protocol, diagnostics
from torchloom._layout import Layout, unit_flavour
from torchloom._text import count
from torchloom.errors import ConfigurationError, MisuseError, MisuseTypeError, MisuseValueError
from torchloom.strategies._replicated import broadcast_tensors
from torchloom.strategies._tp_leftovers import TensorParallelLeftovers
from torchloom.strategies.fsdp2 import FSDP2Strategy

DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
REPLICATE = "data_parallel_replicate"
SHARD = "data_parallel_shard"


def _size(value: Any, what: str) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ConfigurationError(
        f"ModelParallelStrategy({what}={value!r}): {what} must be a positive int or 'auto', got "
        f"{type(value).__name__}."
    )


class ModelParallelStrategy(FSDP2Strategy):
    """Tensor parallelism with FSDP2 (2-D parallelism), applied by your own function to a named device mesh.

    Args:
        parallelize_fn: `fn(model, device_mesh) -> model`, called in `setup_module` after `loom.launch()`. It
            applies `parallelize_module(..., device_mesh["tensor_parallel"], plan)` and
            `fully_shard(..., mesh=device_mesh["data_parallel"])` (pass `**strategy.unit_kwargs()` to
            `fully_shard` to get torchloom's mixed-precision policy and the right mesh) and must return the model.
        data_parallel_size: ranks that read different data; "auto": the number of nodes.
        tensor_parallel_size: ranks that split each layer; "auto": the processes per node. The product of the
            two must be the world size.
        save_distributed_checkpoint: True: each rank writes its shard (a directory); False: rank 0 writes one
            file with the full state.
        process_group_backend: see `ParallelStrategy`.
        timeout: see `ParallelStrategy`.
        data_parallel_replicate_size: torchloom's addition for HSDP: split the data-parallel ranks into
            `replicate x shard`; the mesh then also has the dims "data_parallel_replicate" and
            "data_parallel_shard" (shard with `fully_shard(mesh=device_mesh["data_parallel_replicate",
            "data_parallel_shard"])`); "data_parallel" is their flattening.
        forward_sync_buffers: torchloom's addition: the buffers of modules outside every unit (a BatchNorm's
            running statistics) take rank 0's values before each forward, as under DDP (default), or False: each
            rank keeps its own (see `ShardedStrategy`).

    Parameters that `parallelize_fn` leaves plain (not DTensors) are replicated: identical on every rank (rank 0's
    values at setup) with gradients averaged after each synchronising backward.
    """

    name = "model_parallel"

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module],
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        *,
        data_parallel_replicate_size: int = 1,
        forward_sync_buffers: bool = True,
    ) -> None:
        if not callable(parallelize_fn):
            raise ConfigurationError(
                f"ModelParallelStrategy(parallelize_fn={parallelize_fn!r}): parallelize_fn must be a function "
                "(model, device_mesh) -> model that applies your tensor-parallel plan and fully_shard."
            )
        if not isinstance(data_parallel_replicate_size, int) or data_parallel_replicate_size < 1:
            raise ConfigurationError(
                f"ModelParallelStrategy(data_parallel_replicate_size={data_parallel_replicate_size!r}) must be a "
                "positive int (1: no replication, plain FSDP over the data-parallel ranks)."
            )
        super().__init__(
            state_dict_type="sharded" if save_distributed_checkpoint else "full",
            timeout=timeout,
            process_group_backend=process_group_backend,
            forward_sync_buffers=forward_sync_buffers,
        )
        self.parallelize_fn = parallelize_fn
        self._data_parallel_option = _size(data_parallel_size, "data_parallel_size")
        self._tensor_parallel_option = _size(tensor_parallel_size, "tensor_parallel_size")
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.save_distributed_checkpoint = bool(save_distributed_checkpoint)
        self._leftover_dp_group: dist.ProcessGroup | None = None

    # ---- sizes and the mesh ------------------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """The number of ranks that read different data (Fabric's "auto": the number of nodes)."""
        option = self._data_parallel_option
        return self.num_nodes if option == "auto" else int(option)

    @property
    def tensor_parallel_size(self) -> int:
        """The number of ranks that split each layer (Fabric's "auto": the processes per node)."""
        option = self._tensor_parallel_option
        return self.world_size // self.num_nodes if option == "auto" else int(option)

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh's dims and sizes, outermost first."""
        dp, tp, rep = self.data_parallel_size, self.tensor_parallel_size, self.data_parallel_replicate_size
        if rep > 1:
            return {REPLICATE: rep, SHARD: dp // rep, TENSOR_PARALLEL: tp}
        return {DATA_PARALLEL: dp, TENSOR_PARALLEL: tp}

    def validate(self) -> None:
        super().validate()
        dp, tp, world = self.data_parallel_size, self.tensor_parallel_size, self.world_size
        given = (
            f"data_parallel_size={self._data_parallel_option!r}, "
            f"tensor_parallel_size={self._tensor_parallel_option!r}"
        )
        if dp * tp != world:
            fix = (
                f"tensor_parallel_size={world // dp}"
                if world % dp == 0
                else f"data_parallel_size=1, tensor_parallel_size={world}"
            )
            raise ConfigurationError(
                f"ModelParallelStrategy({given}) makes a mesh of {dp} x {tp} = {dp * tp} ranks, but this job has "
                f"{count(world, 'process')} on {count(self.num_nodes, 'node')}. data_parallel_size x "
                f"tensor_parallel_size must equal the world size (devices x num_nodes): e.g. {fix}. Where the "
                "node count can change between attempts (an elastic job), leave data_parallel_size='auto' (the "
                "number of nodes) and set tensor_parallel_size to the processes per node."
            )
        rep = self.data_parallel_replicate_size
        if dp % rep:
            raise ConfigurationError(
                f"ModelParallelStrategy(data_parallel_replicate_size={rep}) must divide data_parallel_size={dp}: "
                "the data-parallel ranks are split into replicate x shard groups."
            )

    def setup_environment(self) -> None:
        # The launching process checked the mesh against the world it expected; a rank learns the world of its
        # attempt only now (an elastic agent may have started it on another number of nodes). Checked again on
        # every rank, before joining the group, so each one fails with the same clear error instead of inside
        # init_device_mesh, or hanging in a collective of a mesh that does not fit.
        self.validate()
        super().setup_environment()

    def start_diagnostics(self) -> None:
        super().start_diagnostics()
        # The desync report places each rank on the mesh: a hang inside one tensor-parallel group shows as such.
        shape = self.mesh_shape
        diagnostics.RECORD.mesh = (tuple(shape), tuple(shape.values()))

    def teardown(self) -> None:
        diagnostics.RECORD.mesh = None
        self._leftover_dp_group = None  # destroyed with the process group
        super().teardown()

    @property
    def device_mesh(self) -> DeviceMesh:
        """The named mesh `parallelize_fn` gets: dims ("data_parallel", "tensor_parallel"); with
        `data_parallel_replicate_size > 1` ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")
        with "data_parallel" their flattening. Made on first use, after `loom.launch()`."""
        if self._mesh is None:
            self._require_group("the 'model_parallel' device mesh")
            shape = self.mesh_shape
            mesh = init_device_mesh(self.root_device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
            if REPLICATE in shape:
                mesh[(REPLICATE, SHARD)]._flatten(DATA_PARALLEL)
            self._mesh = mesh
        return self._mesh

    def unit_kwargs(self, mesh: DeviceMesh | None = None) -> dict[str, Any]:
        """What to pass to `fully_shard` in your `parallelize_fn` so the units match torchloom's configuration
        (mixed-precision policy from `Loom(precision=...)`, the data-parallel mesh: the ("data_parallel_replicate",
        "data_parallel_shard") sub-mesh under HSDP)."""
        if mesh is None:
            mesh = self.device_mesh
            mesh = mesh[(REPLICATE, SHARD)] if self.data_parallel_replicate_size > 1 else mesh[DATA_PARALLEL]
        return super().unit_kwargs(mesh)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Data is split over the data-parallel ranks only: the ranks of one tensor-parallel group read the same
        samples."""
        mesh = self.device_mesh[DATA_PARALLEL]
        split = {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}
        return _run_protocol.split_over_replica_groups(split)  # under replica groups: over the groups' too

    # ---- setup -------------------------------------------------------------------------------------------------
    _wraps_model_without_units = False

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> nn.Module:
        if not move_to_device:
            raise MisuseError(
                "setup_module(move_to_device=False) cannot be honoured with ModelParallelStrategy: sharding puts "
                "each rank's shards on its device. Leave move_to_device=True."
            )
        self._require_group("setup_module with ModelParallelStrategy")
        if any(unit_flavour(m) == "fsdp" for m in module.modules()):
            raise MisuseError(
                "The model holds FullyShardedDataParallel (FSDP1) units; ModelParallelStrategy shards with "
                "fully_shard (FSDP2) in your parallelize_fn. Remove the FSDP1 wrapping."
            )
        # Every rank starts from rank 0's values, so that the shards parallelize_fn cuts fit together (as the
        # "fsdp2" strategy does for a model without hand-made units). Meta tensors are initialised later.
        broadcast_tensors(
            [t for t in (*module.parameters(), *module.buffers()) if _is_plain(t)], device=self.root_device
        )
        result = self._call_parallelize_fn(module)
        if not isinstance(result, nn.Module):
            raise MisuseError(
                f"parallelize_fn {getattr(self.parallelize_fn, '__name__', self.parallelize_fn)!r} returned "
                f"{type(result).__name__}, not the model: it must end with `return model` (the module it "
                "parallelized)."
            )
        self._check_meshes(result)
        _explain_checkpoint_then_compile(result)
        return super().setup_module(result, move_to_device)

    def _call_parallelize_fn(self, module: nn.Module) -> nn.Module:
        """Run the user's `parallelize_fn`, turning what torch reports there in its own terms (an invariant deep in
        `fully_shard`, a plan entry skipped with a warning) into errors that name the module and the fix."""
        fn_name = getattr(self.parallelize_fn, "__name__", repr(self.parallelize_fn))
        with warnings.catch_warnings(record=True) as caught:
            # Shown every time: torch's own registry would hide the second Loom's skipped entry.
            warnings.filterwarnings("always", message=_PLAN_KEY_WARNING.pattern, category=UserWarning)
            failure: Exception | None = None
            try:
                result = self.parallelize_fn(module, self.device_mesh)
            except Exception as error:
                failure = error
        # Outside the recording context, so that the other warnings reach the caller's own handler.
        skipped = _show_other_warnings(caught)
        if failure is not None:
            explained = self._explain_fully_shard_failure(failure, module, fn_name)
            if explained is None:
                raise failure
            raise explained from failure
        if skipped:
            entries = "; ".join(
                f"key {key!r}: no child matching {token!r} in {_module_summary(module, where)}"
                for key, token, where in skipped
            )
            raise MisuseValueError(
                f"parallelize_fn {fn_name!r}: parallelize_module's plan has entries that match no submodule "
                f"({entries}). torch skips such an entry with a warning, which leaves the layer you meant "
                "unsharded: it would be trained as a plain replicated layer. A plan key is a dotted path from "
                "the module passed to parallelize_module (e.g. 'mlp.up' for model.mlp.up; '*' matches any "
                "child name): fix the key, or drop the entry."
            )
        return result

    def _explain_fully_shard_failure(
        self, error: Exception, root: nn.Module, fn_name: str
    ) -> Exception | None:
        """An error for a `fully_shard` call inside `parallelize_fn` that failed on a mesh other than the
        data-parallel one, naming the module and the mesh to use; None for any other failure (re-raised as is)."""
        call = _innermost_fully_shard_call(error)
        if call is None:
            return None
        target, mesh = call
        ours = self.device_mesh
        data_dims = {DATA_PARALLEL, REPLICATE, SHARD}
        names = mesh.mesh_dim_names if mesh is not None else None
        if mesh is not None and names and set(names) <= data_dims and _sliced_from(mesh, ours):
            return None  # the right mesh: torch failed for another reason, which its own message explains
        where = _module_names(root, target)
        dims = ", ".join(f"{d} ({n})" for d, n in self.mesh_shape.items())
        fix = (
            f"shard it over the data-parallel ranks only: fully_shard({where.split(',')[0]}, "
            "mesh=device_mesh['data_parallel']), or fully_shard(..., **loom.strategy.unit_kwargs()), which also "
            "passes torchloom's mixed-precision policy"
        )
        if mesh is None or names is None:
            problem = (
                f"ran with fully_shard's default mesh (a 1-D mesh over all {count(self.world_size, 'rank')}), "
                f"not one sliced from the strategy's device mesh [{dims}]"
            )
        elif not _sliced_from(mesh, ours):
            problem = (
                f"ran on a device mesh {mesh} that is not sliced from the strategy's [{dims}]: its process "
                "groups are unknown to torchloom's clipping, checkpoints and data split"
            )
        else:
            problem = (
                f"ran on the mesh dims {list(names)}, which overlap the tensor-parallel dim its parameters are "
                "already sharded on"
            )
        message = (
            f"parallelize_fn {fn_name!r}: fully_shard({where}) failed: it {problem}. For a module that "
            f"parallelize_module made tensor-parallel (over device_mesh['tensor_parallel']), {fix}. "
            f"(torch's error: {type(error).__name__}: {error})"
        )
        return _misuse_like(error)(message)

    def _check_meshes(self, module: nn.Module) -> None:
        """DTensor parameters must live on this strategy's mesh (or a slice of it): a mesh made elsewhere has
        process groups torchloom does not know, so clipping, checkpoints and the data split would not match."""
        from torch.distributed.tensor import DTensor

        ours = self.device_mesh
        for name, p in module.named_parameters():
            if isinstance(p, DTensor) and not _sliced_from(p.device_mesh, ours):
                raise MisuseError(
                    f"Parameter {name!r} is a DTensor on a device mesh {p.device_mesh} that is not the strategy's "
                    f"({ours}) nor a slice of it. Build the plan on the mesh parallelize_fn receives: "
                    "device_mesh['tensor_parallel'] for parallelize_module, device_mesh['data_parallel'] for "
                    "fully_shard."
                )

    def _holds_dtensors(self, module: nn.Module) -> bool:
        from torch.distributed.tensor import DTensor

        # Tensor-parallel layers outside every unit: initialised on full-size tensors, keeping rank 0's values.
        return any(isinstance(p, DTensor) for p in module.parameters(recurse=False))

    def _replicate_leftovers(self, module: nn.Module, layout: Layout) -> None:
        from torch.distributed.tensor import DTensor

        distributed = [name for name, p in layout.leftovers if isinstance(p, DTensor)]
        if distributed and self.data_parallel_size > 1:
            raise MisuseError(
                f"Parameter(s) {distributed[:5]}{' ...' if len(distributed) > 5 else ''} are tensor-parallel "
                f"DTensors outside every fully_shard unit, with data_parallel_size={self.data_parallel_size}: "
                "nothing would average their gradients over the data-parallel ranks. In parallelize_fn, apply "
                "fully_shard(module, mesh=device_mesh['data_parallel']) to a module that holds them (e.g. the "
                "root, last)."
            )
        plain = [(name, p) for name, p in layout.leftovers if not isinstance(p, DTensor)]
        super()._replicate_leftovers(module, replace(layout, leftovers=plain))
        tp = self.tensor_parallel_size
        if tp == 1:
            return  # the data-parallel group is every rank: the mean over all of them is right
        # Sharded by fully_shard over the data-parallel ranks only: a copy per tensor-parallel rank.
        unit_params: list[tuple[str, nn.Parameter]] = [
            (name, p)
            for name, p in module.named_parameters()
            if isinstance(p, DTensor) and TENSOR_PARALLEL not in (p.device_mesh.mesh_dim_names or ())
        ]
        if id(module) not in self._grad_syncs and not unit_params:
            return
        # Which reduction each leftover needs depends on what its module sees on the tensor-parallel ranks,
        # known in the first forward (see _tp_leftovers).
        if id(module) in self._grad_syncs:
            self._grad_syncs.pop(id(module)).remove()
        grid = self.device_mesh.mesh.reshape(-1, tp)  # global ranks: (data-parallel replica, tp rank)
        if self._leftover_dp_group is None:
            # Groups of their own (made by every rank for every group), so these all-reduces never interleave
            # with FSDP's collectives over the data-parallel mesh.
            self._leftover_dp_group, _ = dist.new_subgroups_by_enumeration(
                grid.t().tolist(), backend=self.backend
            )
        self._grad_syncs[id(module)] = TensorParallelLeftovers(  # type: ignore[assignment]
            module,
            plain,
            self._leftover_group(),
            self._leftover_dp_group,
            grid,
            self.root_device,
            unit_params,
        )


# The warning parallelize_module gives for a plan key it cannot resolve, before skipping the entry (torch 2.13,
# torch/distributed/tensor/parallel/api.py).
_PLAN_KEY_WARNING = re.compile(
    r"Parallelize plan key '(.*)' could not be resolved: no submodule matching token '(.*)' in module "
    r"(.*), skipping this plan entry",
    re.DOTALL,
)


def _show_other_warnings(caught: list[warnings.WarningMessage]) -> list[tuple[str, ...]]:
    """Show the recorded warnings other than unresolved plan keys as they would have been shown (they already
    passed the caller's filters); return the plan keys' (key, token, module repr), each once."""
    skipped: list[tuple[str, ...]] = []
    for record in caught:
        found = _PLAN_KEY_WARNING.match(str(record.message))
        if found is None:
            warnings.showwarning(
                record.message, record.category, record.filename, record.lineno, record.file, record.line
            )
        elif found.groups() not in skipped:
            skipped.append(found.groups())
    return skipped


def _misuse_like(error: Exception) -> type[MisuseError]:
    """torchloom's misuse error that is also the built-in type torch raised, so `except TypeError` still works."""
    if isinstance(error, TypeError):
        return MisuseTypeError
    if isinstance(error, ValueError):
        return MisuseValueError
    return MisuseError


def _innermost_fully_shard_call(error: BaseException) -> tuple[Any, DeviceMesh | None] | None:
    """(module argument, mesh) of the innermost `fully_shard` frame the error passed through, or None."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "fully_shard" and "fsdp" in frame.f_code.co_filename:
            found = (frame.f_locals.get("module"), frame.f_locals.get("mesh"))
        tb = tb.tb_next
    return found


def _module_names(root: nn.Module, target: Any) -> str:
    """The name(s) of `target` (a module or a list of them) inside `root`, as the user's model spells them."""
    from torchloom._layout import clean_name

    names = {id(m): clean_name(n + ".")[:-1] if n else "<root>" for n, m in root.named_modules()}
    modules = list(target) if isinstance(target, (list, tuple)) else [target]
    return ", ".join(names.get(id(m), f"<a {type(m).__name__}>") for m in modules)


def _module_summary(root: nn.Module, text: str) -> str:
    """Where and what the module is whose repr torch's warning printed: "'mlp' (MLP; children: up, down)"."""
    kind = text.split("(", 1)[0].strip() or text[:40]
    children = re.findall(r"^  \(([^)]+)\):", text, re.M)
    # The warning holds only the module's repr: the modules of that class and repr are where the key was looked up.
    paths = [n or "<root>" for n, m in root.named_modules() if type(m).__name__ == kind and repr(m) == text]
    where = f"{', '.join(repr(p) for p in paths[:3])}{' ...' if len(paths) > 3 else ''} " if paths else ""
    return f"{where}({kind}; children: {', '.join(children) or 'none'})"


class _CompileOrderError(MisuseError, AssertionError):
    """A block checkpoint-wrapped and then compiled failed in torch.compile's AOT autograd (an AssertionError)."""


def _explain_checkpoint_then_compile(root: nn.Module) -> None:
    """Give the blocks that `parallelize_fn` checkpoint-wrapped and then compiled a clear error, should torch fail
    on them. torch 2.13 compiles such a block, but a block whose tensor-parallel plan redistributes inside it (an
    attention block under sequence parallelism) fails in its first training forward with an AssertionError about
    `tensors_saved_with_vc_check` holding a DeviceMesh; the same block compiled first and wrapped second works.
    Blocks that do not hit it (an MLP block) keep training, so only the failure itself is translated."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrappers = sys.modules.get("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    if eval_frame is None or wrappers is None:
        return  # nothing was compiled or checkpoint-wrapped in this process
    from torchloom._layout import clean_name

    for name, mod in root.named_modules():
        where = clean_name(name + ".")[:-1] if name else "<root>"
        if isinstance(mod, eval_frame.OptimizedModule) and isinstance(
            mod._orig_mod, wrappers.CheckpointWrapper
        ):
            mod.forward = _with_order_advice(mod.forward, where)
        elif isinstance(mod, wrappers.CheckpointWrapper) and mod._compiled_call_impl is not None:
            mod._compiled_call_impl = _with_order_advice(mod._compiled_call_impl, where)


def _with_order_advice(call: Callable[..., Any], where: str) -> Callable[..., Any]:
    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except AssertionError as error:
            if "tensors_saved_with_vc_check" not in str(error) or "DeviceMesh" not in str(error):
                raise
            raise _CompileOrderError(
                f"{where!r} was checkpoint-wrapped and then compiled (torch.compile(checkpoint_wrapper(block))), "
                "and torch.compile's AOT autograd cannot save the tensor-parallel plan's device mesh for the "
                "recomputation. Compile first, then wrap: checkpoint_wrapper(torch.compile(block)), in "
                "parallelize_fn after parallelize_module and before fully_shard (docs/model-parallel.md, "
                f"'Activation checkpointing and torch.compile'). (torch's error: {str(error)[:200]})"
            ) from error

    return run


def _is_plain(t: torch.Tensor) -> bool:
    # Not a DTensor (its own pieces are placed by parallelize_fn or were placed by you), not on meta.
    return type(t.data) is torch.Tensor and not t.is_meta


def _sliced_from(mesh: DeviceMesh, root: DeviceMesh) -> bool:
    """Whether `mesh` is `root` or a slice of it: its dims named as root's (or root's flattened "data_parallel")
    and the same ranks in the same places."""
    if mesh is root:
        return True
    names = mesh.mesh_dim_names
    if mesh.device_type != root.device_type or not names:
        return False
    try:
        return torch.equal(root[names].mesh, mesh.mesh)
    except (KeyError, RuntimeError, ValueError):
        return False
