"""The `torchloom` command line: `run` a script on many ranks, `plan` its memory before launch, `inspect` and
`consolidate` checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torchloom
from torchloom.errors import ConfigurationError, TorchloomError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchloom", description=torchloom.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"torchloom {torchloom.__version__}")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser(
        "run",
        help="start SCRIPT on every rank with PyTorch's elastic launcher (what torchrun uses)",
        description="Start SCRIPT once per process with torch.distributed.run. The options reach Loom() in the "
        "script: arguments it leaves at their defaults take these values. As with `fabric run`, the options "
        "below may also come after SCRIPT (anywhere before a `--`); every other argument, and everything after "
        "`--`, goes to the script.",
    )
    run.add_argument("--accelerator", default=None, help="auto, cpu, cuda or mps")
    run.add_argument(
        "--devices", default=None, help="processes per node on CPU; GPUs per node on CUDA (or auto)"
    )
    run.add_argument("--strategy", default=None, help="auto, single_device, ddp, fsdp or fsdp2")
    run.add_argument("--precision", default=None, help="32-true, bf16-mixed, 16-mixed, ...")
    run.add_argument("--num-nodes", "--num_nodes", type=int, default=1, help="number of machines in the job")
    run.add_argument(
        "--node-rank", "--node_rank", type=int, default=0, help="this machine's rank, 0..num_nodes-1"
    )
    run.add_argument(
        "--main-address",
        "--main_address",
        default=None,
        help="address of node 0 (default 127.0.0.1 on one node)",
    )
    run.add_argument(
        "--main-port",
        "--main_port",
        type=int,
        default=None,
        help="free port on node 0 (default: any free port)",
    )
    run.add_argument(
        "--fabric-compat",
        action="store_true",
        help="run a Lightning Fabric program unchanged: lightning.Fabric, its strategies and ThroughputMonitor "
        "become torchloom's in every rank (torchloom.lightning_compat); SCRIPT may then be a command on PATH, "
        "such as litgpt",
    )
    run.add_argument(
        "--fabric-fsdp",
        choices=("fsdp", "fsdp2"),
        default="fsdp",
        help="with --fabric-compat: run Lightning's FSDPStrategy as 'fsdp' (FSDP1, the default) or 'fsdp2'",
    )
    _add_elastic_options(run)
    _add_replica_group_options(run)
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    _add_plan_parser(sub)
    _add_replay_parser(sub)

    inspect = sub.add_parser("inspect", help="show what a checkpoint holds (format, tensors, sizes, entries)")
    inspect.add_argument("checkpoint", help="a checkpoint file (full) or directory (sharded)")
    inspect.add_argument("--json", action="store_true", help="print JSON for machines")
    inspect.add_argument("--allow-pickle", action="store_true", help=_ALLOW_PICKLE)
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="check every file against the size and checksum recorded when it was saved (exit status 1 if any "
        "differs)",
    )

    consolidate = sub.add_parser(
        "consolidate", help="turn a sharded checkpoint directory into one file, without a process group"
    )
    consolidate.add_argument("checkpoint", help="the sharded checkpoint directory")
    consolidate.add_argument(
        "out_file", nargs="?", default=None, help="the file to write (or give it as --output_file)"
    )
    consolidate.add_argument(
        "--output_file",
        "--output-file",
        dest="output_file",
        default=None,
        help="the file to write, as `fabric consolidate` spells it; without either, CHECKPOINT.consolidated "
        "beside the checkpoint (Fabric's default), which must not exist yet",
    )
    consolidate.add_argument("--model-only", action="store_true", help="write only the model weights")
    consolidate.add_argument(
        "--format",
        choices=("torch", "safetensors", "hf"),
        default="torch",
        help="file format: torch, safetensors (one file), or hf (a Hugging Face checkpoint directory: "
        "safetensors shards and their index, what from_pretrained loads); the last two need the safetensors "
        "package and --model-only",
    )
    consolidate.add_argument(
        "--max-shard-size", default="5GB", help="with --format hf: the largest shard file (default 5GB)"
    )
    consolidate.add_argument("--allow-pickle", action="store_true", help=_ALLOW_PICKLE)
    consolidate.add_argument(
        "--no-verify",
        action="store_true",
        help="skip checking the checkpoint's files against their recorded checksums (a damaged file is then "
        "consolidated as it is)",
    )
    return parser


def _add_replay_parser(sub: Any) -> None:
    """`torchloom replay` (torchloom.fault_tolerance.replay_command, imported only when it runs)."""
    replay = sub.add_parser(
        "replay",
        help="replay a fault-tolerant job's record in one process (the run's oracle)",
        description="Replay the record of a `torchloom run --replica-groups` job in one process: each committed "
        "step's gradient is the mean of its participants' gradients on the batches they read, each checked "
        "against the fingerprints the groups sent. SPEC is a Python file defining model() (the initial model), "
        "optimizer(model), batch(group, epoch, index) and loss(model, batch).",
    )
    replay.add_argument("record", help="the job's record (--ft-record; default torchloom-ft-record.jsonl)")
    replay.add_argument("spec", help="the Python file defining model, optimizer, batch and loss")
    replay.add_argument("--compare", default=None, help="a state dict the run saved at its end (torch.save)")
    replay.add_argument("--atol", type=float, default=1e-5, help="largest difference --compare allows")
    replay.add_argument("--out", default=None, help="save the replayed state dict here")
    replay.add_argument("--no-check", action="store_true", help="skip the per-step fingerprint checks")


def _add_plan_parser(sub: Any) -> None:
    from torchloom.planning.fit import add_fit_options

    plan = sub.add_parser(
        "plan",
        help="predict each rank's peak memory before launch (SCRIPT's first steps on fake tensors)",
        description="Run SCRIPT, unchanged, for its first training steps on fake tensors (no memory, no compute) "
        "and a fake process group standing for the whole world, and report each rank's predicted peak memory, "
        "when it happens and what it holds. The options go before SCRIPT; everything after it goes to the script.",
    )
    plan.add_argument("--devices", type=int, default=1, help="processes (devices) per node")
    plan.add_argument("--num-nodes", "--num_nodes", type=int, default=1, help="number of machines")
    plan.add_argument("--strategy", default=None, help="as for `torchloom run`")
    plan.add_argument("--precision", default=None, help="as for `torchloom run`")
    plan.add_argument("--steps", type=int, default=2, help="training steps to simulate (default 2)")
    plan.add_argument(
        "--device",
        default=None,
        help="plan a CUDA job on this GPU (h100, h200, a100, a100-40gb, l4): its memory bounds the simulated "
        "caching allocator; a script's Loom(accelerator='cuda') is planned as a CUDA job without it too",
    )
    plan.add_argument(
        "--device-memory",
        default=None,
        help="plan a CUDA job on a GPU of this much memory, e.g. 80GiB (instead of, or with, --device)",
    )
    plan.add_argument(
        "--budget",
        default=None,
        help="memory per device, e.g. 80GiB: say which ranks fit and, when one is over, the changes that fit",
    )
    plan.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON to FILE")
    plan.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="FILE:LINE=VALUE",
        help="what the script's reads of fake values at FILE:LINE answer (true, false or a number), where the "
        "plan warns that it guessed; repeat for several lines",
    )
    add_fit_options(plan)
    plan.add_argument(
        "--plot", default=None, metavar="FILE", help="draw each rank's memory over the steps: an HTML page"
    )
    plan.add_argument("script", help="the training script")
    plan.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _plan(args: argparse.Namespace) -> int:
    from torchloom.planning.fit import fit_for_command
    from torchloom.planning.plan import PlanError, format_plan, parse_assumptions, parse_bytes

    budget = parse_bytes(args.budget) if args.budget else None
    args.assumed = parse_assumptions(args.assume)
    status = 0
    replan = _replan(args, budget)
    try:
        # With a budget the first plan also records what fitting it needs (the blocks, the micro-batch).
        result = replan({"observe": True} if budget is not None else None, None)
    except PlanError as error:
        print(f"torchloom: error: {error}", file=sys.stderr)
        if not error.plan.get("ranks"):
            return 2
        result, status = error.plan, 2
        print("what was planned until then:", file=sys.stderr)
    if "script" in result:
        print(format_plan(result))
    if status == 0 and budget is not None and result["peak_bytes"] > budget:
        print(fit_for_command(args, result, budget, replan))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot and "script" in result:
        from torchloom.planning.plot import plot_html

        Path(args.plot).write_text(plot_html(result))
    if status == 0 and budget is not None and result["peak_bytes"] > budget:
        return 1
    return status


def _replan(args: argparse.Namespace, budget: int | None) -> Any:
    """The command's plan of the script, with a fit's changes (`torchloom.planning.fit`) when given."""
    from torchloom.planning.plan import parse_bytes, plan

    def replan(fit: dict[str, Any] | None, precision: str | None) -> dict[str, Any]:
        return plan(
            args.script,
            args.script_args,
            devices=args.devices,
            num_nodes=args.num_nodes,
            steps=args.steps,
            strategy=args.strategy,
            precision=precision or args.precision,
            budget=budget,
            fit=fit,
            assume=args.assumed,
            device=args.device,
            device_memory=parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None,
        )

    return replan


def _add_elastic_options(run: argparse.ArgumentParser) -> None:
    """torchrun's elastic options, passed on to it unchanged (see docs: resuming)."""
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=None,
        help="restarts of all ranks after one fails (default 0; 3 per group with --replica-groups)",
    )
    run.add_argument("--nnodes", default=None, help="N or MIN:MAX nodes (a range needs --rdzv-backend c10d)")
    run.add_argument("--rdzv-backend", "--rdzv_backend", default=None, help="static (default) or c10d")
    run.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", default=None, help="HOST:PORT of the rendezvous store"
    )
    run.add_argument("--rdzv-id", "--rdzv_id", default=None, help="the job's id, the same on every node")
    run.add_argument("--rdzv-conf", "--rdzv_conf", default=None, help="KEY=VALUE,... e.g. join_timeout=60")
    run.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=0.1,
        help="seconds between the agent's checks of its ranks",
    )


