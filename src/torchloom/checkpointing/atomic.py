"""Putting a finished checkpoint in place in one step, so a crash never leaves a half-written one at `path`.

A checkpoint (a file or a directory) is written under a temporary sibling name, flushed to disk, and then swapped
into place. Over an existing checkpoint the swap is one `renameat2(RENAME_EXCHANGE)` on Linux, so at every instant
`path` holds either the old or the new checkpoint; elsewhere it is two renames, and `recover` finds the old one if
a crash falls between them.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import stat
import sys
import uuid
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

from torchloom.errors import CheckpointError

_TMP_TAG = ".tmp-"
_OLD_TAG = ".old-"

# How much written data WriteBehindFile lets accumulate before asking the kernel to start writing it out.
WRITE_BEHIND_BYTES = 32 << 20


class WriteBehindFile:
    """A file opened for writing whose data starts going to disk while the rest is still being written.

    The final `fsync` that makes a checkpoint durable then waits only for the last few megabytes instead of the
    whole file: serialising and the disk's writes overlap instead of following each other (benchmarks/
    checkpoint_io.py measures the result). Linux's `sync_file_range(SYNC_FILE_RANGE_WRITE)` starts the writeback
    without waiting for it; it is only a hint, so elsewhere the class is a plain file and `sync()` does all the
    work. `torch.save(obj, WriteBehindFile(f))` works because torch only calls `write`.
    """

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._fd = file.fileno()
        self._written = 0
        self._flushed = 0  # bytes already handed to writeback

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        # An unbuffered file's write(2) stops at about 2 GiB, and torch ignores a short count: loop until all is
        # written. (A buffered file, what torchloom passes, loops itself.)
        done = 0
        while done < len(view):
            done += self._file.write(view[done:])
        self._written += done
        if self._written - self._flushed >= WRITE_BEHIND_BYTES:
            self._file.flush()
            _start_writeback(self._fd, self._flushed, self._written - self._flushed)
            self._flushed = self._written
        return done

    def flush(self) -> None:
        self._file.flush()

    def sync(self) -> None:
        """Wait until everything written is on disk."""
        self._file.flush()
        os.fsync(self._fd)


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    func = _sync_file_range()
    if func is not None:
        func(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure here only loses the overlap


_SYNC_FILE_RANGE: Any = False  # False: not looked up yet


def _sync_file_range() -> Any:
    global _SYNC_FILE_RANGE
    if _SYNC_FILE_RANGE is False:
        _SYNC_FILE_RANGE = None
        if sys.platform.startswith("linux"):
            try:
                func = ctypes.CDLL(None, use_errno=True).sync_file_range
            except (OSError, AttributeError):
                func = None
            if func is not None:
                func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                func.restype = ctypes.c_int
                _SYNC_FILE_RANGE = func
    return _SYNC_FILE_RANGE


def temporary_sibling(path: Path) -> Path:
    """A unique hidden name beside `path` (same filesystem, so renames are atomic)."""
    return path.with_name(f".{path.name}{_TMP_TAG}{uuid.uuid4().hex[:12]}")


def remove_stale_temporaries(path: Path) -> None:
    """Delete what interrupted saves to `path` left behind (only this checkpoint's own temporary names)."""
    if not path.parent.exists():
        return
    for prefix in (f".{path.name}{_TMP_TAG}", f".{path.name}{_OLD_TAG}"):
        for stale in path.parent.glob(f"{_glob_escape(prefix)}*"):
            if prefix.endswith(_OLD_TAG) and not path.exists():
                continue  # the only copy left of the previous checkpoint: `recover` needs it
            _remove(stale)


def discard(tmp: Path | None) -> None:
    """Delete a failed save's temporary file or directory (nothing if it is not there): a save that raises
    leaves the previous checkpoint as it was and nothing else beside it."""
    if tmp is not None:
        _remove(tmp)


def _glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2). False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return result == 0


# What a sharded checkpoint directory holds: DCP's shards and metadata (with the temporary name DCP writes it
# under), and torchloom's own two files.
_CHECKPOINT_FILE = re.compile(r"(__\d+)?\.metadata(\.tmp)?|.*\.distcp|torchloom\.json|extra\.pt")


