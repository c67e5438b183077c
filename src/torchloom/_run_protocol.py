"""The protocol between `torchloom run` and `Loom()`: the environment variables the command sets for the ranks
it starts and that `Loom()` reads in the script.

Both sides import this module and nothing else of each other: `torchloom.run` writes the variables
(`publish`), `torchloom.connector` and `torchloom.loom` read them. A new option that `torchloom run` hands to
`Loom()` is added here, on both sides at once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Set to "1" in the environment of ranks started by `torchloom run` (Fabric's `LT_CLI_USED`): `Loom()` then joins
#: the process group in its constructor, as Fabric does under `fabric run`.
RUN_ENV = "TORCHLOOM_RUN"

#: `torchloom run --strategy fsdp2 ...` passes its options to `Loom()` in the script through these variables
#: (option name -> variable).
CLI_ENV = {
    "accelerator": "TORCHLOOM_ACCELERATOR",
    "devices": "TORCHLOOM_DEVICES",
    "num_nodes": "TORCHLOOM_NUM_NODES",
    "strategy": "TORCHLOOM_STRATEGY",
    "precision": "TORCHLOOM_PRECISION",
}

#: The names of `torchloom run`'s options that the command line gave after the script, comma-separated: the
#: place where a user may have meant them for the script (`Loom()` says so when such an option clashes).
AFTER_SCRIPT_ENV = "TORCHLOOM_RUN_AFTER_SCRIPT"


def publish(options: Mapping[str, object], after_script: str = "") -> None:
    """`torchloom run`'s side: put the options it was given (None: not given) and the names of those given after
    the script into this process' environment, which the ranks it starts inherit."""
    for name, value in options.items():
        if value is not None:
            os.environ[CLI_ENV[name]] = str(value)
    os.environ[RUN_ENV] = "1"
    if after_script:
        os.environ[AFTER_SCRIPT_ENV] = after_script


def under_torchloom_run() -> bool:
    """`Loom()`'s side: whether this process is a rank that `torchloom run` started."""
    return os.environ.get(RUN_ENV) == "1"


def command_line_option(name: str) -> str | None:
    """`Loom()`'s side: the raw value `torchloom run` gave for option `name`, or None when it gave none."""
    return os.environ.get(CLI_ENV[name])


def given_after_script(name: str) -> bool:
    """`Loom()`'s side: whether option `name` came after the script on `torchloom run`'s command line."""
    return name in os.environ.get(AFTER_SCRIPT_ENV, "").split(",")


#: `torchloom run --replica-groups N` (fault tolerance through torchft, `torchloom.fault_tolerance`): the number
#: of replica groups, this process's group, the lighthouse's address and the commit record's path.
REPLICA_GROUPS_ENV = "TORCHLOOM_REPLICA_GROUPS"
REPLICA_GROUP_ENV = "TORCHLOOM_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHLOOM_LIGHTHOUSE"
FT_RECORD_ENV = "TORCHLOOM_FT_RECORD"
#: `--ft-timeout` and `--ft-quorum-timeout` (seconds), when given.
FT_TIMEOUT_ENV = "TORCHLOOM_FT_TIMEOUT"
FT_QUORUM_TIMEOUT_ENV = "TORCHLOOM_FT_QUORUM_TIMEOUT"


def replica_groups() -> tuple[int, int, str, str | None] | None:
    """`Loom()`'s side: (groups, this group, lighthouse address, record path) when `torchloom run` started this
    rank in a replica group, else None."""
    groups = os.environ.get(REPLICA_GROUPS_ENV)
    group = os.environ.get(REPLICA_GROUP_ENV)
    lighthouse = os.environ.get(LIGHTHOUSE_ENV)
    if groups is None or group is None or lighthouse is None:
        return None
    return int(groups), int(group), lighthouse, os.environ.get(FT_RECORD_ENV) or None


def split_over_replica_groups(split: dict[str, int]) -> dict[str, int]:
    """A strategy's data split (`distributed_sampler_kwargs`) made the job's: under `torchloom run
    --replica-groups G`, each group reads its own shard, so the data is split over the G groups' readers, group g
    reading parts g x R .. g x R + R - 1 of the R readers inside each group. Unchanged outside replica groups."""
    spec = replica_groups()
    if spec is None:
        return split
    groups, group = spec[0], spec[1]
    readers = split["num_replicas"]
    return {"num_replicas": groups * readers, "rank": group * readers + split["rank"]}


def ft_timeouts(collective: float, quorum: float) -> tuple[float, float]:
    """`Loom()`'s side: the (collective, quorum) timeouts in seconds that `torchloom run` gave the replica
    groups, else the defaults passed in."""
    given = os.environ.get(FT_TIMEOUT_ENV), os.environ.get(FT_QUORUM_TIMEOUT_ENV)
    return (
        collective if given[0] is None else float(given[0]),
        quorum if given[1] is None else float(given[1]),
    )
