"""Checksums of a checkpoint's files: recorded when a checkpoint is written, verified when it is loaded.

Neither DCP, `torch.load` nor safetensors checks what it reads: one flipped byte of a stored tensor loads as a
different number. So every file torchloom writes gets a checksum at save time, and a load recomputes it first
and refuses a file whose bytes changed (`CheckpointError` naming the file, both checksums, and the opt-out,
`verify=False`).

Where the checksums live:

    sharded   torchloom.json: `"checksums": {"algorithm": ..., "files": {name: {"size": n, "digest": hex}}}`
              for every file of the checkpoint (DCP's shards and .metadata, extra.pt), each hashed by the rank
              that wrote it; torchloom.json itself carries the digest of its own content (`"record_digest"`).
    full      the file's own zip comment (the one part of a zip archive outside its records, which torch.load
              and every zip reader ignore): `torchloom-checksum:<algorithm>:<hex>` over the archive as torch.save
              wrote it (comment length 0); the `__torchloom__` record says that the file has one.
    safetensors  (`save_raw`, `consolidate --format hf`) each file's own header metadata, the string map
              safetensors keeps for its writer (`"torchloom_checksum": "<algorithm>:<hex>"`, beside transformers'
              `"format": "pt"`), over the whole file with those hex digits as zeros. In the file itself, not in
              the index: it holds for a single `model.safetensors` too, goes with a file that is copied alone,
              and cannot go stale when another tool rewrites the folder. A file without it (written elsewhere)
              is not checked.

The algorithm (`ALGORITHM`) is chosen for speed, measured in benchmarks/checkpoint_io.py: the file read as
little-endian 64-bit words, the wrapping sum of each 8 KiB row (numpy: about 10-20 GiB/s on one core, against
3 GiB/s for zlib.crc32 and 0.6-1.7 GiB/s for BLAKE2b or SHA-256), and BLAKE2b-128 over those sums, the bytes
that do not fill a row and the size. It detects any change within one 64-bit word, any change to a single row
that does not cancel out in its 64-bit sum, and any change of length; it is a guard against accidental
corruption (disks, copies, truncation), not against someone forging a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist

from torchloom.errors import CheckpointError, describe_failure, raise_shared_failure

ALGORITHM = "rowsum64-blake2b"
_WORDS = 1024  # 64-bit words per row
_ROW = _WORDS * 8
_PERSON = b"torchloom-ck"

#: How the opt-out is spelled in messages.
OPT_OUT = (
    "If you must load it anyway (e.g. to salvage what is intact), pass verify=False (loom.load(path, state, "
    "verify=False)); `torchloom inspect --verify PATH` lists every file that fails"
)


class Digest:
    """The checksum of a stream of bytes fed in pieces of any size (`update`), equal to `file_digest` of a file
    holding them."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16, person=_PERSON)
        self._carry = bytearray()
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if self._carry:
            take = min(_ROW - len(self._carry), len(view))
            self._carry += view[:take]
            view = view[take:]
            if len(self._carry) < _ROW:
                return
            self._rows(self._carry)
            self._carry = bytearray()
        whole = len(view) - len(view) % _ROW
        if whole:
            self._rows(view[:whole])
        if whole < len(view):
            self._carry += view[whole:]

    def _rows(self, data: Any) -> None:
        self._hash.update(_row_sums(data))

    def _add_rows(self, sums: bytes, nbytes: int) -> None:
        """Whole rows whose sums were computed elsewhere (`_row_sums`), with nothing carried over."""
        assert not self._carry
        self._hash.update(sums)
        self.size += nbytes

    def hexdigest(self) -> str:
        final = self._hash.copy()
        final.update(bytes(self._carry))
        final.update(self.size.to_bytes(8, "little"))
        return final.hexdigest()


def _row_sums(data: Any) -> bytes:
    words = np.frombuffer(data, dtype="<u8")
    # Unsigned sums wrap modulo 2**64 (defined, and the same in any order); the sums are 1/1024 of the data.
    # numpy releases the GIL while it sums, so pieces of a file sum in parallel threads.
    return words.reshape(-1, _WORDS).sum(axis=1, dtype=np.uint64).astype("<u8").tobytes()


# A large file is summed in pieces of this size, on up to `_THREADS` threads (where the machine has the cores:
# a GPU node's ranks have many each; on 2 cores it changes nothing).
_PIECE = 64 << 20
_THREADS = 4
_POOL: Any = None


def _pool() -> Any:
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        _POOL = ThreadPoolExecutor(
            max_workers=max(1, min(_THREADS, cores)), thread_name_prefix="torchloom-sum"
        )
    return _POOL


