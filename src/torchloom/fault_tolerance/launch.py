"""`torchloom run --replica-groups N`: the launching side of fault tolerance.

On one machine (no `--lighthouse`), this process starts a lighthouse of its own (torchft's in-process
`LighthouseServer`) and one child `torchloom run` per replica group, each with the group's number and the
lighthouse's address in its environment. Each child is torch's elastic agent for its group: it restarts the
group's ranks when one dies (`--max-restarts`, 3 by default under replica groups), while the other groups keep
training. On a cluster the user starts the lighthouse (`torchft_lighthouse`) and each group's `torchloom run
--lighthouse HOST:PORT --replica-group G` (`run_group`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from torchloom._run_protocol import (
    FT_QUORUM_TIMEOUT_ENV,
    FT_RECORD_ENV,
    FT_TIMEOUT_ENV,
    LIGHTHOUSE_ENV,
    REPLICA_GROUP_ENV,
    REPLICA_GROUPS_ENV,
)
from torchloom.errors import ConfigurationError
from torchloom.fault_tolerance import _start
from torchloom.fault_tolerance._torchft import require_torchft

#: The embedded lighthouse's settings (milliseconds). A group whose heartbeats stop for `HEARTBEAT_TIMEOUT_MS`
#: is left out of the next quorum (torchft's default, 5000, made the survivors wait 5 s after a kill; 500 kept
#: them about 1 s on 2 loaded cores, 300 about 0.6 s). A group sends one every 100 ms from a thread of torchft's
#: own, so 300 ms tolerates two late ones: a live group whose heartbeats are late longer than that (a starved
#: machine) is left out of one quorum and heals from a peer (exact, a step lost). When a quorum changes, the
#: lighthouse computes it at its next tick, every `QUORUM_TICK_MS` (a healthy step's quorum forms as soon as the
#: last group asks); a quorum waits at most `JOIN_TIMEOUT_MS` for a group that heartbeats but has not asked to
#: join yet (a group still starting).
HEARTBEAT_TIMEOUT_MS = 300
QUORUM_TICK_MS = 25
JOIN_TIMEOUT_MS = 1000
#: Restarts of a group's ranks by its agent when `--max-restarts` is not given.
DEFAULT_GROUP_RESTARTS = 3
#: The record's file name when `--ft-record` is not given (in the working directory).
DEFAULT_RECORD = "torchloom-ft-record.jsonl"


def check(args: argparse.Namespace) -> None:
    """The options of a replica-group launch, checked before anything starts."""
    # torchft's Rust side logs every quorum and commit at INFO (read when it is imported); warnings and errors
    # are what a user reads. The groups' ranks inherit it.
    os.environ.setdefault("RUST_LOG", "warn")
    require_torchft()
    if args.replica_groups < 1:
        raise ConfigurationError(f"--replica-groups {args.replica_groups} is not valid: pass a number >= 1.")
    if args.strategy is not None:
        refusal = _strategy_refusal(args.strategy)
        if refusal is not None:
            raise ConfigurationError(
                f"--replica-groups cannot run --strategy {args.strategy} inside each group: {refusal}."
            )
    if args.max_restarts is None:
        args.max_restarts = DEFAULT_GROUP_RESTARTS
    if args.replica_group is not None and args.lighthouse is None:
        raise ConfigurationError(
            "--replica-group needs --lighthouse HOST:PORT, the lighthouse every group reaches (start one with "
            "`torchft_lighthouse --min_replicas 1`)."
        )
    if args.lighthouse is not None and args.replica_group is None:
        raise ConfigurationError(
            "--lighthouse needs --replica-group G: this group's number, in 0..N-1 for --replica-groups N."
        )
    if args.replica_group is not None and not 0 <= args.replica_group < args.replica_groups:
        raise ConfigurationError(
            f"--replica-group {args.replica_group} must be in 0..{args.replica_groups - 1} for "
            f"--replica-groups {args.replica_groups}."
        )
    _check_timeouts(args)


def _check_timeouts(args: argparse.Namespace) -> None:
    """`--ft-timeout` and `--ft-quorum-timeout`: positive seconds. A collective timeout at or below the
    lighthouse's heartbeat timeout would fail healthy steps whenever a quorum is recomputed."""
    floor = HEARTBEAT_TIMEOUT_MS / 1000
    for option, value in (("--ft-timeout", args.ft_timeout), ("--ft-quorum-timeout", args.ft_quorum_timeout)):
        if value is not None and not value > floor:
            raise ConfigurationError(
                f"{option} {value:g} is too short: pass a number of seconds above {floor:g} (the lighthouse's "
                "heartbeat timeout); the defaults are 30 (--ft-timeout) and 60 (--ft-quorum-timeout)."
            )
    for value, env in ((args.ft_timeout, FT_TIMEOUT_ENV), (args.ft_quorum_timeout, FT_QUORUM_TIMEOUT_ENV)):
        if value is not None:
            os.environ[env] = repr(float(value))  # the groups' ranks inherit it


