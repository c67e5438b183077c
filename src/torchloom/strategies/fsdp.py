"""strategy="fsdp": PyTorch's FullyShardedDataParallel (FSDP1), on CPU (gloo) and CUDA (nccl).

Units come from the user's `wrap()` calls inside `loom.init_module()`, or else from `auto_wrap_policy`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from torchloom import _torch_compat
from torchloom._layout import Layout, Unit, analyze
from torchloom._meta_init import init_fn, materialize_meta
from torchloom.errors import ConfigurationError, MisuseError
from torchloom.strategies._policies import as_module_policy, is_wrap_policy, skipping, tie_splitters
from torchloom.strategies._replicated import broadcast_tensors
from torchloom.strategies._sharded import ShardedStrategy
from torchloom.strategies._unit_checks import full_precision_batchnorms
from torchloom.strategies.base import real_parameters

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

# torch.distributed.fsdp is imported where it is used, not here: it pulls in DTensor (about a second of start-up)
# and this module is imported by `Loom(strategy="fsdp")` in the launching process too, which shards nothing.

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


class FSDPStrategy(ShardedStrategy):
    """FullyShardedDataParallel with torchloom's handling of hand-made units and replicated leftovers.

    Args:
        auto_wrap_policy: a set of module classes (each instance becomes a unit), a callable(module) -> bool, or
            an FSDP policy (`ModuleWrapPolicy`, `CustomPolicy`, a `(module, recurse, nonwrapped_numel)` callable).
            Ignored, with a warning, when the model already has units.
        sharding_strategy: "FULL_SHARD" (default), "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD" (shard within a
            node, replicate across nodes; or as `device_mesh=(replicate, shard)` says), "_HYBRID_SHARD_ZERO2", or
            a `torch.distributed.fsdp.ShardingStrategy` member.
        **options: the options both FSDP strategies share (`activation_checkpointing_policy`, `cpu_offload`,
            `mixed_precision`, `device_mesh`, `state_dict_type`, `unsharded_params`, `timeout`,
            `process_group_backend`; see `ShardedStrategy`); any other keyword goes to every
            FullyShardedDataParallel unit (e.g. `limit_all_gathers`, `backward_prefetch`, `forward_prefetch`).
            `use_orig_params` defaults to True.
    """

    name = "fsdp"
    flavour = "fsdp"
    replica_groups_refusal = (
        "FSDP1's flat parameters hold each rank's shard as a slice of one flat tensor, and its state dicts gather "
        "over the group, so a peer's shards cannot be averaged or healed piece by piece; use strategy='fsdp2' "
        "(the same sharding, on DTensors: HSDP across the groups)"
    )
    # FSDP1 wraps modules; checkpoint wrappers go around the units afterwards, as PyTorch recommends.
    _checkpoint_before_sharding = False
    _mixed_precision_type = "MixedPrecision"
    _owned_unit_options = {
        "device_id": "set by torchloom to each rank's device (Loom(devices=...))",
        "param_init_fn": "torchloom's: it initialises meta-device modules with their reset_parameters()",
        "process_group": "derived from the mesh: pass device_mesh=(replicate, shard) or a DeviceMesh instead",
    }

    def __init__(
        self, auto_wrap_policy: Any = None, *, sharding_strategy: Any = "FULL_SHARD", **options: Any
    ) -> None:
        super().__init__(**options)
        # A ShardingStrategy member or its name; kept as the name ("FULL_SHARD", ...).
        key = str(getattr(sharding_strategy, "name", sharding_strategy)).upper()
        if key not in SHARDING_STRATEGIES:
            raise ConfigurationError(
                f"sharding_strategy={sharding_strategy!r} is not valid. Choose one of "
                f"{', '.join(repr(s) for s in SHARDING_STRATEGIES)}."
            )
        self.sharding_strategy = key
        # Refuses what FSDP would fail on much later.
        as_module_policy(auto_wrap_policy, "auto_wrap_policy", wrap_form=True)
        self.auto_wrap_policy = auto_wrap_policy
        self._unit_options.setdefault("use_orig_params", True)
        #: id -> (meta parameter, its description) of the modules wrap() made units of inside init_module.
        self._wrapped_meta: dict[int, tuple[nn.Parameter, str, str]] = {}

    @property
    def has_policy(self) -> bool:
        return self.auto_wrap_policy is not None

    @property
    def _hybrid(self) -> bool:
        return "HYBRID" in self.sharding_strategy

    def _check_mesh(self) -> None:
        super()._check_mesh()
        shape = self._mesh_shape()
        dims = len(shape)
        if dims == 2 and not self._hybrid:
            raise ConfigurationError(
                f"device_mesh={self._mesh_option!r} is a 2-D (replicate, shard) mesh, which FullyShardedDataParallel "
                f"uses only for hybrid sharding, but sharding_strategy={self.sharding_strategy!r}. Pass "
                "sharding_strategy='HYBRID_SHARD', or a 1-D device_mesh."
            )
        if dims == 2 and self._hybrid and shape[0] > 1 and shape[1] == 1:
            # FSDP1 turns a sharding group of one process into NO_SHARD within it and then never all-reduces
            # across the replicas: every rank trains on its own gradients (measured: ranks 0.03 apart after 5
            # steps of tests/strategies/test_fsdp_options.py's model).
            raise ConfigurationError(
                f"sharding_strategy={self.sharding_strategy!r} over the mesh {shape} shards over one "
                "process per replica, where FullyShardedDataParallel silently stops averaging gradients across the "
                "replicas and ranks drift apart. Use sharding_strategy='NO_SHARD' (every rank holds the whole "
                "model; gradients averaged over all ranks), or strategy='fsdp2' with "
                f"device_mesh={shape}."
            )
        if self.cpu_offload and (self.sharding_strategy == "NO_SHARD" or shape[-1] == 1):
            where = (
                "sharding_strategy='NO_SHARD'"
                if self.sharding_strategy == "NO_SHARD"
                else f"one process per shard group (mesh {shape}), where FullyShardedDataParallel runs NO_SHARD"
            )
            raise ConfigurationError(_unsharded_offload_error(f"cpu_offload with {where}"))
        if dims == 1 and self._hybrid:
            raise ConfigurationError(
                f"sharding_strategy={self.sharding_strategy!r} needs a 2-D (replicate, shard) mesh, but "
                f"device_mesh={self._mesh_option!r} is 1-D. Pass device_mesh=(replicate, shard), or leave it out "
                "to replicate across nodes and shard within each."
            )

    def _check_units(self, layout: Layout) -> None:
        # The same defect as the strategy's own cpu_offload option (see _check_mesh), in units made by hand with
        # FSDP(..., cpu_offload=CPUOffload(offload_params=True)) that FSDP1 runs NO_SHARD (one process per shard
        # group, or asked for).
        from torch.distributed.fsdp import ShardingStrategy

        for unit in layout.units:
            fsdp = cast("FSDP", unit.module)
            if fsdp.cpu_offload.offload_params and fsdp.sharding_strategy == ShardingStrategy.NO_SHARD:
                raise ConfigurationError(
                    _unsharded_offload_error(
                        f"The unit '{unit.path or '<root>'}' offloads its parameters (CPUOffload) but is not "
                        "sharded (FullyShardedDataParallel runs NO_SHARD: one process per shard group, or asked "
                        "for)"
                    )
                )

    def _flavour_unit_kwargs(self, mesh: DeviceMesh) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffload, ShardingStrategy

        # A device mesh also makes FSDP1 use DTensor (not the deprecated ShardedTensor) in sharded state dicts.
        kwargs: dict[str, Any] = {
            "device_id": self.root_device,
            "device_mesh": mesh,
            "sharding_strategy": ShardingStrategy[self.sharding_strategy],
            "param_init_fn": self._param_init_fn,
        }
        if self.cpu_offload:
            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
        mixed_precision = self._mixed_precision_for_units()
        if mixed_precision is not None:
            kwargs["mixed_precision"] = mixed_precision
        return kwargs

    def _param_init_fn(self, module: nn.Module) -> None:
        # FSDP calls this for each module of a unit that sits on the meta device, before flattening. Initialise
        # it locally, then take rank 0's values so the unit is the same model on every rank. (FSDP's own
        # sync_module_states needs a GPU.)
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not any(t.is_meta for t in own):
            return
        materialize_meta(module, self.root_device)  # only the meta tensors: real buffers keep their values
        init = init_fn(module)
        if init is not None:
            with torch.no_grad():
                init()
        broadcast_tensors(
            [*module.parameters(recurse=False), *module.buffers(recurse=False)], device=self.root_device
        )

    def _make_unit(self, module: nn.Module, **kwargs: Any) -> FSDP:
        """What `wrap(m)` calls inside `loom.init_module()`."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # Parameters another unit flattened already are its shards (of sizes that differ between ranks when the
        # flat parameter does not split evenly), not this module's to broadcast: a weight tied with a module
        # wrapped before (gloo aborted the ranks on the mismatched sizes, inside init_module, before
        # setup_module could refuse the tie across the two units, as it now does), or a nested unit's.
        params = [p for p in module.parameters() if not getattr(p, "_fsdp_flattened", False)]
        own = [*params, *module.buffers()]
        if any(t.is_meta for t in own):
            self._refuse_tie_with_earlier_unit(module)
        elif own:
            # A module built before init_module (on the CPU) may be wrapped here: FSDP moves it only after.
            broadcast_tensors(own, device=self.root_device)
        with real_parameters():  # FSDP registers views of its flat parameter: they must stay real
            return FSDP(module, **self._full_precision_batchnorms(module, kwargs))

    def _refuse_tie_with_earlier_unit(self, module: nn.Module) -> None:
        """Refuse, before FSDP materialises `module` from the meta device, a parameter it shares with a unit made
        before: the tie across units that `setup_module` refuses (`check_split_ties`), which does not get there
        under `init_module(empty_init=True)`: the module's reset_parameters() runs on what the first unit made
        of the shared tensor, its flattened shard (found by the scenario engine: torch's "Fan in and fan out can
        not be computed for tensor with fewer than 2 dimensions"). Every rank wraps the same modules, so every
        rank raises here together. Meta parameters hold no memory: keeping them until init_module ends is free."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        nested = {id(p) for sub in module.modules() if isinstance(sub, FSDP) for p in sub.parameters()}
        for name, p in module.named_parameters():
            earlier = self._wrapped_meta.get(id(p))
            if earlier is not None and earlier[0] is p and id(p) not in nested:
                raise MisuseError(
                    f"Parameter '{name}' of the {type(module).__name__} being wrapped and parameter "
                    f"'{earlier[1]}' of the {earlier[2]} wrapped before are tied (the same tensor) but sit in two different FSDP units: each unit "
                    "would shard its own copy, so the tie would be broken (the first unit has already "
                    "materialised and flattened it; this one would fail to initialise it). Keep every module "
                    "that uses it in one unit: wrap neither, so that the unit of their common parent shards the "
                    "tied weight once (the root: unsharded_params='shard'), or let the strategy's "
                    "auto_wrap_policy make the units (it places a tied weight in the unit of all its users)."
                )
        for name, p in module.named_parameters():
            if p.is_meta and id(p) not in nested:
                self._wrapped_meta[id(p)] = (p, name, type(module).__name__)

    def _full_precision_batchnorms(self, module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Wrap each BatchNorm in `module` (outside the units it holds) that the unit's mixed precision would
        break (`needs_full_precision`) in a unit of its own without mixed precision, as FSDP1's auto-wrap policy
        does (`_module_classes_to_ignore`), for the units it makes no policy for: those of wrap(), the root.
        Returns the keyword arguments for `module` itself (without mixed precision if it is such a BatchNorm)."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        dtype = getattr(kwargs.get("mixed_precision"), "param_dtype", None)
        full = {k: v for k, v in kwargs.items() if k != "mixed_precision"}
        own = kwargs
        for path, bn in full_precision_batchnorms(module, dtype):
            if not path:
                own = full
                continue
            parent, _, name = path.rpartition(".")
            with real_parameters():
                module.get_submodule(parent).register_module(name, FSDP(bn, **full))
        return own

    @contextlib.contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        from torch.distributed.fsdp.wrap import enable_wrap

        self._require_group("init_module with strategy='fsdp'")
        with (
            super().module_init_context(empty_init),
            enable_wrap(wrapper_cls=self._make_unit, **self.unit_kwargs()),
        ):
            try:
                yield
            finally:
                self._wrapped_meta.clear()

    # ---- making units ----------------------------------------------------------------------------------------
    def _shard_with_policy(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

        policy = self.auto_wrap_policy
        # A module holding part of a tied weight's users is no unit: the weight goes to the unit above.
        skip = tie_splitters(module) if policy is not None else {}
        if skip:
            self._tie_skipped.extend(skip.values())
            return FSDP(module, auto_wrap_policy=skipping(policy, skip), **self.unit_kwargs())
        if isinstance(policy, (set, frozenset, list, tuple)):
            policy = ModuleWrapPolicy(set(policy))
        elif isinstance(policy, type) and issubclass(policy, nn.Module):
            policy = ModuleWrapPolicy({policy})
        elif policy is not None and not is_wrap_policy(policy):
            # A predicate(module) -> bool: FSDP would call it as (module, recurse, nonwrapped_numel).
            policy = CustomPolicy(policy)
        kwargs = self.unit_kwargs()
        if policy is None:  # with a policy, FSDP wraps BatchNorms apart itself
            kwargs = self._full_precision_batchnorms(module, kwargs)
        return FSDP(module, auto_wrap_policy=policy, **kwargs)

    def _shard_root(self, module: nn.Module, layout: Layout) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(module, **self._full_precision_batchnorms(module, self.unit_kwargs()))

    def _set_unit_sync(self, stack: contextlib.ExitStack, units: list[Unit]) -> None:
        for unit in units:
            stack.enter_context(cast("FSDP", unit.module).no_sync())

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> nn.Module:
        forward_module = super().setup_module(module, move_to_device)
        _GradsAsideWithoutGrad(forward_module)
        return forward_module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Refuse an optimizer that holds some but not all of one unit's parameters: FSDP1 flattens a unit's
        parameters into one tensor, and torch's optimizer state dict of such an optimizer fails, on some ranks
        only ("... is not in the optimizer state. The FSDPParamInfo has the param keys ..."), so `loom.save`
        would raise there and leave the other ranks waiting (found by the scenario engine: one root unit, and
        one optimizer for the blocks and one for the rest)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for layout in self._layouts.values():
            for unit in layout.units:
                # Frozen parameters have no optimizer state: an optimizer of the trainable ones (adapters
                # beside frozen weights in one unit) is whole.
                originals = [
                    p for p in _torch_compat.fsdp1_flat_param_originals(unit.module) if p.requires_grad
                ]
                inside = sum(id(p) in held for p in originals)
                if 0 < inside < len(originals):
                    name = unit.path or "the root"
                    raise MisuseError(
                        f"The optimizer {type(optimizer).__name__} holds {inside} of the {len(originals)} "
                        f"trainable parameters of FSDP unit {name!r}. Under strategy='fsdp' each unit's parameters are "
                        "one flattened tensor, whose optimizer state cannot be split between optimizers (saving "
                        "it fails). Give each optimizer whole units: make the modules of each optimizer units of "
                        "their own (a policy or wrap()), or use one optimizer with param groups, or "
                        "strategy='fsdp2'."
                    )
        return super().setup_optimizer(optimizer)

    def _shard_groups(self, module: nn.Module) -> dict[int, dist.ProcessGroup | None]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        groups: dict[int, dist.ProcessGroup | None] = {}
        for unit in analyze(module).units:
            fsdp = cast(FSDP, unit.module)
            if fsdp.sharding_strategy == ShardingStrategy.NO_SHARD:
                continue  # every rank holds the whole, already averaged, gradient
            nested = {
                id(p)
                for sub in fsdp.modules()
                if sub is not fsdp and isinstance(sub, FSDP)
                for p in sub.parameters()
            }
            for p in fsdp.parameters():
                if id(p) not in nested:
                    groups[id(p)] = fsdp.process_group
        return groups


class _GradsAsideWithoutGrad:
    """Set the gradients aside during a forward without autograd (`torch.no_grad()`, `loom.evaluate`) and give
    them back after it. A compiled FSDP1 model (`torch.compile`, any backend) kept its gradients as zeros
    (`zero_grad(set_to_none=False)`) then failed in such a forward with dynamo's "attempting to assign a gradient
    of size [88] to a tensor of size [176]": in a forward without autograd FSDP1 unshards each flat parameter's
    data but leaves its gradient the shard, and dynamo cannot build a fake tensor of that pair (found by the
    scenario engine; raw FullyShardedDataParallel + torch.compile fails the same way, as in torch's issue
    #139110 (a validation loop)). Without gradients there is nothing to pair; a forward without autograd does not
    touch them, and they are given back as they were (the training after it is the eager one's, bit for bit).
    The check of the grad mode is traced; only the setting aside runs outside the graph (a graph break in such
    forwards only)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Kept out of a compiled graph. Wrapped here, not with a decorator on the class: `torch.compiler.disable`
        # imports dynamo (and DTensor), about a second that the launching process must not pay for `Loom(...)`.
        self._set_aside = torch.compiler.disable(self._set_aside)  # type: ignore[method-assign]
        self._give_back = torch.compiler.disable(self._give_back)  # type: ignore[method-assign]
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after, always_call=True)

    def _before(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            self._set_aside()

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            self._give_back()

    def _set_aside(self) -> None:
        for t in (*_torch_compat.fsdp1_flat_params(self._module), *self._module.parameters()):
            if t.grad is not None:
                self._saved.append((t, t.grad))
                t.grad = None

    def _give_back(self) -> None:
        for t, grad in self._saved:
            t.grad = grad
        self._saved.clear()


def _unsharded_offload_error(what: str) -> str:
    # Seen on an H200 (torch 2.11, one process): after a checkpoint save or load, the next step of offloaded
    # NO_SHARD units differed from the uninterrupted run's by twice the learning rate (Adam), with the saved and
    # loaded parameters and optimizer state identical. FSDP2's offload passes there.
    return (
        f"{what}: FullyShardedDataParallel's offloading of unsharded units trains wrongly after a checkpoint is "
        "saved or loaded (no error; the next step is not the one the uninterrupted run takes). Use "
        "strategy='fsdp2' with cpu_offload=True (it offloads correctly on one GPU too), or leave cpu_offload "
        "out, or shard over 2 or more GPUs."
    )