def file_digest(path: Path, length: int | None = None, patch: bytes = b"") -> tuple[int, str]:
    """(size, checksum) of the file at `path` (only its first `length` bytes, followed by `patch`, if given),
    read memory-mapped: no copy of the file in memory."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size if length is None else length
    whole = size - size % _ROW
    return size, _finish(path, size, _range_sums(path, 0, whole), patch)


def _finish(path: Path, size: int, sums: bytes, patch: bytes) -> str:
    """The checksum of `path`'s first `size` bytes + `patch`, given the sums of all its whole rows."""
    digest = Digest()
    whole = size - size % _ROW
    digest._add_rows(sums, whole)
    with open(path, "rb") as f:
        f.seek(whole)
        digest.update(f.read(size - whole))
    digest.update(patch)
    return digest.hexdigest()


def _range_sums(path: Path, start: int, stop: int) -> bytes:
    """The row sums of bytes [start, stop) of `path` (both multiples of a row), memory-mapped."""
    if stop <= start:
        return b""
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), stop - start, access=mmap.ACCESS_READ, offset=start) as mapped,
    ):
        view = memoryview(mapped)
        length = stop - start
        pieces = [view[i : min(i + _PIECE, length)] for i in range(0, length, _PIECE)]
        try:
            sums = _pool().map(_row_sums, pieces) if len(pieces) > 1 else map(_row_sums, pieces)
            return b"".join(sums)
        finally:
            # The map closes only once no view of it is left.
            for piece in pieces:
                piece.release()
            view.release()


class HashingFile:
    """A file-like object for `torch.save` that checksums what passes through it to `file`."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.digest = Digest()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


def entry(size: int, digest: str) -> dict[str, Any]:
    return {"size": size, "digest": digest}


def mismatch_error(file: Path, expected: dict[str, Any], found: tuple[int, str] | None) -> CheckpointError:
    if found is None:
        what = "is missing"
    elif found[0] != expected.get("size"):
        what = (
            f"has {found[0]} bytes where the checkpoint recorded {expected.get('size')} (checksum {found[1]}, "
            f"expected {expected.get('digest')})"
        )
    else:
        what = f"has checksum {found[1]}, but the checkpoint recorded {expected.get('digest')} ({ALGORITHM})"
    return CheckpointError(
        f"Checkpoint file {str(file)!r} {what}: it changed after it was written (disk or copy corruption), so "
        f"the values it would load are not the ones saved. Load another checkpoint, or restore this one from a "
        f"good copy. {OPT_OUT}."
    )


def check_file(path: Path, expected: dict[str, Any]) -> CheckpointError | None:
    """The error for `path` if its size or checksum differs from `expected` (an `entry`), else None."""
    try:
        size = path.stat().st_size
    except OSError:
        return mismatch_error(path, expected, None)
    if size != expected.get("size"):
        return mismatch_error(path, expected, (size, "(not computed)"))
    found = file_digest(path)
    return None if found[1] == expected.get("digest") else mismatch_error(path, expected, found)


def check_shared(io: Any, sizes: dict[Path, int], check: Any) -> None:
    """`check(file)` (raises `CheckpointError` for a bad file) for every file of `sizes`, the work split over the
    ranks: the largest files first, each to the rank with the least to read so far. Every rank raises if any
    file fails (`agree`)."""
    world = io.world_size if io.is_distributed else 1
    rank = io.global_rank if io.is_distributed else 0
    load, mine = [0] * world, []
    for file in sorted(sizes, key=lambda f: (-int(sizes[f]), str(f))):
        least = load.index(min(load))
        load[least] += int(sizes[file])
        if least == rank:
            mine.append(file)

    def check_mine() -> None:
        for file in mine:
            check(file)

    agree(io, check_mine)


def check_algorithm(where: Path, algorithm: Any) -> None:
    if algorithm != ALGORITHM:
        raise CheckpointError(
            f"{str(where)!r} records checksums made with {algorithm!r}, which this torchloom cannot compute (it "
            f"uses {ALGORITHM!r}): it was written by another torchloom version. Upgrade torchloom, or load it "
            "without verifying (verify=False)."
        )


# ---- a sharded checkpoint's record: its own digest ---------------------------------------------------------
RECORD_DIGEST = "record_digest"


def _record_bytes(meta: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != RECORD_DIGEST}, sort_keys=True).encode()


def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with the digest of its own content, so that a changed value in torchloom.json is caught too."""
    return {**meta, RECORD_DIGEST: hashlib.blake2b(_record_bytes(meta), digest_size=16).hexdigest()}


