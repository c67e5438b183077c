"""Turns `Loom(...)`'s arguments into one configured strategy, checking them before any process starts."""

from __future__ import annotations

import importlib
import os
import sys
from datetime import timedelta
from typing import Any

from torchloom._fabric_strategies import from_instance, is_lightning_strategy
from torchloom._run_protocol import (
    command_line_option,
    given_after_script,
    replica_groups,
    under_torchloom_run,
)
from torchloom._text import count
from torchloom.accelerators import CPUAccelerator, select_accelerator
from torchloom.environments import (
    ClusterEnvironment,
    LocalEnvironment,
    detect_environment,
    warn_if_srun_was_forgotten,
)
from torchloom.errors import ConfigurationError
from torchloom.precision import select_precision
from torchloom.strategies.base import Strategy

STRATEGIES = ("auto", "single_device", "ddp", "fsdp", "fsdp2")

# Lightning Fabric's spellings. A Fabric name for something torchloom has gets it; one for something torchloom does
# not have is refused with the nearest torchloom choice.
FABRIC_PRECISIONS = {
    16: "16-mixed",
    "16": "16-mixed",
    32: "32-true",
    "32": "32-true",
    64: "64-true",
    "64": "64-true",
}
FABRIC_PRECISIONS.update({"bf16": "bf16-mixed", None: "32-true"})
FABRIC_STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    # torchloom's launch(fn) starts ranks with the spawn method already.
    "ddp_spawn": ("ddp", {}),
    "ddp_find_unused_parameters_true": ("ddp", {"find_unused_parameters": True}),
    "ddp_find_unused_parameters_false": ("ddp", {}),
    "fsdp_cpu_offload": ("fsdp", {"cpu_offload": True}),
    # launch(fn) forks the ranks, so fn may be defined in a notebook cell (refused once CUDA is initialised).
    "ddp_fork": ("ddp", {"start_method": "fork"}),
    "ddp_notebook": ("ddp", {"start_method": "fork"}),
}
REFUSED_STRATEGIES = {
    "dp": "DataParallel is not supported. Use strategy='ddp'.",
    # As in Fabric, the strategy needs the user's function: only an instance makes sense.
    "model_parallel": (
        "ModelParallelStrategy needs your parallelize_fn. Pass an instance: "
        "strategy=ModelParallelStrategy(parallelize_fn, data_parallel_size=..., tensor_parallel_size=...) "
        "(from torchloom.strategies)."
    ),
}

# name -> "module:Class", imported on use so that `import torchloom` stays light.
_STRATEGY_CLASSES = {
    "single_device": "torchloom.strategies.single_device:SingleDeviceStrategy",
    "ddp": "torchloom.strategies.ddp:DDPStrategy",
    "fsdp": "torchloom.strategies.fsdp:FSDPStrategy",
    "fsdp2": "torchloom.strategies.fsdp2:FSDP2Strategy",
}


_DEFAULTS = {
    "accelerator": "auto",
    "devices": "auto",
    "num_nodes": None,
    "strategy": "auto",
    "precision": "32-true",
}


def command_line_defaults(**given: Any) -> tuple[Any, ...]:
    """Fill arguments left at their defaults from `torchloom run`'s options; refuse one the script sets to a
    different value (as Fabric refuses a clash with `fabric run`): the processes are already started by then, so
    the script cannot win for devices and nodes, and letting it win for the others would contradict the command
    line the user reads."""
    if given.get("devices") in _ONE_DEVICE and _inside_running_job():
        # A one-device Loom made inside a running job (litgpt's merge_lora on rank 0): the command line
        # described the job's own Loom, not this one (see `configure`).
        return tuple(given.values())
    out = []
    for name, value in given.items():
        raw = command_line_option(name)
        if raw is None:
            out.append(value)
            continue
        from_cli: Any = int(raw) if name in ("devices", "num_nodes") and raw.isdigit() else raw
        if value == _DEFAULTS[name] or _same_option(name, value, raw):
            out.append(from_cli)
            continue
        raise ConfigurationError(_clash_message(name, value, raw))
    return tuple(out)


