"""Where the tensors that no unit manages live: moved to the rank's device after sharding, and to host memory
for the length of a full-state-dict load under offload (with the optimizer state that goes with them)."""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom._layout import Layout, analyze


def place_outside_units(module: nn.Module, layout: Layout, device: torch.device) -> None:
    """Move every parameter and buffer outside the units to `device`. `fully_shard` and `FSDP(device_id=)` move
    only what their unit owns, so a model built on the CPU and sharded by hand keeps its leftovers there, and
    the broadcasts that follow would fail under NCCL."""
    inside = {id(m) for unit in layout.units for m in unit.module.modules()}
    for mod in module.modules():
        own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
        if id(mod) not in inside and any(not t.is_meta and t.device != device for t in own):
            # nn.Module.to's own conversion, on this module's tensors only: in place where it can be.
            mod._apply(lambda t: t if t.is_meta else t.to(device), recurse=False)


@contextlib.contextmanager
def on_one_device_for_full_load(
    module: nn.Module, full: bool, optimizer: Optimizer | None = None
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
        if (id(t) in leftovers or id(t) not in params) and type(t.data) is torch.Tensor and t.device != host
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
            place_state_with_parameters(optimizer, moved_ids)


def place_state_with_parameters(optimizer: Optimizer, param_ids: set[int]) -> None:
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