def _add_replica_group_options(run: argparse.ArgumentParser) -> None:
    """Fault tolerance through torchft (`torchloom.fault_tolerance`, docs: fault_tolerance). A group started by
    an embedded launch learns its place from the environment, so it repeats the launch's command line."""
    from torchloom._run_protocol import FT_RECORD_ENV, LIGHTHOUSE_ENV, REPLICA_GROUP_ENV

    group = os.environ.get(REPLICA_GROUP_ENV)
    run.add_argument(
        "--replica-groups",
        "--replica_groups",
        type=int,
        default=None,
        help="replica groups of the job (torchft)",
    )
    run.add_argument(
        "--replica-group",
        "--replica_group",
        type=int,
        default=None if group is None else int(group),
        help="this group's number, with --lighthouse (one launch per group on a cluster)",
    )
    run.add_argument(
        "--lighthouse",
        default=os.environ.get(LIGHTHOUSE_ENV),
        help="HOST:PORT of a running torchft lighthouse (default: one started here)",
    )
    run.add_argument(
        "--ft-record",
        "--ft_record",
        default=os.environ.get(FT_RECORD_ENV),
        help="the record of committed steps (default torchloom-ft-record.jsonl)",
    )
    run.add_argument(
        "--ft-timeout",
        "--ft_timeout",
        type=float,
        default=None,
        help="seconds a collective, commit vote or heal may take before the step fails: bounds a group that "
        "hangs (default 30)",
    )
    run.add_argument(
        "--ft-quorum-timeout",
        "--ft_quorum_timeout",
        type=float,
        default=None,
        help="seconds a group waits for a quorum, e.g. while the lighthouse is down (default 60)",
    )


