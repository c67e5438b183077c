"""`torchloom plan`: each rank's peak memory before launch, from the user's unchanged script run for its first
training steps on fake tensors and a fake process group standing for the whole world.

One fresh process per simulated rank (`_fake_rank`): rank 0, which holds what only rank 0 holds, and the last
rank, standing for all the others (ranks of data-parallel strategies differ only in their shard of the data and
of the sharded state, which is the same size on every rank but for the remainders).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchloom.errors import ConfigurationError, TorchloomError
from torchloom.planning.tracker import KINDS, same_spot

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20}
_UNITS.update({"g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40})


class PlanError(TorchloomError):
    """The plan could not be completed; `plan` holds what was planned up to the failure."""

    def __init__(self, message: str, plan: dict[str, Any]) -> None:
        super().__init__(message)
        self.plan = plan


#: `torchloom plan --device NAME`: the memory a device's driver reports (`nvidia-smi`'s total, in MiB; of which the
#: CUDA context takes a few hundred MiB, `CUDA_CONTEXT`) and its compute capability. The capabilities are NVIDIA's
#: (developer.nvidia.com/cuda-gpus and /cuda-legacy-gpus); the totals as reported on those cards (sources by
#: entry). A card of another memory (the 96 GB H100 of Meta's Grand Teton, say): `--device h100 --device-memory
#: 96GiB`.
DEVICES: dict[str, tuple[int, tuple[int, int]]] = {
    # Modal's reported totals (modal-labs/modal-client#2797): H100 SXM/PCIe 80GB 81,559 MiB, A100 80GB 81,920,
    # A100 40GB 40,960, A10 23,028, L40S 46,068, L4 23,034, T4 15,360 MiB; H200 143,771 MiB (Modal's blog, "Why
    # does an NVIDIA H100 80GB card offer 85.52 GB?")
    "h100": (81559 * 2**20, (9, 0)),
    "h100-nvl": (95830 * 2**20, (9, 0)),  # H100 NVL 94GB: nvidia-smi's 95,830 MiB (NVIDIA/gpu-admin-tools#4)
    "h200": (143771 * 2**20, (9, 0)),
    # B200: 178.35 GiB as CUDA reports it (pytorch/ao#4002), to the MiB as rounded there
    "b200": (182630 * 2**20, (10, 0)),
    "a100": (81920 * 2**20, (8, 0)),
    "a100-40gb": (40960 * 2**20, (8, 0)),
    "a10": (23028 * 2**20, (8, 6)),
    "a10g": (23028 * 2**20, (8, 6)),  # AWS's A10G: nvidia-smi's 23,028 MiB (NVIDIA/DCGM#232)
    "l40s": (46068 * 2**20, (8, 9)),
    "l4": (23034 * 2**20, (8, 9)),
    "t4": (15360 * 2**20, (7, 5)),
    "rtx5090": (
        32607 * 2**20,
        (12, 0),
    ),  # GeForce RTX 5090: nvidia-smi's 32,607 MiB (noonghunna/club-3090#1107)
}

#: The CUDA context of each process (the driver's and the CUDA runtime's own state, and the kernels it loads),
#: outside the caching allocator: a stated allowance for the plan's "does it fit" judgement, not a measurement.
#: With CUDA 12's lazy module loading, torch's context takes about 0.4-0.6 GiB on data-centre GPUs.
CUDA_CONTEXT = 512 * 2**20


def parse_bytes(text: str, option: str = "--budget") -> int:
    """'80GiB', '80 GB', '512MiB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigurationError(
            f"{option} {text!r} is not a size: write a number and a unit, such as 80GiB, 40GB or 512MiB."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_assumptions(items: list[str]) -> dict[str, bool | int | float]:
    """`--assume train.py:42=false` (repeated) -> {'train.py:42': False}."""
    found: dict[str, bool | int | float] = {}
    for item in items:
        spot, _, text = item.partition("=")
        file, _, line = spot.rpartition(":")
        value: bool | int | float | None = {"true": True, "false": False}.get(text.strip().lower())
        if value is None:
            try:
                value = float(text) if any(c in text for c in ".eE") else int(text)
            except ValueError:
                value = None
        if not file or not line.isdigit() or value is None:
            raise ConfigurationError(
                f"--assume {item!r}: write FILE:LINE=VALUE, such as train.py:42=false or model.py:17=0.5 (VALUE: "
                "true, false or a number), with the file and line a WARNING of the plan names."
            )
        found[f"{file}:{line}"] = value
    return found


