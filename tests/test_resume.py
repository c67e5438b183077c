"""`torchloom.latest_checkpoint` and `rotate_checkpoints` on real saves of 2 ranks: full (DDP) and sharded
(FSDP2) checkpoints, synchronous and asynchronous, beside partial saves and the user's own files."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from torch import nn

import torchloom
from torchloom import Loom, MisuseError, latest_checkpoint, rotate_checkpoints
from torchloom.checkpointing import atomic


def _paused_swaps():
    """Hold every checkpoint's swap into place (its files all written under the temporary name) until released:
    an asynchronous save stays "in flight" for as long as the test needs."""
    release = threading.Event()
    original = atomic.replace

    def paused(tmp, path, *args, **kwargs):
        release.wait(60)
        return original(tmp, path, *args, **kwargs)

    atomic.replace = paused
    return release, lambda: setattr(atomic, "replace", original)


def _params(model) -> torch.Tensor:
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().flatten() for p in full])


def _train_and_save(
    loom: Loom, directory: Path, names: list[str], async_last: bool
) -> dict[str, torch.Tensor]:
    """One step per name, a checkpoint after each (the last asynchronous and held in flight while the newest
    complete one is looked up); return every checkpoint's parameters by name."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, optimizer = loom.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    saved = {}
    for step, name in enumerate(names):
        loom.backward(model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": model, "optimizer": optimizer, "step": step + 1}
        last = step == len(names) - 1
        if last and async_last:
            release, restore = _paused_swaps()
            try:
                loom.save(directory / name, state, async_save=True)
                # The async save is written but not in place: the newest complete checkpoint is the one before.
                assert latest_checkpoint(directory) == directory / names[-2]
                loom.barrier()  # every rank looked before rank 0's swap goes ahead
            finally:
                release.set()
                restore()
            _wait_until_exists(directory / name)
            loom.barrier()
        else:
            loom.save(directory / name, state)
        saved[name] = _params(model)
    return saved


def _wait_until_exists(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _checkpoints_on_two_ranks(rank: int, world_size: int, root: str) -> dict:
    from torchloom.strategies import FSDP2Strategy

    root_path = Path(root)
    results = {}
    for fmt, strategy in (("full", "ddp"), ("sharded", FSDP2Strategy())):
        directory = root_path / fmt
        suffix = ".pt" if fmt == "full" else ""
        names = [f"step-{i}{suffix}" for i in (1, 2, 9, 10)]
        loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
        loom.launch()
        saved = _train_and_save(loom, directory, names, async_last=True)
        loom.barrier()
        # Resuming: every rank finds the same newest checkpoint and loads the parameters saved last.
        newest = latest_checkpoint(directory)
        torch.manual_seed(1)
        model = nn.Linear(4, 2)
        model, optimizer = loom.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        loom.load(newest, state)
        results[fmt] = {
            "newest": newest.name,
            "step": state["step"],
            "loaded": _params(model),
            "saved": saved,
        }
        loom.close()
    return results


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    results = run_ranks(_checkpoints_on_two_ranks, 2, str(root), timeout=240)
    return root, results


def test_latest_checkpoint_of_real_saves_on_two_ranks(saved_on_two_ranks):
    """Full and sharded checkpoints of 2 ranks, the last written asynchronously: while it is in flight the
    previous one is the newest (checked inside the ranks); once in place, every rank finds it (not step-9:
    completion order, not names compared as text), and loading it gives the parameters saved last."""
    _, results = saved_on_two_ranks
    for fmt, suffix in (("full", ".pt"), ("sharded", "")):
        for rank_result in results:
            found = rank_result[fmt]
            assert found["newest"] == f"step-10{suffix}" and found["step"] == 4, found
            assert torch.equal(found["loaded"], found["saved"][f"step-10{suffix}"])


def _plant_partial_and_user_files(directory: Path, fmt: str) -> dict[str, Path]:
    """Beside the real checkpoints, newer than all of them: what a crash or the user leaves in the folder."""
    newest = directory / ("step-10.pt" if fmt == "full" else "step-10")
    planted = {}

    def copy(name: str) -> Path:
        target = directory / name
        (shutil.copytree if newest.is_dir() else shutil.copy)(newest, target)
        planted[name] = target
        return target

    copy(f".step-11{'.pt' if fmt == 'full' else ''}.tmp-0123456789ab")  # a save killed before its swap
    if fmt == "full":
        truncated = copy("step-12.pt")  # e.g. a copy being made: its zip directory is missing
        truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
        user = directory / "user-model.pt"
        torch.save({"weights": torch.ones(2)}, user)  # the user's own torch.save: no torchloom record
        planted["user-model.pt"] = user
    else:
        unfinished = copy("step-12")  # DCP's metadata not written yet
        (unfinished / ".metadata").unlink()
        short = copy("step-13")  # a shard cut short
        shard = next(short.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:8])
        os.utime(short / ".metadata")
        mixed = copy("step-14")  # the user's file inside: not a folder torchloom wrote
        (mixed / "notes.txt").write_text("mine")
    notes = directory / "notes.txt"
    notes.write_text("keep me")
    (directory / "logs").mkdir(exist_ok=True)
    (directory / "logs" / "run.log").write_text("keep me too")
    link = directory / "latest"
    link.symlink_to(newest.name)
    planted.update({"notes.txt": notes, "logs": directory / "logs", "latest": link})
    return planted


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_partial_saves_and_user_files_are_never_latest_nor_rotated(saved_on_two_ranks, fmt):
    """A killed save's temporary, a truncated file, a sharded folder without metadata or with a short shard,
    user files and links, all newer than the real checkpoints: `latest_checkpoint` still returns the newest
    complete one, and rotation deletes only older complete checkpoints, never the newest nor anything else."""
    root, _ = saved_on_two_ranks
    directory = root / fmt
    suffix = ".pt" if fmt == "full" else ""
    planted = _plant_partial_and_user_files(directory, fmt)
    assert latest_checkpoint(directory) == directory / f"step-10{suffix}"
    removed = rotate_checkpoints(directory, keep_last=2)
    assert removed == [directory / f"step-1{suffix}", directory / f"step-2{suffix}"]
    assert not any(p.exists() for p in removed)
    assert (directory / f"step-9{suffix}").exists() and (directory / f"step-10{suffix}").exists()
    for name, path in planted.items():
        assert path.exists() or path.is_symlink(), name
    assert rotate_checkpoints(directory, keep_last=2) == []
    assert rotate_checkpoints(directory, keep_last=1) == [directory / f"step-9{suffix}"]
    assert latest_checkpoint(directory) == directory / f"step-10{suffix}"
    with pytest.raises(MisuseError, match="keep_last"):
        rotate_checkpoints(directory, keep_last=0)


def test_equal_times_order_by_the_numbers_in_the_names(tmp_path):
    """On a filesystem with coarse timestamps two checkpoints can carry the same time: step-10 is then newer
    than step-9, not older as text would have it."""
    for name in ("step-9.pt", "step-10.pt", "step-2.pt"):
        torch.save({"model": {}, "__torchloom__": {"version": 2}}, tmp_path / name)
        os.utime(tmp_path / name, ns=(10**18, 10**18))
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10.pt"
    assert latest_checkpoint(tmp_path / "missing") is None
    assert rotate_checkpoints(tmp_path, keep_last=1) == [tmp_path / "step-2.pt", tmp_path / "step-9.pt"]


def test_exported_with_docstrings():
    for name in ("latest_checkpoint", "rotate_checkpoints", "Elastic"):
        assert name in torchloom.__all__ and getattr(torchloom, name).__doc__
