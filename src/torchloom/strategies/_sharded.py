"""What the two FSDP strategies share: the flow of `setup_module` (respecting the user's units, sharding by
policy otherwise, meta-device initialisation, the replicated leftovers), of `backward`, `no_backward_sync`,
clipping and full-state-dict loads, for every layout.

`FSDPStrategy` (fsdp.py) and `FSDP2Strategy` (fsdp2.py) supply the flavour-specific pieces: how a module
becomes a unit, how a unit stops syncing, and how sharded parameters are initialised. The concerns the flow calls
into live in modules of their own: option and policy parsing (`_policies`), the mesh (`_mesh`), meta-device
initialisation (`_meta_init`), layout refusals (`_unit_checks`), the hooks on a set-up model (`_unit_watch`), the
cross-rank agreement checks (`_agreement`), gradient norms and clipping (`_clipping`, given the shard groups) and
device moves (`_placement`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from torchloom import _run_protocol
from torchloom._describe import summary
from torchloom._layout import Layout, Unit, analyze
from torchloom._meta_init import PendingModules, materialize, meta_modules
from torchloom.errors import ConfigurationError, MisuseError, warn_user
from torchloom.strategies import _agreement, _clipping
from torchloom.strategies import _mesh as mesh_rules
from torchloom.strategies._placement import on_one_device_for_full_load, place_outside_units
from torchloom.strategies._policies import (
    OptionTypeError,
    apply_activation_checkpointing,
    as_module_policy,
    checkpointing_policy,
    fsdp_types,
    offload_params,
)
from torchloom.strategies._replicated import PeerBackwardFailedError, ReplicatedGradSync, broadcast_tensors
from torchloom.strategies._unit_checks import check_batchnorm_units, check_flavours, check_split_ties
from torchloom.strategies._unit_watch import BufferSync, UnitRuns, leftover_buffer_owners, watch_unit_runs
from torchloom.strategies.parallel import ParallelStrategy, refuse_options

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

log = logging.getLogger("torchloom")

UNSHARDED_PARAMS = ("replicate", "shard", "error")
STATE_DICT_TYPES = ("sharded", "full")


class ShardedStrategy(ParallelStrategy):
    """Base of "fsdp" and "fsdp2": the options both flavours share. See README, section FSDP.

    Args:
        activation_checkpointing_policy: a set of module classes, a `ModuleWrapPolicy`, a callable(module) ->
            bool, or an FSDP1 auto-wrap policy callable `(module, recurse, nonwrapped_numel) -> bool` (e.g.
            `partial(transformer_auto_wrap_policy, ...)`, `CustomPolicy`): matching modules recompute their
            activations in backward.
        activation_checkpointing: Fabric's deprecated spelling: a module class or a list of them (warns).
        cpu_offload: keep sharded parameters (and gradients, optimizer state) in CPU memory (CUDA only): a bool,
            `torch.distributed.fsdp.CPUOffload(offload_params=...)`, or for "fsdp2" also `CPUOffloadPolicy(...)`
            / `OffloadPolicy()`.
        mixed_precision: the units' dtypes, overriding what `Loom(precision=...)` would choose for them:
            `torch.distributed.fsdp.MixedPrecision` ("fsdp") or `MixedPrecisionPolicy` ("fsdp2"). Its
            `param_dtype` must agree with a `precision=` other than "32-true" (checked in `Loom(...)`).
        device_mesh: the mesh units shard over: a tuple (replicate, shard) whose product is the world size
            (hybrid sharding, HSDP), a tuple (shard,), or a DeviceMesh of your own.
        state_dict_type: "sharded" (default) or "full", the checkpoint format `loom.save` writes.
        unsharded_params: what happens to parameters outside every unit: "replicate" (default), "shard", "error".
        forward_sync_buffers: DDP's buffer semantics for the modules outside every unit (a BatchNorm's running
            statistics): True (default, as DDP): before a forward, their buffers take rank 0's values when the
            previous forward computed gradients outside `no_backward_sync` (and before the first); one bucketed
            broadcast, none when there are no such buffers. False: each rank keeps its own after setup (DDP's
            `forward_sync_buffers=False`, `broadcast_buffers=False` before torch 2.13). Buffers are always
            broadcast from rank 0 at setup; buffers inside units are never synchronised (see docs/sharding.md).
        timeout, process_group_backend: see `ParallelStrategy`.
        **unit_options: passed to every unit torchloom makes (see `unit_kwargs`).
    """

    flavour: str = ""
    supports_meta_init = True
    #: Sharding replaces parameters, so optimizers must be created after setup_module.
    replaces_parameters = True
    sharded_gradients = True
    #: Whether a model without units is sharded by the policy (or whole); False: used as it is (its units, if
    #: any, come from the user's own function, as under "model_parallel").
    _wraps_model_without_units = True
    #: Whether activation checkpointing goes on before the units are made (FSDP2) or after (FSDP1).
    _checkpoint_before_sharding = True
    #: torch.distributed.fsdp classes `cpu_offload=` and `mixed_precision=` take, besides a bool.
    _offload_types: tuple[str, ...] = ("CPUOffload",)
    _mixed_precision_type: str = ""
    #: Unit keywords that torchloom sets itself -> what to do instead.
    _owned_unit_options: dict[str, str] = {}

    def __init__(
        self,
        *,
        activation_checkpointing_policy: Any = None,
        activation_checkpointing: Any = None,
        cpu_offload: Any = False,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        state_dict_type: str = "sharded",
        unsharded_params: str = "replicate",
        forward_sync_buffers: bool = True,
        timeout: timedelta | None = None,
        process_group_backend: str | None = None,
        **unit_options: Any,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend)
        owner = type(self).__name__
        refuse_options(owner, unit_options, self._owned_unit_options)
        if unsharded_params not in UNSHARDED_PARAMS:
            raise ConfigurationError(
                f"unsharded_params={unsharded_params!r} is not valid. Choose one of "
                f"{', '.join(repr(v) for v in UNSHARDED_PARAMS)}: 'replicate' keeps parameters outside every FSDP unit "
                "in sync like DDP, 'shard' makes the root a unit, 'error' refuses such parameters."
            )
        if state_dict_type not in STATE_DICT_TYPES:
            raise ConfigurationError(
                f"state_dict_type={state_dict_type!r} is not valid. Choose 'sharded' (a directory, every rank "
                "writes its shard) or 'full' (one file written by rank 0)."
            )
        mp_type = fsdp_types(self._mixed_precision_type)
        if mixed_precision is not None and not (mp_type and isinstance(mixed_precision, mp_type)):
            raise OptionTypeError(
                f"{owner}(mixed_precision={mixed_precision!r}): mixed_precision must be a "
                f"torch.distributed.fsdp.{self._mixed_precision_type}, got {type(mixed_precision).__name__}. "
                "Or leave it out and choose the precision with Loom(precision=...)."
            )
        self.activation_checkpointing_policy = as_module_policy(
            checkpointing_policy(owner, activation_checkpointing, activation_checkpointing_policy),
            "activation_checkpointing_policy",
            wrap_form=True,
        )
        self.cpu_offload = offload_params(cpu_offload, self._offload_types, owner)
        self._cpu_offload_option = cpu_offload
        self.mixed_precision = mixed_precision
        self._mesh_option = mesh_rules.mesh_spec(device_mesh, owner)
        self._mesh: DeviceMesh | None = device_mesh if isinstance(device_mesh, DeviceMesh) else None
        self.state_dict_type = state_dict_type
        self.unsharded_params = unsharded_params
        if not isinstance(forward_sync_buffers, bool):
            raise OptionTypeError(
                f"{owner}(forward_sync_buffers={forward_sync_buffers!r}) must be True (rank 0's buffers before "
                "each forward, as DDP) or False (each rank keeps its own), got "
                f"{type(forward_sync_buffers).__name__}."
            )
        self.forward_sync_buffers = forward_sync_buffers
        self._buffer_syncs: dict[int, BufferSync] = {}
        self._unit_options = unit_options
        self._layouts: dict[int, Layout] = {}
        self._unit_runs: dict[int, UnitRuns] = {}
        self._grad_syncs: dict[int, ReplicatedGradSync] = {}
        self._groups: dict[int, _clipping.NormGroups] = {}
        self._replica_group: dist.ProcessGroup | None = None
        self._flags_group: dist.ProcessGroup | None = None
        self._warned_policy = False
        #: Modules the wrapping policy picked but that were made no unit: each holds part of a tied weight's users.
        self._tie_skipped: list[str] = []

    # In a replica group (torchloom.fault_tolerance), HSDP across the groups: sharded inside a group, each rank's
    # local pieces (shards, replicated leftovers) averaged with the same rank of the other groups after every
    # backward that synchronised inside the group, before any clipping.
    replica_groups_refusal: str | None = None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return _run_protocol.split_over_replica_groups(super().distributed_sampler_kwargs)

    def validate(self) -> None:
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ConfigurationError(
                "cpu_offload=True moves sharded parameters from the GPU to CPU memory, but this job already runs "
                "on the CPU. Remove cpu_offload, or use accelerator='cuda'."
            )
        self._check_mesh()
        self._check_mixed_precision()

    # ---- the mesh and the configuration every unit gets -----------------------------------------------------
    @property
    def _hybrid(self) -> bool:
        """Whether the flavour's own option asks for hybrid sharding (replicate across nodes, shard within)."""
        return False

    def _mesh_shape(self) -> tuple[int, ...]:
        # A given `device_mesh=` fixes the shape by itself: the world is read only when it does not, so the shape
        # of a strategy not yet part of a Loom (no processes) can still be asked (`record.mesh_of`).
        if self._mesh_option is not None:
            return mesh_rules.mesh_shape(self._mesh_option, self._hybrid, num_nodes=1, world_size=1)
        return mesh_rules.mesh_shape(None, self._hybrid, self.num_nodes, self.world_size)

    def _check_mesh(self) -> None:
        mesh_rules.check_mesh(
            self._mesh_option, self._mesh_shape(), self._hybrid, self.world_size, self.num_nodes
        )

    def _check_mixed_precision(self) -> None:
        """An explicit `mixed_precision=` decides the units' dtypes. "32-true" leaves them to it alone; any other
        precision already fixes the dtype forward computes in, and a different `param_dtype` would make the
        units compute in one dtype while Loom converts to another: refused."""
        wanted = getattr(self.mixed_precision, "param_dtype", None)
        precision = self.precision
        compute = precision.autocast_dtype if precision.is_mixed else precision.param_dtype
        if wanted is None or wanted == compute or (compute == torch.float32 and not precision.is_mixed):
            return
        raise ConfigurationError(
            f"mixed_precision={self.mixed_precision!r} asks the units to compute in {wanted}, but "
            f"precision={precision.name!r} computes in {compute}. Make them agree: leave precision at '32-true' "
            f"to let mixed_precision alone choose the units' dtypes, or set param_dtype={compute}."
        )

    def _mixed_precision_for_units(self) -> Any:
        """The user's `mixed_precision`, else what the precision implies for units (None: full precision)."""
        if self.mixed_precision is not None:
            return self.mixed_precision
        if not self.precision.is_mixed:
            return None
        # Half-precision compute, fp32 sharded master weights, gradients reduced in fp32. Autocast (from the
        # precision) still wraps forward, so that fp32 replicated leftovers work with half-precision units.
        policy = fsdp_types(self._mixed_precision_type)[0]
        return policy(param_dtype=self.precision.autocast_dtype, reduce_dtype=torch.float32)

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh's dims and sizes, outermost first (what a checkpoint records of its layout): "shard", with
        "replicate" before it for hybrid sharding; a given DeviceMesh's own dim names where it has them."""
        return mesh_rules.dim_sizes(self._mesh_shape(), self._mesh)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh units shard over, made on first use (after launch): `device_mesh=` as given (a tuple becomes
        a mesh of that shape), else for hybrid sharding (num_nodes, processes per node), else 1-D."""
        if self._mesh is None:
            self._require_group(f"the {self.name!r} device mesh")
            self._mesh = mesh_rules.make_mesh(self.root_device.type, self._mesh_shape())
        return self._mesh

    def unit_kwargs(self, mesh: DeviceMesh | None = None) -> dict[str, Any]:
        """The keyword arguments torchloom gives every unit it makes (`FullyShardedDataParallel(block, **kw)`
        under "fsdp", `fully_shard(block, **kw)` under "fsdp2"): mesh, sharding, mixed precision, offload,
        meta-device initialisation and your extra unit keywords. Pass them to units you make yourself so they
        match: `fully_shard(block, **loom.strategy.unit_kwargs())`. `mesh`: shard over this mesh instead of
        `device_mesh`."""
        return {**self._flavour_unit_kwargs(mesh or self.device_mesh), **self._unit_options}

    def _flavour_unit_kwargs(self, mesh: DeviceMesh) -> dict[str, Any]:
        raise NotImplementedError

    # ---- flavour-specific pieces ------------------------------------------------------------------------------
    @property
    def has_policy(self) -> bool:
        raise NotImplementedError

    def _shard_with_policy(self, module: nn.Module) -> nn.Module:
        """Make units bottom-up as the policy says, then the root; return what forward runs through."""
        raise NotImplementedError

    def _shard_root(self, module: nn.Module, layout: Layout) -> nn.Module:
        """Make the root one more unit (around the user's units); return what forward runs through."""
        raise NotImplementedError

    def _set_unit_sync(self, stack: contextlib.ExitStack, units: list[Unit]) -> None:
        """Inside `stack`, stop `units` (the top-level ones) from reducing gradients."""
        raise NotImplementedError

    def _materialize_units(self, module: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
        """Initialise meta-device modules that are inside units (after the units exist)."""

    def _shard_groups(self, module: nn.Module) -> dict[int, Any]:
        """id(parameter) -> the group over which its gradient is sharded, or a tuple of groups (one per mesh dim
        it is sharded over); absent: replicated."""
        raise NotImplementedError

    # ---- setup -----------------------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> nn.Module:
        """Shard `module` (see the class docstring); each rank's shards go to its device, so
        `move_to_device=False` cannot be honoured and is refused."""
        if not move_to_device:
            raise MisuseError(
                f"setup_module(move_to_device=False) cannot be honoured with strategy {self.name!r}: sharding puts "
                "each rank's shards on its device. Leave move_to_device=True."
            )
        self._require_group(f"setup_module with strategy={self.name!r}")
        layout = analyze(module)
        self._check_flavours(layout)
        self._check_split_ties(layout)
        self._check_units(layout)
        check_batchnorm_units(layout)
        pending_init = meta_modules(module)
        by_policy = False
        if layout.units or not self._wraps_model_without_units:
            # The user chose the units: never wrap the root again, never apply a policy on top.
            if self.has_policy and not self._warned_policy:
                self._warned_policy = True
                self._warn(
                    f"The model already has {len(layout.units)} FSDP unit(s) made by hand, so the configured "
                    "wrapping policy is ignored and the root is not wrapped. Remove the policy to silence this."
                )
            self._apply_activation_checkpointing(module)
            forward_module = module
            if self.unsharded_params == "shard" and layout.leftovers:
                forward_module = self._shard_root(module, layout)
        else:
            if not pending_init:
                # Units shard whatever each rank holds: start every rank from rank 0's weights.
                broadcast_tensors([*module.parameters(), *module.buffers()], device=self.root_device)
            if not self.has_policy:
                self._warn(
                    f"strategy={self.name!r} without a wrapping policy makes the whole model one unit, which saves "
                    "no memory during forward and backward. Pass a policy (e.g. the set of your block classes) or "
                    "shard blocks by hand."
                )
            if self._checkpoint_before_sharding:
                self._apply_activation_checkpointing(module)
            forward_module = self._shard_with_policy(module)
            by_policy = True
            if not self._checkpoint_before_sharding:
                self._apply_activation_checkpointing(forward_module)
        self._materialize(forward_module, pending_init)
        layout = analyze(forward_module)
        if by_policy:
            # Again on the units the policy made: a tie between two of them cannot be seen before
            # (found with an auto_wrap_policy of nn.Linear and nn.Embedding under tied embeddings: FSDP1 left
            # the head's unit empty and the head computed with the embedding's shard; FSDP2 fails at the first
            # forward). Before any forward, so no rank dies in a collective.
            self._check_split_ties(layout, made_by="the wrapping policy")
        check_batchnorm_units(layout)  # a safety net: the units torchloom made give BatchNorms their own
        self._place_outside_units(forward_module, layout)
        self._layouts[id(forward_module)] = layout
        self._watch_unit_runs(forward_module, layout)
        self._replicate_leftovers(forward_module, layout)
        # Buffers are never sharded, and FSDP does not keep them in sync: one broadcast at setup does.
        broadcast_tensors([b for b in forward_module.buffers() if b is not None], device=self.root_device)
        self._sync_leftover_buffers(forward_module, layout)
        if self.global_rank == 0:
            log.info("%s", summary(forward_module, self.world_size, self._tie_skipped))
        if self.replicas is not None:
            self.replicas.add_module(forward_module)
        return forward_module

    def _check_flavours(self, layout: Layout) -> None:
        check_flavours(layout, self.flavour, self.name)

    def _check_units(self, layout: Layout) -> None:
        """Refuse units the user made with options that cannot train correctly (the flavour knows which)."""

    def _check_split_ties(self, layout: Layout, made_by: str = "") -> None:
        check_split_ties(layout, made_by)

    def _apply_activation_checkpointing(self, module: nn.Module) -> None:
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)

    def _materialize(self, module: nn.Module, pending: PendingModules) -> None:
        materialize(module, pending, self.root_device, self._holds_dtensors, self._materialize_units)

    def _holds_dtensors(self, module: nn.Module) -> bool:
        """Whether `module` outside every unit still holds distributed parameters to initialise like a unit's
        (tensor-parallel layers under "model_parallel"); replicated leftovers are initialised locally."""
        return False

    def _place_outside_units(self, module: nn.Module, layout: Layout) -> None:
        """Move every parameter and buffer outside the units to the device. `fully_shard` and
        `FSDP(device_id=)` move only what their unit owns, so a model built on the CPU and sharded by hand keeps
        its leftovers there, and the broadcasts that follow would fail under NCCL."""
        place_outside_units(module, layout, self.root_device)

    def _replicate_leftovers(self, module: nn.Module, layout: Layout) -> None:
        if not layout.leftovers:
            return
        if self.unsharded_params == "error":
            names = ", ".join(name for name, _ in layout.leftovers)
            raise MisuseError(
                f"unsharded_params='error': these parameters are outside every FSDP unit: {names}. Put them in a "
                "unit, or use unsharded_params='replicate' (kept in sync like DDP) or 'shard' (wrap the root)."
            )
        params = [p for _, p in layout.leftovers]
        broadcast_tensors(params, device=self.root_device)
        sync = self._grad_syncs[id(module)] = ReplicatedGradSync(params, self._leftover_group())
        sync.watch_outputs(module)

    def _leftover_group(self) -> dist.ProcessGroup:
        if self._replica_group is None:
            # A group of its own, so the leftovers' collectives never interleave with FSDP's own.
            self._replica_group = dist.new_group(backend=self.backend)
        return self._replica_group

    def _sync_leftover_buffers(self, module: nn.Module, layout: Layout) -> None:
        """DDP's `forward_sync_buffers` for the buffers of the modules outside every unit (see `BufferSync`)."""
        if not self.forward_sync_buffers or self.world_size == 1:
            return
        owners = leftover_buffer_owners(module, layout)
        if owners:
            self._buffer_syncs[id(module)] = BufferSync(
                module, owners, self._leftover_group(), self.root_device
            )

    def teardown(self) -> None:
        for sync in self._grad_syncs.values():
            sync.remove()
        self._grad_syncs.clear()
        for buffers in self._buffer_syncs.values():
            buffers.remove()
        self._buffer_syncs.clear()
        self._flags_group = None  # destroyed with the process group
        super().teardown()

    # ---- training --------------------------------------------------------------------------------------------
    def _layout_of(self, module: nn.Module) -> Layout:
        layout = self._layouts.get(id(module))
        if layout is None:
            raise MisuseError(
                "This module was not set up by this strategy. Pass the module from setup_module."
            )
        return layout

    def _watch_unit_runs(self, module: nn.Module, layout: Layout) -> None:
        """Record which units run forward between two backwards (checked in `backward`), and which parameters of
        "fsdp2" units get a gradient (see `_unit_watch.watch_unit_runs`)."""
        if self.world_size == 1:
            return
        watch = watch_unit_runs(module, layout)
        if watch is not None:
            self._flag_group()  # made now, at setup, where every rank is: new_group is collective
            self._unit_runs[id(module)] = watch

    def _flag_group(self) -> dist.ProcessGroup | None:
        """Where the agreement checks meet: a gloo group, so the flags stay in host memory. Over NCCL the flags
        would live on the GPU, and reading the result would wait for the GPU's whole queue (the forward before
        backward starts, the backward before the optimizer step): two stalls per step. None: the training group,
        already gloo."""
        if self._flags_group is None and self.backend != "gloo":
            self._flags_group = dist.new_group(backend="gloo")
        return self._flags_group

    def _check_unit_runs(self) -> None:
        _agreement.check_unit_runs(self._unit_runs.values(), self._flag_group)

    def _check_unit_grads(self) -> None:
        _agreement.check_unit_grads(self._unit_runs.values(), self._flag_group)

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, **kwargs: Any) -> None:
        self._check_unit_runs()
        for watch in self._unit_runs.values():
            watch.start_backward()
        # Each backward is one round of the leftover gradient sync on every rank, whether or not this rank's
        # backward reaches the leftovers, and whether or not it completes.
        rounds = [sync for sync in self._grad_syncs.values() if sync.enabled]
        for sync in rounds:
            sync.begin()
        try:
            super().backward(tensor, module, **kwargs)
        except BaseException as error:
            for sync in rounds:
                sync.end(error)
            raise
        finally:
            # Activation checkpointing runs units' forwards again inside backward: not the next step's runs.
            for watch in self._unit_runs.values():
                watch.take()
        # End every round before raising, so no round is left open on this rank alone.
        errors = []
        for sync in rounds:
            try:
                sync.end()
            except PeerBackwardFailedError as error:
                errors.append(error)
        if errors:
            raise errors[0]
        self._check_unit_grads()
        if self.replicas is not None and not self._accumulating:
            self.replicas.average_gradients()

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Generator[None, None, None]:
        if not enabled:
            yield
            return
        layout = self._layout_of(module)
        sync = self._grad_syncs.get(id(module))
        watch = self._unit_runs.get(id(module))
        buffers = self._buffer_syncs.get(id(module))
        with contextlib.ExitStack() as stack:
            self._set_unit_sync(stack, layout.top_units)
            if buffers is not None:
                buffers.syncing = False
                stack.callback(setattr, buffers, "syncing", True)
            if watch is not None:
                watch.checking = False
                stack.callback(setattr, watch, "checking", True)
            if sync is not None:
                sync.enabled = False
                stack.callback(setattr, sync, "enabled", True)
            self._accumulating += 1
            stack.callback(setattr, self, "_accumulating", self._accumulating - 1)
            yield

    def _norm_groups(self, module: nn.Module) -> _clipping.NormGroups:
        """The groups each parameter's gradient is sharded over (the flavour's `_shard_groups`), once per model."""
        groups = self._groups.get(id(module))
        if groups is None:
            groups = self._groups[id(module)] = _clipping.NormGroups(
                _clipping.as_shard_groups(self._shard_groups(module))
            )
        return groups

    # ---- state dicts (checkpointing) -------------------------------------------------------------------------
    @property
    def checkpoint_format(self) -> str:  # type: ignore[override]
        return self.state_dict_type

    def _state_dict_options(self, full: bool, loading: bool = False, **kwargs: Any) -> StateDictOptions:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if not full:
            return StateDictOptions(**kwargs)
        # Saving gathers to rank 0 only, in CPU memory, so no other rank holds a full copy; loading reads each
        # rank's shard from the (memory-mapped) full tensors every rank has. FSDP1's offloading path crashes on
        # CPU (the bug that breaks Lightning Fabric's full checkpoints on CPU): there every rank gathers instead.
        offload = not loading and (self.root_device.type != "cpu" or self.flavour == "fsdp2")
        return StateDictOptions(full_state_dict=True, cpu_offload=offload, **kwargs)

    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True, full: bool = True
    ) -> Any:
        with on_one_device_for_full_load(module, full):
            return super().load_module_state_dict(module, state, strict=strict, full=full)

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool = True
    ) -> None:
        # A full state without tensors (SGD without momentum) loads as each rank's own: see `holds_tensors`.
        full = full and holds_tensors(state)
        with on_one_device_for_full_load(module, full, optimizer):
            super().load_optimizer_state_dict(module, optimizer, state, full=full)

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _warn(self, message: str) -> None:
        if self.global_rank == 0:
            warn_user(message)


def holds_tensors(state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict holds a tensor to distribute. torch's full load asks for one, of at least
    one dimension, to learn the device (`Expected device to be set` without); a state of param groups only (SGD
    without momentum) has nothing to distribute, and loads as each rank's own, as under DDP."""
    return any(
        isinstance(v, torch.Tensor) and v.dim() > 0
        for entry in state.get("state", {}).values()
        for v in (entry.values() if isinstance(entry, dict) else ())
    )