def human(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def simulated_ranks(world_size: int) -> list[tuple[int, list[int]]]:
    """(the rank simulated, the ranks it stands for)."""
    if world_size == 1:
        return [(0, [0])]
    return [(0, [0]), (world_size - 1, list(range(1, world_size)))]


def rank_label(entry: dict[str, Any]) -> str:
    """Who a simulated rank stands for: 'rank 0', 'ranks 1-7 (as rank 7)', with its pipeline stage if any."""
    ranks = entry["ranks"]
    together = ranks == list(range(ranks[0], ranks[-1] + 1))
    many = f"ranks {ranks[0]}-{ranks[-1]}" if together else "ranks " + ",".join(map(str, ranks))
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"{many} (as rank {entry['rank']})"
    if entry.get("stage") is not None:
        who += f", pipeline stage {entry['stage']}"
    return who


def _clean_module(name: str) -> str:
    """A module name without the wrappers' own levels (`LoomModule._forward_module.module.layers.3` ->
    `layers.3`)."""
    wrappers = {
        "_forward_module",
        "module",
        "_fsdp_wrapped_module",
        "_checkpoint_wrapped_module",
        "_orig_mod",
    }
    parts = [part for part in name.split(".")[1:] if part not in wrappers]
    return ".".join(parts) if parts else name.split(".")[0]


def plan(
    script: str,
    script_args: list[str] | None = None,
    *,
    devices: int = 1,
    num_nodes: int = 1,
    steps: int = 2,
    strategy: str | None = None,
    precision: str | None = None,
    budget: int | None = None,
    timeout: float = 1800.0,
    fit: dict[str, Any] | None = None,
    assume: dict[str, Any] | None = None,
    device: str | None = None,
    device_memory: int | None = None,
    alloc_conf: str | None = None,
) -> dict[str, Any]:
    """Plan `script` on `devices` ranks per node and `num_nodes` nodes; returns the plan as a dict (what
    `--json` writes); `fit`: the changes a re-plan of `torchloom.planning.fit` applies; `assume`: what the
    script's reads of fake values answer, by `FILE:LINE` (`--assume`); `device` (a name of `DEVICES`) or
    `device_memory` (bytes): plan a CUDA job on that device (a script's `Loom(accelerator="cuda")` is one without
    them too), with the caching allocator simulated as `alloc_conf` configures it (default: the environment's
    `PYTORCH_CUDA_ALLOC_CONF`, as the real run reads it). Raises `PlanError` (with what was planned so far) when a
    simulated rank failed."""
    if not Path(script).is_file():
        raise ConfigurationError(f"The script {script!r} does not exist (looked in {os.getcwd()}).")
    if devices < 1 or num_nodes < 1 or steps < 1:
        raise ConfigurationError("--devices, --num-nodes and --steps must be at least 1.")
    world_size = devices * num_nodes
    target = planned_device(device, device_memory, alloc_conf)
    options = {
        "accelerator": "cpu",
        "devices": str(devices),
        "num_nodes": str(num_nodes),
        "strategy": strategy,
        "precision": precision,
    }
    entries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="torchloom-plan-") as folder:

        def start(rank: int) -> subprocess.Popen[str]:
            config: dict[str, Any] = {
                "rank": rank,
                "world_size": world_size,
                "devices": devices,
                "steps": steps,
                "options": options,
                "script": os.path.abspath(script),
                "script_args": list(script_args or []),
                "out": os.path.join(folder, f"rank{rank}.json"),
                "fit": fit,
                "assume": dict(assume or {}),
                "mailbox": folder,
                "device": target,
            }
            path = os.path.join(folder, f"config{rank}.json")
            with open(path, "w") as f:
                json.dump(config, f)
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", "1")
            # Into a file, not a pipe: the planner polls its ranks (to start a pipeline's missing stages), and a
            # full pipe would stop a rank that writes much.
            with open(os.path.join(folder, f"stderr{rank}.txt"), "w") as stderr:
                return subprocess.Popen(
                    [sys.executable, "-m", "torchloom.planning._fake_rank", path],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    text=True,
                )

        children = {rank: (stands_for, start(rank)) for rank, stands_for in simulated_ranks(world_size)}
        stages = _wait(children, folder, start, timeout)
        for rank, (stands_for, child) in sorted(children.items()):
            out = os.path.join(folder, f"rank{rank}.json")
            with open(os.path.join(folder, f"stderr{rank}.txt")) as f:
                stderr = f.read()
            if not os.path.exists(out):
                raise PlanError(
                    f"the simulated rank {rank} ended (exit status {child.returncode}) without a plan:\n"
                    + stderr[-3000:],
                    {"ranks": entries},
                )
            with open(out) as f:
                result = json.load(f)
            result["ranks"] = stands_for
            if stages is not None and result.get("stage") is not None:
                # A pipeline stage is a role of its own: each simulated rank stands for its stage's ranks.
                result["ranks"] = stages[result["stage"]]
            result["module"] = _clean_module(result["module"]) if result["module"] else ""
            entries.append(result)
    result_plan: dict[str, Any] = {
        "script": script,
        "script_args": list(script_args or []),
        "world_size": world_size,
        "devices": devices,
        "num_nodes": num_nodes,
        "steps": steps,
        "strategy": strategy,
        "precision": precision,
        "peak_bytes": max(entry["peak_bytes"] for entry in entries),
        "budget_bytes": budget,
        "ranks": entries,
    }
    if any(entry.get("cuda") for entry in entries):
        result_plan["device"] = target
        result_plan["reserved_peak_bytes"] = max(
            entry["allocator"]["reserved_peak"] for entry in entries if entry.get("allocator")
        )
        result_plan["device_fit"] = device_fit(entries, target)
        hosts = [entry["host"]["peak_bytes"] for entry in entries if entry.get("host")]
        if hosts:  # CPU offload: the host's (pinned) memory, apart from the device's
            result_plan["host_peak_bytes"] = max(hosts)
    result_plan["warnings"] = warnings(result_plan)
    for spot in assume or {}:  # a misspelt --assume would otherwise leave the guess it meant to replace
        if not any(
            same_spot(spot, read["file"], read["line"])
            for entry in entries
            for read in entry.get("fake_reads", [])
        ):
            result_plan["warnings"].append(f"--assume {spot}: no read of a fake value happened at that line")
    problems: dict[str, list[int]] = {}  # the same problem on several simulated ranks is said once
    for entry in entries:
        problem = _problem(entry, steps)
        if problem is not None:
            problems.setdefault(problem, []).append(entry["rank"])
    if problems:
        raise PlanError(
            "\n".join(
                f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {problem}"
                for problem, ranks in problems.items()
            ),
            result_plan,
        )
    return result_plan