def _same_option(name: str, value: Any, raw: str) -> bool:
    """Whether the script's `value` says what the command line's `raw` says (spellings aside)."""
    if name == "precision":
        normal = {**FABRIC_PRECISIONS, **{str(k): v for k, v in FABRIC_PRECISIONS.items()}}
        return normal.get(str(value), str(value)) == normal.get(raw, raw)
    if name == "strategy" and isinstance(value, Strategy):
        return value.name == raw.lower()
    return str(value).lower() == raw.lower()


def _clash_message(name: str, value: Any, raw: str) -> str:
    flag = f"--{name.replace('_', '-')}"
    started = ""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if name == "devices" and local.isdigit():
        started = f", which started {count(int(local), 'process', 'processes')} per node"
    elif name == "num_nodes":
        started = f", which started the job on {count(int(raw), 'node')}" if raw.isdigit() else ""
    message = (
        f"Loom({name}={value!r}) in the script disagrees with `torchloom run {flag} {raw}`{started}. Drop one of "
        f"them (leave {name} out of Loom(...) to follow the command line, or {flag} out of the command line to "
        f"follow the script), or make them agree."
    )
    if given_after_script(name):
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
        message += (
            f" {flag} {raw} came after the script on the command line, where it is still torchloom run's option "
            f"(as with `fabric run`): to give it to the script instead, put it after `--`: "
            f"`torchloom run {script} -- {flag} {raw}`."
        )
    return message


