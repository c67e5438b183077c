"""`torchloom run`: start a script on every rank through `torch.distributed.run`, PyTorch's elastic launcher.

torchrun's own machinery does the work (rendezvous across nodes, watching the ranks, stopping all of them when
one fails, SIGTERM/SIGINT handling), so torchrun and SLURM habits carry over. torchloom adds checks before any
process starts, passes the options to `Loom()` through the environment, and names the rank that failed.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from torchloom.accelerators import select_accelerator
from torchloom.connector import AFTER_SCRIPT_ENV, CLI_ENV
from torchloom.environments import find_free_port
from torchloom.errors import ConfigurationError

#: Set in the environment of ranks started by `torchloom run` (Fabric's `LT_CLI_USED`): `Loom()` then joins the
#: process group in its constructor, as Fabric does under `fabric run`.
RUN_ENV = "TORCHLOOM_RUN"


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


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """The `torch.distributed.run` command line for these options (checked first)."""
    script = Path(args.script)
    if not script.is_file():
        raise ConfigurationError(f"The script {args.script!r} does not exist (looked in {os.getcwd()}).")
    if args.num_nodes < 1 or not 0 <= args.node_rank < args.num_nodes:
        raise ConfigurationError(
            f"--node-rank {args.node_rank} must be in 0..{args.num_nodes - 1} for --num-nodes {args.num_nodes}."
        )
    nproc = _processes_per_node(args.accelerator, args.devices)
    if args.num_nodes > 1 and (args.main_address is None or args.main_port is None):
        raise ConfigurationError(
            "--num-nodes > 1 needs --main-address (node 0's address, reachable from every node) and --main-port."
        )
    address = args.main_address or "127.0.0.1"
    port = args.main_port
    if port is None:
        port = find_free_port(address)
    elif args.node_rank == 0:
        _check_port_free(address, port)
    return [
        f"--nproc-per-node={nproc}",
        f"--nnodes={args.num_nodes}",
        f"--node-rank={args.node_rank}",
        f"--master-addr={address}",
        f"--master-port={port}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        str(script),
        *args.script_args,
    ]


def run(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from torchloom.launcher import _describe_failure, _exit_status

    options = {
        "accelerator": args.accelerator,
        "devices": args.devices,
        "strategy": args.strategy,
        "precision": args.precision,
        "num_nodes": str(args.num_nodes),
    }
    for name, value in options.items():
        if value is not None:
            os.environ[CLI_ENV[name]] = str(value)
    os.environ[RUN_ENV] = "1"
    after_script = getattr(args, "after_script", "")
    if after_script:
        os.environ[AFTER_SCRIPT_ENV] = after_script
    launch_args = get_args_parser().parse_args(torchrun_args(args))
    # torchrun waits 30 s by default before killing ranks that ignore SIGTERM; ours is shorter and one setting.
    from torchloom.launcher import shutdown_timeout

    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(shutdown_timeout()))
    try:
        torchrun(launch_args)
    except ChildFailedError as error:
        print(_describe_failure(error), file=sys.stderr, flush=True)
        return _exit_status(error)
    except KeyboardInterrupt:
        return 130
    return 0