def device_fit(entries: list[dict[str, Any]], device: dict[str, Any]) -> dict[str, Any]:
    """Does the job fit on the device: the largest simulated rank's reserved peak (what the caching allocator
    holds), NCCL's allowance and the CUDA context's (`CUDA_CONTEXT`), both outside the allocator, against the
    device's memory (none given: no judgement, `fits` None)."""
    entry = max((e for e in entries if e.get("allocator")), key=lambda e: e["allocator"]["reserved_peak"])
    reserved = entry["allocator"]["reserved_peak"]
    nccl = (entry.get("nccl") or {}).get("bytes", 0)
    needed = reserved + nccl + CUDA_CONTEXT
    memory = device.get("memory")
    return {
        "rank": entry["rank"],
        "reserved": reserved,
        "nccl": nccl,
        "cuda_context": CUDA_CONTEXT,
        "needed": needed,
        "memory": memory,
        "fits": None if not memory else needed <= memory and not entry["allocator"].get("out_of_memory"),
    }


def planned_device(name: str | None, memory: int | None, alloc_conf: str | None = None) -> dict[str, Any]:
    """What a CUDA job is planned on: `--device` (a name of `DEVICES`) and/or `--device-memory`, and the
    caching allocator's configuration (`PYTORCH_CUDA_ALLOC_CONF`, as the real run reads it)."""
    from torchloom.planning.allocator import parse_config

    target: dict[str, Any] = {"name": None, "memory": memory, "capability": None}
    if name is not None:
        key = name.lower()
        if key not in DEVICES:
            raise ConfigurationError(
                f"--device {name!r} is not a device the plan knows: one of {', '.join(DEVICES)}, or give its "
                "memory with --device-memory (such as 80GiB)."
            )
        target["name"] = key
        target["memory"] = memory or DEVICES[key][0]
        target["capability"] = list(DEVICES[key][1])
    conf = alloc_conf if alloc_conf is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    target["expandable_segments"] = parse_config(conf)
    return target