def check_seal(file: Path, meta: dict[str, Any]) -> None:
    expected = meta.get(RECORD_DIGEST)
    if expected is None:
        return  # written before checksums existed
    found = hashlib.blake2b(_record_bytes(meta), digest_size=16).hexdigest()
    if found != expected:
        raise CheckpointError(
            f"Checkpoint file {str(file)!r} has checksum {found}, but records {expected}: its content changed "
            f"after it was written. Load another checkpoint, or restore this one from a good copy. {OPT_OUT}."
        )


# ---- a full checkpoint's checksum, in its zip comment ------------------------------------------------------
_EOCD = b"PK\x05\x06"  # the zip archive's end-of-central-directory record: 22 bytes, then the comment
_EOCD_SIZE = 22
_MARK = b"torchloom-checksum:"
_TAIL = _EOCD_SIZE + 128


def append_trailer(file: BinaryIO, digest: Digest) -> None:
    """Put the checksum of the archive `file` holds (what torch.save wrote, all of it through `digest`) in its
    zip comment. `file` is open for writing, positioned at its end."""
    comment = _MARK + f"{ALGORITHM}:{digest.hexdigest()}".encode()
    file.flush()
    end = file.tell()
    file.seek(end - 2)  # the comment's length, the EOCD's last field (0: torch.save writes no comment)
    file.write(len(comment).to_bytes(2, "little"))
    file.seek(end)
    file.write(comment)


def read_trailer(path: Path) -> tuple[int, str, str] | None:
    """(the archive's length without its comment, algorithm, expected checksum) of a full checkpoint file, None
    for a file without a torchloom checksum. A damaged trailer raises."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - _TAIL))
        tail = f.read()
    at = tail.rfind(_MARK)
    if at < 0:
        return None
    comment = tail[at:]
    eocd = at - _EOCD_SIZE
    fields = comment[len(_MARK) :].decode("ascii", "replace").split(":")
    if (
        eocd < 0
        or tail[eocd : eocd + 4] != _EOCD
        or int.from_bytes(tail[at - 2 : at], "little") != len(comment)
        or len(fields) != 2
    ):
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} has a damaged checksum record at its end: the file changed after it "
            f"was written. Load another checkpoint, or restore this one from a good copy. {OPT_OUT}."
        )
    return size - len(comment), fields[0], fields[1]


def rewritten_without_comment(path: Path) -> bool:
    """Whether the file is a zip archive that ends in its end-of-central-directory record with no comment, as
    plain `torch.save` writes one: a torchloom checkpoint loaded and saved again (its record copied along), not a
    damaged trailer (which leaves a comment length, or bytes after the record)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _EOCD_SIZE:
            return False
        f.seek(size - _EOCD_SIZE)
        tail = f.read()
    return tail[:4] == _EOCD and tail[-2:] == b"\0\0"


def check_full_file_shared(io: Any, path: Path) -> bool:
    """`check_full_file` with the work split over the ranks (each sums an equal share of the file's rows; the
    sums, 1/1024 of the file, are gathered on the checkpoint group); every rank raises if the file changed.
    Whether it carries a checksum."""
    if not (io.is_distributed and dist.is_initialized()):
        carried, error = check_full_file(path)
        if error is not None:
            raise error
        return carried
    group = io.checkpoint_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    state: dict[str, Any] = {}

    def share() -> None:
        trailer = read_trailer(path)
        if trailer is not None:
            check_algorithm(path, trailer[1])
            length = trailer[0] - 2  # the archive as torch.save wrote it: its comment length was 0
            rows = length // _ROW
            start, stop = (rows * rank // world) * _ROW, (rows * (rank + 1) // world) * _ROW
            state.update(trailer=trailer, length=length, sums=_range_sums(path, start, stop))

    agree(io, share)  # a damaged trailer on any rank raises on all, before the gather
    if not state:
        return False
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, state["sums"], group=group)

    def compare() -> None:
        length, expected = state["length"], state["trailer"][2]
        found = _finish(path, length, b"".join(parts), b"\0\0")
        if found != expected:
            raise mismatch_error(path, {"size": length, "digest": expected}, (length, found))

    agree(io, compare)
    return True


def check_full_file(path: Path) -> tuple[bool, CheckpointError | None]:
    """(whether `path` carries a checksum, the error if it does not match)."""
    trailer = read_trailer(path)
    if trailer is None:
        return False, None
    length, algorithm, expected = trailer
    check_algorithm(path, algorithm)
    # The checksum covers the archive as torch.save wrote it: its comment length was 0.
    size, found = file_digest(path, length - 2, patch=b"\0\0")
    if found == expected:
        return True, None
    return True, mismatch_error(path, {"size": size, "digest": expected}, (size, found))


