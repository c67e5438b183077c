"""Loading pretrained weights: extra peak memory per rank while a Hugging Face safetensors checkpoint loads
into a model sharded on 2 CPU ranks, as a ratio to what the rank must hold anyway (its part + one tensor).

    torchloom    loom.load_raw(checkpoint_dir, model): each rank reads only its own slices, memory-mapped
    full+scatter every rank reads the whole state dict (safetensors.torch.load_file of every shard), then
                 set_model_state_dict(full_state_dict=True) keeps its part: what most training code does

The model is the benchmarks' own `Net` (blocks of LayerNorm + two Linear layers, and a head), created on the meta
device under `loom.init_module(empty_init=True)`, every block a `fully_shard` unit made by hand and the head a
replicated leftover. The checkpoint (a few hundred MB, fp32, split into shards as `transformers` splits them) is
written once by `torchloom.checkpointing.hf.write_dir`.

What is measured, per rank, in fresh processes: the rise of the peak resident set size (VmHWM, reset through
/proc/self/clear_refs just before the load) over the RSS just before it. Pages of a memory-mapped file count in
RSS once touched, so reading a slice through the map counts it, as it should: while they are mapped they are
memory the rank uses (they can be dropped under pressure, unlike a copy). The ratio's denominator is

    own = bytes of this rank's local tensors (its shards of the blocks + the whole replicated head)
        + bytes of the largest tensor in the checkpoint

Goal: torchloom's ratio <= 1.1.

    python benchmarks/hf_load.py            # ~68M parameters (272 MB), about a minute
    python benchmarks/hf_load.py --tiny     # smoke test (every load in the same ranks)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import (  # noqa: E402
    Net,
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

GOAL = "<= 1.1"
SIDES = {
    "torchloom": "loom.load_raw of the sharded checkpoint: own slices, memory-mapped",
    "torchloom_one_file": "loom.load_raw of the same weights in one model.safetensors",
    "full_scatter": "full state dict on every rank (sharded checkpoint), then "
    "set_model_state_dict(full_state_dict=True)",
}


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rank(rank: int, world: int, side: str, checkpoint: str, dim: int, blocks: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from torchloom import Loom

    # As in memory.py: keep glibc from holding freed large blocks, so RSS measures what the load holds.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loom = Loom(accelerator="cpu", devices=world, strategy="fsdp2")
        loom.launch()
        with loom.init_module(empty_init=True):
            model = Net(dim, blocks)
        for block in model.blocks:
            fully_shard(block, **loom.strategy.unit_kwargs())
        model = loom.setup_module(model)
    tensors = [*model.parameters(), *model.buffers()]
    own = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)
    largest = max(t.numel() * t.element_size() for t in tensors)  # global sizes (DTensor .numel())
    # Import what either side uses before measuring: code and libraries are not what the load holds.
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import torchloom.checkpointing.hf  # noqa: F401

    gc.collect()
    loom.barrier()
    before = current_rss_bytes()
    _reset_peak()
    if side.startswith("torchloom"):
        loom.load_raw(checkpoint, model)
    else:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state: dict[str, torch.Tensor] = {}
        for file in sorted(Path(checkpoint).glob("*.safetensors")):
            state.update(load_file(file))
        set_model_state_dict(model.forward_module, state, options=StateDictOptions(full_state_dict=True))
        del state
    peak = peak_rss_bytes() - before
    gc.collect()
    # A checksum of what this rank loaded: both sides must load the same values.
    checksum = sum(
        float((t.to_local() if hasattr(t, "to_local") else t).detach().double().sum()) for t in tensors
    )
    return {"extra": peak, "own": own, "largest": largest, "checksum": checksum}


def _ranks(rank: int, world: int, runs: list[tuple[str, str]], dim: int, blocks: int) -> list[dict[str, Any]]:
    return [_rank(rank, world, side, checkpoint, dim, blocks) for side, checkpoint in runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="smoke-test size (seconds; numbers mean nothing)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="fresh ranks per side, ABBA order")
    parser.add_argument("--max-shard-size", default="100MB", help="the checkpoint's shard size")
    parser.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temporary dir)"
    )
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.dim, args.blocks, args.repeats, args.max_shard_size = 64, 2, 1, "100KB"
    header("Loading a Hugging Face checkpoint: extra peak RSS per rank, 2 CPU ranks (gloo), fsdp2", args)

    from torchloom.checkpointing import hf

    root = Path(tempfile.mkdtemp(prefix="hf_load-", dir=args.dir))
    try:
        checkpoint, one_file = root / "checkpoint", root / "one-file"
        torch.manual_seed(0)
        model = Net(args.dim, args.blocks)
        hf.write_dir(model.state_dict(), checkpoint, max_shard_size=args.max_shard_size)
        hf.write_dir(model.state_dict(), one_file, max_shard_size=2**62)
        del model  # the ranks are forked from this process: they should not start out holding the model
        gc.collect()
        files = sorted(checkpoint.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(
            f"# checkpoint: {model_numel(args.dim, args.blocks):,} parameters, {mib(size)} MiB in {len(files)} "
            "file(s)",
            flush=True,
        )
        runs: dict[str, list[list[dict[str, Any]]]] = {side: [] for side in SIDES}
        order = [
            (side, str(one_file if side == "torchloom_one_file" else checkpoint))
            for i in range(args.repeats)
            for side in (SIDES if i % 2 == 0 else reversed(list(SIDES)))
        ]
        # Every load in fresh ranks; --tiny, whose numbers mean nothing, runs them all in the same two ranks
        # (starting ranks is most of a smoke test's cost).
        for group in [order] if args.tiny else [[run] for run in order]:
            per_group = run_ranks(_ranks, group, args.dim, args.blocks, timeout=600)
            for i, (side, _) in enumerate(group):
                runs[side].append([r[i] for r in per_group])
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for rank in range(2):
        checksums = {run[rank]["checksum"] for side in SIDES for run in runs[side]}
        if len(checksums) != 1:
            raise SystemExit(
                f"the sides loaded different values on rank {rank} (checksums {sorted(checksums)})"
            )
    ratios = {
        side: [r["extra"] / (r["own"] + r["largest"]) for run in runs[side] for r in run] for side in SIDES
    }
    first = runs["torchloom"][0]
    rows = []
    for side in SIDES:
        for rank in range(len(first)):
            extras = [run[rank]["extra"] for run in runs[side]]
            rows.append(
                [
                    side,
                    rank,
                    mib(first[rank]["own"]),
                    mib(first[rank]["largest"]),
                    f"{mib(min(extras))}..{mib(max(extras))}",
                    f"{min(ratios[side]):.3f}..{max(ratios[side]):.3f}",
                ]
            )
    print(
        table(["side", "rank", "own MiB", "largest MiB", "extra peak MiB", "extra/(own+largest)"], rows),
        flush=True,
    )
    for side, text in SIDES.items():
        print(f"# {side}: {text}", flush=True)
    results = [
        ratio_line("hf_load torchloom extra/(own+largest)", ratios["torchloom"], GOAL),
        ratio_line("hf_load torchloom one-file extra/(own+largest)", ratios["torchloom_one_file"], GOAL),
        ratio_line("hf_load full+scatter extra/(own+largest)", ratios["full_scatter"]),
    ]
    write_json(args.json, {"settings": vars(args), "runs": runs, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
