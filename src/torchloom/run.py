"""`torchloom run`: start a script on every rank through `torch.distributed.run`, PyTorch's elastic launcher.

torchrun's own machinery does the work (rendezvous across nodes, watching the ranks, stopping all of them when
one fails, SIGTERM/SIGINT handling), so torchrun and SLURM habits carry over. torchloom adds checks before any
process starts, passes the options to `Loom()` through the environment, and names the rank that failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

from torchloom._run_protocol import publish
from torchloom.accelerators import select_accelerator
from torchloom.environments import find_free_port
from torchloom.errors import ConfigurationError


def _processes_per_node(accelerator: str | None, devices: str | None) -> int:
    acc = select_accelerator(accelerator or "auto")
    if devices is None or devices == "auto":
        return len(acc.parse_devices("auto"))
    if not devices.isdigit() or int(devices) < 1:
        raise ConfigurationError(f"--devices {devices!r} is not valid: pass a positive number or 'auto'.")
    return len(acc.parse_devices(int(devices)))


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError as error:
            raise ConfigurationError(
                f"--main-port {port} is not free on {host} ({error.strerror}). Pick another port, or leave "
                "--main-port out on a single node to use any free one."
            ) from None


def _node_range(args: argparse.Namespace) -> tuple[int, int]:
    """(MIN, MAX) nodes: --nnodes (torchrun's spelling, a range for an elastic job) or --num-nodes."""
    from torchloom.launcher import node_range

    if args.nnodes is None:
        if args.num_nodes < 1:
            raise ConfigurationError(f"--num-nodes {args.num_nodes} is not valid: pass a number >= 1.")
        return args.num_nodes, args.num_nodes
    low, high = node_range(args.nnodes)
    if args.num_nodes != 1 and (low, high) != (args.num_nodes, args.num_nodes):
        raise ConfigurationError(
            f"--num-nodes {args.num_nodes} and --nnodes {args.nnodes} disagree. Give one of them."
        )
    if low != high and (args.rdzv_backend or "static") == "static":
        raise ConfigurationError(
            f"--nnodes {args.nnodes} is a range, which the static rendezvous cannot do (its node count is fixed). "
            "Add --rdzv-backend c10d --rdzv-endpoint HOST:PORT (a port on one node every node reaches)."
        )
    return low, high


def torchrun_args(args: argparse.Namespace, port: int | None = None) -> list[str]:
    """The `torch.distributed.run` command line for these options (checked first). `port`: the rendezvous
    port where the user set none (`_drawn_port_host`); drawn here when None."""
    script = Path(args.script)
    program: list[str] = [str(script)]
    if getattr(args, "fabric_compat", False):
        # Each rank installs the switch, then runs the program (a script or a command such as `litgpt`).
        program = ["-m", "torchloom.lightning_compat", "--fsdp", args.fabric_fsdp, args.script]
    elif not script.is_file():
        raise ConfigurationError(f"The script {args.script!r} does not exist (looked in {os.getcwd()}).")
    low, high = _node_range(args)
    nproc = _processes_per_node(args.accelerator, args.devices)
    max_restarts = 0 if args.max_restarts is None else args.max_restarts
    if max_restarts < 0:
        raise ConfigurationError(f"--max-restarts {max_restarts} is not valid: pass a number >= 0.")
    common = [
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={args.monitor_interval}",
    ]
    if (args.rdzv_backend or "static") != "static":
        return [*common, *_elastic_rendezvous(args, low, high, port), *program, *args.script_args]
    if not 0 <= args.node_rank < high:
        raise ConfigurationError(f"--node-rank {args.node_rank} must be in 0..{high - 1} for {high} nodes.")
    if high > 1 and (args.main_address is None or args.main_port is None):
        raise ConfigurationError(
            "--num-nodes > 1 needs --main-address (node 0's address, reachable from every node) and --main-port."
        )
    address = args.main_address or "127.0.0.1"
    if args.main_port is None:
        port = port or find_free_port(address)
    else:
        port = args.main_port
        if args.node_rank == 0:
            _check_port_free(address, port)
    return [
        *common,
        f"--nnodes={high}",
        f"--node-rank={args.node_rank}",
        f"--master-addr={address}",
        f"--master-port={port}",
        *program,
        *args.script_args,
    ]


def _elastic_rendezvous(args: argparse.Namespace, low: int, high: int, port: int | None) -> list[str]:
    """torchrun's options for an elastic rendezvous (c10d, etcd): the agents meet at the endpoint, node ranks
    are assigned there, and each attempt may have another node count within MIN:MAX."""
    from torchloom.launcher import _split_endpoint

    endpoint = args.rdzv_endpoint
    if endpoint is None:
        if high > 1:
            raise ConfigurationError(
                f"--rdzv-backend {args.rdzv_backend} with up to {high} nodes needs --rdzv-endpoint HOST:PORT, the "
                "same on every node (a port on one of them, reachable from all)."
            )
        endpoint = f"127.0.0.1:{port or find_free_port('127.0.0.1')}"
    _split_endpoint(endpoint)
    run_id = args.rdzv_id or ("torchloom" if high > 1 else f"torchloom-{os.getpid()}")
    extra = [f"--rdzv-conf={args.rdzv_conf}"] if args.rdzv_conf else []
    return [
        f"--nnodes={low}:{high}",
        f"--rdzv-backend={args.rdzv_backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        *extra,
    ]


def run(args: argparse.Namespace) -> int:
    if getattr(args, "replica_groups", None) is None:
        _refuse_ft_options(args)
    else:
        # Fault tolerance (torchloom.fault_tolerance.launch): on one machine, a lighthouse and one child launch
        # per group, each of which comes back here with its group set; on a cluster, one group.
        from torchloom.fault_tolerance import launch

        launch.check(args)
        if args.lighthouse is None:
            return launch.run_embedded(args, args.command_line)
        launch.publish_group(args)
    return _run_agent(args)


def _refuse_ft_options(args: argparse.Namespace) -> None:
    """The fault-tolerance timeouts mean nothing without `--replica-groups`: refused rather than ignored."""
    for option, attribute in (("--ft-timeout", "ft_timeout"), ("--ft-quorum-timeout", "ft_quorum_timeout")):
        if getattr(args, attribute, None) is not None:
            raise ConfigurationError(
                f"{option} applies to replica groups only: add --replica-groups N (fault tolerance), or leave "
                f"{option} out."
            )


def _drawn_port_host(args: argparse.Namespace) -> str | None:
    """Where the rendezvous port is torchloom's draw (the user set none), the host it is drawn on; else None."""
    if (args.rdzv_backend or "static") == "static":
        return (args.main_address or "127.0.0.1") if args.main_port is None else None
    return "127.0.0.1" if args.rdzv_endpoint is None else None


def _run_agent(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from torchloom.launcher import (
        LAUNCHED_ENV,
        _describe_failure,
        _exit_status,
        avoid_shared_rendezvous_store,
        forwarding_signals_to_ranks,
        on_a_free_port,
    )

    options = {
        "accelerator": args.accelerator,
        "devices": args.devices,
        "strategy": args.strategy,
        "precision": args.precision,
    }
    low, high = _node_range(args)
    if low == high:  # an elastic job's node count is the rendezvous' to decide, attempt by attempt
        options["num_nodes"] = str(high)
    publish(options, getattr(args, "after_script", ""))
    # The ranks die with this agent (a node lost takes its ranks along, as a killed `loom.launch()` does).
    os.environ[LAUNCHED_ENV] = "1"
    avoid_shared_rendezvous_store(args.rdzv_backend)
    first = torchrun_args(args)  # its errors before anything starts; a retry on a new port builds it again
    # torchrun waits 30 s by default before killing ranks that ignore SIGTERM; ours is shorter and one setting.
    from torchloom.launcher import shutdown_timeout

    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(shutdown_timeout()))
    try:
        with forwarding_signals_to_ranks():
            host = _drawn_port_host(args)
            on_a_free_port(
                lambda port: torchrun(
                    get_args_parser().parse_args(first if port is None else torchrun_args(args, port))
                ),
                None,
                None if host is None else lambda: find_free_port(host),
            )
    except ChildFailedError as error:
        print(_describe_failure(error), file=sys.stderr, flush=True)
        return _exit_status(error)
    except KeyboardInterrupt:
        return 130
    except (
        Exception
    ) as error:  # torch's SignalException: SIGTERM (e.g. preemption) stopped the agent and ranks
        if type(error).__name__ == "SignalException":
            return 128 + int(getattr(error, "sigval", signal.SIGTERM))
        raise
    return 0
