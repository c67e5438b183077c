"""Checkpoints are never lost: a save killed part-way leaves the previous checkpoint loadable and bit-exact;
damaged checkpoints give a clear error naming the file (never a hang); async saves finish or report failure."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
from fsdp_models import D_IN, Block, Net, full_state
from harness import run_ranks

from torchloom import CheckpointError, Loom
from torchloom.checkpointing import atomic
from torchloom.strategies import FSDP2Strategy
from torchloom.testing import RanksFailed

# The tests share two rank groups (module fixtures): whichever test runs first waits for them.
pytestmark = pytest.mark.timeout(600)


def _killed_save(rank: int, world_size: int, fmt: str, point: str, path: str, expected: str) -> str:
    """Save, train a step, then save again with `point` of that save made to SIGKILL its rank; rank 0 writes the
    first save's full state to `expected`. Returns only if the second save finished (it must not)."""
    loom = Loom(
        accelerator="cpu",
        devices=world_size,
        strategy=FSDP2Strategy(shard_policy={Block}, state_dict_type=fmt),
    )
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))

    def step():
        loom.backward(model(torch.randn(4, D_IN)).pow(2).mean())
        opt.step()
        opt.zero_grad()

    step()
    loom.save(path, {"model": model, "optimizer": opt, "step": 1})
    full = full_state(model)
    if loom.global_rank == 0:
        torch.save(full, expected)
    step()

    def die(*args, **kwargs):
        os.kill(os.getpid(), 9)

    # Patched in this rank's process only (a rank of `run_ranks` is a process of its own).
    victim = 1 if point == "write_data" else 0
    if loom.global_rank == victim:
        if point == "write_data":
            from torch.distributed.checkpoint import FileSystemWriter

            FileSystemWriter.write_data = die
        elif point == "finish":
            from torch.distributed.checkpoint import FileSystemWriter

            FileSystemWriter.finish = die
        elif point == "torch_save":
            import torchloom.checkpointing.full as full_format

            def partial(obj, f, *a, **k):
                f.write(b"half a checkpoint" * 1000)
                f.flush()
                die()

            full_format.torch.save = partial
        elif point == "replace":
            atomic.replace = die
    loom.save(path, {"model": model, "optimizer": opt, "step": 2})
    return "SAVE SHOULD NOT HAVE FINISHED"


KILL_POINTS = [
    ("sharded", "write_data"),  # a rank dies while writing its shards
    ("sharded", "finish"),  # shards written, metadata not
    ("sharded", "replace"),  # everything written, not yet swapped in
    ("full", "torch_save"),  # rank 0 dies half-way through the file
    ("full", "replace"),
]


@pytest.mark.parametrize("fmt,point", KILL_POINTS)
def test_killed_save_keeps_previous_checkpoint(fmt, point, tmp_path):
    # Ranks forked from run_ranks' server, not a launched job (a job start per kill point cost ~5x the CPU): the
    # victim's SIGKILL ends the group as a launcher ends the job. That a launched job whose rank is SIGKILLed
    # ends with no process left is tests/test_launcher.py's (test_failing_rank_ends_the_job[kill]).
    path, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_killed_save, 2, fmt, point, str(path), str(expected), timeout=120)
    # Whichever the harness saw first: the victim's death, or its peer's save failing on the lost connection.
    victim = 1 if point == "write_data" else 0
    message = str(failed.value)
    assert f"rank {victim} died with exit code -9" in message or (
        f"rank {1 - victim} failed" in message and "loom.save(path" in message
    ), message
    # The previous checkpoint is at `path`, whole: it loads bit-exact into a plain single-process model.
    loom = Loom(accelerator="cpu")
    model = loom.setup_module(Net())
    rest = loom.load(path, {"model": model})
    assert rest["step"] == 1
    want = torch.load(expected)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    # The next save clears what the killed one left behind.
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    loom.save(path, {"model": model, "step": 3})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")], leftovers
    assert loom.load(path, {"model": model})["step"] == 3


