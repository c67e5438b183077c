"""The mesh the sharded strategies' units shard over: `device_mesh=` as users give it, its shape, the rules it
must follow against the job's world size and nodes, and its dims' names as a checkpoint records them."""

from __future__ import annotations

import math
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchloom._text import count
from torchloom.errors import ConfigurationError
from torchloom.strategies._policies import OptionTypeError


def mesh_spec(value: Any, owner: str) -> tuple[int, ...] | DeviceMesh | None:
    """`device_mesh=` checked: None, a DeviceMesh, or a tuple (replicate, shard) / (shard,) of positive ints."""
    if value is None or isinstance(value, DeviceMesh):
        return value
    if (
        isinstance(value, (tuple, list))
        and len(value) in (1, 2)
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)
    ):
        return tuple(value)
    raise OptionTypeError(
        f"{owner}(device_mesh={value!r}): device_mesh must be a tuple (replicate, shard) of positive ints, "
        "e.g. (2, 4) for 2 replicas of 4-way sharding, a tuple (shard,), or a "
        f"torch.distributed.device_mesh.DeviceMesh; got {type(value).__name__}."
    )


def make_mesh(device_type: str, shape: tuple[int, ...]) -> DeviceMesh:
    """A 1-D mesh ("shard",) or a 2-D mesh ("replicate", "shard") over every rank."""
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def mesh_shape(
    option: tuple[int, ...] | DeviceMesh | None, hybrid: bool, num_nodes: int, world_size: int
) -> tuple[int, ...]:
    """The shape `device_mesh=` gives, else (nodes, processes per node) for hybrid sharding, else 1-D."""
    if isinstance(option, tuple):
        return option
    if isinstance(option, DeviceMesh):
        return tuple(option.mesh.shape)
    if hybrid:
        return (num_nodes, world_size // num_nodes)
    return (world_size,)


def check_mesh(
    option: tuple[int, ...] | DeviceMesh | None, shape: tuple[int, ...], hybrid: bool, world: int, nodes: int
) -> None:
    """Refuse a mesh that does not cover the job's ranks exactly (or hybrid sharding over uneven nodes)."""
    if option is None:
        if hybrid and world % nodes:
            raise ConfigurationError(
                f"Hybrid sharding replicates across the {nodes} nodes and shards within each, so every node "
                f"needs the same number of processes, but this job has {count(world, 'process')}. Start the same "
                "number on every node, or pass device_mesh=(replicate, shard) with replicate x shard = "
                f"{world}."
            )
        return
    if math.prod(shape) != world:
        example = f"({nodes}, {world // nodes})" if world % nodes == 0 else f"(1, {world})"
        raise ConfigurationError(
            f"device_mesh={option!r} has {' x '.join(map(str, shape))} = {math.prod(shape)} "
            f"positions, but this job has {count(world, 'process')}. The product must equal the world size "
            f"(devices x num_nodes): e.g. device_mesh={example}."
        )


def dim_sizes(shape: tuple[int, ...], mesh: DeviceMesh | None) -> dict[str, int]:
    """The mesh's dims and sizes, outermost first: "shard", with "replicate" before it for hybrid sharding; a
    given DeviceMesh's own dim names where it has them."""
    names = mesh.mesh_dim_names if mesh is not None else None
    if not names or len(names) != len(shape):
        default = ("replicate", "shard") if len(shape) <= 2 else tuple(f"dim{i}" for i in range(len(shape)))
        names = default[-len(shape) :]
    return {str(n): int(k) for n, k in zip(names, shape, strict=True)}
