"""Memory: peak resident memory per rank for 3 AdamW steps on 2 CPU ranks, against the analytical floor.

    (a)  torchloom "fsdp2", every block its own unit made by hand (fully_shard(block)), head replicated
    (a') the same layout with raw fully_shard(block), left at its defaults, and a hand-written all-reduce for
         the head. Without a root unit every block is an FSDP root, and FSDP2 keeps a root's parameters
         unsharded from forward to backward and each root's reduce-scatter buffer to the end of backward;
         torchloom gives hand-made units the behaviour they would have under a root unit.
    (b)  torchloom "fsdp2" with no units made and no policy: the root is the only unit
    (c)  torchloom "ddp"
    (a) glibc  (a) again, with glibc's malloc left at its defaults (see below)
    (a) fsdp   (a) with torchloom "fsdp" (FullyShardedDataParallel): wrap(block) inside loom.init_module()

Every configuration runs in fresh processes (peak RSS is a process's high-water mark, VmHWM). The sharded
configurations build the model on the meta device (`loom.init_module(empty_init=True)`), so no rank ever holds
the whole model; DDP needs it whole by definition.

glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which FSDP's
per-step buffers (a block's gathered parameters, its unsharded gradients) come from the heap, and the freed ones
stay there as fragments the process keeps: RSS then grows with the allocator's history, not with what training
holds. Every configuration except "(a) glibc" therefore fixes the threshold at 1 MiB in each rank (what
`MALLOC_MMAP_THRESHOLD_=1048576` does), and "(a) glibc" shows the difference.

The floor for (a), per rank, in bytes (fp32, AdamW keeps two moments):

    floor(a) = 16 * (N_sharded / world + N_replicated)      parameters + gradients + optimizer state
             + 4 * N_largest_block                           one block's parameters, gathered for compute
             + activations                                   saved for backward, 4 * tokens * (10 * dim + 2) per
                                                              block + 4 * tokens * dim for the head
             + baseline                                      measured: the rank's RSS after import and
                                                              process-group start, before the model exists

Goal: (a) within 15% of floor(a). Also printed: (a)/(b) and (a)/(c).

`--device cuda` runs the same configurations on 2 GPUs over NCCL and measures GPU memory instead: the peak of
`torch.cuda.max_memory_allocated()` per rank (what the tensors held, from the caching allocator), against the
same floor(a) with the baseline measured the same way (the memory allocated after process-group start, before
the model exists: about zero). The caching allocator's reserved peak is printed beside it; NCCL's own buffers
live outside the allocator and are in neither. "(a) glibc" has no meaning there and is not run.

    python benchmarks/memory.py                  # ~202M parameters, a few minutes
    python benchmarks/memory.py --tiny           # smoke test (on CPU every configuration in the same ranks)
    python benchmarks/memory.py --device cuda    # GPU memory on 2 GPUs
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    Net,
    add_device_argument,
    batch,
    block_numel,
    check_device,
    current_rss_bytes,
    header,
    mib,
    model_numel,
    peak_rss_bytes,
    ratio_line,
    run_ranks,
    table,
    write_json,
)
from torch import nn  # noqa: E402

CONFIGS = {
    "a": "torchloom fsdp2, per-block units by hand",
    "a_raw": "raw fully_shard, per-block units, head all-reduced by hand",
    "b": "torchloom fsdp2, one root unit",
    "c": "torchloom ddp",
    "a_glibc": "(a) with glibc's default malloc settings",
    "a_fsdp": "torchloom fsdp (FSDP1), per-block units by hand",
}
LABELS = {"a": "(a)", "a_raw": "(a')", "b": "(b)", "c": "(c)", "a_glibc": "(a) glibc", "a_fsdp": "(a) fsdp"}
# Allocations of at least this many bytes get pages of their own, returned to the system when freed.
MMAP_THRESHOLD = 1 << 20


def _fix_malloc() -> None:
    """Stop glibc from raising its mmap threshold as large blocks are freed (it does so up to 32 MiB by
    default). Without this, the freed all-gather and gradient buffers of FSDP stay in the heap as fragments that
    the process still holds: RSS then measures the allocator, not the training. This is what
    MALLOC_MMAP_THRESHOLD_=1048576 in the environment does; GPU memory has its own caching allocator."""
    import ctypes

    m_mmap_threshold = -3
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, MMAP_THRESHOLD)


GOAL = "<= 1.15"


def _rank(rank: int, world: int, config: str, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    import torchloom
    from torchloom import Loom

    logging.getLogger("torchloom").setLevel(logging.WARNING)
    # Expected here: (b) is root-only on purpose; (a') initialises DTensors with torch's random ops on CPU.
    warnings.filterwarnings("ignore", message=".*without a wrapping policy.*")
    warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
    dim, blocks, tokens, steps = cfg["dim"], cfg["blocks"], cfg["tokens"], cfg["steps"]
    on_gpu = cfg["device"] == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if config == "a_glibc":
        config = "a"
    elif sys.platform.startswith("linux"):
        _fix_malloc()
    x, y = (t.to(device) for t in batch(rank, tokens, dim))
    if config == "a_raw":
        if not dist.is_initialized():  # --tiny runs every configuration in the same ranks
            dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
    else:
        strategy = {"c": "ddp", "a_fsdp": "fsdp"}.get(config, "fsdp2")
        loom = Loom(accelerator=cfg["device"], devices=world, strategy=strategy)
        loom.launch()
    dist.barrier()
    gc.collect()
    baseline = current_rss_bytes()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_baseline = torch.cuda.memory_allocated()
    start = time.perf_counter()

    if config in ("a", "b"):
        with loom.init_module(empty_init=True):
            model = Net(dim, blocks)
        if config == "a":
            for block in model.blocks:
                fully_shard(block)
        model = loom.setup_module(model)
        optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    elif config == "a_fsdp":
        from torch.distributed.fsdp.wrap import wrap

        with loom.init_module(empty_init=True):
            model = Net(dim, blocks, wrap=wrap)
        model = loom.setup_module(model)
        optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    elif config == "c":
        with loom.init_module():
            model = Net(dim, blocks)
        model = loom.setup_module(model)
        optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    else:
        with torch.device("meta"):
            model = Net(dim, blocks)
        for block in model.blocks:
            fully_shard(block)
        model.to_empty(device=device)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            for p in model.head.parameters():
                dist.broadcast(p, src=0)
        # Sharded (DTensor) and plain parameters in groups of their own: torch's foreach AdamW, the default on
        # CUDA, refuses a group that mixes them (torchloom splits mixed groups for each step).
        head = {id(p) for p in model.head.parameters()}
        sharded = [p for p in model.parameters() if id(p) not in head]
        optimizer = torch.optim.AdamW(
            [{"params": sharded}, {"params": list(model.head.parameters())}], lr=1e-4
        )
    after_setup = current_rss_bytes()
    gpu_after_setup = torch.cuda.memory_allocated() if on_gpu else 0

    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        if config == "a_raw":
            loss.backward()
            grads = [p.grad for p in model.head.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        else:
            loom.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    del torchloom
    out = {
        "baseline": baseline,
        "after_setup": after_setup,
        "peak": peak_rss_bytes(),
        "seconds": time.perf_counter() - start,
    }
    if on_gpu:
        # GPU memory replaces host memory as the measure; the host's peak is kept for reference.
        torch.cuda.synchronize()
        out.update(
            host_peak=out["peak"],
            baseline=gpu_baseline,
            after_setup=gpu_after_setup,
            peak=torch.cuda.max_memory_allocated(),
            reserved_peak=torch.cuda.max_memory_reserved(),
        )
    return out


def _ranks(rank: int, world: int, configs: list[str], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [_rank(rank, world, config, cfg) for config in configs]


def floor_a(cfg: dict[str, Any], world: int, baseline: float) -> dict[str, float]:
    dim, blocks, tokens = cfg["dim"], cfg["blocks"], cfg["tokens"]
    sharded = blocks * block_numel(dim)
    replicated = dim * dim + dim
    parts = {
        "state": 16 * (sharded / world + replicated),
        "block": 4 * block_numel(dim),
        "activations": 4 * tokens * (10 * dim + 2) * blocks + 4 * tokens * dim,
        "baseline": baseline,
    }
    parts["total"] = sum(parts.values())
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="smoke-test size (seconds)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    parser.add_argument("--json", help="also write the results to this JSON file")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    check_device(parser, args.device, args.world)
    if args.device == "cuda" and args.configs == ",".join(CONFIGS):
        args.configs = ",".join(c for c in CONFIGS if c != "a_glibc")  # host malloc: nothing to do with GPUs
    if args.tiny:
        args.dim, args.blocks, args.tokens = 128, 8, 8
        if args.configs == ",".join(CONFIGS):
            args.configs = "a,a_raw,b,c"  # "(a) glibc" and "(a) fsdp" add nothing at this size
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "a" not in configs or any(c not in CONFIGS for c in configs):
        parser.error(f"--configs must include 'a' and only name {', '.join(CONFIGS)}")
    if args.device == "cuda" and "a_glibc" in configs:
        parser.error("'a_glibc' measures the host's malloc: leave it out with --device cuda")
    world = args.world
    cfg = {k: getattr(args, k) for k in ("dim", "blocks", "tokens", "steps", "device")}
    numel = model_numel(args.dim, args.blocks)
    on_gpu = args.device == "cuda"
    if on_gpu:
        header(f"Memory: peak torch.cuda.max_memory_allocated per rank, {world} GPU(s) (NCCL), AdamW", args)
    else:
        header("Memory: peak RSS per rank, 2 CPU ranks (gloo), AdamW", args)
        print(
            f"# malloc: mmap threshold fixed at {MMAP_THRESHOLD} bytes in every configuration but '(a) glibc'",
            flush=True,
        )
    print(
        f"# model: {args.blocks} blocks of width {args.dim} + replicated head = {numel / 1e6:.1f}M parameters "
        f"({numel * 4 / 2**30:.2f} GiB fp32); {args.tokens} rows per rank; {args.steps} steps",
        flush=True,
    )
    measured: dict[str, dict[str, float]] = {}
    # Each configuration in fresh ranks: a peak is a process's high-water mark. --tiny on CPU, whose numbers mean
    # nothing, runs them all in the same two ranks (starting ranks is most of a smoke test's cost).
    for group in [configs] if args.tiny and not on_gpu else [[c] for c in configs]:
        per_group = run_ranks(_ranks, group, cfg, world_size=world, device=args.device)
        for i, config in enumerate(group):
            per_rank = [r[i] for r in per_group]
            worst = max(per_rank, key=lambda r: r["peak"])
            measured[config] = {**worst, "baseline": max(r["baseline"] for r in per_rank)}
            print(f"# ran {config}: {CONFIGS[config]} ({worst['seconds']:.0f} s)", flush=True)

    floor = floor_a(cfg, world, measured["a"]["baseline"])
    rows = []
    for config in configs:
        m = measured[config]
        rows.append(
            [
                LABELS[config],
                CONFIGS[config],
                mib(m["baseline"]),
                mib(m["after_setup"]),
                mib(m["peak"]),
                f"{m['peak'] / floor['total']:.3f}",
            ]
        )
    print()
    print(
        table(["", "configuration", "baseline MiB", "after setup MiB", "peak MiB", "peak / floor(a)"], rows)
    )
    print()
    print(
        f"floor(a) = state {mib(floor['state'])} + largest block {mib(floor['block'])} + activations "
        f"{mib(floor['activations'])} + baseline {mib(floor['baseline'])} = {mib(floor['total'])} MiB per rank"
    )
    print()
    if on_gpu:
        reserved = ", ".join(f"{LABELS[c]} {mib(measured[c]['reserved_peak'])}" for c in configs)
        print(f"# caching allocator's reserved peak, MiB: {reserved}")
        print()
    tag = " cuda" if on_gpu else ""  # GPU rows are named apart: they measure another memory
    results = [ratio_line(f"memory{tag} (a)/floor(a)", [measured["a"]["peak"] / floor["total"]], GOAL)]
    if "a_raw" in measured:
        results.append(
            ratio_line(
                f"memory{tag} (a)/(a') torchloom/raw", [measured["a"]["peak"] / measured["a_raw"]["peak"]]
            )
        )
    if "b" in measured:
        results.append(
            ratio_line(
                f"memory{tag} (a)/(b) per-block/root-only", [measured["a"]["peak"] / measured["b"]["peak"]]
            )
        )
    if "c" in measured:
        results.append(
            ratio_line(f"memory{tag} (a)/(c) per-block/ddp", [measured["a"]["peak"] / measured["c"]["peak"]])
        )
    if "a_fsdp" in measured:
        results.append(
            ratio_line(f"memory{tag} (a) fsdp/floor(a)", [measured["a_fsdp"]["peak"] / floor["total"]])
        )
    if "a_glibc" in measured:
        results.append(
            ratio_line("memory (a) glibc defaults/floor(a)", [measured["a_glibc"]["peak"] / floor["total"]])
        )
    write_json(
        args.json,
        {
            "benchmark": "memory",
            "settings": vars(args),
            "world_size": world,
            "numel": numel,
            "measured": measured,
            "floor_a": floor,
            "ratios": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
