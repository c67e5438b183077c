"""strategy="fsdp2": PyTorch's `fully_shard` (FSDP2, DTensor-based), on CPU (gloo) and CUDA (nccl).

Units come from the user's own `fully_shard(block)` calls after `loom.launch()`, or else from `shard_policy`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchloom import _torch_compat
from torchloom._layout import Layout, Unit, unit_flavour
from torchloom._meta_init import materialize_meta, run_init
from torchloom.errors import ConfigurationError
from torchloom.strategies._policies import as_module_policy, tie_splitters
from torchloom.strategies._sharded import ShardedStrategy
from torchloom.strategies._unit_checks import full_precision_batchnorms

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# torch.distributed.fsdp and torch.distributed.tensor are imported where they are used, not here: together they
# cost about a second of start-up, and this module is imported by `Loom(strategy="fsdp2")` in the launching
# process too, which shards nothing.


class FSDP2Strategy(ShardedStrategy):
    """`fully_shard` with torchloom's handling of hand-made units and replicated leftovers.

    Args:
        shard_policy: a set of module classes or a callable(module) -> bool: matching modules become units,
            bottom-up, then the root. Ignored, with a warning, when the model already has units.
        reshard_after_forward: free unsharded parameters after forward (FULL_SHARD-like, default) or keep them
            until backward (SHARD_GRAD_OP-like).
        hybrid: shard within each node and replicate across nodes (a 2-D mesh of shape (num_nodes, per-node));
            `device_mesh=(replicate, shard)` chooses the shape yourself (give one of the two).
        **options: the options both FSDP strategies share (`activation_checkpointing_policy`, `cpu_offload`
            (also `CPUOffloadPolicy(...)`), `mixed_precision` (a `MixedPrecisionPolicy`), `device_mesh`,
            `state_dict_type`, `unsharded_params`, `timeout`, `process_group_backend`; see `ShardedStrategy`);
            any other keyword goes to every `fully_shard` call.
    """

    name = "fsdp2"
    flavour = "fsdp2"
    _offload_types = ("CPUOffload", "CPUOffloadPolicy", "OffloadPolicy")
    _mixed_precision_type = "MixedPrecisionPolicy"
    _owned_unit_options = {
        "mesh": "torchloom's: pass device_mesh=(replicate, shard) or a DeviceMesh instead",
        "mp_policy": "torchloom's: pass mixed_precision=MixedPrecisionPolicy(...) instead",
        "offload_policy": "torchloom's: pass cpu_offload=CPUOffloadPolicy(...) (or True) instead",
    }

    def __init__(
        self,
        shard_policy: Any = None,
        *,
        reshard_after_forward: bool | int = True,
        hybrid: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if hybrid and self._mesh_option is not None:
            raise ConfigurationError(
                f"FSDP2Strategy(hybrid=True, device_mesh={self._mesh_option!r}): give one of them. hybrid=True "
                "makes the mesh (num_nodes, processes per node); device_mesh=(replicate, shard) chooses the shape."
            )
        self.shard_policy = as_module_policy(shard_policy, "shard_policy")
        self.reshard_after_forward = reshard_after_forward
        self.hybrid = bool(hybrid)

    @property
    def has_policy(self) -> bool:
        return self.shard_policy is not None

    @property
    def _hybrid(self) -> bool:
        return self.hybrid

    def _flavour_unit_kwargs(self, mesh: DeviceMesh) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        offload = self._cpu_offload_option
        if not isinstance(offload, OffloadPolicy):
            offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": offload,
        }
        mixed_precision = self._mixed_precision_for_units()
        if mixed_precision is not None:
            kwargs["mp_policy"] = mixed_precision
        return kwargs

    # ---- making units ----------------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> nn.Module:
        forward_module = super().setup_module(module, move_to_device)
        layout = self._layouts[id(forward_module)]
        if not layout.root_is_unit and len(layout.top_units) > 1:
            # Without a root unit every top-level unit is an FSDP root, and FSDP2 treats roots in ways that undo a
            # per-block memory plan (benchmarks/memory.py measures both; a unit behaves as under a root unit after):
            units = [cast("FSDPModule", unit.module) for unit in layout.top_units]
            for unit in units:
                # A root left at fully_shard's default reshard_after_forward keeps its parameters unsharded from
                # forward to backward: with every block a root, the whole model. Non-root units reshard.
                if _torch_compat.fsdp2_auto_reshard_after_forward(unit):
                    unit.set_reshard_after_forward(True, recurse=False)
            # Each root has its own communication context and keeps its full-size reduce-scatter input until
            # the end of backward: the whole model's gradients, unsharded. One shared context frees each as the
            # next unit's reduce-scatter starts (torch >= 2.10; 2.9 has no way to share one).
            _torch_compat.share_fsdp2_comm_ctx(units)
        return forward_module

    def _shard_with_policy(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        kwargs = self.unit_kwargs()
        root_kwargs = self._full_precision_batchnorms(module, kwargs)
        if self.shard_policy is not None:
            # A module holding part of a tied weight's users is no unit: the weight goes to the unit above.
            skip = tie_splitters(module)
            # named_modules() lists parents before children; reversed, every block is sharded before what holds it.
            for name, sub in reversed(list(module.named_modules())):
                if name and unit_flavour(sub) is None and self.shard_policy(sub):
                    if id(sub) in skip:
                        self._tie_skipped.append(name)
                        continue
                    fully_shard(sub, **kwargs)
        fully_shard(module, **root_kwargs)
        return module

    def _full_precision_batchnorms(self, module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Make each BatchNorm in `module` (outside the units it holds) that the units' mixed precision would
        break (`needs_full_precision`) a unit of its own without mixed precision, before the units around it:
        FSDP2 lets a nested unit have a policy of its own. Its input stays in the compute dtype and its
        parameters and running statistics in float32, as under one process's autocast (and as FSDP1's auto-wrap
        policy does it). Returns the keyword arguments for `module` itself (the full-precision ones if it is
        such a BatchNorm)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = getattr(kwargs.get("mp_policy"), "param_dtype", None)
        full = {**kwargs, "mp_policy": MixedPrecisionPolicy()}
        own = kwargs
        for path, bn in full_precision_batchnorms(module, dtype):
            if path:
                fully_shard(bn, **full)
            else:
                own = full
        return own

    def _shard_root(self, module: nn.Module, layout: Layout) -> nn.Module:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        # The root joins the mesh the user's units already use.
        mesh = next(
            (p.device_mesh for u in layout.units for p in u.module.parameters() if isinstance(p, DTensor)),
            None,
        )
        kwargs = self.unit_kwargs(mesh)
        fully_shard(module, **self._full_precision_batchnorms(module, kwargs))
        return module

    def _set_unit_sync(self, stack: contextlib.ExitStack, units: list[Unit]) -> None:
        for unit in units:
            fsdp = cast("FSDPModule", unit.module)
            fsdp.set_requires_gradient_sync(False)
            stack.callback(fsdp.set_requires_gradient_sync, True)

    def _shard_groups(self, module: nn.Module) -> dict[int, Any]:
        """id(parameter) -> the groups of the mesh dims its gradient is split over, in mesh order (a local norm
        summed over each in turn is summed over their product: tensor parallel inside FSDP2 has two); absent:
        replicated everywhere."""
        from torch.distributed.tensor import DTensor

        groups: dict[int, Any] = {}
        for name, p in module.named_parameters():
            if not isinstance(p, DTensor):
                continue
            if any(pl.is_partial() for pl in p.placements):
                raise NotImplementedError(
                    f"Clipping a parameter with Partial placement: {name} {p.placements}."
                )
            # Anything but Replicate splits the tensor: Shard, and the _StridedShard that fully_shard puts over a
            # tensor-parallel Shard of the same dim (which is no Shard subclass).
            dims = [i for i, pl in enumerate(p.placements) if not pl.is_replicate()]
            if dims:
                groups[id(p)] = tuple(p.device_mesh.get_group(i) for i in dims)
        return groups

    # ---- meta-device initialisation --------------------------------------------------------------------------
    def _materialize_units(self, module: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
        # Allocate only what is on meta, module by module: real tensors (units built for real) keep their values.
        # Shards live in CPU memory under cpu_offload (FSDP2 refuses them elsewhere); buffers on the device.
        shard_device = torch.device("cpu") if self.cpu_offload else self.root_device
        with torch.no_grad():
            for _, mod in modules:
                materialize_meta(mod, self.root_device, param_device=shard_device)
                self._init_sharded_module(mod)

    def _init_sharded_module(self, mod: nn.Module) -> None:
        """Run `mod`'s reset_parameters on full-size plain tensors for its own parameters only (one layer at a
        time, never the whole model), then keep this rank's shard of rank 0's values.

        Running it on the DTensors directly would be wrong on CPU: DTensor's random ops draw the same numbers
        for every shard there, so all shards of a weight would be identical copies."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        own = list(mod.named_parameters(recurse=False))
        originals = {}
        for name, param in own:
            if isinstance(param, DTensor):
                originals[name] = param
                full = torch.empty(param.shape, dtype=param.dtype, device=self.root_device)
                mod._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
        try:
            run_init(mod)
        finally:
            for name, param in originals.items():
                filled = cast(nn.Parameter, mod._parameters[name])
                mod._parameters[name] = param
                # Every rank passes a full tensor; only rank 0's values are scattered (src_data_rank=0).
                shard = distribute_tensor(
                    filled.detach(), param.device_mesh, param.placements, src_data_rank=0
                )
                param.to_local().copy_(shard.to_local())