def _strategy_refusal(name: str) -> str | None:
    """Why `--strategy NAME` cannot run inside a replica group (the strategy's own `replica_groups_refusal`), or
    None; a name `Loom()` does not know is left to its own error."""
    from torchloom.connector import FABRIC_STRATEGIES, REFUSED_STRATEGIES, STRATEGIES, strategy_class

    key = name.lower()
    if key in REFUSED_STRATEGIES:
        return REFUSED_STRATEGIES[key]
    key = FABRIC_STRATEGIES.get(key, (key, {}))[0]
    if key == "auto" or key not in STRATEGIES:
        return None
    return strategy_class(key).replica_groups_refusal


def publish_group(args: argparse.Namespace) -> None:
    """A group's `torchloom run`: hand its place to the ranks it starts (`torchloom._run_protocol`)."""
    os.environ[REPLICA_GROUPS_ENV] = str(args.replica_groups)
    os.environ[REPLICA_GROUP_ENV] = str(args.replica_group)
    os.environ[LIGHTHOUSE_ENV] = args.lighthouse
    os.environ[FT_RECORD_ENV] = str(Path(args.ft_record or DEFAULT_RECORD).resolve())


def run_embedded(args: argparse.Namespace, command: list[str]) -> int:
    """One machine: a lighthouse here, one child `torchloom run` per group (`command`: this process's own
    `torchloom` arguments, which each child repeats with its group in the environment). Returns 0 when every
    group finished, else the first failed group's status."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        quorum_tick_ms=QUORUM_TICK_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    record = Path(args.ft_record or DEFAULT_RECORD).resolve()
    record.write_text("")  # a new job: a new record
    start_store, start_address = _start.host()
    children: list[subprocess.Popen[bytes]] = []
    try:
        for group in range(args.replica_groups):
            env = dict(
                os.environ,
                **{
                    LIGHTHOUSE_ENV: lighthouse.address(),
                    REPLICA_GROUP_ENV: str(group),
                    FT_RECORD_ENV: str(record),
                    _start.START_ENV: start_address,
                },
            )
            children.append(subprocess.Popen([sys.executable, "-m", "torchloom", *command], env=env))
        return _wait(children)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)
            if child.poll() is None:
                child.kill()
        lighthouse.shutdown()
        del start_store


def _wait(children: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every group; SIGTERM and SIGINT go on to them. A group that fails for good (its restarts spent)
    is reported, and the others go on: they are fault tolerant."""
    status = 0

    def forward(signum: int, frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        running = dict(enumerate(children))
        while running:
            for group, child in list(running.items()):
                code = child.poll()
                if code is None:
                    continue
                del running[group]
                if code != 0:
                    print(
                        f"torchloom: replica group {group} failed for good (exit code {code}); the other groups "
                        "go on.",
                        file=sys.stderr,
                        flush=True,
                    )
                    status = status or (code if code > 0 else 1)
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status
