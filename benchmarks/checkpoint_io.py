"""Checkpoint I/O: torchloom's save and load against the raw torch.distributed.checkpoint calls, on 2 CPU ranks.

The model is sharded with FSDP2 by hand (every block a unit, the head replicated), set up by torchloom; both
sides save the same live model:

    sharded save   loom.save(dir, {"model": model})                                   (state_dict_type="sharded")
                   vs dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dir)
    sharded load   loom.load(dir, {"model": model})
                   vs sd = get_model_state_dict(model); dcp.load(sd, ...); set_model_state_dict(model, sd)
    full save      loom.save(file, {"model": model})                                  (state_dict_type="full")
                   vs sd = get_model_state_dict(model, full_state_dict=True, cpu_offload=True); rank 0 torch.save
                   (and the same raw save followed by an fsync of the file, as torchloom does, for reference;
                   and loom.save(file, ..., fsync=False), which skips the flush to disk as raw torch.save does)
    async save     time until loom.save(dir, ..., async_save=True) returns vs a synchronous loom.save(dir, ...)
                   (and, for reference, the time until raw dcp.async_save(..., checkpoint_id=dir) returns)
    verify cost    loom.load(dir or file, {"model": model}) (checks every file's checksum first, the default)
                   vs the same with verify=False, sharded and full, in the same run, alternating; and the
                   verification alone (what load(verify=True) runs first) against load(verify=False), in wall
                   time and in this process's CPU time (which other jobs on a shared machine barely change)

Every save goes to a new path (the previous one is deleted and the page cache's dirty data written out with
`os.sync()`, outside the timing). torchloom writes atomically (a
temporary name, fsync, rename); DCP fsyncs its files too (FileSystemWriter(sync_files=True), the default), while
raw torch.save does not fsync. A durable save cannot be faster than the disk, while raw torch.save of a file that
fits in the page cache returns at memory speed: where the disk is slower than serialising, "full save" can only
reach its goal with fsync=False. A load reads the checkpoint its own side wrote just before, usually from the
page cache. Goals: throughput torchloom/raw >= 0.95 (time raw/torchloom); async blocking time < 20% of a sync
save; verification at most 5% of a load (its CPU seconds / those of load(verify=False) <= 0.05; the wall-time
ratios are reported too, but on a shared machine their spread is larger than 5%).

    python benchmarks/checkpoint_io.py             # ~269M parameters, a 1.0 GiB fp32 model
    python benchmarks/checkpoint_io.py --tiny      # smoke test
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    Net,
    alternate,
    header,
    model_numel,
    ratio_line,
    ratios,
    run_ranks,
    summary,
    table,
    write_json,
)

THROUGHPUT_GOAL = ">= 0.95"
ASYNC_GOAL = "< 0.2"
VERIFY_GOAL = "<= 0.05"


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    import torchloom  # noqa: F401 - sets up its logger, which is quietened next
    from torchloom import Loom
    from torchloom.checkpointing import integrity, sharded
    from torchloom.strategies import FSDP2Strategy

    logging.getLogger("torchloom").setLevel(logging.WARNING)
    strategy = FSDP2Strategy()
    loom = Loom(accelerator="cpu", devices=world, strategy=strategy)
    loom.launch()
    with loom.init_module(empty_init=True):
        model = Net(cfg["dim"], cfg["blocks"])
    for block in model.blocks:
        fully_shard(block)
    model = loom.setup_module(model)
    module = model.forward_module
    base = Path(cfg["dir"])
    counter = iter(range(10**6))
    last: dict[str, Path] = {}

    def fresh(kind: str, suffix: str = "") -> Path:
        """A new path for this save; the previous one of this kind is deleted here, outside the timing, and what
        earlier saves left in the page cache is written out, so that no save pays for another's writeback."""
        dist.barrier()
        if rank == 0:
            if kind in last:
                _remove(last[kind])
            os.sync()
        path = base / f"{kind}-{next(counter)}{suffix}"
        last[kind] = path
        dist.barrier()
        return path

    cpu: dict[str, list[float]] = {}

    def timed(fn: Any, cpu_key: str | None = None) -> float:
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        elapsed = time.perf_counter() - start
        if cpu_key is not None:
            cpu.setdefault(cpu_key, []).append(time.process_time() - start_cpu)
        dist.barrier()
        return elapsed

    # ---- the sides -------------------------------------------------------------------------------------------
    def loom_sharded_save() -> float:
        path = fresh("loom-sharded")
        strategy.state_dict_type = "sharded"
        return timed(lambda: loom.save(path, {"model": model}))

    def raw_sharded_save() -> float:
        path = fresh("raw-sharded")
        return timed(lambda: dcp.save({"model": get_model_state_dict(module)}, checkpoint_id=str(path)))

    def loom_sharded_load(verify: bool = True) -> float:
        key = f"sharded_load_{verify}"
        return timed(lambda: loom.load(last["loom-sharded"], {"model": model}, verify=verify), key)

    def loom_full_load(verify: bool = True) -> float:
        key = f"full_load_{verify}"
        return timed(lambda: loom.load(last["loom-full-True"], {"model": model}, verify=verify), key)

    def verify_alone(kind: str) -> float:
        """What load(verify=True) runs before loading: every rank checks its share of the files."""
        if kind == "sharded":
            path = last["loom-sharded"]
            meta = sharded.read_meta(path)
            return timed(lambda: sharded.verify(strategy, path, meta), "sharded_verify")
        path = last["loom-full-True"]
        return timed(lambda: integrity.check_full_file_shared(strategy, path), "full_verify")

    def raw_sharded_load() -> float:
        def load() -> None:
            state = {"model": get_model_state_dict(module)}
            dcp.load(state, checkpoint_id=str(last["raw-sharded"]))
            set_model_state_dict(module, state["model"])

        return timed(load)

    def loom_full_save(fsync: bool = True) -> float:
        path = fresh(f"loom-full-{fsync}", ".pt")
        strategy.state_dict_type = "full"
        try:
            return timed(lambda: loom.save(path, {"model": model}, fsync=fsync))
        finally:
            strategy.state_dict_type = "sharded"

    def raw_full_save(fsync: bool = False) -> float:
        path = fresh(f"raw-full-{fsync}", ".pt")

        def save() -> None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(module, options=options)
            if rank == 0 and not fsync:
                torch.save({"model": state}, path)
            elif rank == 0:
                with open(path, "wb") as f:
                    torch.save({"model": state}, f)
                    f.flush()
                    os.fsync(f.fileno())
            dist.barrier()

        return timed(save)

    async_total: list[float] = []

    def loom_async_save() -> float:
        path = fresh("loom-async")
        blocking = timed(lambda: loom.save(path, {"model": model}, async_save=True))
        start = time.perf_counter()
        loom._checkpointer.finish_pending_save()  # the next save would wait here; not part of the blocking time
        async_total.append(blocking + time.perf_counter() - start)
        return blocking

    # Its own group, as DCP recommends: the background upload's collectives must not interleave with this
    # thread's barriers on the default group.
    async_group = dist.new_group(backend="gloo")

    def raw_async_save() -> float:
        path = fresh("raw-async")
        future: list[Any] = []
        blocking = timed(
            lambda: future.append(
                dcp.async_save(
                    {"model": get_model_state_dict(module)},
                    checkpoint_id=str(path),
                    process_group=async_group,
                )
            )
        )
        future[0].result()
        return blocking

    def loom_sync_save() -> float:
        path = fresh("loom-sync")
        return timed(lambda: loom.save(path, {"model": model}))

    # One untimed round of each, so that lazily built state (process groups, planners) is not timed.
    for warm in (
        loom_sharded_save,
        raw_sharded_save,
        loom_sharded_load,
        lambda: loom_sharded_load(verify=False),
        raw_sharded_load,
        loom_full_save,
        loom_full_load,
        lambda: loom_full_load(verify=False),
        lambda: loom_full_save(fsync=False),
        raw_full_save,
        lambda: raw_full_save(fsync=True),
        loom_async_save,
        raw_async_save,
        loom_sync_save,
    ):
        warm()
    async_total.clear()
    repeats = cfg["repeats"]
    out = {
        "sharded_save": alternate({"torchloom": loom_sharded_save, "raw": raw_sharded_save}, repeats),
        "sharded_load": alternate(
            {
                "torchloom": loom_sharded_load,
                "raw": raw_sharded_load,
                "torchloom_no_verify": lambda: loom_sharded_load(verify=False),
                "verify_alone": lambda: verify_alone("sharded"),
            },
            repeats,
        ),
        "full_save": alternate(
            {
                "torchloom": loom_full_save,
                "raw": raw_full_save,
                "raw_fsync": lambda: raw_full_save(fsync=True),
                "torchloom_no_fsync": lambda: loom_full_save(fsync=False),
            },
            repeats,
        ),
        "async_save": alternate(
            {"async": loom_async_save, "sync": loom_sync_save, "raw_async": raw_async_save}, repeats
        ),
    }
    # The full file loom_full_save wrote last (every repeat above replaced it), loaded by every rank.
    out["full_load"] = alternate(
        {
            "torchloom": loom_full_load,
            "torchloom_no_verify": lambda: loom_full_load(verify=False),
            "verify_alone": lambda: verify_alone("full"),
        },
        repeats,
    )
    # CPU seconds of the timed repeats only (the warm-up round recorded one of each first).
    out["cpu"] = {k: v[-repeats:] for k, v in cpu.items()}
    out["async_total"] = list(async_total)
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="smoke-test size (seconds)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4, help="measurements per side (alternating)")
    parser.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: a temporary dir)"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds before the ranks are stopped (a busy machine)"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.dim, args.blocks, args.repeats = 64, 2, 1
    numel = model_numel(args.dim, args.blocks)
    nbytes = numel * 4
    header(
        "Checkpoint I/O: torchloom vs raw torch.distributed.checkpoint / torch.save, 2 CPU ranks (gloo)", args
    )
    print(
        f"# model: {args.blocks} blocks of width {args.dim} (fully_shard each) + replicated head = "
        f"{numel / 1e6:.1f}M parameters, {nbytes / 2**30:.2f} GiB fp32 (model weights only)",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="torchloom-bench-", dir=args.dir))
    try:
        per_rank = run_ranks(
            _rank,
            {"dim": args.dim, "blocks": args.blocks, "repeats": args.repeats, "dir": str(workdir)},
            timeout=args.timeout,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def series(op: str, side: str) -> list[float]:
        return [max(r[op][side][i] for r in per_rank) for i in range(args.repeats)]

    rows, results = [], []
    for op, label in (
        ("sharded_save", "sharded save"),
        ("sharded_load", "sharded load"),
        ("full_save", "full save"),
    ):
        loom_t, raw_t = series(op, "torchloom"), series(op, "raw")
        throughput = ratios(raw_t, loom_t)  # torchloom throughput / raw throughput
        rows.append(
            [
                label,
                summary(loom_t, "{:.2f}"),
                summary(raw_t, "{:.2f}"),
                f"{nbytes / 2**20 / min(loom_t):.0f} / {nbytes / 2**20 / min(raw_t):.0f}",
                summary(throughput),
            ]
        )
        results.append((f"checkpoint {label} throughput torchloom/raw", throughput, THROUGHPUT_GOAL))
    # The full save's two other comparisons: both sides durable, and neither.
    for loom_side, raw_side, label, name, goal in (
        ("torchloom", "raw_fsync", "full save, raw + fsync", "torchloom/(raw + fsync)", None),
        ("torchloom_no_fsync", "raw", "full save, fsync=False", "torchloom fsync=False/raw", THROUGHPUT_GOAL),
    ):
        loom_t, raw_t = series("full_save", loom_side), series("full_save", raw_side)
        throughput = ratios(raw_t, loom_t)
        rows.append(
            [
                label,
                summary(loom_t, "{:.2f}"),
                summary(raw_t, "{:.2f}"),
                f"{nbytes / 2**20 / min(loom_t):.0f} / {nbytes / 2**20 / min(raw_t):.0f}",
                summary(throughput),
            ]
        )
        results.append((f"checkpoint full save throughput {name}", throughput, goal))
    verify_rows = []
    for op, label, kind in (("sharded_load", "sharded load", "sharded"), ("full_load", "full load", "full")):
        with_t, without_t = series(op, "torchloom"), series(op, "torchloom_no_verify")
        alone = series(op, "verify_alone")
        cost = ratios(with_t, without_t)
        share = ratios(alone, without_t)
        # CPU time: the rank that spent the most, per repeat.
        cpu_alone = [max(r["cpu"][f"{kind}_verify"][i] for r in per_rank) for i in range(args.repeats)]
        cpu_load = [max(r["cpu"][f"{op}_False"][i] for r in per_rank) for i in range(args.repeats)]
        cpu_share = ratios(cpu_alone, cpu_load)
        verify_rows.append(
            [
                label,
                summary(with_t, "{:.3f}"),
                summary(without_t, "{:.3f}"),
                summary(cost),
                summary(alone, "{:.3f}"),
                summary(cpu_share),
            ]
        )
        results.append((f"checkpoint {label} time verify/verify=False", cost, None))
        results.append((f"checkpoint {label} verification alone/load verify=False (wall)", share, None))
        results.append(
            (f"checkpoint {label} verification alone/load verify=False (CPU seconds)", cpu_share, VERIFY_GOAL)
        )
    async_t, sync_t = series("async_save", "async"), series("async_save", "sync")
    total = [max(r["async_total"][i] for r in per_rank) for i in range(args.repeats)]
    print()
    print(
        table(["operation", "torchloom s", "raw s", "best MiB/s torchloom / raw", "throughput ratio"], rows)
    )
    print()
    print(
        table(
            ["sharded save", "seconds"],
            [
                ["async_save=True: blocking", summary(async_t, "{:.2f}")],
                ["async_save=True: until written", summary(total, "{:.2f}")],
                ["synchronous", summary(sync_t, "{:.2f}")],
                ["raw dcp.async_save: blocking", summary(series("async_save", "raw_async"), "{:.2f}")],
            ],
        )
    )
    print()
    print(
        table(
            [
                "load",
                "verify=True s",
                "verify=False s",
                "time ratio",
                "verification alone s",
                "verification/load CPU s",
            ],
            verify_rows,
        )
    )
    print()
    out = [ratio_line(name, values, goal) for name, values, goal in results]
    out.append(ratio_line("checkpoint async blocking/sync save", ratios(async_t, sync_t), ASYNC_GOAL))
    write_json(
        args.json, {"benchmark": "checkpoint_io", "settings": vars(args), "numel": numel, "ratios": out}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
