"""What the two FSDP strategies share: respecting the user's units, the replicated leftovers, meta-device
initialisation, the global gradient norm, and gradient-sync control for every layout.

`FSDPStrategy` (fsdp.py) and `FSDP2Strategy` (fsdp2.py) supply the flavour-specific pieces: how a module
becomes a unit, how a unit stops syncing, and how sharded parameters are initialised.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from torchloom._layout import Layout, Unit, analyze, clean_name, describe_layout
from torchloom._text import count
from torchloom.errors import ConfigurationError, MisuseError, warn_user
from torchloom.strategies._replicated import PeerBackwardFailedError, ReplicatedGradSync, broadcast_tensors
from torchloom.strategies.parallel import ParallelStrategy, refuse_options

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

log = logging.getLogger("torchloom")

UNSHARDED_PARAMS = ("replicate", "shard", "error")
STATE_DICT_TYPES = ("sharded", "full")

ModulePolicy = Callable[[nn.Module], bool]


def is_wrap_policy(policy: Any) -> bool:
    """Whether `policy` has FSDP1's auto-wrap form rather than being a predicate `(module) -> bool`: a policy
    object (`ModuleWrapPolicy`, `CustomPolicy`) or a callable taking `(module, recurse, nonwrapped_numel)`, such
    as `functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})` (what Fabric's users pass
    to both `auto_wrap_policy` and `activation_checkpointing_policy`)."""
    wrap = sys.modules.get("torch.distributed.fsdp.wrap")
    if wrap is not None and isinstance(policy, (wrap.ModuleWrapPolicy, wrap.CustomPolicy)):
        return True
    if not callable(policy) or isinstance(policy, type):
        return False
    try:
        params = inspect.signature(policy).parameters
    except (TypeError, ValueError):  # builtins without a signature: call them as predicates
        return False
    if "recurse" in params or "nonwrapped_numel" in params:
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params.values() if p.kind in positional and p.default is inspect.Parameter.empty]
    return len(required) >= 3


def as_module_policy(policy: Any, what: str, wrap_form: bool = False) -> Any:
    """A set of module classes, FSDP's `ModuleWrapPolicy` (what Fabric's users pass), or a callable(module) ->
    bool, as a callable(module) -> bool (None stays None). With `wrap_form`, a policy in FSDP1's auto-wrap form
    (`is_wrap_policy`) is returned as it is, for torch to apply with its own recursion (size-based policies need
    the count of parameters not yet wrapped, which only that recursion knows); without, it is refused."""
    if policy is None:
        return None
    wrap = sys.modules.get("torch.distributed.fsdp.wrap")
    if wrap is not None and isinstance(policy, wrap.ModuleWrapPolicy):
        # Its documented call: (module, recurse, nonwrapped_numel); recurse=False asks "is this one of them?".
        return lambda module: policy(module, False, -1)
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise ConfigurationError(
                f"{what} must be a set of nn.Module classes or a callable, got {policy!r}."
            )
        return lambda module: isinstance(module, classes)
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return lambda module: isinstance(module, policy)
    if is_wrap_policy(policy):
        if wrap_form:
            return policy
        raise ConfigurationError(
            f"{what}={policy!r} is an FSDP1 auto-wrap policy (module, recurse, nonwrapped_numel), which {what} "
            "does not take: pass the set of your block classes (e.g. {Block}) or a callable(module) -> bool."
        )
    if callable(policy):
        return policy
    raise ConfigurationError(f"{what} must be a set of nn.Module classes or a callable, got {policy!r}.")


# Initialisers found for modules without a reset_parameters of their own (see `meta_modules`).
_ANCESTOR_INIT: weakref.WeakKeyDictionary[nn.Module, Callable[[], None]] = weakref.WeakKeyDictionary()
# Meta parameter -> the real one made for it, so that a parameter shared by two modules (tied embeddings) is
# allocated once and stays shared; module-by-module materialisation would otherwise untie it. (Keyed by identity:
# tensors compare by value.)
_MATERIALIZED: Any = WeakIdKeyDictionary()


def _init_fn(module: nn.Module) -> Callable[[], None] | None:
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return _ANCESTOR_INIT.get(module)


def _has_own_state(module: nn.Module, meta_only: bool = True) -> bool:
    tensors = [
        *module.parameters(recurse=False),
        *(b for b in module.buffers(recurse=False) if b is not None),
    ]
    return any(t.is_meta for t in tensors) if meta_only else bool(tensors)


def materialize_meta(
    module: nn.Module, device: torch.device, param_device: torch.device | None = None
) -> None:
    """Allocate `module`'s own meta-device parameters (on `param_device`, default `device`) and buffers (on
    `device`), uninitialised, and leave its real tensors alone (`to_empty` would wipe them). Parameters keep
    their identity: FSDP2 holds on to its sharded DTensors."""
    for name, param in list(module._parameters.items()):
        if param is None or not param.is_meta:
            continue
        if type(param.data) is not torch.Tensor:  # a DTensor: swap, as nn.Module._apply does for subclasses
            empty = nn.Parameter(
                torch.empty_like(param, device=param_device or device), requires_grad=param.requires_grad
            )
            torch.utils.swap_tensors(param, empty)  # in place: every module sharing it sees the real one
        else:
            real = _MATERIALIZED.get(param)
            if real is None:
                real = _MATERIALIZED[param] = nn.Parameter(
                    torch.empty_like(param, device=param_device or device), requires_grad=param.requires_grad
                )
            module._parameters[name] = real  # what to_empty does: a meta tensor cannot take real data
    for name, buf in list(module._buffers.items()):
        if buf is not None and buf.is_meta:
            module._buffers[name] = torch.empty_like(buf, device=device)


def meta_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules whose own parameters/buffers are on the meta device; each must know how to initialise itself."""
    found = [(name, m) for name, m in module.named_modules() if _has_own_state(m)]
    _find_ancestor_inits(module, [m for _, m in found])
    missing = [f"{name or '<root>'} ({type(m).__name__})" for name, m in found if _init_fn(m) is None]
    if missing:
        raise MisuseError(
            "These modules were created on the meta device (init_module(empty_init=True)) but have no "
            f"reset_parameters() to initialise their own parameters: {', '.join(missing)}. Add a "
            "reset_parameters() method to them (or, as Hugging Face models do, an _init_weights(module) method to "
            "the model), or create the model with empty_init=False."
        )
    return found


