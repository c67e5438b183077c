"""What rank r of a replica group exchanges with rank r of the other groups, whatever the strategy made of the
model: the local pieces of the gradients it averages, and the state a healing group receives.

torchft's `Manager` connects rank r of every group (its process group is per group rank), so the groups must
hold the same pieces of the model at the same group ranks. Every strategy that runs inside a group does: DDP
holds the whole model on every rank; `fully_shard` and a tensor-parallel plan cut each parameter the same way in
every group (the same mesh, the same rank), so a DTensor's local piece at rank r of one group is the same slice as
at rank r of another. Averaging is linear, so the local pieces can be averaged as they are, whatever their
placement: a `Shard` is averaged slice by slice, a `Replicate` copy stays equal on the ranks that hold it (they
all receive the same sum), and a pending `Partial` sum stays a partial sum of the average.

Healing sends local pieces too: a DTensor travels as its local tensor with its placements, shape and stride,
never with its device mesh (torchft pickles the state; a pickled `DeviceMesh` names process groups of the sending
process, which the receiving process may number otherwise). The receiver writes parameters and buffers in place
(bit for bit the sender's), and rebuilds the optimizer's DTensor state on the mesh of the parameter it belongs
to."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (sharing its storage), or the tensor itself."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def trainable(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The trainable parameters of `modules`, in parameter order (the same on every group's rank r): the ones
    whose gradients the groups average."""
    return [p for module in modules for p in module.parameters() if p.requires_grad]


def whole(modules: list[nn.Module]) -> bool:
    """Whether this rank's gradient pieces are the whole gradients (no parameter is a DTensor)."""
    dtensor = _dtensor_type()
    return dtensor is None or not any(isinstance(p, dtensor) for m in modules for p in m.parameters())


@dataclass(frozen=True)
class _Piece:
    """A DTensor on its way to a peer: its local tensor and how it lies on the mesh (not the mesh itself)."""

    tensor: torch.Tensor
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def _as_pieces(state: Any) -> Any:
    dtensor = _dtensor_type()
    if dtensor is None:
        return state

    def piece(v: Any) -> Any:
        if isinstance(v, dtensor):
            return _Piece(v.to_local(), tuple(v.placements), v.shape, tuple(v.stride()))
        return v

    return tree_map(piece, state)


def module_state(module: nn.Module) -> dict[str, Any]:
    """`module`'s state dict with every DTensor as its local piece, its buffers copied: torchft serialises the
    state for the healing peer while this group's step goes on, and the step's forward updates buffers (a
    BatchNorm's statistics) in place, where the parameters wait for the commit."""
    buffers = {id(b) for b in module.buffers()}
    state = {
        name: value.detach().clone() if id(value) in buffers else value
        for name, value in module.state_dict(keep_vars=True).items()
    }
    return _as_pieces({name: v.detach() if isinstance(v, torch.Tensor) else v for name, v in state.items()})  # type: ignore[no-any-return]


def load_module_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Write a peer's `module_state` into `module` in place: each local piece into this rank's (the same slice)."""
    own = module.state_dict()
    if set(own) != set(state):
        raise RuntimeError(
            f"A peer's model state has other keys than this group's ({sorted(set(own) ^ set(state))[:5]}): the "
            "groups must run the same script with the same strategy."
        )
    other: dict[str, Any] = {}
    with torch.no_grad():
        for name, value in state.items():
            target = own[name]
            if not isinstance(target, torch.Tensor):
                other[name] = value  # extra state (get_extra_state): loaded by the module's own rule
                continue
            source = value.tensor if isinstance(value, _Piece) else value
            local(target).copy_(source)
    if other:
        module.load_state_dict(other, strict=False)


def optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """`optimizer`'s state dict with every DTensor as its local piece."""
    return _as_pieces(optimizer.state_dict())  # type: ignore[no-any-return]


def load_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load a peer's `optimizer_state`: each piece becomes a DTensor again on the mesh of the parameter whose
    state it is (the optimizer of a restarted group may hold no state yet, so there is nothing to write into)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt = dict(state)
    rebuilt["state"] = {
        index: {key: _rebuild(value, params[int(index)]) for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    optimizer.load_state_dict(rebuilt)


def _rebuild(value: Any, param: torch.Tensor) -> Any:
    if not isinstance(value, _Piece):
        return value
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        raise RuntimeError(
            "A peer's optimizer state holds a DTensor for a parameter that is plain in this group: the groups "
            "must run the same script with the same strategy."
        )
    return DTensor.from_local(
        value.tensor.to(param.device),
        param.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride,
    )


def _dtensor_type() -> Any:
    # No DTensor exists unless its module was imported (about a second): a DDP group never imports it here.
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else None
