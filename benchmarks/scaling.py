"""Scaling on paper: the largest model that fits per GPU, and the communication per step, for 8, 64 and 512 GPUs
of 80 GiB with FULL_SHARD and HYBRID_SHARD (and DDP for reference), from the per-rank memory model that
benchmarks/memory.py measures on CPU.

Memory per GPU for a model of P parameters in L equal blocks (each its own unit), sharded over S ranks (S = N for
FULL_SHARD; S = G, the GPUs per node, for HYBRID_SHARD, which replicates across the N / G nodes):

    M(P) = B + A + k * (s * P / S + u * P / L)

    s = 16 bytes        fp32 parameters (4) + gradients (4) + AdamW's two moments (8); with bf16-mixed the
                        sharded parameters, gradients and optimizer state stay fp32, so s is the same
    u = 2*b + g         the gathered units: parameters of the unit computing and of the one prefetched (b bytes a
                        parameter each: 4 fp32, 2 bf16) + that unit's unsharded gradients (g = b)
    k                   measured overhead factor: (peak - baseline) / (floor - baseline) of configuration (a) in
                        memory.py, i.e. what a real run holds beyond the formula's state, block and activations
    B                   per-GPU baseline (CUDA context, NCCL buffers, allocator reserve), --baseline-gib
    A                   activations per GPU (batch, sequence and checkpointing dependent), --activations-gib

    largest P = (M_gpu - B - A) / (k * (s / S + u / L))
    DDP: M(P) = B + A + k * 20 * P          (parameters, gradients, AdamW and DDP's gradient buckets, fp32)

Communication per step, bytes each GPU sends (it receives as much), with ring collectives:

    FULL_SHARD     (N - 1) / N * P * (2*b + r)            all-gather in forward and again in backward, reduce-scatter
    HYBRID_SHARD   (G - 1) / G * P * (2*b + r)            the same inside a node, plus
                   + 2 * (R - 1) / R * P / G * r          all-reduce of each shard across the R = N / G nodes
    DDP            2 * (N - 1) / N * P * r                all-reduce of all gradients
    r = 4 bytes    gradients are reduced in fp32 (also under bf16-mixed, torchloom's reduce_dtype)

Replicated leftovers (a head outside every unit) add 16 bytes per parameter to every GPU, and their all-reduce
2 * (N - 1) / N * P_rep * 4 bytes to the communication; the table leaves them out.

    python benchmarks/scaling.py                              # k from benchmarks/results/memory.json if present
    python benchmarks/scaling.py --memory-json out.json       # k from a memory.py --json run of your own
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import header, ratio_line, table  # noqa: E402

GIB = 2**30
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "memory.json"


def overhead_factor(path: Path | None) -> tuple[float, str]:
    """k from a memory.py JSON, or 1.0 where there is none."""
    if path is None or not path.exists():
        return 1.0, "no memory.py results found: k = 1 (the formula alone)"
    data = json.loads(path.read_text())
    measured, floor = data["measured"]["a"], data["floor_a"]
    k = (measured["peak"] - floor["baseline"]) / (floor["total"] - floor["baseline"])
    return k, (
        f"k = {k:.3f} from {path} (configuration (a): peak {measured['peak'] / 2**20:.0f} MiB, floor "
        f"{floor['total'] / 2**20:.0f} MiB, baseline {floor['baseline'] / 2**20:.0f} MiB)"
    )


def largest(mem: float, base: float, act: float, k: float, per_param: float) -> float:
    return max(0.0, (mem - base - act) / (k * per_param))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="the same table (it is arithmetic); for the smoke test"
    )
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory per GPU")
    parser.add_argument("--gpus", default="8,64,512", help="GPU counts")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="G: the shard group of HYBRID_SHARD")
    parser.add_argument("--blocks", type=int, default=32, help="L: equal blocks, each its own unit")
    parser.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="bf16-mixed")
    parser.add_argument(
        "--baseline-gib", type=float, default=3.0, help="B: CUDA context, NCCL, allocator reserve"
    )
    parser.add_argument("--activations-gib", type=float, default=8.0, help="A: activations per GPU")
    parser.add_argument("--memory-json", type=Path, default=DEFAULT_JSON, help="a memory.py --json result")
    args = parser.parse_args(argv)
    header("Scaling on paper: largest model per GPU and communication per step", args)
    k, source = overhead_factor(args.memory_json)
    b = 4 if args.precision == "fp32" else 2
    r, s, u = 4, 16, 3 * b
    mem, base, act = args.gpu_gib * GIB, args.baseline_gib * GIB, args.activations_gib * GIB
    G, L = args.gpus_per_node, args.blocks
    print(f"# {source}")
    print(
        f"# {args.precision}: s = {s} B, u = 2*b + g = {u} B (b = g = {b}), r = {r} B; L = {L} blocks; "
        f"B = {args.baseline_gib:g} GiB, A = {args.activations_gib:g} GiB, {args.gpu_gib:g} GiB per GPU",
        flush=True,
    )
    rows = []
    for n in [int(v) for v in args.gpus.split(",")]:
        for name, shard in (("FULL_SHARD", n), ("HYBRID_SHARD", min(G, n)), ("DDP", None)):
            if shard is None:
                p = largest(mem, base, act, k, 5 * s / 4)
                state, units = k * 5 * s / 4 * p, 0.0
                comm = 2 * (n - 1) / n * p * r
                across = "all" if n > G else "none"
            else:
                p = largest(mem, base, act, k, s / shard + u / L)
                state, units = k * s / shard * p, k * u / L * p
                comm = (shard - 1) / shard * p * (2 * b + r)
                replicas = n // shard
                if replicas > 1:
                    inter = 2 * (replicas - 1) / replicas * p / shard * r
                    comm += inter
                    across = f"{inter / GIB:.1f} (all-reduce)"
                else:
                    across = "all" if shard > G else "none"
            rows.append(
                [
                    n,
                    name,
                    shard or 1,
                    f"{p / 1e9:.1f}",
                    f"{state / GIB:.1f}",
                    f"{units / GIB:.1f}",
                    f"{comm / GIB:.1f}",
                    across,
                ]
            )
    print()
    print(
        table(
            [
                "GPUs",
                "sharding",
                "shard group",
                "largest model, B params",
                "sharded state GiB",
                "gathered units GiB",
                "comm GiB/step/GPU",
                "of it across nodes GiB",
            ],
            rows,
        )
    )
    print()
    ratio_line("scaling overhead factor k (measured/formula, memory.py (a))", [k])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