def _find_ancestor_inits(root: nn.Module, modules: list[nn.Module]) -> None:
    """Hugging Face models initialise their modules from the model: `model._init_weights(module)` (an RMSNorm
    has no reset_parameters). Record that initialiser for each module that has none of its own."""
    needing = {id(m) for m in modules if _init_fn(m) is None}
    if not needing:
        return

    def visit(module: nn.Module, initialiser: Any) -> None:
        own = getattr(module, "_init_weights", None)
        initialiser = own if callable(own) else initialiser
        if id(module) in needing and initialiser is not None:
            _ANCESTOR_INIT[module] = functools.partial(initialiser, module)
        for child in module.children():
            visit(child, initialiser)

    visit(root, None)


class _OptionTypeError(ConfigurationError, TypeError):
    """A strategy option of a type it does not take: a TypeError (as in PyTorch and Fabric) that is also
    torchloom's ConfigurationError."""


def _fsdp_types(*names: str) -> tuple[type, ...]:
    """torch.distributed.fsdp's classes `names`, or () when nobody has imported it: an object of one of them
    cannot exist then, and importing it here would cost a second in the launching process."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return tuple(getattr(fsdp, n) for n in names) if fsdp is not None else ()


def _offload_params(value: Any, accepted: tuple[str, ...], owner: str) -> bool:
    """Whether `cpu_offload=` asks to offload: a bool, FSDP1's `CPUOffload(offload_params=...)`, or (FSDP2's)
    `CPUOffloadPolicy()` (offload) / `OffloadPolicy()` (none)."""
    if isinstance(value, bool):
        return value
    cpu_offload = _fsdp_types("CPUOffload")
    if cpu_offload and isinstance(value, cpu_offload):
        return bool(value.offload_params)
    if "CPUOffloadPolicy" in accepted and (policies := _fsdp_types("CPUOffloadPolicy", "OffloadPolicy")):
        if isinstance(value, policies[0]):
            return True
        if type(value) is policies[1]:
            return False
    names = ", ".join(f"torch.distributed.fsdp.{n}" for n in accepted)
    raise _OptionTypeError(
        f"{owner}(cpu_offload={value!r}): cpu_offload must be a bool or one of {names}, got "
        f"{type(value).__name__}. Pass True/False, or e.g. CPUOffload(offload_params=True)."
    )


def _checkpointing_policy(owner: str, old: Any, policy: Any) -> Any:
    """Fabric's deprecated `activation_checkpointing=` (a module class or a list of them) as a policy."""
    if old is None:
        return policy
    if policy is not None:
        raise ConfigurationError(
            "You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter."
        )
    classes = tuple(old) if isinstance(old, (list, tuple, set, frozenset)) else (old,)
    as_module_policy(set(classes), "activation_checkpointing")  # the same error as the policy for non-classes
    # Fabric's own deprecation message, so that a Fabric user recognises it. FutureWarning: shown by default.
    warnings.warn(
        f"`{owner}(activation_checkpointing={old})` is deprecated, use "
        f"`{owner}(activation_checkpointing_policy={set(classes)})` instead.",
        FutureWarning,
        stacklevel=4,  # the user's call: _checkpointing_policy <- ShardedStrategy <- the flavour's __init__
    )
    return set(classes)