def strategy_class(name: str) -> type[Strategy]:
    module, cls = _STRATEGY_CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def configure(
    accelerator: Any,
    devices: Any,
    num_nodes: int | None,
    strategy: Any,
    precision: Any,
    timeout: timedelta | None,
) -> Strategy:
    """Select the strategy and complete it, in one `_bind` step, with its accelerator, precision, cluster
    environment, devices and timeout (which also checks its options against them)."""
    if isinstance(precision, (int, str)) or precision is None:
        precision = FABRIC_PRECISIONS.get(precision, precision)
    acc = select_accelerator(accelerator)
    if num_nodes is not None and (
        not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1
    ):
        raise ConfigurationError(f"num_nodes={num_nodes!r} is not valid: pass a positive int.")
    env = detect_environment(1, num_nodes or 1)
    if env.creates_processes_externally:
        num_nodes = _nodes_of_launch(env, num_nodes)
    num_nodes = num_nodes or 1
    given_devices = devices
    if devices == "auto" and isinstance(acc, CPUAccelerator) and env.creates_processes_externally:
        # Under torchrun/srun on CPU, the launcher already decided how many processes there are.
        devices = env.local_world_size() or max(1, env.world_size() // num_nodes)
    parallel_devices = acc.parse_devices(devices)
    num_processes = len(parallel_devices)
    if (
        env.creates_processes_externally
        and num_processes * num_nodes == 1
        and env.world_size() > 1
        and given_devices in _ONE_DEVICE
        and not (isinstance(strategy, Strategy) and strategy.is_distributed)
        and _inside_running_job()
    ):
        # As Fabric(devices=1) inside a running job: a process of its own (rank 0 of 1) beside the job, which its
        # collectives never involve. Without a running group, devices=1 under torchrun stays refused below: every
        # launched process would train alone.
        env = _LoneProcess()
    elif env.creates_processes_externally:
        _check_external_world(env, num_processes, num_nodes, given_devices)
    else:
        warn_if_srun_was_forgotten()
        env = detect_environment(num_processes, num_nodes)
    world_size = env.world_size()

    if timeout is not None and not isinstance(timeout, timedelta):
        raise ConfigurationError(f"timeout must be a datetime.timedelta, got {timeout!r}.")
    instance = _select_strategy(strategy, world_size)
    _check_replica_groups(instance)
    prec = select_precision(precision, acc.name, sharded_gradients=instance.sharded_gradients)
    instance._bind(acc, prec, env, parallel_devices, num_nodes, timeout)
    return instance


def _check_replica_groups(instance: Strategy) -> None:
    """Under `torchloom run --replica-groups`, only a strategy whose model is data-parallel across the groups
    joins the groups' quorum (torchloom.fault_tolerance); any other would train without fault tolerance, silently."""
    if replica_groups() is not None and instance.replica_groups_refusal is not None:
        raise ConfigurationError(
            f"torchloom run --replica-groups cannot run {type(instance).__name__} inside a replica group: "
            f"{instance.replica_groups_refusal}."
        )


def _select_strategy(strategy: Any, world_size: int) -> Strategy:
    if isinstance(strategy, str) and strategy.lower() in REFUSED_STRATEGIES:
        raise ConfigurationError(f"strategy={strategy!r}: {REFUSED_STRATEGIES[strategy.lower()]}")
    if not isinstance(strategy, (str, Strategy)) and is_lightning_strategy(strategy):
        # Lightning's own FSDPStrategy(...) etc., built by a program that imports them (issue 39).
        strategy = from_instance(strategy)
    if isinstance(strategy, Strategy):
        instance = strategy
    elif isinstance(strategy, str) and strategy.lower() in FABRIC_STRATEGIES:
        name, kwargs = FABRIC_STRATEGIES[strategy.lower()]
        instance = strategy_class(name)(**kwargs)
    elif isinstance(strategy, str) and strategy.lower() in STRATEGIES:
        name = strategy.lower()
        if name == "auto":
            # A replica group of one process is still data-parallel with the other groups.
            name = "single_device" if world_size == 1 and replica_groups() is None else "ddp"
        instance = strategy_class(name)()
    else:
        raise ConfigurationError(
            f"Unknown strategy {strategy!r}. Valid strategies: {', '.join(repr(s) for s in STRATEGIES)}, "
            "or a torchloom.strategies.Strategy instance."
        )
    if world_size > 1 and not instance.is_distributed:
        raise ConfigurationError(
            f"strategy {instance.name!r} runs one process, but this job has {count(world_size, 'process')}. "
            "Use strategy='ddp', 'fsdp' or 'fsdp2' (or 'auto'), or devices=1."
        )
    return instance


_ONE_DEVICE = (1, "1", [0], (0,))


def _inside_running_job() -> bool:
    """Whether this process already takes part in a process group (another Loom of the job, or the user's)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class _LoneProcess(LocalEnvironment):
    """The environment of a one-device Loom inside a running job: rank 0 of its own world of one process, whatever
    the job's RANK and LOCAL_RANK say (Fabric's SingleDeviceStrategy has rank 0 on every process)."""

    def __init__(self) -> None:
        super().__init__(1, 1)

    def global_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0


def _nodes_of_launch(env: ClusterEnvironment, num_nodes: int | None) -> int | None:
    """The node count the launcher started (torchrun's agents, SLURM's nodes of the step); `num_nodes` when the
    launcher does not say. A given `num_nodes` that disagrees is refused: hybrid sharding would replicate across
    the wrong groups of ranks, and an elastic job cannot know its node count in advance anyway."""
    launched = env.num_nodes()
    if num_nodes is None or launched is None:
        return num_nodes if launched is None else launched
    if num_nodes != launched:
        launcher, command, (flag,) = _launcher(env, ("--nnodes", "--num-nodes"))
        raise ConfigurationError(
            f"Loom(num_nodes={num_nodes}), but {launcher} started this job on {count(launched, 'node')}. Leave "
            f"num_nodes out to follow the launcher, or make them agree (e.g. {command} {flag} {num_nodes})."
        )
    return num_nodes


def _check_external_world(env: ClusterEnvironment, num_processes: int, num_nodes: int, devices: Any) -> None:
    expected = num_processes * num_nodes
    if env.world_size() != expected and devices != "auto":
        launcher, command, (nproc, nodes) = _launcher(
            env, ("--nproc-per-node", "--devices"), ("--nnodes", "--num-nodes")
        )
        raise ConfigurationError(
            f"Loom(devices={devices!r}, num_nodes={num_nodes}) expects {count(expected, 'process')}, but {launcher} "
            f"started {env.world_size()}. Make them agree (e.g. {command} {nproc} {num_processes} {nodes} "
            f"{num_nodes}), or leave devices out of Loom(...) (or pass devices='auto') to follow the launcher."
        )


def _launcher(env: ClusterEnvironment, *flags: tuple[str, str]) -> tuple[str, str, tuple[str, ...]]:
    """How to name the launcher that started this job, its command, and its spelling of each (torchrun's, torchloom
    run's) option in `flags`: `torchloom run`'s under `torchloom run`, which uses torchrun's machinery but is not
    what the user typed."""
    if under_torchloom_run():
        return "`torchloom run`", "torchloom run", tuple(ours for _, ours in flags)
    name = "torchrun" if type(env).__name__ == "TorchElasticEnvironment" else repr(env)
    return name, "torchrun", tuple(theirs for theirs, _ in flags)
