"""Bookkeeping hooks the sharded strategies put on a set-up model: which units ran forward and which "fsdp2" unit
parameters got a gradient between two backwards (checked across ranks by `_agreement`), and DDP's buffer
semantics for the modules outside every unit (`BufferSync`)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchloom._layout import Layout, clean_name
from torchloom.strategies._replicated import broadcast_tensors


class UnitRuns:
    """Which of a model's units ran forward, with gradients, since the last backward ended (one flag per unit),
    and the parameters of its "fsdp2" units (whose gradients must be present on all ranks or none)."""

    def __init__(self, paths: list[str], params: list[tuple[str, nn.Parameter]]) -> None:
        self.paths = paths
        self.params = params
        self.names = [n for n, _ in params]
        #: Which parameters fully_shard wrote a reduced gradient into since `start_backward`. Whether a
        #: gradient exists says nothing about this backward: it survives `zero_grad(set_to_none=False)` and
        #: accumulation from an earlier backward (and a unit's gradients share one version counter).
        #: One byte per flag (set to 1 by the hooks), read as a tensor without a copy by `_agreement.agree`.
        self.got = bytearray(len(params))
        self.ran = bytearray(len(paths))
        #: False inside no_backward_sync (nothing is reduced, so nothing to agree on).
        self.checking = True

    def take(self) -> bytearray:
        ran, self.ran = self.ran, bytearray(len(self.paths))
        return ran

    def start_backward(self) -> None:
        self.got = bytearray(len(self.params))


def _mark_run(watch: UnitRuns, index: int, module: nn.Module, args: Any) -> None:
    # A forward without gradients (evaluation) is never reduced.
    if torch.is_grad_enabled():
        watch.ran[index] = 1


def _mark_grad(watch: UnitRuns, index: int, param: torch.Tensor) -> None:
    # fully_shard calls a sharded parameter's post-accumulate-grad hooks after writing its reduced gradient.
    watch.got[index] = 1


def watch_unit_runs(module: nn.Module, layout: Layout) -> UnitRuns | None:
    """Record which units run forward between two backwards, and which parameters of "fsdp2" units get a
    gradient (None: nothing to record). FSDP's reduce-scatters go one per unit, in the order backward reaches
    them: a unit whose forward never ran on a rank (an expert that got no token there) is not reduced there,
    while the ranks that ran it reduce it, so the ranks pair different units; and FSDP2 reduces, per unit, only
    the parameters that have a gradient, so a parameter without one on a single rank shifts the rest. Same-shaped
    pieces (experts) are then summed into each other silently; others crash or hang."""
    nested = [u for u in layout.units if u.module is not module]
    leftovers = {id(p) for _, p in layout.leftovers}
    fsdp2_params = (
        [(clean_name(n), p) for n, p in module.named_parameters() if id(p) not in leftovers]
        if any(u.flavour == "fsdp2" for u in layout.units)
        else []  # FSDP1 reduces each unit's flat parameter whole: a missing gradient is a zero there
    )
    if not nested and not fsdp2_params:
        return None
    watch = UnitRuns([u.path for u in nested], fsdp2_params)
    for i, unit in enumerate(nested):
        unit.module.register_forward_pre_hook(functools.partial(_mark_run, watch, i))
    for i, (_, param) in enumerate(fsdp2_params):
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(functools.partial(_mark_grad, watch, i))
    return watch


def plain_buffers(modules: list[nn.Module]) -> tuple[torch.Tensor, ...]:
    """The modules' own buffers that every rank holds whole (not DTensors, not on the meta device)."""
    return tuple(
        b
        for m in modules
        for b in m._buffers.values()
        if b is not None and type(b.data) is torch.Tensor and not b.is_meta and b.numel()
    )


def leftover_buffer_owners(module: nn.Module, layout: Layout) -> list[nn.Module]:
    """The modules outside every unit that hold plain buffers of their own."""
    inside = {id(m) for unit in layout.units for m in unit.module.modules()}
    return [m for m in module.modules() if id(m) not in inside and plain_buffers([m])]


class BufferSync:
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
        buffers = plain_buffers(self.owners)
        if buffers:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffers):
                broadcast_tensors(buffers, group=self.group, device=self.device, packed=True)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.due = torch.is_grad_enabled() and self.syncing
