"""A scenario's replica groups (the `replicas` axis): the launched ranks split into groups of the scenario's world
size, each group its own process group, and the groups joined through torchft by a lighthouse of the scenario's
own: the environment `torchloom run --replica-groups` gives its ranks, set up inside one launched rank group, so
that replica scenarios run many per launch as the others do.

Launched rank `r` of `ranks` is rank `r % size` of group `r // size`; the engine's results stay in launched-rank
order, so group g's readers are the job's readers g x dp .. g x dp + dp - 1, as torchloom splits the data
(`_run_protocol.split_over_replica_groups`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from unittest import mock

from torchloom import _run_protocol

from .axes import Scenario

_STORE_TIMEOUT = timedelta(seconds=120)


@contextlib.contextmanager
def replica_group(scenario: Scenario, phase: str, rank: int, ranks: int) -> Iterator[int]:
    """Around one scenario's `Loom` on launched rank `rank` of `ranks`: this rank's group's environment, and the
    group's world size (all `ranks`, without replica groups)."""
    if scenario.replicas == 1:
        yield ranks
        return
    from torch.distributed import TCPStore

    # torchft's quorum log (a dozen lines a step) kept out of the reports.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    from torchloom.fault_tolerance import launch

    groups = scenario.replicas
    size = ranks // groups
    group, group_rank = divmod(rank, size)
    # The launched group's own store (torchrun's agent store) carries the addresses between the ranks.
    launcher = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=_STORE_TIMEOUT
    )
    key = f"replicas/{phase}/{scenario.id}"
    lighthouse = None
    if rank == 0:
        # Every quorum holds every group (no fault here): the groups start and step together.
        lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=groups,
            join_timeout_ms=launch.JOIN_TIMEOUT_MS,
            quorum_tick_ms=launch.QUORUM_TICK_MS,
            heartbeat_timeout_ms=launch.HEARTBEAT_TIMEOUT_MS,
        )
        launcher.set(f"{key}/lighthouse", lighthouse.address())
    store = None
    if group_rank == 0:  # the group's process group store, as a group's agent hosts it
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        launcher.set(f"{key}/group{group}", str(store.port))
    environment = {
        "RANK": str(group_rank),
        "LOCAL_RANK": str(group_rank),
        "WORLD_SIZE": str(size),
        "LOCAL_WORLD_SIZE": str(size),
        "MASTER_PORT": launcher.get(f"{key}/group{group}").decode(),
        _run_protocol.REPLICA_GROUPS_ENV: str(groups),
        _run_protocol.REPLICA_GROUP_ENV: str(group),
        _run_protocol.LIGHTHOUSE_ENV: launcher.get(f"{key}/lighthouse").decode(),
    }
    try:
        with mock.patch.dict(os.environ, environment):  # the launched rank's own again afterwards
            yield size
    finally:
        # The lighthouse and a group's store outlive every rank that uses them.
        launcher.add(f"{key}/done", 1)
        if lighthouse is not None or store is not None:
            deadline = time.monotonic() + _STORE_TIMEOUT.total_seconds()
            while launcher.add(f"{key}/done", 0) < ranks and time.monotonic() < deadline:
                time.sleep(0.01)
        if lighthouse is not None:
            lighthouse.shutdown()
        del store
