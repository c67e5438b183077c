"""Checkpoint soak: 20 save/load cycles on 2 ranks, mixing sharded, full and async saves to one path, with SIGKILL
injected into five saves, one at each point a save can die. The latest completed checkpoint always loads
bit-exact, training ends where an uninterrupted run ends, no temporary files are left, and no files or threads
leak."""

from __future__ import annotations

import json
import textwrap

import pytest
from harness import PYTHON, REPO, run_job, wait_no_strays

CYCLES = 20
# Cycles whose save is killed on the first attempt; where it dies follows from the cycle (`arm` in the script):
# 3 full async in torch.save, 4 sharded sync in DCP's write_data (rank 1), 5 full sync in the rename, 6 sharded
# async in the rename, 12 sharded sync in DCP's finish (rank 0). The cycles' pattern (format, sync or async)
# repeats every 4 and each kill costs a job start, so 20 cycles cover what 100 did; a leak of anything per cycle
# shows in the uninterrupted run's 15 cycles between its two counts (and the killed run's last attempt, from 12,
# counts over 3 cycles).
KILLS = (3, 4, 5, 6, 12)

SOAK_SCRIPT = textwrap.dedent(
    """
    import json, os, random, sys, threading
    sys.path.insert(0, {tests!r})
    import torch
    from fsdp_models import Block, Net, D_IN, full_state
    from torchloom import Loom
    from torchloom.strategies import FSDP2Strategy

    root, cycles, kills = sys.argv[1], int(sys.argv[2]), [int(k) for k in sys.argv[3].split(",") if k]
    path = os.path.join(root, "ckpt")
    loom = Loom(accelerator="cpu", devices=2, strategy=FSDP2Strategy(shard_policy={{Block}}))
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    state = {{"model": model, "optimizer": opt}}
    start = 0
    if os.path.exists(path):
        start = loom.load(path, state)["cycle"]
        snapshot = torch.load(os.path.join(root, f"snapshot-{{start}}.pt"))
        current = full_state(model)
        assert all(torch.equal(current[k], v) for k, v in snapshot.items()), "resumed state differs"
        loom.print(f"RESUMED {{start}}", flush=True)

    def die(*args, **kwargs):
        os.kill(os.getpid(), 9)

    def arm(cycle, fmt):
        rng = random.Random(cycle)
        if fmt == "sharded":
            point, victim = rng.choice([("write_data", 1), ("finish", 0), ("replace", 0)])
        else:
            point, victim = rng.choice([("torch_save", 0), ("replace", 0)])
        if loom.global_rank != victim:
            return
        if point in ("write_data", "finish"):
            from torch.distributed.checkpoint import FileSystemWriter
            setattr(FileSystemWriter, point, die)
        elif point == "torch_save":
            import torchloom.checkpointing.full as full
            def partial(obj, f, *a, **k):
                f.write(b"half" * 1000)
                f.flush()
                die()
            full.torch.save = partial
        else:
            import torchloom.checkpointing.atomic as atomic
            atomic.replace = die

    baseline = None
    for cycle in range(start, cycles):
        g = torch.Generator().manual_seed(cycle * 10 + loom.global_rank)
        loom.backward(model(torch.randn(4, D_IN, generator=g)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        fmt, is_async = ("sharded", "full")[cycle % 2], cycle % 4 >= 2
        loom.strategy.state_dict_type = fmt
        marker = os.path.join(root, f"killed-{{cycle}}")
        if cycle in kills and not os.path.exists(marker):
            loom.barrier()
            if loom.global_rank == 0:
                open(marker, "w").close()
            loom.barrier()
            arm(cycle, fmt)
        snapshot = full_state(model)
        if loom.global_rank == 0:
            torch.save(snapshot, os.path.join(root, f"snapshot-{{cycle + 1}}.pt"))
        loom.save(path, {{**state, "cycle": cycle + 1}}, async_save=is_async)
        loom.load(path, state)  # waits for an async save first
        current = full_state(model)
        assert all(torch.equal(current[k], v) for k, v in snapshot.items()), f"cycle {{cycle}} did not round-trip"
        if cycle == start + 4:
            baseline = (len(os.listdir("/proc/self/fd")), threading.active_count())
    end = (len(os.listdir("/proc/self/fd")), threading.active_count())
    leftovers = [n for n in os.listdir(root) if n.startswith(".ckpt")]
    final = full_state(model)  # a collective: every rank
    if loom.global_rank == 0:
        torch.save(final, os.path.join(root, "final.pt"))
    report = {{"rank": loom.global_rank, "baseline": baseline, "end": end, "leftovers": leftovers, "start": start}}
    sys.stdout.write("REPORT " + json.dumps(report) + "\\n")  # one write: both ranks share stdout
    sys.stdout.flush()
    """
)


def _run(root, kills: tuple[int, ...]) -> tuple[list[str], list[dict]]:
    script = root / "soak.py"
    script.write_text(SOAK_SCRIPT.format(tests=str(REPO / "tests")))
    outputs = []
    for _attempt in range(len(kills) + 1):
        result, token = run_job(
            [PYTHON, str(script), str(root), str(CYCLES), ",".join(map(str, kills))], timeout=240
        )
        assert wait_no_strays(token) == []
        outputs.append(result.stdout)
        if result.returncode == 0:
            reports = [
                json.loads(line[7:]) for line in result.stdout.splitlines() if line.startswith("REPORT ")
            ]
            return outputs, reports
        assert "did not round-trip" not in result.stdout and "resumed state differs" not in result.stdout, (
            result.stdout
        )
    raise AssertionError("the soak never finished:\n" + "\n".join(outputs))


# Seven jobs one after another: the suite's 300 s default ended it at a load of 20-30 on 2 cores (each job
# keeps its own 240 s limit, so a hang still fails it).
@pytest.mark.timeout(900)
def test_checkpoint_soak(tmp_path):
    import torch

    (tmp_path / "clean").mkdir()
    (tmp_path / "killed").mkdir()
    _, clean_reports = _run(tmp_path / "clean", ())
    outputs, reports = _run(tmp_path / "killed", KILLS)
    assert len(outputs) == len(KILLS) + 1  # each kill ended one attempt; the last attempt finished
    resumed_at = [
        int(line.split()[1]) for out in outputs for line in out.splitlines() if line.startswith("RESUMED")
    ]
    assert resumed_at == list(KILLS)  # each restart resumed from the checkpoint before the killed save
    clean, killed = torch.load(tmp_path / "clean" / "final.pt"), torch.load(tmp_path / "killed" / "final.pt")
    assert all(torch.equal(clean[k], v) for k, v in killed.items())
    for report in reports + clean_reports:
        assert report["leftovers"] == [], report
        (fds0, threads0), (fds1, threads1) = report["baseline"], report["end"]
        assert fds1 <= fds0 and threads1 <= threads0, report