def _mesh_spec(value: Any, owner: str) -> tuple[int, ...] | DeviceMesh | None:
    if value is None or isinstance(value, DeviceMesh):
        return value
    if (
        isinstance(value, (tuple, list))
        and len(value) in (1, 2)
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)
    ):
        return tuple(value)
    raise _OptionTypeError(
        f"{owner}(device_mesh={value!r}): device_mesh must be a tuple (replicate, shard) of positive ints, "
        "e.g. (2, 4) for 2 replicas of 4-way sharding, a tuple (shard,), or a "
        f"torch.distributed.device_mesh.DeviceMesh; got {type(value).__name__}."
    )


def _make_mesh(device_type: str, shape: tuple[int, ...]) -> DeviceMesh:
    """A 1-D mesh ("shard",) or a 2-D mesh ("replicate", "shard") over every rank."""
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


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
        mp_type = _fsdp_types(self._mixed_precision_type)
        if mixed_precision is not None and not (mp_type and isinstance(mixed_precision, mp_type)):
            raise _OptionTypeError(
                f"{owner}(mixed_precision={mixed_precision!r}): mixed_precision must be a "
                f"torch.distributed.fsdp.{self._mixed_precision_type}, got {type(mixed_precision).__name__}. "
                "Or leave it out and choose the precision with Loom(precision=...)."
            )
        self.activation_checkpointing_policy = as_module_policy(
            _checkpointing_policy(owner, activation_checkpointing, activation_checkpointing_policy),
            "activation_checkpointing_policy",
            wrap_form=True,
        )
        self.cpu_offload = _offload_params(cpu_offload, self._offload_types, owner)
        self._cpu_offload_option = cpu_offload
        self.mixed_precision = mixed_precision
        self._mesh_option = _mesh_spec(device_mesh, owner)
        self._mesh: DeviceMesh | None = device_mesh if isinstance(device_mesh, DeviceMesh) else None
        self.state_dict_type = state_dict_type
        self.unsharded_params = unsharded_params
        if not isinstance(forward_sync_buffers, bool):
            raise _OptionTypeError(
                f"{owner}(forward_sync_buffers={forward_sync_buffers!r}) must be True (rank 0's buffers before "
                "each forward, as DDP) or False (each rank keeps its own), got "
                f"{type(forward_sync_buffers).__name__}."
            )
        self.forward_sync_buffers = forward_sync_buffers
        self._buffer_syncs: dict[int, _BufferSync] = {}
        self._unit_options = unit_options
        self._layouts: dict[int, Layout] = {}
        self._unit_runs: dict[int, _UnitRuns] = {}
        self._grad_syncs: dict[int, ReplicatedGradSync] = {}
        self._groups: dict[int, dict[int, dist.ProcessGroup]] = {}
        self._replica_group: dist.ProcessGroup | None = None
        self._flags_group: dist.ProcessGroup | None = None
        self._warned_policy = False

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
        option = self._mesh_option
        if isinstance(option, tuple):
            return option
        if isinstance(option, DeviceMesh):
            return tuple(option.mesh.shape)
        if self._hybrid:
            return (self.num_nodes, self.world_size // self.num_nodes)
        return (self.world_size,)

    def _check_mesh(self) -> None:
        world, nodes = self.world_size, self.num_nodes
        if self._mesh_option is None:
            if self._hybrid and world % nodes:
                raise ConfigurationError(
                    f"Hybrid sharding replicates across the {nodes} nodes and shards within each, so every node "
                    f"needs the same number of processes, but this job has {count(world, 'process')}. Start the same "
                    "number on every node, or pass device_mesh=(replicate, shard) with replicate x shard = "
                    f"{world}."
                )
            return
        shape = self._mesh_shape()
        if math.prod(shape) != world:
            example = f"({nodes}, {world // nodes})" if world % nodes == 0 else f"(1, {world})"
            raise ConfigurationError(
                f"device_mesh={self._mesh_option!r} has {' x '.join(map(str, shape))} = {math.prod(shape)} "
                f"positions, but this job has {count(world, 'process')}. The product must equal the world size "
                f"(devices x num_nodes): e.g. device_mesh={example}."
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
        policy = _fsdp_types(self._mixed_precision_type)[0]
        return policy(param_dtype=self.precision.autocast_dtype, reduce_dtype=torch.float32)

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh's dims and sizes, outermost first (what a checkpoint records of its layout): "shard", with
        "replicate" before it for hybrid sharding; a given DeviceMesh's own dim names where it has them."""
        shape = self._mesh_shape()
        names = self._mesh.mesh_dim_names if self._mesh is not None else None
        if not names or len(names) != len(shape):
            default = (
                ("replicate", "shard") if len(shape) <= 2 else tuple(f"dim{i}" for i in range(len(shape)))
            )
            names = default[-len(shape) :]
        return {str(n): int(k) for n, k in zip(names, shape, strict=True)}

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh units shard over, made on first use (after launch): `device_mesh=` as given (a tuple becomes
        a mesh of that shape), else for hybrid sharding (num_nodes, processes per node), else 1-D."""
        if self._mesh is None:
            self._require_group(f"the {self.name!r} device mesh")
            self._mesh = _make_mesh(self.root_device.type, self._mesh_shape())
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
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._require_group(f"setup_module with strategy={self.name!r}")
        layout = analyze(module)
        self._check_flavours(layout)
        self._check_split_ties(layout)
        self._check_units(layout)
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
        self._place_outside_units(forward_module, layout)
        self._layouts[id(forward_module)] = layout
        self._watch_unit_runs(forward_module, layout)
        self._replicate_leftovers(forward_module, layout)
        # Buffers are never sharded, and FSDP does not keep them in sync: one broadcast at setup does.
        broadcast_tensors([b for b in forward_module.buffers() if b is not None], device=self.root_device)
        self._sync_leftover_buffers(forward_module, layout)
        if self.global_rank == 0:
            log.info("%s", describe_layout(forward_module, self.world_size))
        return forward_module

    def _check_flavours(self, layout: Layout) -> None:
        other = {"fsdp": "fsdp2", "fsdp2": "fsdp"}[self.flavour]
        kinds = {"fsdp": "FullyShardedDataParallel (FSDP1)", "fsdp2": "fully_shard (FSDP2)"}
        if len(layout.flavours) > 1:
            raise MisuseError(
                "The model mixes FullyShardedDataParallel (FSDP1) units and fully_shard (FSDP2) units, which "
                "cannot train together. Shard every unit with one of them."
            )
        if layout.flavours == {other}:
            raise MisuseError(
                f"The model's units were made with {kinds[other]}, but the strategy is {self.name!r}. Use "
                f"strategy={other!r}."
            )

    def _check_units(self, layout: Layout) -> None:
        """Refuse units the user made with options that cannot train correctly (the flavour knows which)."""

    def _check_split_ties(self, layout: Layout, made_by: str = "") -> None:
        """Refuse a tied parameter that a unit boundary splits (`tests/test_hf_models.py` found it with GPT-2's
        tied embeddings and head): FSDP2 silently trains two copies, FSDP1 crashes with a shape error. Also
        one held by two units (the scenario engine found it): FSDP2 trains two copies, FSDP1 aborts the ranks.
        Runs on the user's units before sharding and again on those the policy made (`made_by`)."""
        if layout.ties_across_units:
            first, second = layout.ties_across_units[0]
            users = " and ".join(
                f"module '{_owner_path(name)}' (in unit '{_unit_path(layout, name) or '<root>'}')"
                for name in (first, second)
            )
            fix = (
                "leave both out of the policy, so that the unit of their common parent (the root) shards the "
                "tied weight once"
                if made_by
                else "wrap neither, so that the unit of their common parent shards the tied weight once (the "
                "root: unsharded_params='shard'), or make no unit of either (they stay replicated)"
            )
            raise MisuseError(
                f"Parameters '{first}' and '{second}' are tied (the same tensor) but sit in two different FSDP "
                f"units{' made by ' + made_by if made_by else ''}: {users}. Each unit shards its own copy, "
                "so the tie would be broken: the copies would train apart (fully_shard) or the ranks would "
                f"crash (FullyShardedDataParallel). Keep every module that uses it in one unit: {fix}. Both "
                "strategy='fsdp' and 'fsdp2' need this (torchloom does not take fully_shard([module_a, "
                "module_b]) as one unit)."
            )
        if not layout.split_ties:
            return
        outside, inside = layout.split_ties[0]
        partner = (
            f"'{inside}' inside an FSDP unit" if inside else "a parameter fully_shard() moved into a unit"
        )
        raise MisuseError(
            f"Parameter '{outside}' is outside every FSDP unit but tied to (the same tensor as) {partner}, e.g. "
            "tied input embeddings and output head with only the embedding in a unit. FSDP shards a parameter "
            "only for the modules of its own unit, so the tie would be broken: the copies would train apart "
            "(fully_shard) or the module outside would see a shard (FullyShardedDataParallel). Keep every "
            "module that uses it on one side: make no unit of the shared module (it stays replicated), or a "
            "unit that contains all its users (e.g. the root: unsharded_params='shard')."
        )

    def _apply_activation_checkpointing(self, module: nn.Module) -> None:
        policy = self.activation_checkpointing_policy
        if policy is None:
            return
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointWrapper,
            apply_activation_checkpointing,
        )

        if any(isinstance(m, CheckpointWrapper) for m in module.modules()):
            return  # the user already placed activation checkpointing; do not nest another layer
        if is_wrap_policy(policy):
            apply_activation_checkpointing(module, auto_wrap_policy=policy)
        else:
            apply_activation_checkpointing(module, check_fn=policy)

    def _materialize(self, module: nn.Module, pending: list[tuple[str, nn.Module]]) -> None:
        if not pending:
            return
        unit_owned = {id(m) for u in analyze(module).units for m in u.module.modules()}
        # In the model's own order, runs of modules inside units and outside them, so that rank 0 draws its random
        # numbers in the order a real initialisation draws them (meta init then gives the same values).
        runs: list[tuple[bool, list[tuple[str, nn.Module]]]] = []
        for name, mod in pending:
            distributed = id(mod) in unit_owned or self._holds_dtensors(mod)
            if runs and runs[-1][0] == distributed:
                runs[-1][1].append((name, mod))
            else:
                runs.append((distributed, [(name, mod)]))
        for distributed, modules in runs:
            if distributed:
                self._materialize_units(module, modules)
                continue
            with torch.no_grad():
                for _, mod in modules:
                    # Leftovers are replicated: initialise locally, then _replicate_leftovers broadcasts rank 0's.
                    materialize_meta(mod, self.root_device)
                    _init_fn(mod)()  # type: ignore[misc]

    def _holds_dtensors(self, module: nn.Module) -> bool:
        """Whether `module` outside every unit still holds distributed parameters to initialise like a unit's
        (tensor-parallel layers under "model_parallel"); replicated leftovers are initialised locally."""
        return False

    def _place_outside_units(self, module: nn.Module, layout: Layout) -> None:
        """Move every parameter and buffer outside the units to the device. `fully_shard` and
        `FSDP(device_id=)` move only what their unit owns, so a model built on the CPU and sharded by hand keeps
        its leftovers there, and the broadcasts that follow would fail under NCCL."""
        device = self.root_device
        inside = {id(m) for unit in layout.units for m in unit.module.modules()}
        for mod in module.modules():
            own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
            if id(mod) not in inside and any(not t.is_meta and t.device != device for t in own):
                # nn.Module.to's own conversion, on this module's tensors only: in place where it can be.
                mod._apply(lambda t: t if t.is_meta else t.to(device), recurse=False)

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
        """DDP's `forward_sync_buffers` for the buffers of the modules outside every unit (see `_BufferSync`)."""
        if not self.forward_sync_buffers or self.world_size == 1:
            return
        inside = {id(m) for unit in layout.units for m in unit.module.modules()}
        owners = [m for m in module.modules() if id(m) not in inside and _plain_buffers([m])]
        if owners:
            self._buffer_syncs[id(module)] = _BufferSync(
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
        "fsdp2" units get a gradient. FSDP's reduce-scatters go one per unit, in the order backward reaches them:
        a unit whose forward never ran on a rank (an expert that got no token there) is not reduced there, while
        the ranks that ran it reduce it, so the ranks pair different units; and FSDP2 reduces, per unit, only the
        parameters that have a gradient, so a parameter without one on a single rank shifts the rest. Same-shaped
        pieces (experts) are then summed into each other silently; others crash or hang."""
        if self.world_size == 1:
            return
        nested = [u for u in layout.units if u.module is not module]
        leftovers = {id(p) for _, p in layout.leftovers}
        fsdp2_params = (
            [(clean_name(n), p) for n, p in module.named_parameters() if id(p) not in leftovers]
            if any(u.flavour == "fsdp2" for u in layout.units)
            else []  # FSDP1 reduces each unit's flat parameter whole: a missing gradient is a zero there
        )
        if not nested and not fsdp2_params:
            return
        self._flag_group()  # made now, at setup, where every rank is: new_group is collective
        watch = _UnitRuns([u.path for u in nested], fsdp2_params)
        for i, unit in enumerate(nested):
            unit.module.register_forward_pre_hook(functools.partial(_mark_run, watch, i))
        for i, (_, param) in enumerate(fsdp2_params):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(functools.partial(_mark_grad, watch, i))
        self._unit_runs[id(module)] = watch

    def _flag_group(self) -> dist.ProcessGroup | None:
        """Where the agreement checks meet: a gloo group, so the flags stay in host memory. Over NCCL the flags
        would live on the GPU, and reading the result would wait for the GPU's whole queue (the forward before
        backward starts, the backward before the optimizer step): two stalls per step. None: the training group,
        already gloo."""
        if self._flags_group is None and self.backend != "gloo":
            self._flags_group = dist.new_group(backend="gloo")
        return self._flags_group

    def _agree(self, flags: bytearray, names: list[str]) -> list[str]:
        """The names whose flag is 1 on some ranks and 0 on others (one all-reduce: MAX over [flags, not flags]).
        Vectorised: the flags are read in place, and only the names of mixed flags are looked up, so the cost
        per flag is a few bytes of tensor work, not Python (thousands of flags per backward in MoE models)."""
        if not flags:
            return []
        mine = torch.frombuffer(flags, dtype=torch.uint8)
        both = torch.cat([mine, 1 - mine]).to(torch.int32)  # gloo reduces int32 everywhere
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._flag_group())
        n = len(flags)
        mixed = torch.logical_and(both[:n], both[n:]).nonzero().flatten().tolist()
        return [names[i] for i in mixed]

    def _check_unit_runs(self) -> None:
        """Every rank's units that ran since the last backward must be the same (see `_watch_unit_runs`)."""
        for watch in self._unit_runs.values():
            ran = watch.take()
            if not watch.checking or not ran:
                continue  # inside no_backward_sync this backward reduces nothing
            mixed = self._agree(ran, watch.paths)
            if mixed:
                raise MisuseError(
                    f"The FSDP unit(s) {mixed} ran forward on some ranks and not on others before this backward "
                    "(e.g. an expert that got no tokens on one rank). FSDP reduces the gradients of the units "
                    "that ran, one collective per unit, so the ranks would exchange different units' gradients: "
                    "silently wrong results, or a hang. Call every unit on every rank (an expert with an empty "
                    "batch when no token goes to it), keep the experts in one parameter (as transformers' MoE "
                    "models do), or make no units of them."
                )

    def _check_unit_grads(self) -> None:
        """After a backward that reduced: every rank's "fsdp2" unit parameters that this backward gave a gradient
        must be the same (see `_watch_unit_runs`). The reduction already happened, so this stops the step, not
        the damage."""
        for watch in self._unit_runs.values():
            if not watch.checking or not watch.params:
                continue
            mixed = self._agree(watch.got, watch.names)
            if mixed:
                raise MisuseError(
                    f"Parameter(s) {mixed[:5]}{' ...' if len(mixed) > 5 else ''} of FSDP2 units got a gradient "
                    "on some ranks and not on others in this backward (e.g. an expert inside a unit that got no "
                    "tokens on one rank). fully_shard reduces only the parameters that have a gradient, so the "
                    "ranks reduced different parameters together: these gradients are wrong; do not step. Make "
                    "every parameter get a gradient on every rank (call every expert, with an empty batch when no "
                    "token goes to it), or use strategy='fsdp' (its flat parameters reduce missing gradients as "
                    "zeros) or DDPStrategy(find_unused_parameters=True)."
                )

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
            yield

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        _reduce_pending_grads(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = self._total_norm(module, optimizer, float(norm_type))
        if not torch.isfinite(total):
            # The norm is the same on every rank, so every rank takes the same branch.
            if self.precision.skip_step_for_nonfinite_norm(optimizer):
                return total  # fp16 overflow: the loss scaler skips this step on every rank
            if error_if_nonfinite:
                raise RuntimeError(
                    f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so "
                    "they cannot be clipped. Pass error_if_nonfinite=False to clip anyway."
                )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # One fused multiply per device and dtype (what torch.nn.utils.clip_grads_with_norm_ does), on the local
        # pieces of sharded gradients.
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g
            by_kind.setdefault((local.device, local.dtype), []).append(local)
        with torch.no_grad():
            for (device, dtype), tensors in by_kind.items():
                torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))
        return total

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        """Clamp every gradient element to [-clip_val, clip_val]: elementwise, so each rank clamps its own local
        pieces. torch's `clip_grad_value_` hands sharded (DTensor) and replicated (plain) gradients to one
        foreach kernel, which refuses the mix (found by the scenario engine: FSDP2 units plus replicated
        leftovers in one optimizer). A gradient whose pieces are pending partial sums is reduced first: clamping
        each addend is not clamping their sum."""
        self.precision.unscale_gradients(optimizer)
        _reduce_pending_grads(optimizer)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        local.clamp_(min=-clip_val, max=clip_val)

    def _total_norm(self, module: nn.Module, optimizer: Optimizer, norm_type: float) -> torch.Tensor:
        """The norm of all gradients as if the model were not sharded: each sharded gradient's local pieces are
        combined over its shard group, and replicated gradients (the same on every rank) are counted once.

        Where a gradient's pieces meet is read from the gradient's own placements, which need not be its
        parameter's: tensor parallel leaves e.g. a Replicate gradient on an embedding sharded by rows. Pending
        partial sums must have been reduced (`_reduce_pending_grads`)."""
        groups = self._groups.get(id(module))
        if groups is None:
            # A gradient sharded over several mesh dims (tensor parallel inside FSDP2) has one group per dim: its
            # local norm summed over each in turn is summed over all the ranks that hold a piece of it.
            groups = self._groups[id(module)] = {
                pid: g if isinstance(g, tuple) else (g,) for pid, g in self._shard_groups(module).items()
            }
        # Every rank must issue the same collectives in the same order, even where it holds no gradient: the
        # parameters' groups (the same on every rank) first, then any other group a gradient's placements name
        # (placements are the same on every rank: they come from the same program).
        order = {tuple(map(id, g)): g for g in groups.values()}  # first seen first, in parameter order
        # The local gradient pieces, by where their norms meet: each shard group, or None for the replicated.
        pieces: dict[tuple[int, ...] | None, list[torch.Tensor]] = {None: [], **{k: [] for k in order}}
        split: dict[tuple[int, Any], tuple[dist.ProcessGroup, ...]] = {}  # (mesh, placements) -> groups
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if hasattr(p.grad, "to_local"):
                    layout = (id(p.grad.device_mesh), p.grad.placements)
                    if layout not in split:
                        split[layout] = _split_groups(p.grad)
                    grad, shard_groups = p.grad.to_local(), split[layout]
                else:
                    grad, shard_groups = p.grad, groups.get(id(p))
                if grad.numel() == 0:
                    continue
                key = tuple(map(id, shard_groups)) if shard_groups else None
                if key is not None and key not in order:
                    order[key] = shard_groups
                    pieces[key] = []
                pieces[key].append(grad.detach())
        inf = math.isinf(norm_type)

        def contribution(tensors: list[torch.Tensor]) -> torch.Tensor:
            # torch's own fused per-tensor norms, as clip_grad_norm_ computes them; combined in float64.
            if not tensors:
                return torch.zeros((), dtype=torch.float64, device=self.root_device)
            norm = torch.nn.utils.get_total_norm(tensors, norm_type).to(self.root_device, torch.float64)
            return norm if inf else norm**norm_type

        total = contribution(pieces[None])  # replicated: the same on every rank, counted once
        for ids, shard_groups in order.items():
            value = contribution(pieces[ids])
            for g in shard_groups:
                dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=g)
            total = torch.maximum(total, value) if inf else total + value
        return (total if inf else total ** (1.0 / norm_type)).to(torch.float32)

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
        with self._on_one_device_for_full_load(module, full):
            return super().load_module_state_dict(module, state, strict=strict, full=full)

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool = True
    ) -> None:
        with self._on_one_device_for_full_load(module, full, optimizer):
            super().load_optimizer_state_dict(module, optimizer, state, full=full)

    @contextlib.contextmanager
    def _on_one_device_for_full_load(
        self, module: nn.Module, full: bool, optimizer: Optimizer | None = None
    ) -> Generator[None, None, None]:
        """torch's full-state-dict loading (`set_model_state_dict` / `set_optimizer_state_dict` with
        `full_state_dict=True`) wants every tensor of the model, and of the optimizer's state, on one device: it
        raises "Multiple devices found" / "Device mismatch" otherwise. Under offload (`cpu_offload`, or units made
        with an offload policy of their own) the units' shards live in host memory while the replicated leftovers
        and every buffer stay on the GPU, so every full load (a full checkpoint, `load_raw` of a plain state dict)
        would fail. For the load, move those to host memory too, in
        place (parameters, buffers and optimizer states keep their identity), and back to the GPU afterwards."""
        tensors = [*module.parameters(), *module.buffers()]  # each listed once
        host = torch.device("cpu")
        # torch's own test: tensors with dimensions, off the meta device (a DTensor's device is its shard's).
        devices = {t.device for t in tensors if t.dim() > 0 and not t.is_meta}
        if not full or len(devices) < 2 or host not in devices:
            yield
            return
        # Only what no unit manages: the leftovers (parameters outside every unit) and buffers. A unit's parameters
        # are FSDP's own (FSDP2's DTensors; FSDP1's views into its flat parameter, which a new `.data` would cut
        # loose from it: the unit would go on training its flat parameter while the optimizer steps the copies).
        leftovers = {id(p) for _, p in analyze(module).leftovers}
        params = {id(p) for p in module.parameters()}
        moved = [
            (t, t.device)
            for t in tensors
            if (id(t) in leftovers or id(t) not in params)
            and type(t.data) is torch.Tensor
            and t.device != host
        ]
        moved_ids = {id(t) for t, _ in moved}
        for t, _ in moved:
            t.data = t.data.to(host)
        if optimizer is not None:
            for param, state in optimizer.state.items():
                if id(param) in moved_ids:
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            state[key] = value.to(host)
        try:
            yield
        finally:
            for t, device in moved:
                t.data = t.data.to(device)
            if optimizer is not None:
                _place_state_with_parameters(optimizer, moved_ids)

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _warn(self, message: str) -> None:
        if self.global_rank == 0:
            warn_user(message)