def _write_sharded(rank: int, world_size: int, root: str) -> None:
    loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(shard_policy={Block}))
    loom.launch()
    model = loom.setup_module(Net())
    loom.save(f"{root}/sharded", {"model": model, "step": 1})
    full = Loom(
        accelerator="cpu",
        devices=world_size,
        strategy=FSDP2Strategy(shard_policy={Block}, state_dict_type="full"),
    )
    full.launch()
    full.save(f"{root}/full.pt", {"model": model, "step": 1})


def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    """Every 2-rank check of this file in one rank group (starting ranks dominates their cost), each in a folder
    of its own: the good checkpoints, a damaged copy loaded on both ranks, async saves, fsync=False, saves
    onto a user's folder, failed sharded saves. Keys name the check."""
    import torch.distributed as dist

    _write_sharded(rank, world_size, f"{root}/good")
    if rank == 0:
        _damage(Path(root) / "good", Path(root) / "damaged", "missing shard")
    dist.barrier()
    return {
        "damaged": _load_damaged(rank, world_size, f"{root}/damaged/ckpt"),
        "async": _async_body(rank, world_size, f"{root}/async"),
        "fsync": _fsync_body(rank, world_size, f"{root}/fsync"),
        "refused": _refused_on_ranks(rank, world_size, f"{root}/refused"),
        "failed": _failed_sharded_saves(rank, world_size, f"{root}/failed"),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("two_ranks")
    for name in ("good", "damaged", "async", "fsync", "refused", "failed"):
        (root / name).mkdir()
    _user_folder(root / "refused")
    before = _tree(root / "refused" / "checkpoints")
    per_rank = run_ranks(_two_ranks, 2, str(root), timeout=300)
    assert _tree(root / "refused" / "checkpoints") == before  # refused saves deleted nothing
    return root, per_rank


@pytest.fixture(scope="module")
def good(two_ranks) -> Path:
    return two_ranks[0] / "good"


def _damage(good, tmp_path, how: str):
    target = tmp_path / "ckpt"
    if how.startswith("full"):
        target = tmp_path / "ckpt.pt"
        shutil.copy(good / "full.pt", target)
    else:
        shutil.copytree(good / "sharded", target)
    if how == "truncated shard":
        shard = sorted(target.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
        return target, shard.name
    if how == "missing shard":
        shard = sorted(target.glob("*.distcp"))[-1]
        shard.unlink()
        return target, shard.name
    if how == "garbage metadata":
        (target / ".metadata").write_bytes(b"\x00not a pickle")
        return target, ".metadata"
    if how == "garbage torchloom.json":
        (target / "torchloom.json").write_text("{nope")
        return target, "torchloom.json"
    if how == "full truncated":
        target.write_bytes(target.read_bytes()[:200])
        return target, "ckpt.pt"
    if how == "full wrong file":
        target.write_text("this is a text file, not a checkpoint")
        return target, "ckpt.pt"
    raise AssertionError(how)


DAMAGE = [
    "truncated shard",
    "missing shard",
    "garbage metadata",
    "garbage torchloom.json",
    "full truncated",
    "full wrong file",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_checkpoint_names_the_file(good, tmp_path, how):
    target, name = _damage(good, tmp_path, how)
    loom = Loom(accelerator="cpu")
    model = loom.setup_module(Net())
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        loom.load(target, {"model": model})


def _load_damaged(rank: int, world_size: int, target: str) -> str:
    loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(shard_policy={Block}))
    loom.launch()
    model = loom.setup_module(Net())
    try:
        loom.load(target, {"model": model})
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_damaged_checkpoint_on_two_ranks_fails_fast_everywhere(two_ranks):
    root, per_rank = two_ranks
    (name,) = {p.name for p in (root / "good" / "sharded").iterdir()} - {
        p.name for p in (root / "damaged" / "ckpt").iterdir()
    }  # the missing shard
    messages = [result["damaged"] for result in per_rank]
    assert all(name in m for m in messages), messages


def test_wrong_kind_of_path(good, tmp_path):
    loom = Loom(accelerator="cpu")
    model = loom.setup_module(Net())
    with pytest.raises(CheckpointError, match="is a directory"):
        loom.load_raw(good / "sharded", model)
    (tmp_path / "not-a-checkpoint").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        loom.load(tmp_path / "not-a-checkpoint", {"model": model})
    with pytest.raises(CheckpointError, match="No checkpoint"):
        loom.load(tmp_path / "absent", {"model": model})
    newer = tmp_path / "newer"
    shutil.copytree(good / "sharded", newer)
    meta = json.loads((newer / "torchloom.json").read_text())
    (newer / "torchloom.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(CheckpointError, match="newer torchloom"):
        loom.load(newer, {"model": model})


def _async_body(rank: int, world_size: int, root: str) -> dict:
    import torchloom.checkpointing.atomic as atomic

    out = {}
    for fmt in ("sharded", "full"):
        loom = Loom(
            accelerator="cpu",
            devices=world_size,
            strategy=FSDP2Strategy(shard_policy={Block}, state_dict_type=fmt),
        )
        loom.launch()
        torch.manual_seed(0)
        model = loom.setup_module(Net())
        opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        snapshot = full_state(model)
        path = f"{root}/async-{fmt}"
        loom.save(path, {"model": model, "step": 1}, async_save=True)
        # Training goes on while the write happens; the checkpoint must hold the state at save time.
        loom.backward(model(torch.randn(4, D_IN)).pow(2).mean())
        opt.step()
        fresh = loom.setup_module(Net())
        rest = loom.load(path, {"model": fresh})  # waits for the async save first
        out[fmt] = {
            "snapshot": all(torch.equal(v, snapshot[k]) for k, v in full_state(fresh).items()),
            "step": rest["step"],
        }

        # A background write that fails is reported at the next save, on every rank.
        real = atomic.replace
        if rank == 0:
            atomic.replace = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full"))
        loom.save(path, {"model": model}, async_save=True)
        try:
            loom.save(path, {"model": model})
            out[fmt]["error"] = None
        except CheckpointError as error:
            out[fmt]["error"] = str(error)
        finally:
            atomic.replace = real

        # A value that cannot be pickled is named.
        try:
            loom.save(path, {"model": model, "lock": threading.Lock()})
            out[fmt]["unpicklable"] = None
        except CheckpointError as error:
            out[fmt]["unpicklable"] = str(error)
    return out


def test_async_save(two_ranks):
    for result in two_ranks[1]:
        for fmt, r in result["async"].items():
            assert r["snapshot"] and r["step"] == 1, fmt
            assert (
                r["error"] and "previous asynchronous save failed" in r["error"] and "disk full" in r["error"]
            ), r
            assert r["unpicklable"] and "'lock'" in r["unpicklable"], r


# ---- WriteBehindFile: the durable full save overlaps serialising with disk writes -------------------------------
def _write_behind_save(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        out = atomic.WriteBehindFile(f)
        torch.save(obj, out)
        out.sync()


def test_write_behind_file_writes_the_same_bytes_and_starts_writeback_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "WRITE_BEHIND_BYTES", 1 << 16)
    started: list[tuple[int, int]] = []
    real = atomic._start_writeback
    monkeypatch.setattr(
        atomic, "_start_writeback", lambda fd, offset, n: (started.append((offset, n)), real(fd, offset, n))
    )
    obj = {
        **{f"w{i}": torch.randn(64, 256) for i in range(8)},
        "steps": torch.arange(1000),
        "note": "x" * 100,
    }
    path = tmp_path / "x.pt"
    _write_behind_save(obj, path)
    reference = io.BytesIO()
    torch.save(obj, reference)
    assert path.read_bytes() == reference.getvalue()
    # Writeback was started from the first byte, in order, with no gaps, and only the tail was left to sync().
    assert len(started) >= 4 and started[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(started, started[1:], strict=False))
    assert path.stat().st_size - sum(started[-1]) < 1 << 16


def test_write_behind_file_finishes_short_writes(tmp_path):
    # write(2) may write less than asked (it stops near 2 GiB on Linux) and torch ignores the count, so the
    # wrapper must loop; a file that takes at most 4 KiB per call shows that it does.
    class ShortWrites:
        def __init__(self, f: io.FileIO) -> None:
            self.f = f

        def fileno(self) -> int:
            return self.f.fileno()

        def write(self, data: memoryview) -> int:
            return self.f.write(data[:4096])

        def flush(self) -> None:
            pass

    obj = {"w": torch.randn(128, 128)}
    path = tmp_path / "short.pt"
    with open(path, "wb", buffering=0) as f:
        out = atomic.WriteBehindFile(ShortWrites(f))  # type: ignore[arg-type]
        torch.save(obj, out)
        out.sync()
    assert torch.equal(torch.load(path)["w"], obj["w"])


# ---- fsync=False: no flush to disk, the same checkpoint ---------------------------------------------------------
def _fsync_body(rank: int, world_size: int, root: str) -> dict:
    import os

    calls = {"n": 0}
    real_fsync, real_sync = os.fsync, os.sync

    def counting_fsync(fd: int) -> None:
        calls["n"] += 1
        real_fsync(fd)

    def counting_sync() -> None:
        calls["n"] += 1
        real_sync()

    os.fsync, os.sync = counting_fsync, counting_sync  # every caller (torchloom, DCP) looks them up on `os`
    try:  # the rank group runs other checks after this one
        return _fsync_cases(root, calls)
    finally:
        os.fsync, os.sync = real_fsync, real_sync


def _fsync_cases(root: str, calls: dict) -> dict:
    strategy = FSDP2Strategy(shard_policy={Block})
    loom = Loom(accelerator="cpu", devices=2, strategy=strategy)
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    want = full_state(model)
    out: dict = {}
    for fmt in ("full", "sharded"):
        strategy.state_dict_type = fmt
        for fsync in (True, False):
            for async_save in (False, True):
                path = Path(root) / f"{fmt}-{fsync}-{async_save}"
                calls["n"] = 0
                loom.save(path, {"model": model}, async_save=async_save, fsync=fsync)
                loom._checkpointer.finish_pending_save()
                count = calls["n"]
                fresh = loom.setup_module(Net())  # other weights until loaded
                loom.load(path, {"model": fresh})
                got = full_state(fresh)
                same = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
                out[(fmt, fsync, async_save)] = (count, same)
    return out


def test_fsync_false_skips_every_flush_and_saves_the_same_checkpoint(two_ranks):
    per_rank = [result["fsync"] for result in two_ranks[1]]
    for fmt in ("full", "sharded"):
        for async_save in (False, True):
            # Durable by default: rank 0 flushes (and, sharded, DCP flushes each rank's shard file).
            assert per_rank[0][(fmt, True, async_save)][0] > 0, (fmt, async_save)
            for rank, result in enumerate(per_rank):
                calls, same = result[(fmt, False, async_save)]
                assert calls == 0, (fmt, async_save, rank)
                assert same and result[(fmt, True, async_save)][1], (fmt, async_save, rank)
    assert per_rank[1][("sharded", True, False)][0] > 0  # each rank's own shards are flushed too


# ---- what a save may replace: a checkpoint, never a folder of the user's ----------------------------------------
def _user_folder(root: Path) -> Path:
    """A folder of checkpoints with a note: what `loom.save(folder, ...)` once replaced with one checkpoint."""
    folder = root / "checkpoints"
    (folder / "step-100").mkdir(parents=True)
    (folder / "step-100" / "model.pt").write_bytes(b"weights of step 100")
    (folder / "notes.txt").write_text("keep me")
    return folder


def _tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def _looms(world_size: int) -> dict[str, Loom]:
    """A Loom per format (launched: the sharded one needs a process group, also in one process)."""
    looms = {}
    for fmt in ("full", "sharded"):
        strategy = FSDP2Strategy(shard_policy={Block}, state_dict_type=fmt)
        looms[fmt] = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
        looms[fmt].launch()
    return looms


def _refused_in_one_process(rank: int, world_size: int, root: str) -> None:
    looms = _looms(world_size)
    for fmt, loom in looms.items():
        model = loom.setup_module(Net())
        for async_save in (False, True):
            case = Path(root) / f"{fmt}-{async_save}"
            folder = _user_folder(case)
            before = _tree(folder)
            with pytest.raises(CheckpointError, match=r"checkpoints'.*'notes\.txt', 'step-100'.*step-100'"):
                loom.save(folder, {"model": model, "step": 1}, async_save=async_save)
            loom._checkpointer.finish_pending_save()
            assert _tree(folder) == before, (fmt, async_save)
            assert sorted(p.name for p in case.iterdir()) == ["checkpoints"]  # no temporary left either
            # The fix the error names works: into the folder.
            loom.save(folder / "step-200", {"model": model, "step": 2}, async_save=async_save)
            assert loom.load(folder / "step-200", {"model": model})["step"] == 2
            assert _tree(folder).items() >= before.items()


def _one_process(rank: int, world_size: int, root: str) -> dict[str, str | None]:
    """The checks in one process, each in a folder of its own (one launch for both): check -> its failure
    (the traceback) or None."""
    import traceback

    out: dict[str, str | None] = {}
    for name, check in (("refused", _refused_in_one_process), ("replaceable", _replaceable_in_one_process)):
        (Path(root) / name).mkdir()
        try:
            check(rank, world_size, f"{root}/{name}")
            out[name] = None
        except Exception:  # noqa: BLE001 - reported by the test that makes this claim
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, str | None]:
    return run_ranks(_one_process, 1, str(tmp_path_factory.mktemp("one_process")), timeout=150)[0]


def test_save_onto_a_folder_is_refused_and_deletes_nothing(one_process):
    assert one_process["refused"] is None, one_process["refused"]


def _replaceable_in_one_process(rank: int, world_size: int, root: str) -> None:
    tmp_path = Path(root)
    looms = _looms(world_size)
    model = looms["full"].setup_module(Net())
    sharded_model = looms["sharded"].setup_module(Net())

    # A file is re-saved in place, as every epoch's `ckpt.pt` is (any file: torch.save overwrites too).
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_text("an old file")
    for step in (1, 2):
        looms["full"].save(ckpt, {"model": model, "step": step})
        assert looms["full"].load(ckpt, {"model": model})["step"] == step
    # A sharded checkpoint replaces a full one at the same path, and the other way round.
    looms["sharded"].save(ckpt, {"model": sharded_model, "step": 3})
    assert ckpt.is_dir() and looms["full"].load(ckpt, {"model": model})["step"] == 3
    looms["full"].save(ckpt, {"model": model, "step": 4})
    assert ckpt.is_file() and looms["full"].load(ckpt, {"model": model})["step"] == 4

    # A sharded save takes an empty directory (as DCP writes into one); a full save does not (a file was meant
    # to go into it, as Fabric's IsADirectoryError says).
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="empty directory"):
        looms["full"].save(empty, {"model": model})
    assert empty.is_dir() and not list(empty.iterdir())
    looms["sharded"].save(empty, {"model": sharded_model, "step": 5})
    assert looms["full"].load(empty, {"model": model})["step"] == 5

    # A sharded checkpoint the user added a file to is no longer only a checkpoint: refused by both formats.
    (empty / "README.md").write_text("my notes")
    before = _tree(empty)
    for fmt, m in (("full", model), ("sharded", sharded_model)):
        with pytest.raises(CheckpointError, match="README"):
            looms[fmt].save(empty, {"model": m})
        assert _tree(empty) == before

    # A sharded save never replaces a file that is not a torch checkpoint.
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a torch checkpoint"):
        looms["sharded"].save(notes, {"model": sharded_model})
    assert notes.read_text() == "not a checkpoint"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_what_a_save_may_replace(one_process):
    assert one_process["replaceable"] is None, one_process["replaceable"]


def test_replace_checks_again_at_the_swap(tmp_path):
    # Something may appear at `path` between the check before writing and the swap: the swap checks again.
    tmp = tmp_path / "new"
    tmp.write_bytes(b"new checkpoint")
    folder = _user_folder(tmp_path)
    before = _tree(folder)
    with pytest.raises(CheckpointError, match="checkpoints"):
        atomic.replace(tmp, folder)
    assert _tree(folder) == before and tmp.exists()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file or directory"):
        atomic.check_replaceable(fifo, directory=False)
    atomic.check_replaceable(tmp_path / "absent", directory=True)  # nothing there: fine


def _refused_on_ranks(rank: int, world_size: int, root: str) -> dict:
    folder = Path(root) / "checkpoints"
    out = {}
    for fmt, loom in _looms(world_size).items():
        model = loom.setup_module(Net())
        for async_save in (False, True):
            try:
                loom.save(folder, {"model": model}, async_save=async_save)
                out[(fmt, async_save)] = None
            except CheckpointError as error:
                out[(fmt, async_save)] = str(error)
            # The ranks are still in step: a save to the right place works.
            good = Path(root) / f"ok-{fmt}-{async_save}"
            loom.save(good, {"model": model, "step": 1}, async_save=async_save)
            out[(fmt, async_save, "ok")] = loom.load(good, {"model": model})["step"]
        # The check itself failing on rank 0 (here: made to) reaches every rank too, instead of hanging them.
        real = atomic.check_replaceable
        if rank == 0:
            atomic.check_replaceable = lambda *a, **k: (_ for _ in ()).throw(PermissionError("no access"))
        try:
            loom.save(Path(root) / "elsewhere", {"model": model})
            out[(fmt, "check failed")] = None
        except CheckpointError as error:
            out[(fmt, "check failed")] = str(error)
        finally:
            atomic.check_replaceable = real
    return out


def test_save_onto_a_folder_is_refused_on_every_rank(two_ranks):
    # The folder deleted nothing: checked by the `two_ranks` fixture against its tree before the rank group.
    for result in (per_rank["refused"] for per_rank in two_ranks[1]):
        for fmt in ("sharded", "full"):
            for async_save in (False, True):
                message = result[(fmt, async_save)]
                assert message and "checkpoints" in message and "notes.txt" in message, (fmt, async_save)
                assert result[(fmt, async_save, "ok")] == 1
            assert "no access" in (result[(fmt, "check failed")] or ""), result


def _failed_sharded_saves(rank: int, world_size: int, root: str) -> dict:
    """Sharded saves that fail after rank 0 made the temporary folder: DCP's write on rank 1 (a full disk), and
    the swap on rank 0; each synchronous and async (whose failure surfaces at the next call)."""
    from torch.distributed.checkpoint import FileSystemWriter

    loom = _looms(world_size)["sharded"]
    model = loom.setup_module(Net())
    path = Path(root) / "ckpt"
    loom.save(path, {"model": model, "step": 1})
    out = {}
    real_write, real_replace = FileSystemWriter.write_data, atomic.replace

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def swap_refused(*args, **kwargs):
        raise PermissionError("swap refused")

    for where, patch in (("write", full_disk), ("swap", swap_refused)):
        for async_save in (False, True):
            if where == "write" and rank == 1:
                FileSystemWriter.write_data = patch
            if where == "swap" and rank == 0:
                atomic.replace = patch
            try:
                loom.save(path, {"model": model, "step": 2}, async_save=async_save)
                loom.load(path, {})  # an async save's failure surfaces here
                out[(where, async_save)] = None
            except CheckpointError as error:
                out[(where, async_save)] = str(error)
            finally:
                FileSystemWriter.write_data, atomic.replace = real_write, real_replace
            loom.barrier()
            out[(where, async_save, "left")] = sorted(os.listdir(root))
            out[(where, async_save, "step")] = loom.load(path, {"model": model})["step"]
    return out


def test_a_failed_sharded_save_leaves_nothing_beside_the_checkpoint(two_ranks):
    # The hidden temporary folder (a whole checkpoint's worth of shards) used to stay until the next save to the
    # same path.
    for result in (per_rank["failed"] for per_rank in two_ranks[1]):
        for where, cause in (("write", "No space left on device"), ("swap", "swap refused")):
            for async_save in (False, True):
                assert cause in (result[(where, async_save)] or ""), (where, async_save, result)
                assert result[(where, async_save, "left")] == ["ckpt"], (where, async_save)
                assert result[(where, async_save, "step")] == 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