_ALLOW_PICKLE = (
    "also unpickle objects that are not plain data (tensors, numbers, strings, lists, dicts); unpickling can run "
    "any code the file's author chose: only for checkpoints you trust"
)

# `torchloom run`'s own options, each taking one value.
RUN_OPTIONS = frozenset(
    (
        "--accelerator",
        "--devices",
        "--strategy",
        "--precision",
        "--num-nodes",
        "--num_nodes",
        "--node-rank",
        "--node_rank",
        "--main-address",
        "--main_address",
        "--main-port",
        "--main_port",
        # torchrun's elastic options
        "--max-restarts",
        "--max_restarts",
        "--nnodes",
        "--rdzv-backend",
        "--rdzv_backend",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        "--rdzv-id",
        "--rdzv_id",
        "--rdzv-conf",
        "--rdzv_conf",
        "--monitor-interval",
        "--monitor_interval",
        "--fabric-fsdp",
        # fault tolerance (torchft)
        "--replica-groups",
        "--replica_groups",
        "--replica-group",
        "--replica_group",
        "--lighthouse",
        "--ft-record",
        "--ft_record",
        "--ft-timeout",
        "--ft_timeout",
        "--ft-quorum-timeout",
        "--ft_quorum_timeout",
    )
)


def split_run_args(
    argv: list[str], places: list[tuple[str, str | None, bool]] | None = None
) -> tuple[list[str], list[str]]:
    """Split the arguments after `run` into torchloom's (its options, then SCRIPT) and the script's.

    `fabric run`'s rule: torchloom's own options count wherever they stand before a `--`, before or after the
    script; every other argument after the script, and everything after `--`, belongs to the script. `places`,
    if given, receives (option, value, after the script?) for each of torchloom's options."""
    ours: list[str] = []
    theirs: list[str] = []
    script: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--" and script:
            theirs.extend(argv[i + 1 :])
            break
        name = arg.split("=", 1)[0]
        if name in RUN_OPTIONS:
            takes_next = "=" not in arg and i + 1 < len(argv)
            ours.extend(argv[i : i + 2] if takes_next else [arg])
            if places is not None:
                value = argv[i + 1] if takes_next else (arg.split("=", 1)[1] if "=" in arg else None)
                places.append((name.replace("_", "-"), value, bool(script)))
            i += 2 if takes_next else 1
            continue
        if script:
            theirs.append(arg)
        elif arg.startswith("-"):
            ours.append(arg)
        else:
            script.append(arg)
        i += 1
    # The script goes last: argparse hands everything after it to the script.
    return ours + script, theirs