def _owner_path(param_name: str) -> str:
    return param_name.rpartition(".")[0] or "<root>"


def _unit_path(layout: Layout, param_name: str) -> str:
    """The path of the innermost unit around the module that holds `param_name` ("" for a root unit)."""
    module = param_name.rpartition(".")[0]
    paths = [
        u.path for u in layout.units if not u.path or module == u.path or module.startswith(u.path + ".")
    ]
    return max(paths, key=len, default="")


def _plain_buffers(modules: list[nn.Module]) -> tuple[torch.Tensor, ...]:
    """The modules' own buffers that every rank holds whole (not DTensors, not on the meta device)."""
    return tuple(
        b
        for m in modules
        for b in m._buffers.values()
        if b is not None and type(b.data) is torch.Tensor and not b.is_meta and b.numel()
    )


class _BufferSync:
    """DDP's buffer semantics (`forward_sync_buffers=True`) for the modules outside every unit: before a forward
    of the root, their buffers take rank 0's values, if the previous forward computed gradients outside
    `no_backward_sync` (or there was none), as `DistributedDataParallel` decides it. Without it each rank's
    BatchNorm statistics drift apart on its own data, and the ranks evaluate with different models.

    The buffers are looked up at each broadcast (a module may assign new ones) and sent in a few large
    broadcasts. Their version counters are kept, as DDP keeps them: a buffer saved for a backward still to run
    (a BatchNorm in eval mode) takes new values that autograd must not mistake for a modification."""

    def __init__(
        self, root: nn.Module, owners: list[nn.Module], group: dist.ProcessGroup, device: torch.device
    ) -> None:
        self.owners = owners
        self.group = group
        self.device = device
        self.due = True  # DDP's `require_forward_param_sync`: True before the first forward
        self.syncing = True  # False inside no_backward_sync
        self._handles = [
            root.register_forward_pre_hook(self._before_forward),
            root.register_forward_hook(self._after_forward),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self.due:
            return
        buffers = _plain_buffers(self.owners)
        if buffers:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffers):
                broadcast_tensors(buffers, group=self.group, device=self.device, packed=True)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.due = torch.is_grad_enabled() and self.syncing


