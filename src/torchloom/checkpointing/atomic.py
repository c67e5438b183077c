"""Putting a finished checkpoint in place in one step, so a crash never leaves a half-written one at `path`.

A checkpoint (a file or a directory) is written under a temporary sibling name and then swapped into place.
Over an existing checkpoint the swap is one `renameat2(RENAME_EXCHANGE)` on Linux, so at every instant `path`
holds either the old or the new checkpoint; elsewhere it is two renames, and `recover` finds the old one if a
crash falls between them.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import uuid
from pathlib import Path

_TMP_TAG = ".tmp-"
_OLD_TAG = ".old-"


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


def replace(tmp: Path, path: Path) -> None:
    """Move the finished `tmp` to `path`, replacing whatever is there (file or directory) in one step."""
    if not path.exists() and not path.is_symlink():
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        _remove(tmp)  # now holds the previous checkpoint
    else:
        old = path.with_name(f".{path.name}{_OLD_TAG}{uuid.uuid4().hex[:12]}")
        os.rename(path, old)
        os.rename(tmp, path)
        _remove(old)
    fsync_dir(path.parent)


def recover(path: Path) -> Path:
    """`path`, or if a two-rename swap was interrupted, the previous checkpoint it was moving aside."""
    if path.exists():
        return path
    olds = sorted(
        path.parent.glob(f"{_glob_escape(f'.{path.name}{_OLD_TAG}')}*"), key=lambda p: p.stat().st_mtime
    )
    return olds[-1] if olds else path


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
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
