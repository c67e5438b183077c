"""What every benchmark shares: starting CPU ranks, alternating the sides of a comparison, statistics, tables.

Each benchmark compares two (or more) sides in one invocation. Sides run alternately in ABBA order (A B, then
B A, ...), so a slow phase of the shared machine hits both alike; each side is timed several times, and every
result line gives the median and the spread (min..max). The ratio of the two sides is computed per repeat and
then summarised, which cancels most of the drift that absolute times suffer from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchloom import testing
from torchloom.testing import free_port  # noqa: F401 - re-exported for the benchmarks

# ---- the model every benchmark trains ------------------------------------------------------------------------


class Block(nn.Module):
    """A transformer-style MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """`blocks` blocks and a head. `wrap` (e.g. FSDP1's `wrap` inside `loom.init_module()`) is applied to every
    block; the head is left outside every unit, so under FSDP it is a replicated leftover."""

    def __init__(
        self,
        dim: int,
        blocks: int,
        out: int | None = None,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
    ):
        super().__init__()
        wrap = wrap or (lambda m: m)
        self.blocks = nn.ModuleList(wrap(Block(dim)) for _ in range(blocks))
        self.head = nn.Linear(dim, out or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_numel(dim: int) -> int:
    return 2 * dim + (dim * 4 * dim + 4 * dim) + (4 * dim * dim + dim)


def model_numel(dim: int, blocks: int, out: int | None = None) -> int:
    out = out or dim
    return blocks * block_numel(dim) + dim * out + out


def batch(rank: int, tokens: int, dim: int, out: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch, different on every rank (data parallel)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(tokens, dim, generator=g), torch.randn(tokens, out or dim, generator=g)


# ---- ranks ---------------------------------------------------------------------------------------------------


def run_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 900, device: str = "cpu"
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes; return their results in rank order.
    A rank that fails or a job past `timeout` stops every rank and raises."""
    # fork on Linux: the ranks start without importing torch again (seconds on a busy 2-core machine). The parent
    # never runs a torch op before this, so no thread pool is inherited half-initialised. CUDA cannot be used in
    # a forked child once the parent has touched it (as asking for the GPU's name does): spawn there.
    fork = sys.platform.startswith("linux") and device == "cpu"
    return testing.run_ranks(
        fn, *args, world_size=world_size, timeout=timeout, start_method="fork" if fork else "spawn"
    )


# ---- alternating the sides -----------------------------------------------------------------------------------


def alternate(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Call each side's measurement `repeats` times, in ABBA order; return each side's measurements."""
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else reversed(names):
            out[name].append(sides[name]())
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes()


# ---- statistics and output -----------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def summary(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """'median [min..max]'."""
    return f"{fmt.format(median(values))} [{fmt.format(min(values))}..{fmt.format(max(values))}]"


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-repeat ratios a_i / b_i (the sides of one repeat ran back to back)."""
    return [x / y for x, y in zip(a, b, strict=True)]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratio_line(name: str, values: Sequence[float], goal: str | None = None) -> dict[str, Any]:
    """Print one result line, `ratio  NAME  median [min..max]  goal ...  met|MISSED`, and return it as a dict.
    `goal` is "<= 1.03", ">= 0.95" or "< 0.2"."""
    med = median(values)
    verdict = ""
    if goal:
        op, bound = goal.split()
        ok = {
            "<=": med <= float(bound),
            "<": med < float(bound),
            ">=": med >= float(bound),
            ">": med > float(bound),
        }[op]
        verdict = f"  goal {goal}  {'met' if ok else 'MISSED'}"
    print(f"ratio  {name}  {summary(values)}{verdict}", flush=True)
    return {
        "name": name,
        "median": med,
        "min": min(values),
        "max": max(values),
        "goal": goal,
        "values": list(values),
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}){mem}, torch {torch.__version__}, Python {platform.python_version()}"
    )


def gpu_name() -> str:
    """The first GPU's name and memory ('' without CUDA)."""
    if not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(0)
    return f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB)"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: 2 ranks on gloo (the default); cuda: --world ranks on as many GPUs over NCCL",
    )
    parser.add_argument(
        "--world",
        type=int,
        choices=(1, 2),
        default=2,
        help="ranks with --device cuda, one per GPU (1 on a one-GPU machine: no communication to measure, "
        "but torchloom's own step and memory costs on the GPU); the CPU runs are always 2 ranks",
    )


def check_device(parser: argparse.ArgumentParser, device: str, world: int = 2) -> None:
    """Refuse --device cuda where there are fewer than `world` GPUs, and --world 1 on CPU, before any rank
    starts."""
    if device == "cpu" and world != 2:
        parser.error("--world applies to --device cuda; the CPU runs are 2 gloo ranks")
    if device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < world:
            parser.error(
                f"--device cuda needs {world} GPUs; torch {torch.__version__} sees {have} "
                f"(torch.cuda.is_available() is {torch.cuda.is_available()})"
            )


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a wall-clock measurement covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def header(title: str, args: argparse.Namespace) -> None:
    print(f"# {title}", flush=True)
    print(f"# machine: {machine()}", flush=True)
    if getattr(args, "device", "cpu") == "cuda":
        print(f"# gpu: {gpu_name()}", flush=True)
    print(f"# command: python {' '.join(sys.argv)}", flush=True)
    print(f"# settings: {json.dumps(vars(args), default=str)}", flush=True)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(
            json.dumps({"machine": machine(), "command": sys.argv, **payload}, indent=2, default=str)
        )


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"
