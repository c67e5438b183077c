"""What tests and benchmarks need to run code on several local CPU ranks without a launcher: a free port, the
environment torchrun would give each rank, and the end of a rank. Not part of the training API."""

from __future__ import annotations

import socket
from datetime import timedelta

#: How long a finished rank of a test job waits for its peers before it tears its process group down anyway.
END_TIMEOUT = timedelta(seconds=30)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a rank of a one-node job, so `Loom(...).launch()` (or
    `init_process_group("gloo")`) joins the job's process group."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def end_rank(world_size: int, failed: bool) -> None:
    """Destroy this rank's process group, if any. A rank that finished waits for its peers first (as
    `Loom.close()` does), so no peer is cut off inside a collective; a failed one does not wait."""
    import torch.distributed as dist

    from torchloom.strategies.parallel import shutdown_process_group

    if not dist.is_initialized():
        return
    if failed:
        dist.destroy_process_group()
    else:
        shutdown_process_group(world_size, END_TIMEOUT)