class _UnitRuns:
    """Which of a model's units ran forward, with gradients, since the last backward ended (one flag per unit),
    and the parameters of its "fsdp2" units (whose gradients must be present on all ranks or none)."""

    def __init__(self, paths: list[str], params: list[tuple[str, nn.Parameter]]) -> None:
        self.paths = paths
        self.params = params
        self.names = [n for n, _ in params]
        #: Which parameters fully_shard wrote a reduced gradient into since `start_backward`. Whether a
        #: gradient exists says nothing about this backward: it survives `zero_grad(set_to_none=False)` and
        #: accumulation from an earlier backward (and a unit's gradients share one version counter).
        #: One byte per flag (set to 1 by the hooks), read as a tensor without a copy by `_agree`.
        self.got = bytearray(len(params))
        self.ran = bytearray(len(paths))
        #: False inside no_backward_sync (nothing is reduced, so nothing to agree on).
        self.checking = True

    def take(self) -> bytearray:
        ran, self.ran = self.ran, bytearray(len(self.paths))
        return ran

    def start_backward(self) -> None:
        self.got = bytearray(len(self.params))


def _mark_run(watch: _UnitRuns, index: int, module: nn.Module, args: Any) -> None:
    # A forward without gradients (evaluation) is never reduced.
    if torch.is_grad_enabled():
        watch.ran[index] = 1


