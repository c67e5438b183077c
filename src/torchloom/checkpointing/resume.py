"""Finding the checkpoint to resume from, and keeping only the last few.

A torchloom checkpoint is complete once it has its final name: saves write under a hidden temporary name
(`.NAME.tmp-…`) and rename the finished checkpoint into place (`atomic.py`), and an asynchronous save does the
same when its background write ends. So what has a visible name and the shape torchloom writes is complete:

    full      a file `torch.save` wrote (a zip archive whose directory, written last, is readable) whose pickle
              holds torchloom's `__torchloom__` record (every `loom.save` of a module, optimizer or object)
    sharded   a directory holding only a sharded checkpoint's files, among them `torchloom.json`, `extra.pt`
              and DCP's `.metadata` (which DCP writes after every shard), every shard it names present

Only the entries directly inside the directory are looked at. "Newest" is the order the checkpoints were
completed in (the modification time of the full file, of a sharded checkpoint's `.metadata`), names compared
with their numbers as numbers when two times are equal: torchloom records no training step of its own, and a job
that resumes from its newest checkpoint writes the next ones after it, so completion order is progress order.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zipfile
from pathlib import Path

from torchloom.checkpointing import atomic
from torchloom.checkpointing.state import META_KEY
from torchloom.errors import CheckpointError, MisuseError

_SHARDED_REQUIRED = (".metadata", "torchloom.json", "extra.pt")


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete torchloom checkpoint directly inside `directory` (a full checkpoint file or a
    sharded checkpoint directory, as `loom.save` writes them), or None when there is none (or no directory).

    Never a partial save: a save in progress, synchronous or asynchronous, or one interrupted by a crash, lives
    under a hidden temporary name until it is complete; a sharded directory without its metadata or with a
    shard missing or short is skipped (the next newest is taken). Anything else in the directory (your own
    files, logs, a `torch.save` file without torchloom's record) is ignored. Newest means last completed (the
    file's modification time; keep it when copying checkpoints: `cp -p`, `rsync -t`).

    Every rank of a job should resume from the same checkpoint: on a shared filesystem each rank finds the same
    one, or decide on rank 0 with `path = loom.broadcast(latest_checkpoint(directory))`.

        path = torchloom.latest_checkpoint("checkpoints")
        if path is not None:
            loom.load(path, state)
    """
    for _, path in _complete_checkpoints(Path(directory)):
        if _shards_present(path):
            return path
    return None


def rotate_checkpoints(directory: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete torchloom checkpoints directly inside `directory`; return
    what was deleted, oldest first. Call it on one rank, after a save (e.g. `if loom.is_global_zero:`).

    Only what `latest_checkpoint` would recognise is ever deleted: a checkpoint being written (its hidden
    temporary name), a damaged one, files and folders that are not torchloom checkpoints, links, and anything
    in a sharded checkpoint's folder that torchloom did not write stay. The newest complete checkpoint is always
    kept (`keep_last` >= 1)."""
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise MisuseError(
            f"rotate_checkpoints(keep_last={keep_last!r}): pass a whole number >= 1 (the newest complete "
            "checkpoint is never deleted)."
        )
    complete = [path for _, path in _complete_checkpoints(Path(directory)) if _shards_present(path)]
    removed = complete[keep_last:]
    for path in reversed(removed):
        _delete_checkpoint(path)
    return list(reversed(removed))


def _complete_checkpoints(directory: Path) -> list[tuple[tuple, Path]]:
    """(order key, path) of the complete-looking checkpoints in `directory`, newest first."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        if name.startswith("."):
            continue  # a save in progress or interrupted (.NAME.tmp-…, .NAME.old-…), or a hidden file
        path = directory / name
        completed_at = _completion_time(path)
        if completed_at is not None:
            found.append(((completed_at, _natural(name)), path))
    return sorted(found, key=lambda item: item[0], reverse=True)


def _completion_time(path: Path) -> int | None:
    """When `path` was completed (ns), if it is a complete torchloom checkpoint; None otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return path.stat().st_mtime_ns if _is_torchloom_file(path) else None
    if stat.S_ISDIR(mode) and _is_sharded_checkpoint(path):
        return (path / ".metadata").stat().st_mtime_ns
    return None  # links (a "latest" link would name a checkpoint twice) and anything else


def _is_torchloom_file(path: Path) -> bool:
    """A full checkpoint: a readable torch zip archive whose pickle holds the `__torchloom__` record. The pickle
    is searched for the key's bytes, never unpickled."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                return False
            return META_KEY.encode() in archive.read(pickles[0])
    except (OSError, zipfile.BadZipFile, RuntimeError, ValueError):
        return False


def _is_sharded_checkpoint(path: Path) -> bool:
    """A directory holding only a sharded checkpoint's files, its metadata among them."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if not all(n in names for n in _SHARDED_REQUIRED):
        return False
    if not all(atomic.is_checkpoint_file(path / n) for n in names):
        return False
    try:
        meta = json.loads((path / "torchloom.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == "sharded"


def _shards_present(path: Path) -> bool:
    """For a sharded checkpoint, DCP's metadata reads and every shard file it names is there and long enough."""
    if not path.is_dir():
        return True
    from torchloom.checkpointing import sharded

    try:
        sharded.read_dcp_metadata(path)
    except CheckpointError:
        return False
    return True


def _delete_checkpoint(path: Path) -> None:
    """Remove one checkpoint: a full file, or a sharded directory's own files and then the directory, which is
    left in place if anything else appeared in it. Safe against another process deleting it meanwhile."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for name in os.listdir(path):
        if atomic.is_checkpoint_file(path / name):
            (path / name).unlink(missing_ok=True)
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as error:
        raise CheckpointError(
            f"Deleted the checkpoint files in {str(path)!r} but kept the folder: something else is in it "
            f"({error.strerror})."
        ) from None


def _natural(name: str) -> tuple:
    """`name` with its numbers compared as numbers: step-9 before step-10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