def _where(spot: dict[str, Any]) -> str:
    return f"{spot['file']}:{spot['line']}" + (f" (`{spot['code']}`)" if spot.get("code") else "")


def _guessed(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The reads of fake values the plan answered with a guess (the user said nothing of them)."""
    return [read for read in entry.get("fake_reads", []) if not read.get("assumed")]


def warnings(result: dict[str, Any]) -> list[str]:
    """What the plan guessed or could not model, once for all the simulated ranks: each line of the script that
    read a fake value (answered without knowing it), each `torch.compile` (planned as eager)."""
    found: list[str] = []
    for entry in result["ranks"]:
        for read in _guessed(entry):
            answers = " or ".join(repr(a) for a in read["answers"])
            text = (
                f"{_where(read)} read the value of a fake tensor {read['count']} time"
                f"{'s' if read['count'] > 1 else ''} (in {read['function']}); the plan answered {answers} "
                "without knowing it, so a branch there may go another way than on real data. Say what it is: "
                f"--assume {os.path.basename(read['file'])}:{read['line']}=VALUE, or "
                "`with torchloom.planning.assume(VALUE):` around the read"
            )
            if text not in found:
                found.append(text)
        for compiled in entry.get("compiled", []):
            text = (
                f"{_where(compiled)}: torch.compile is planned as eager (fake tensors run torch's eager "
                "kernels): a compiled run's activations and temporaries can differ (fused kernels hold fewer "
                "intermediates; the compiler's own buffers are not counted)"
            )
            if text not in found:
                found.append(text)
    return found


def _wait(
    children: dict[int, tuple[list[int], Any]], folder: str, start: Any, timeout: float
) -> list[list[int]] | None:
    """Wait for the simulated ranks; when a pipeline's ranks say which ranks each stage has (`stages.json`),
    start a simulated rank for each stage no simulated rank runs (its last rank), which the others' stages wait
    for. Returns the stages' ranks (None: no pipeline)."""
    import time

    deadline = time.monotonic() + timeout
    stages: list[list[int]] | None = None
    path = os.path.join(folder, "stages.json")
    while any(child.poll() is None for _, child in children.values()):
        if stages is None and os.path.exists(path):
            with open(path) as f:
                stages = json.load(f)
            assert stages is not None
            covered = {next(i for i, ranks in enumerate(stages) if rank in ranks) for rank in children}
            for stage, ranks in enumerate(stages):
                if stage not in covered:
                    children[ranks[-1]] = (ranks, start(ranks[-1]))
        if time.monotonic() > deadline:
            for _, child in children.values():
                child.kill()
            raise PlanError(f"the simulated ranks did not finish within {timeout:.0f} s", {"ranks": []})
        time.sleep(0.05)
    return stages


def _problem(entry: dict[str, Any], steps: int) -> str | None:
    """What stopped a simulated rank short of the planned steps, without its rank (said once for all)."""
    if entry["error"]:
        first, _, rest = entry["error"].partition("\n")
        at = f" at {_where(entry['user_line'])}" if entry.get("user_line") else ""
        why = (
            "The operation it names cannot run on fake tensors (they have no values: a result whose shape "
            "depends on the values, or a kernel without a fake implementation)"
            if entry.get("fake_tensor_error")
            else "The script raised this error during the run on fake tensors"
        )
        if "into pipeline stages" in first:
            why += (
                ". torch's pipeline tracer ran on the plan's fake tensors here: if `torchloom run` sets this model "
                "up, the failure is the planner's limit, not the model's (please report it with this message)"
            )
        guessed = _guessed(entry)
        if guessed:
            lines = ", ".join(_where(read) for read in guessed)
            unused = "unused parameters" in first or "finished reduction" in first
            why += (
                f". A read of a fake value caused it: the script read fake values at {lines}, and the branch "
                "there went the way the plan's guess sent it, leaving parameters unused that the real run uses"
                if unused
                else f". The script read fake values before it (at {lines}): if a branch there went another "
                "way than on real data, the error may be the plan's"
            ) + " (say what each value is with --assume FILE:LINE=VALUE or torchloom.planning.assume)"
        return (
            f"the run on fake tensors stopped after {entry['steps']} of {steps} training "
            f"steps{at}: {first}\n{why}; the plan below covers what ran before it. Details:\n{rest}"
        )
    if entry["steps"] == 0:
        return (
            "the script ended without reaching a training step (no optimizer.step() ran), so "
            "there is no step to plan. `torchloom plan` plans the first steps of a training loop: check that the "
            "script trains with these arguments (a --steps 0, a dry-run flag or an empty data set stop it)."
        )
    if entry["steps"] < steps:
        return (
            f"the script ended after {entry['steps']} training steps, fewer than the {steps} "
            f"planned; the plan covers those (give --steps {entry['steps']} to plan only those)."
        )
    return None


def _device_line(allocator: dict[str, Any], device: dict[str, Any]) -> str:
    """A CUDA job's rank: the caching allocator's simulated peaks, as `max_memory_allocated()` and
    `max_memory_reserved()` would report them, against the device's memory."""
    line = (
        f"CUDA caching allocator (simulated{', expandable segments' if device.get('expandable_segments') else ''})"
        f": max_memory_allocated {human(allocator['allocated_peak'])}, "
        f"max_memory_reserved {human(allocator['reserved_peak'])}"
    )
    if device.get("memory"):
        line += f" of the device's {human(device['memory'])}"
    oom = allocator.get("out_of_memory")
    if oom:
        line += (
            f"; OUT OF MEMORY at step {oom['step'] + 1}, {oom['phase']}"
            + (f" of {_clean_module(oom['module'])}" if oom["module"] else "")
            + f": {human(oom['bytes'])} more with {human(oom['reserved'])} reserved (the cache released first)"
        )
    return line


def _cuda_lines(entry: dict[str, Any]) -> list[str]:
    """What a CUDA rank's reserved peak is made of (each stream's and pool's segments, which serve only that
    stream and pool) and which kernel each attention call was planned with."""
    allocator = entry.get("allocator") or {}
    lines = []
    pools = allocator.get("reserved_at_peak") or []
    if pools:
        held = allocator.get("allocated_at_reserved_peak", 0)
        at = allocator.get("reserved_peak_at") or {}
        where = (
            f" (step {at['step'] + 1}, {at['phase']}"
            + (f" of {_clean_module(at['module'])}" if at["module"] else "")
            + ")"
            if at and at.get("phase") not in (None, "setup", "between steps")
            else f" ({at['phase']})"
            if at
            else ""
        )
        lines.append(
            f"    reserved at its peak{where}, {human(held)} of it allocated: "
            + ", ".join(f"{p['stream']} {p['pool']} pool {human(p['bytes'])}" for p in pools)
        )
    host = entry.get("host")
    if host:
        at = (
            host["phase"]
            if host["phase"] in ("setup", "between steps")
            else f"step {host['step']}, {host['phase']}"
        )
        parts = [f"{kind} {human(host['breakdown'][kind])}" for kind in KINDS if host["breakdown"].get(kind)]
        lines.append(
            f"    host memory (CPU offload: the CPU's memory, pinned by default, not the device's; in no figure above): peak "
            f"{human(host['peak_bytes'])} at {at}: " + ", ".join(parts)
        )
    cublas = entry.get("cublas")
    if cublas and cublas["workspaces"]:
        made = cublas["workspaces"]
        lines.append(
            f"    cuBLAS workspaces (allocator blocks no tensor owns: in max_memory_allocated and reserved, not in the "
            f"peak above): {human(cublas['bytes'])}, one for each thread and stream that ran a matmul: "
            + ", ".join(f"{w['library']} {human(w['bytes'])} ({w['thread']}, {w['stream']})" for w in made)
        )
    nccl = entry.get("nccl")
    if nccl and nccl["communicators"]:
        lines.append(
            f"    outside the allocator (not in max_memory_reserved): NCCL, an allowance of "
            f"{human(nccl['per_communicator'])} for each of {nccl['communicators']} communicator"
            f"{'s' if nccl['communicators'] > 1 else ''} (2 x NCCL_BUFFSIZE x NCCL_MAX_NCHANNELS), "
            f"{human(nccl['bytes'])}; the CUDA context: an allowance of {human(CUDA_CONTEXT)} (below)"
        )
    for kernel, call in sorted((entry.get("attention") or {}).items()):
        lines.append(
            f"    attention: {call['calls']} call{'s' if call['calls'] > 1 else ''} planned as CUDA's {kernel} "
            f"kernel ({call['op']}" + (f"; {call['why']}" if kernel != "flash" else "") + ")"
        )
    return lines


def format_plan(result: dict[str, Any]) -> str:
    device = result.get("device")
    on = ""
    if device is not None:
        on = " as a CUDA job" + (
            f" on {device['name']}"
            if device.get("name")
            else f" on a device of {human(device['memory'])}"
            if device.get("memory")
            else ""
        )
    lines = [
        f"torchloom plan: {result['script']} on {result['world_size']} ranks "
        f"({result['devices']} per node, {result['num_nodes']} node{'s' if result['num_nodes'] > 1 else ''}), "
        f"first {result['steps']} training steps on fake tensors{on}",
    ]
    for warning in result.get("warnings", []):
        lines.append(f"WARNING: {warning}")
    for entry in result["ranks"]:
        for read in entry.get("fake_reads", []):
            answers = " or ".join(repr(a) for a in read["answers"])
            line = f"assumed ({read['assumed']}): {_where(read)} read as {answers}"
            if read.get("assumed") and line not in lines:
                lines.append(line)
    budget = result.get("budget_bytes")
    for entry in result["ranks"]:
        who = rank_label(entry)
        where = (
            entry["phase"]
            if entry["phase"] in ("setup", "between steps")
            else (
                f"step {entry['step']}, {entry['phase']}"
                + (f" of {entry['module']}" if entry["module"] else "")
            )
        )
        fits = ""
        if budget:
            fits = (
                "  fits"
                if entry["peak_bytes"] <= budget
                else f"  OVER the budget by {human(entry['peak_bytes'] - budget)}"
            )
        lines.append(f"{who}: peak {human(entry['peak_bytes'])} at {where}{fits}")
        parts = [
            f"{kind} {human(entry['breakdown'][kind])}" for kind in KINDS if entry["breakdown"].get(kind)
        ]
        lines.append("    " + ", ".join(parts))
        if entry.get("allocator"):
            lines.append("    " + _device_line(entry["allocator"], result.get("device") or {}))
            lines.extend(_cuda_lines(entry))
    fit = result.get("device_fit")
    if fit:
        line = (
            f"on the device: {human(fit['reserved'])} reserved + {human(fit['nccl'])} NCCL + "
            f"{human(fit['cuda_context'])} CUDA context (allowances, outside the allocator) = {human(fit['needed'])}"
        )
        if fit["memory"]:
            line += f" of {human(fit['memory'])}: " + (
                f"fits ({human(fit['memory'] - fit['needed'])} to spare)" if fit["fits"] else "DOES NOT FIT"
            )
        lines.append(line)
    if budget:
        lines.append(
            f"budget {human(budget)} per rank: "
            + (
                "every rank fits"
                if result["peak_bytes"] <= budget
                else f"the largest peak is {human(result['peak_bytes'])}"
            )
        )
    return "\n".join(lines)
