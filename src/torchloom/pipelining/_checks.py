"""What a `parallelize_fn` made of a pipeline's stages that cannot train correctly (found by the scenario engine),
as the sharded strategies and `ModelParallelStrategy` refuse the same layouts."""

from __future__ import annotations

from torch import nn

from torchloom._layout import analyze
from torchloom.errors import MisuseError
from torchloom.strategies._unit_checks import check_batchnorm_units, check_split_ties

#: torch's schedules that compute weight gradients in a pass of their own.
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble")


def parallelized_problems(
    stages: dict[int, nn.Module], data_parallel_size: int, schedule: str, data_parallel_dim: str
) -> list[str]:
    """This rank's problems: a weight tied between two `fully_shard` units (each unit would train its own copy), a
    low-precision unit around a BatchNorm, tensor-parallel DTensors outside every unit at data_parallel_size > 1
    (neither a unit nor the plain-gradient averaging would reduce their gradients: the replicas would train
    apart), and `fully_shard` units under a zero-bubble schedule."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    problems: list[str] = []
    try:
        for stage in stages.values():
            check_split_ties(analyze(stage))
            check_batchnorm_units(analyze(stage))
    except MisuseError as error:
        problems.append(str(error))
    unreduced = [
        n
        for s in stages.values()
        for n, p in s.named_parameters()
        if isinstance(p, DTensor) and data_parallel_dim not in (p.device_mesh.mesh_dim_names or ())
    ]
    if unreduced and data_parallel_size > 1:
        problems.append(
            f"Parameter(s) {unreduced[:5]}{' ...' if len(unreduced) > 5 else ''} are tensor-parallel DTensors "
            f"outside every fully_shard unit, with data_parallel_size={data_parallel_size}: nothing would "
            "average their gradients over the data-parallel ranks. In parallelize_fn, apply fully_shard(module, "
            "mesh=device_mesh['data_parallel']) to a module that holds them (e.g. each block)."
        )
    if schedule in ZERO_BUBBLE and any(
        isinstance(m, FSDPModule) for s in stages.values() for m in s.modules()
    ):
        problems.append(
            f"schedule={schedule!r} with fully_shard units in the stages: torch's zero-bubble schedules "
            "compute the weight gradients in a pass of their own, after FSDP2 has resharded the unit, and the "
            "stage fails there while its pipeline peers wait. Use schedule='interleaved_1f1b' (or '1f1b', "
            "'gpipe') with fully_shard units, or the zero-bubble schedule without fully_shard in parallelize_fn."
        )
    return problems
