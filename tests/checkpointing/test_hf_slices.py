"""`load_raw` reads each rank's slice of a safetensors tensor for any DTensor placement on a 2-D mesh: the slice
read must be exactly what `distribute_tensor` gives the rank (uneven and empty shards, strided shards that
interleave rows), and nothing else is read."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytest.importorskip("safetensors")


def _placements() -> list[tuple[str, tuple[int, ...], tuple[int, int], list]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [
        # name, global shape, mesh shape, placements
        ("rows x cols", (8, 6), (2, 2), [Shard(0), Shard(1)]),
        ("rows twice", (8, 6), (2, 2), [Shard(0), Shard(0)]),
        # FSDP2 over a column-parallel weight: contiguous rows, but not in mesh order.
        ("fsdp over colwise", (8, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
        # Interleaved rows: a rank's rows are not one block.
        ("interleaved", (8, 6), (2, 2), [Shard(0), _StridedShard(0, split_factor=2)]),
        ("replicated then cols", (8, 6), (2, 2), [Replicate(), Shard(1)]),
        ("cols then replicated", (8, 6), (2, 2), [Shard(1), Replicate()]),
        ("uneven, a rank empty", (3, 5), (2, 2), [Shard(0), Shard(0)]),
        ("uneven both dims", (5, 7), (2, 2), [Shard(1), Shard(0)]),
        ("1-D mesh", (6, 4), (4,), [Shard(0)]),
        ("vector", (10,), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ]


def _slices_body(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    from torchloom import _torch_compat
    from torchloom.checkpointing import hf
    from torchloom.errors import CheckpointError

    dist.init_process_group("gloo")
    cases = _placements()
    full = {
        name: torch.arange(float(torch.Size(shape).numel())).reshape(shape) for name, shape, _, _ in cases
    }
    if rank == 0:
        save_file({k.replace(" ", "_"): v for k, v in full.items()}, f"{root}/w.safetensors")
    dist.barrier()
    out: dict = {}
    reads: list = []
    with contextlib.ExitStack() as stack:
        reader = hf._Reader(Path(root) / "w.safetensors", stack)
        plain_read = reader.read

        def counting_read(name, index=None):
            got = plain_read(name, index)
            reads.append(got.numel())
            return got

        reader.read = counting_read
        for name, shape, mesh_shape, placements in cases:
            mesh = init_device_mesh("cpu", mesh_shape)
            expected = distribute_tensor(full[name], mesh, placements, src_data_rank=None)
            # The indices DTensor's own split gives select this rank's local tensor.
            indices = _torch_compat.local_indices(expected)
            picked = full[name]
            for dim, index in enumerate(indices):
                if index is not None:
                    picked = picked.index_select(dim, index)
            assert torch.equal(picked, expected.to_local()), name
            # load_raw's fill: the same values, reading no element twice and none of other ranks'.
            target = distribute_tensor(torch.zeros(shape), mesh, placements, src_data_rank=None)
            reads.clear()
            hf._fill(target, reader, name.replace(" ", "_"))
            assert torch.equal(target.to_local(), expected.to_local()), name
            assert sum(reads) == expected.to_local().numel(), (name, reads)
            out[name] = (tuple(expected.to_local().shape), len(reads))
            # And back: the whole tensor, as save_raw gathers it.
            assert torch.equal(target.full_tensor(), full[name]), name
        # A partial sum holds no slice of the full tensor: refused, naming the placement.
        mesh = init_device_mesh("cpu", (2, 2))
        partial = distribute_tensor(torch.zeros(8, 6), mesh, [Partial(), Partial()], src_data_rank=None)
        with pytest.raises(CheckpointError, match="Partial"):
            hf._fill(partial, reader, "rows_x_cols")
    return out


def test_each_rank_reads_exactly_its_slice_for_any_placement(tmp_path):
    results = run_ranks(_slices_body, 4, str(tmp_path), timeout=180)
    # Interleaved rows take one read per run; every other case one read (or none for an empty shard).
    assert results[0]["interleaved"] == ((2, 6), 2)
    assert results[0]["fsdp over colwise"] == ((2, 6), 1)
    assert [r["uneven, a rank empty"] for r in results] == [
        ((1, 5), 1),
        ((1, 5), 1),
        ((1, 5), 1),
        ((0, 5), 0),
    ]