def _mark_grad(watch: _UnitRuns, index: int, param: torch.Tensor) -> None:
    # fully_shard calls a sharded parameter's post-accumulate-grad hooks after writing its reduced gradient.
    watch.got[index] = 1


def _reduce_pending_grads(optimizer: Optimizer) -> None:
    """Reduce every gradient that holds pending partial sums (a DTensor with a `Partial` placement), in place of
    the gradient. Tensor parallel leaves them where a replicated parameter meets sharded activations: the norm
    weights of a `SequenceParallel` plan each see one rank's share of the sequence, so their gradients are the
    sum over the tensor-parallel ranks of what each holds. A norm or a clamp of the local pieces is then wrong.
    The optimizer would reduce them itself (DTensor does, for every torch optimizer): reducing them here, once,
    to the parameter's own placements, gives it the same values."""
    from torch.distributed.tensor import DTensor, Replicate

    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if not isinstance(grad, DTensor) or not any(pl.is_partial() for pl in grad.placements):
                continue
            if (
                isinstance(p, DTensor)
                and p.device_mesh == grad.device_mesh
                and not any(pl.is_partial() for pl in p.placements)
            ):
                placements = p.placements  # e.g. a reduce-scatter straight into a sharded parameter's layout
            else:
                placements = tuple(Replicate() if pl.is_partial() else pl for pl in grad.placements)
            with torch.no_grad():
                p.grad = grad.redistribute(grad.device_mesh, placements)


def _split_groups(grad: Any) -> tuple[dist.ProcessGroup, ...]:
    """The groups of the mesh dims a DTensor gradient's local pieces are split over (anything but Replicate:
    Shard, and the _StridedShard that fully_shard puts over a tensor-parallel Shard), in mesh order."""
    mesh = grad.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(grad.placements) if not pl.is_replicate())


def _place_state_with_parameters(optimizer: Optimizer, param_ids: set[int]) -> None:
    """Put the optimizer state of the parameters `param_ids` where torch's `Optimizer.load_state_dict` puts state:
    on its parameter's device, except the "step" counter, which stays in host memory unless the parameter group
    is capturable or fused."""
    for group in optimizer.param_groups:
        step_follows = bool(group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            if id(param) not in param_ids or param not in optimizer.state:
                continue
            state = optimizer.state[param]
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != param.device:
                    if key != "step" or step_follows:
                        state[key] = value.to(param.device)