def check_run_option_places(places: list[tuple[str, str | None, bool]], script: str = "SCRIPT") -> str:
    """Refuse one of torchloom run's options given twice with different values (typically once for the launcher
    before the script and once meant for the script after it); return the names, comma-separated and without the
    dashes, of those given after the script (for the messages in the ranks)."""
    seen: dict[str, tuple[str | None, bool]] = {}
    for name, value, after in places:
        if name in seen and seen[name][0] != value:
            first, first_after = seen[name]
            where = {False: "before the script", True: "after the script"}
            raise ConfigurationError(
                f"{name} is given twice, {name} {first} {where[first_after]} and {name} {value} {where[after]}. "
                f"Both are torchloom run's option (as with `fabric run`, its options count anywhere before a "
                f"`--`), so it cannot tell which one you meant. Give it once; to pass the script an option of the "
                f"same name, put it after `--`: `torchloom run {name} {first} {script} -- {name} {value}`."
            )
        seen[name] = (value, after)
    return ",".join(sorted({name[2:].replace("-", "_") for name, _, after in places if after}))


def consolidated_path(checkpoint: str, out_file: str | None, output_file: str | None) -> Path:
    """Where `torchloom consolidate` writes: OUT_FILE or --output_file (the same path if both), else Fabric's
    default `CHECKPOINT.consolidated` beside the checkpoint, which is refused if it exists (as Fabric does), so
    that leaving out the name never overwrites anything."""
    if out_file is not None and output_file is not None and Path(out_file) != Path(output_file):
        raise TorchloomError(
            f"two output files given: OUT_FILE {out_file!r} and --output_file {output_file!r}. Give one of them."
        )
    chosen = out_file if out_file is not None else output_file
    if chosen is not None:
        return Path(chosen)
    folder = Path(checkpoint)
    default = folder.with_name(folder.name + ".consolidated")
    if default.exists():
        raise TorchloomError(
            f"{str(default)!r} exists already (the default output name). Choose another path with --output_file, "
            "or move or delete it first."
        )
    return default


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    script_args: list[str] | None = None
    places: list[tuple[str, str | None, bool]] = []
    command = list(argv)
    if argv[:1] == ["run"]:
        ours, script_args = split_run_args(argv[1:], places)
        argv = ["run", *ours]
    args = parser.parse_args(argv)
    if script_args is not None:
        args.script_args = script_args
    args.command_line = command  # what an embedded replica-group launch repeats per group
    try:
        if args.command == "run":
            from torchloom.run import run

            args.after_script = check_run_option_places(places, args.script)
            return run(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "replay":
            from torchloom.fault_tolerance.replay_command import main as replay_main

            return replay_main(args)
        if args.command == "inspect":
            from torchloom.checkpointing.tools import format_inspection, inspect

            info = inspect(args.checkpoint, weights_only=not args.allow_pickle, verify_files=args.verify)
            print(json.dumps(info, indent=2) if args.json else format_inspection(info))
            return 1 if info.get("verify", {}).get("failures") else 0
        if args.command == "consolidate":
            from torchloom.checkpointing.tools import consolidate

            out_file = consolidated_path(args.checkpoint, args.out_file, args.output_file)
            consolidate(
                args.checkpoint,
                out_file,
                model_only=args.model_only,
                fmt=args.format,
                max_shard_size=args.max_shard_size,
                weights_only=not args.allow_pickle,
                verify_files=not args.no_verify,
            )
            print(f"wrote {out_file}", file=sys.stderr)
            return 0
    except TorchloomError as error:
        print(f"torchloom: error: {error}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