def agree(io: Any, check: Any) -> None:
    """Run `check()` (which raises `CheckpointError` for a bad file) on every rank, and raise on every rank if
    it failed on any: a load then never enters a collective that some ranks skip. One all-reduce of a flag on
    the checkpoint group (gloo, on CPU) when all is well; the messages are gathered only after a failure."""
    failure, own = None, None
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - every failure reaches every rank, or the others would hang
        own = exc
        message = str(exc) if isinstance(exc, CheckpointError) else f"Verifying the checkpoint failed: {exc}"
        failure = describe_failure(message, exc)
    rank = io.global_rank
    if io.is_distributed and dist.is_initialized():
        group = io.checkpoint_group
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, group=group)
        if not int(flag.item()):
            return
        failures: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(failures, failure, group=group)
        rank, failure = next((r, f) for r, f in enumerate(failures) if f)
        own = own if rank == dist.get_rank(group) else None
    raise_shared_failure(failure, rank, own, CheckpointError)


# ---- a safetensors file's checksum, in its own header metadata ---------------------------------------------
SAFETENSORS_KEY = "torchloom_checksum"
_HEX = 32  # digits of the BLAKE2b-128 digest
#: The metadata value a safetensors file is written with; `seal_safetensors` puts the digest in place.
SAFETENSORS_PLACEHOLDER = f"{ALGORITHM}:{'0' * _HEX}"


def _safetensors_field(path: Path) -> tuple[int, str, str] | None:
    """(where the hex digits start in the file, algorithm, recorded hex) of a safetensors file's checksum, None
    for a file without one. The header is 8 bytes of its JSON length, then the JSON."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = f.read(min(length, 100 << 20))
    key = f'"{SAFETENSORS_KEY}"'.encode()
    at = header.find(key)
    if at < 0:
        return None
    start = header.find(b'"', at + len(key)) + 1  # past the colon (and any blank) to the value
    end = header.find(b'"', start)
    fields = header[start:end].decode("ascii", "replace").split(":")
    if start <= 0 or end < 0 or len(fields) != 2 or len(fields[1]) != _HEX:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} has a damaged checksum record in its header: the file changed after "
            f"it was written. Load another checkpoint, or restore this one from a good copy. {OPT_OUT}."
        )
    return 8 + start + len(fields[0]) + 1, fields[0], fields[1]


def _digest_zeroed(path: Path, at: int) -> tuple[int, str]:
    """(size, checksum) of the file with its `_HEX` digits at `at` read as zeros. Read in pieces, not mapped: a
    rank loading a model holds one piece of a file at a time, never a whole shard (`load_raw`'s promise)."""
    digest = Digest()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f.read(at))
        digest.update(b"0" * _HEX)
        f.seek(at + _HEX)
        while piece := f.read(_PIECE):
            digest.update(piece)
    return size, digest.hexdigest()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], save_file: Any) -> None:
    """One safetensors file written with safetensors' `save_file`, its checksum in its header metadata."""
    # transformers refuses safetensors files whose metadata does not say they hold PyTorch tensors.
    save_file(tensors, str(path), metadata={"format": "pt", SAFETENSORS_KEY: SAFETENSORS_PLACEHOLDER})
    # Read back while the file is in the page cache, to fill in the placeholder.
    seal_safetensors(path)


def seal_safetensors(path: Path) -> None:
    """Put the file's checksum into the placeholder it was written with (`SAFETENSORS_PLACEHOLDER`): the same
    number of bytes, so nothing else moves."""
    field = _safetensors_field(path)
    assert field is not None and field[2] == "0" * _HEX, "written without the checksum placeholder"
    _, hexdigest = _digest_zeroed(path, field[0])
    with open(path, "r+b") as f:
        f.seek(field[0])
        f.write(hexdigest.encode())


def check_safetensors(path: Path) -> bool:
    """Raise `CheckpointError` if a safetensors file's bytes changed since torchloom wrote it; whether it carries
    a checksum (one written elsewhere does not: nothing to check)."""
    field = _safetensors_field(path)
    if field is None:
        return False
    at, algorithm, expected = field
    check_algorithm(path, algorithm)
    size, found = _digest_zeroed(path, at)
    if found != expected:
        raise mismatch_error(path, {"size": size, "digest": expected}, (size, found))
    return True
