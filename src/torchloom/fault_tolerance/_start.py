"""The groups of a new job start their first step together.

torchft forms a quorum of whichever groups ask (the lighthouse's `min_replicas` is 1, so that a job goes on
when groups die): at a job's start the group whose ranks imported torch first trained alone for as long as the
others took to start (179 steps of a small model on 2 loaded cores), and the others then healed from it and
skipped their shards' batches of those steps. So `torchloom run --replica-groups N` (one machine) hosts a store,
and the ranks of every group wait there, before their first quorum, until every group has arrived. Only the
first attempt of each group waits: a group that an agent restarted joins a job that is already running.
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta
from typing import Any

#: The start store's address (HOST:PORT), set by the one-machine launch for the groups it starts.
START_ENV = "TORCHLOOM_FT_START"
#: Seconds the groups of a new job wait for each other before the first step; then those present go on.
START_TIMEOUT_S = 300.0


def host() -> tuple[Any, str]:
    """The launcher's side: a store for the groups' start, and its address for `START_ENV`."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, f"127.0.0.1:{store.port}"


def wait_for_groups(groups: int, group_rank: int) -> None:
    """A rank's side, before its group's first quorum: wait until every group of a new job has arrived (group
    rank 0 counts its group in). Nothing under a restarted attempt, or without the launcher's store."""
    address = os.environ.get(START_ENV)
    if not address or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    from torch.distributed import TCPStore

    host_name, port = address.rsplit(":", 1)
    store = TCPStore(host_name, int(port), is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    arrived = store.add("arrived", 1 if group_rank == 0 else 0)
    deadline = time.monotonic() + START_TIMEOUT_S
    while arrived < groups:
        if time.monotonic() > deadline:
            warnings.warn(
                f"Only {arrived} of {groups} replica groups started within {START_TIMEOUT_S:.0f} s; those present "
                "start training, and the others heal from them when they arrive.",
                stacklevel=2,
            )
            return
        time.sleep(0.02)
        arrived = store.add("arrived", 0)
