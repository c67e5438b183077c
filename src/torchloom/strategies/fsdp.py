"""strategy="fsdp": PyTorch's FullyShardedDataParallel (FSDP1), on CPU (gloo) and CUDA (nccl).

Units come from the user's `wrap()` calls inside `loom.init_module()`, or else from `auto_wrap_policy`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchloom._layout import Layout, Unit, analyze
from torchloom.errors import ConfigurationError
from torchloom.strategies._replicated import broadcast_tensors
from torchloom.strategies._sharded import ShardedStrategy, _init_fn, as_module_policy, materialize_meta
from torchloom.strategies.base import real_parameters

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

# torch.distributed.fsdp is imported where it is used, not here: it pulls in DTensor (about a second of start-up)
# and this module is imported by `Loom(strategy="fsdp")` in the launching process too, which shards nothing.

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


class FSDPStrategy(ShardedStrategy):
    """FullyShardedDataParallel with torchloom's handling of hand-made units and replicated leftovers.

    Args:
        auto_wrap_policy: a set of module classes (each instance becomes a unit) or an FSDP policy callable.
            Ignored, with a warning, when the model already has units.
        activation_checkpointing_policy: a set of module classes or a callable(module) -> bool.
        sharding_strategy: "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD" or "HYBRID_SHARD" (shard within a node,
            replicate across nodes).
        cpu_offload: keep sharded parameters (and gradients) in CPU memory.
        state_dict_type: "sharded" (default) or "full", the checkpoint format `loom.save` writes.
        unsharded_params: what happens to parameters outside every unit: "replicate" (default), "shard", "error".
        **fsdp_kwargs: passed to every FullyShardedDataParallel unit (e.g. `limit_all_gathers`,
            `backward_prefetch`, `forward_prefetch`). `use_orig_params` defaults to True.
    """

    name = "fsdp"
    flavour = "fsdp"
    # FSDP1 wraps modules; checkpoint wrappers go around the units afterwards, as PyTorch recommends.
    _checkpoint_before_sharding = False

    def __init__(
        self,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: str = "FULL_SHARD",
        cpu_offload: bool = False,
        state_dict_type: str = "sharded",
        unsharded_params: str = "replicate",
        timeout: timedelta | None = None,
        process_group_backend: str | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        super().__init__(
            activation_checkpointing_policy=activation_checkpointing_policy,
            cpu_offload=cpu_offload,
            state_dict_type=state_dict_type,
            unsharded_params=unsharded_params,
            timeout=timeout,
            process_group_backend=process_group_backend,
        )
        # A ShardingStrategy member or its name; kept as the name ("FULL_SHARD", ...).
        key = str(getattr(sharding_strategy, "name", sharding_strategy)).upper()
        if key not in SHARDING_STRATEGIES:
            raise ConfigurationError(
                f"sharding_strategy={sharding_strategy!r} is not valid. Choose one of "
                f"{', '.join(repr(s) for s in SHARDING_STRATEGIES)}."
            )
        self.sharding_strategy = key
        as_module_policy(auto_wrap_policy, "auto_wrap_policy")  # refuses what FSDP would fail on much later
        self.auto_wrap_policy = auto_wrap_policy
        self.fsdp_kwargs = {"use_orig_params": True, **fsdp_kwargs}
        self._mesh: Any = None

    @property
    def has_policy(self) -> bool:
        return self.auto_wrap_policy is not None

    # ---- the configuration every unit gets -------------------------------------------------------------------
    def unit_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every FullyShardedDataParallel unit gets (device, mesh, sharding strategy, mixed
        precision, offload, meta-device init). `wrap()` inside `loom.init_module()` uses them already; pass them
        to units you construct yourself: `FSDP(block, **loom.strategy.unit_kwargs())`."""
        from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

        assert self.precision is not None
        kwargs: dict[str, Any] = {
            "device_id": self.root_device,
            "sharding_strategy": ShardingStrategy[self.sharding_strategy],
            "param_init_fn": self._param_init_fn,
        }
        # A device mesh makes FSDP1 use DTensor (not the deprecated ShardedTensor) in sharded state dicts.
        kwargs["device_mesh"] = self._device_mesh()
        if self.cpu_offload:
            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
        if self.precision.is_mixed:
            # Compute in half precision, keep fp32 master shards, reduce gradients in fp32. Autocast (from the
            # precision) still wraps forward so that replicated leftovers in fp32 mix with half-precision units.
            kwargs["mixed_precision"] = MixedPrecision(
                param_dtype=self.precision.autocast_dtype, reduce_dtype=torch.float32
            )
        return {**kwargs, **self.fsdp_kwargs}

    def _device_mesh(self) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            if self.sharding_strategy == "HYBRID_SHARD":
                shape: tuple[int, ...] = (self.num_nodes, self.world_size // self.num_nodes)
                self._mesh = init_device_mesh(
                    self.root_device.type, shape, mesh_dim_names=("replicate", "shard")
                )
            else:
                self._mesh = init_device_mesh(
                    self.root_device.type, (self.world_size,), mesh_dim_names=("shard",)
                )
        return self._mesh

    def _param_init_fn(self, module: nn.Module) -> None:
        # FSDP calls this for each module of a unit that sits on the meta device, before flattening. Initialise
        # it locally, then take rank 0's values so the unit is the same model on every rank. (FSDP's own
        # sync_module_states needs a GPU.)
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not any(t.is_meta for t in own):
            return
        materialize_meta(module, self.root_device)  # only the meta tensors: real buffers keep their values
        init = _init_fn(module)
        if init is not None:
            with torch.no_grad():
                init()
        broadcast_tensors([*module.parameters(recurse=False), *module.buffers(recurse=False)])

    def _make_unit(self, module: nn.Module, **kwargs: Any) -> FSDP:
        """What `wrap(m)` calls inside `loom.init_module()`."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        own = [*module.parameters(), *module.buffers()]
        if own and not any(t.is_meta for t in own):
            broadcast_tensors(own)
        with real_parameters():  # FSDP registers views of its flat parameter: they must stay real
            return FSDP(module, **kwargs)

    @contextlib.contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        from torch.distributed.fsdp.wrap import enable_wrap

        self._require_group("init_module with strategy='fsdp'")
        with (
            super().module_init_context(empty_init),
            enable_wrap(wrapper_cls=self._make_unit, **self.unit_kwargs()),
        ):
            yield

    # ---- making units ----------------------------------------------------------------------------------------
    def _shard_with_policy(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = self.auto_wrap_policy
        if isinstance(policy, (set, frozenset, list, tuple)):
            policy = ModuleWrapPolicy(set(policy))
        elif isinstance(policy, type) and issubclass(policy, nn.Module):
            policy = ModuleWrapPolicy({policy})
        return FSDP(module, auto_wrap_policy=policy, **self.unit_kwargs())

    def _shard_root(self, module: nn.Module, layout: Layout) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(module, **self.unit_kwargs())

    def _set_unit_sync(self, stack: contextlib.ExitStack, units: list[Unit]) -> None:
        for unit in units:
            stack.enter_context(unit.module.no_sync())

    def _shard_groups(self, module: nn.Module) -> dict[int, dist.ProcessGroup]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        groups: dict[int, dist.ProcessGroup] = {}
        for unit in analyze(module).units:
            fsdp = unit.module
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