def is_checkpoint_file(path: Path) -> bool:
    """`path` is a regular file (not a link) with the name of one of a sharded checkpoint's files."""
    try:
        regular = stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
    return regular and _CHECKPOINT_FILE.fullmatch(path.name) is not None


def check_replaceable(path: Path, directory: bool) -> None:
    """Raise `CheckpointError` unless a new checkpoint (`directory`: a sharded one) may take `path`'s place.

    A save replaces the checkpoint at its path and nothing else: the swap deletes what was there. So `path` may
    be absent, a symbolic link (only the link is replaced), a file (a full save replaces any file, as
    `torch.save` overwrites; a sharded save only a file `torch.save` wrote), or a directory holding nothing but
    a sharded checkpoint's files (for a sharded save, an empty directory too). Any other directory (a folder of
    checkpoints, an output folder) is refused, whatever the format."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there (writing beside it then says what is wrong with the folder)
    if stat.S_ISLNK(mode):
        return
    if stat.S_ISREG(mode):
        if directory and not _is_torch_file(path):
            raise CheckpointError(
                f"Cannot save the sharded checkpoint (a directory) at {str(path)!r}: a file that is not a torch "
                "checkpoint is there, and saving would delete it. Save to another path, or remove the file first."
            )
        return
    if not stat.S_ISDIR(mode):
        raise CheckpointError(
            f"Cannot save a checkpoint at {str(path)!r}: it is not a regular file or directory. Save to another path."
        )
    names = sorted(os.listdir(path))
    if not names and directory:
        return
    foreign = [n for n in names if not (_CHECKPOINT_FILE.fullmatch(n) and (path / n).is_file())]
    is_checkpoint = bool(names) and not foreign and any(n in ("torchloom.json", ".metadata") for n in names)
    if is_checkpoint:
        return
    what = "an empty directory" if not names else f"a directory holding {_listing(foreign or names)}"
    raise CheckpointError(
        f"Cannot save a checkpoint at {str(path)!r}: {what}, not a checkpoint, and saving would replace it "
        f"whole. A save replaces only a checkpoint: save into the folder instead (e.g. "
        f"{str(path / 'step-100')!r}), or to another path."
    )


def _is_torch_file(path: Path) -> bool:
    """A file `torch.save` wrote: a zip archive holding the pickle `<name>/data.pkl`."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(n.endswith("/data.pkl") for n in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def replace(tmp: Path, path: Path, fsync: bool = True, check: bool = True) -> None:
    """Move the finished `tmp` to `path`, replacing the checkpoint there (file or directory) in one step; with
    `fsync`, also make the rename itself durable. With `check` (the callers' check, made again: something may
    have appeared at `path` meanwhile), what is at `path` must be a checkpoint (`check_replaceable`)."""
    if check:
        check_replaceable(path, directory=tmp.is_dir())
    if not path.exists() and not path.is_symlink():
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        _remove(tmp)  # now holds the previous checkpoint
    else:
        old = path.with_name(f".{path.name}{_OLD_TAG}{uuid.uuid4().hex[:12]}")
        os.rename(path, old)
        os.rename(tmp, path)
        _remove(old)
    if fsync:
        fsync_dir(path.parent)


def recover(path: Path) -> Path:
    """`path`, or if a two-rename swap was interrupted, the previous checkpoint it was moving aside."""
    if path.exists():
        return path
    olds = sorted(
        path.parent.glob(f"{_glob_escape(f'.{path.name}{_OLD_TAG}')}*"), key=lambda p: p.stat().st_mtime
    )
    return olds[-1] if olds else path


def fsync_file(path: Path) -> None:
    """Flush a written file to disk (before it is renamed into place)."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file of a directory checkpoint to disk before it is renamed into place."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            file = os.path.join(dirpath, name)
            if not stat.S_ISREG(os.lstat(file).st_mode):
                continue  # a link or a fifo carried over from the user's folder: opening a fifo would block
            try:
                fd = os.open(file, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
