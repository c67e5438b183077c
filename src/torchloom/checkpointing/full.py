"""The full format: one `torch.save` file written by rank 0.

Top-level keys are the user's; a model's entry uses the module's own parameter names and an optimizer's entry is
keyed by parameter name, so plain PyTorch reads it: `model.load_state_dict(torch.load(path)["model"])`. The
reserved key `__torchloom__` holds metadata, only in files that hold a module, an optimizer or another object
with `state_dict()`: a state of plain values only (`loom.save(path, model.state_dict())`) is written exactly as
given, as `torch.save` would, so `model.load_state_dict(torch.load(path))` works.
"""

from __future__ import annotations

import copy
import pickle
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from torchloom.checkpointing import atomic, integrity
from torchloom.checkpointing._interface import StateAccess
from torchloom.checkpointing.state import (
    FORMAT_VERSION,
    META_KEY,
    MODULE,
    OPTIMIZER,
    VALUE,
    Entry,
    check_missing,
    collect_state,
    kinds_of,
    restore_entry,
)
from torchloom.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    describe_failure,
    raise_shared_failure,
    warn_user,
)


def write_file(obj: dict[str, Any], path: Path, fsync: bool = True) -> None:
    """Write `obj` beside `path` with its checksum (computed while writing, kept in the zip comment:
    `integrity.append_trailer`), flush it to disk (unless `fsync=False`), then swap it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic.temporary_sibling(path)
    try:
        with open(tmp, "wb") as f:
            out = atomic.WriteBehindFile(f) if fsync else f
            hashing = integrity.HashingFile(out)
            torch.save(obj, hashing)
            integrity.append_trailer(f, hashing.digest)
            if fsync:
                out.sync()
        atomic.replace(tmp, path, fsync=fsync)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def find_unpicklable(obj: dict[str, Any]) -> str | None:
    """The first top-level key whose value pickle cannot write."""
    for key, value in obj.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - any pickling failure counts
            return key
    return None


def write_error(payload: dict[str, Any], path: Path, exc: BaseException) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)  # says itself what is wrong (what is at `path` may not be replaced)
    key = find_unpicklable(payload)
    if key is not None:
        return (
            f"Cannot save entry {key!r} of the checkpoint: {type(exc).__name__}: {exc}. Store a picklable value "
            "there (or an object with state_dict()/load_state_dict())."
        )
    return f"Cannot write checkpoint {str(path)!r}: {type(exc).__name__}: {exc}"


def needs_record(entries: dict[str, Entry]) -> bool:
    """Plain values only (a state dict, a dict of tensors): nothing torchloom converted, nothing to record, and
    an extra key would break `model.load_state_dict(torch.load(path))`."""
    return any(entry.kind != VALUE for entry in entries.values())


def check_target(io: StateAccess, path: Path) -> None:
    """Rank 0 checks that a checkpoint may replace what is at `path` (`atomic.check_replaceable`: a folder that
    is not a checkpoint may not), before anything is gathered or written; every rank raises if not."""
    failure, own = None, None
    if io.global_rank == 0:
        try:
            atomic.check_replaceable(path, directory=False)
        except Exception as exc:  # noqa: BLE001 - every failure reaches every rank, or the others would hang
            own = exc
            message = str(exc) if isinstance(exc, CheckpointError) else write_error({}, path, exc)
            failure = describe_failure(message, exc)
    if io.is_distributed:
        failure = io.broadcast(failure, src=0)
    raise_shared_failure(failure, 0, own, CheckpointError)


def save(
    io: StateAccess,
    path: Path,
    entries: dict[str, Entry],
    record: dict[str, Any] | None,
    async_save: bool = False,
    fsync: bool = True,
) -> Future | None:
    """Every rank collects (sharded strategies gather to rank 0 here); rank 0 writes `entries` and, as the key
    `__torchloom__`, `record`; every rank learns the outcome. With `async_save`, rank 0 writes a private copy in
    a background thread and returns its future."""
    check_target(io, path)
    payload = collect_state(io, entries, full=True)
    if record is not None:
        # The file's checksum is in its zip comment; the record says it has one (a damaged comment is caught).
        payload[META_KEY] = {**record, "checksum": integrity.ALGORITHM}
    if async_save:
        snapshot, failure, own = None, None, None
        if io.global_rank == 0:
            try:
                snapshot = private_snapshot(payload, entries)
            except Exception as exc:  # noqa: BLE001 - every rank raises it, as a synchronous save's failure
                own = exc
                failure = describe_failure(write_error(payload, path, exc), exc)
        del payload  # the writer holds the snapshot; the gathered tensors it did not copy live on in it
        if io.is_distributed:
            failure = io.broadcast(failure, src=0)
        raise_shared_failure(failure, 0, own, CheckpointError)
        if io.global_rank != 0:
            return None
        return _writer().submit(_write_or_explain, snapshot, path, fsync)
    failure, own = None, None
    if io.global_rank == 0:
        try:
            atomic.remove_stale_temporaries(path)
            write_file(payload, path, fsync=fsync)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            own = exc
            failure = describe_failure(write_error(payload, path, exc), exc)
    if io.is_distributed:
        # Doubles as the barrier: no rank returns before the file is in place (or has failed everywhere).
        failure = io.broadcast(failure, src=0)
    raise_shared_failure(failure, 0, own, CheckpointError)


def private_snapshot(payload: dict[str, Any], entries: dict[str, Entry]) -> dict[str, Any]:
    """A private copy of `payload` for the background writer: every value the writer reads is either copied or
    known to be unreachable from training, and at most one copy of the state is held in host memory, never two.

    A module's or optimizer's full state dict holds either the live tensors themselves (one process, DDP: the
    parameters, optimizer moments, a tensor `lr` of a param group) or fresh tensors (FSDP: gathered into new CPU
    memory on rank 0). Copying every tensor, as the async save once did, held a second copy of a gathered model
    in host memory until the write finished. A tensor is live when it shares storage with a parameter, buffer,
    optimizer state or param-group value of the objects being saved; tensors on a device are copied to the host
    anyway (that is the one copy), and the tensors of other entries (user objects, schedulers: their provenance
    is unknown) are always copied. Everything else (numbers are immutable; lists, dicts, NumPy arrays, user
    objects are not) is deep-copied: the writer pickles after `save` has returned, while training goes on, and a
    scheduler step or an in-place change must not reach the checkpoint."""
    live = _live_storages(entries)
    kinds = kinds_of(entries)

    def private(t: torch.Tensor, known: bool) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cpu":
            return t.to("cpu")
        if not known or _storage_of(t) in live:
            return t.clone()
        return t

    # The tensors the writer reads, each decided once; deepcopy then takes them from its memo and copies the rest
    # (sharing between values is kept, as pickling the original would have kept it).
    memo: dict[int, Any] = {}
    # Tensors kept as they are: copied after all if an entry of unknown provenance holds them too.
    uncopied: set[int] = set()
    for key, value in payload.items():
        known = kinds.get(key) in (MODULE, OPTIMIZER)
        for leaf in torch.utils._pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and (
                id(leaf) not in memo or (id(leaf) in uncopied and not known)
            ):
                memo[id(leaf)] = private(leaf, known)
                if _storage_of(memo[id(leaf)]) == _storage_of(leaf) and leaf.numel():
                    uncopied.add(id(leaf))
                else:
                    uncopied.discard(id(leaf))
    out: dict[str, Any] = {}
    for key, value in payload.items():
        try:
            out[key] = copy.deepcopy(value, memo)
        except Exception as exc:  # noqa: BLE001 - any copying failure: name the entry
            raise CheckpointError(
                f"async_save cannot copy entry {key!r} of the checkpoint ({type(exc).__name__}: {exc}): an "
                "asynchronous save copies every value before it returns, so that training cannot change what "
                "is written. Store a value copy.deepcopy can copy there, or save with async_save=False."
            ) from exc
    return out


def _storage_of(t: torch.Tensor) -> int:
    # An empty storage has no address to compare (0): counted live, copying it costs nothing.
    return t.untyped_storage().data_ptr() if t.numel() else 0


def _live_storages(entries: dict[str, Entry]) -> set[int]:
    """The storages of every parameter, buffer, optimizer state and param-group tensor of the modules and
    optimizers saved (a DTensor's local shard; an FSDP1 parameter is a view into its unit's flat parameter, same
    storage)."""
    tensors: list[torch.Tensor] = []
    for entry in entries.values():
        if entry.kind == MODULE:
            tensors += [*entry.obj.parameters(), *entry.obj.buffers()]
        elif entry.kind == OPTIMIZER:
            for per_param in entry.obj.state.values():
                tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
            # A tensor `lr` (or other hyper-parameter) of a param group: a scheduler changes it in place.
            for group in entry.obj.param_groups:
                tensors += [v for k, v in group.items() if k != "params" and isinstance(v, torch.Tensor)]
    live = {0}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        live.add(_storage_of(local.detach()))
    return live


_WRITER: ThreadPoolExecutor | None = None


def _writer() -> ThreadPoolExecutor:
    global _WRITER
    if _WRITER is None:
        _WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchloom-save")
    return _WRITER


def _write_or_explain(payload: dict[str, Any], path: Path, fsync: bool) -> None:
    try:
        atomic.remove_stale_temporaries(path)
        write_file(payload, path, fsync=fsync)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(write_error(payload, path, exc)) from exc


def unsafe_content_error(path: Path, error: BaseException, item: str | None = None) -> CheckpointError:
    """torch.load(weights_only=True) met an object that is not plain data (in the file, or in its `item`): say
    so, and how to load it anyway."""
    where = f"Item {item!r} of {str(path)!r}" if item is not None else repr(str(path))
    return CheckpointError(
        f"{where} holds objects that are not plain data (tensors, numbers, strings, lists, dicts), which "
        f"loading with weights_only=True refuses: {_refusal(error)}. "
        "Unpickling them can run any code the file's author chose. If you trust the file, load it with "
        "weights_only=False (loom.load(path, state, weights_only=False), or --allow-pickle for the command line)."
    )


def _refusal(error: BaseException) -> str:
    """What torch.load(weights_only=True) refused ("Unsupported global: GLOBAL posix.system ..."), from its
    message of several paragraphs; its first line otherwise."""
    text = str(error)
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", text)
    if found:
        return found.group(1).rstrip(". ")
    return text.splitlines()[0] if text else repr(error)


def verify_file(path: Path) -> bool:
    """Raise `CheckpointError` if the file's bytes differ from those its checksum was made of; whether it
    carries a checksum (a file written before torchloom recorded them, or not by torchloom, does not)."""
    carried, error = integrity.check_full_file(path)
    if error is not None:
        raise error
    return carried


def check_record_checksum(path: Path, record: Any, carried: bool) -> None:
    """A file whose record says it carries a checksum must have one (its trailer may be what was damaged)."""
    if not carried and isinstance(record, dict) and record.get("checksum"):
        if integrity.rewritten_without_comment(path):
            warn_user(
                f"Checkpoint file {str(path)!r} was written again without its checksum (by plain torch.save, "
                "its torchloom record copied along): it is loaded unchecked. Save it with loom.save to check it."
            )
            return
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} records that it carries a checksum, but none is at its end: the file "
            f"changed after it was written. Load another checkpoint, or restore this one from a good copy. "
            f"{integrity.OPT_OUT}."
        )


def read(path: Path, weights_only: bool = True, verify: bool = False) -> dict[str, Any]:
    """Read a full checkpoint file, memory-mapped: ranks share the page cache instead of each holding a copy.
    With `weights_only`, only plain data is unpickled (what torchloom itself writes is plain data). With
    `verify`, its checksum is checked first (in this process alone: `load` makes the ranks agree)."""
    if not path.exists():
        raise CheckpointNotFoundError(
            f"No checkpoint at {str(path)!r}. Check the path: it is the file (or, for sharded checkpoints, "
            "the directory) that loom.save wrote."
        )
    if path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a directory (a sharded checkpoint), not a file. Load it with loom.load, or make one "
            "file of it with `torchloom consolidate`."
        )
    carried = verify_file(path) if verify else False
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except pickle.UnpicklingError as error:
        if weights_only and "weights only load failed" in str(error).lower():
            raise unsafe_content_error(path, error) from error
        raise CheckpointError(
            f"Cannot read checkpoint {str(path)!r}: {type(error).__name__}: {error}. The file is truncated, corrupt "
            "or not a torch checkpoint."
        ) from error
    except Exception as error:  # noqa: BLE001 - the file is corrupt in some way; say which file
        raise CheckpointError(
            f"Cannot read checkpoint {str(path)!r}: {type(error).__name__}: {error}. The file is truncated, corrupt "
            "or not a torch checkpoint."
        ) from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict) and meta.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} was written by a newer torchloom (format version {meta['version']}; this one reads up "
            f"to {FORMAT_VERSION}). Upgrade torchloom to load it."
        )
    if verify:
        check_record_checksum(path, meta, carried)
    return checkpoint


def load(
    io: StateAccess,
    path: Path,
    entries: dict[str, Entry],
    strict: bool,
    weights_only: bool = True,
    verify: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore `entries` from the file at `path`. Returns the saved plain values and leftovers (every entry of
    the checkpoint, named or not, that is not loaded into an object), and the file's `__torchloom__` record.
    With `verify`, every rank checks the file's checksum first and all raise if any finds it changed."""
    carried = False
    if verify and path.is_file():
        carried = integrity.check_full_file_shared(io, path)
    checkpoint = read(path, weights_only=weights_only)
    record = checkpoint.pop(META_KEY, None)
    if verify:
        # Decided by the file alone, which every rank has just found intact: the same on every rank.
        check_record_checksum(path, record, carried)
    check_missing(entries, list(checkpoint), strict)
    for key, entry in entries.items():
        if key in checkpoint:
            restore_entry(io, key, entry, checkpoint[key], strict, full=True)
    values = {k: v for k, v in checkpoint.items() if k not in entries or entries[k].kind == VALUE}
    return values, record if isinstance(record, dict) else {}
