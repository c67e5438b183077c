"""The sharded format: a directory written with `torch.distributed.checkpoint` (DCP), every rank writing its
own shards in parallel.

    path/
      .metadata, __<rank>_<n>.distcp   DCP: the models and optimizers (replicated tensors stored once)
      torchloom.json                   format, version, world size, the layout (mesh), what kind each entry
                                       is, and the size and checksum of every other file (`integrity`)
      extra.pt                         everything else: LR schedulers, user objects, plain values, and the
                                       `__torchloom__` record of the run's state (loss scaler, generators)

DCP reshards on load, so a checkpoint written by N ranks loads into any number of ranks, or into one process
with a plain model.
"""

from __future__ import annotations

import json
import pickle
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from torchloom import _torch_compat
from torchloom.checkpointing import atomic, integrity, record
from torchloom.checkpointing._interface import StateAccess
from torchloom.checkpointing._safe_reader import SafeReader
from torchloom.checkpointing.full import unsafe_content_error, write_error
from torchloom.checkpointing.state import (
    FORMAT_VERSION,
    META_KEY,
    MODULE,
    OPTIMIZER,
    VALUE,
    Entry,
    check_extra_state,
    check_joint_parts,
    check_missing,
    check_module_keys,
    collect_state,
    extra_state_of,
    restore_entry,
    torch_internal_warnings_filtered,
    whole_module_shapes,
)
from torchloom.errors import CheckpointError, describe_failure, raise_shared_failure

META_FILE = "torchloom.json"
EXTRA_FILE = "extra.pt"


_STAGERS: dict[bool, Any] = {}


def _stager(device: torch.device) -> Any:
    """The stager every async save of this process uses. It copies the shards to CPU memory before
    `dcp.async_save` returns (DCP's default; handed a storage writer, which choosing `sync_files` needs, DCP
    would stage with the writer's own slower copy instead), and it is kept: DCP's stager caches its CPU copy
    per tensor storage (released with the tensor), so after the first async save staging is a copy into the
    same buffers, with no allocation. benchmarks/checkpoint_io.py saw a fresh stager block for 0.17-1.0 s and
    a kept one for 0.13-0.17 s. The cost: one CPU copy of this rank's saved shards stays allocated between
    saves. The previous save has always finished before the next stages (`finish_pending_save`).

    Where this torch's stager cannot stage twice (`_torch_compat.dcp_stager_reusable`), every save gets a new one.

    On a GPU the copies go into pinned (page-locked) memory with non-blocking copies, all queued at once and
    waited for together (DCP synchronises the device before `stage` returns), instead of one blocking
    pageable copy per tensor; on CPU both options need an accelerator and gain nothing."""
    from torch.distributed.checkpoint.staging import DefaultStager

    on_gpu = device.type == "cuda"
    if not _torch_compat.dcp_stager_reusable():
        return DefaultStager(_staging_options(device))  # torch 2.11: a stager stages once
    if on_gpu not in _STAGERS:
        _STAGERS[on_gpu] = DefaultStager(_staging_options(device))
    return _STAGERS[on_gpu]


def _staging_options(device: torch.device) -> Any:
    from torch.distributed.checkpoint.staging import StagingOptions

    on_gpu = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=on_gpu,
        use_shared_memory=False,
        use_async_staging=False,  # staged before async_save returns: training may change the tensors after
        use_non_blocking_copy=on_gpu,
    )


def _dcp_kwargs(io: StateAccess) -> dict[str, Any]:
    if io.is_distributed and dist.is_initialized():
        return {"process_group": io.checkpoint_group}
    return {"no_dist": True}


def save(
    io: StateAccess,
    path: Path,
    entries: dict[str, Entry],
    meta: dict[str, Any],
    async_save: bool = False,
    fsync: bool = True,
) -> Future | None:
    """Write `entries` as a sharded checkpoint at `path`, with the `__torchloom__` record `meta` (its
    descriptive part also as torchloom.json). With `async_save`, return a future that completes once the
    checkpoint is in place (rank 0 swaps it in); the shards are staged in memory before this returns."""
    collected = collect_state(io, entries, full=False)
    tensors = {k: v for k, v in collected.items() if entries[k].kind in (MODULE, OPTIMIZER)}
    check_flat_names(tensors)
    extra = {k: v for k, v in collected.items() if k not in tensors}
    described, run_state = record.split(meta)
    extra[META_KEY] = run_state
    # Every rank must write into the same temporary directory: rank 0 names it.
    tmp = atomic.temporary_sibling(path) if io.global_rank == 0 else None
    failure, own = None, None
    sums: dict[str, Any] = {}  # rank 0: extra.pt's checksum, computed while writing it
    if io.global_rank == 0:
        try:
            # Before anything is written: a folder that is not a checkpoint is refused, not replaced.
            atomic.check_replaceable(path, directory=True)
            atomic.remove_stale_temporaries(path)
            tmp.mkdir(parents=True)
            with open(tmp / EXTRA_FILE, "wb") as f:
                hashing = integrity.HashingFile(f)
                torch.save(extra, hashing)
            sums[EXTRA_FILE] = integrity.entry(hashing.digest.size, hashing.digest.hexdigest())
            # Rewritten with every file's checksum once DCP has written the shards (`_record_checksums`).
            (tmp / META_FILE).write_text(json.dumps(described))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            own = exc
            failure = describe_failure(write_error(extra, path, exc), exc)
            atomic.discard(tmp)
    if io.is_distributed:
        failure, tmp = io.broadcast((failure, tmp), src=0)
    raise_shared_failure(failure, 0, own, CheckpointError)
    assert tmp is not None
    # DCP flushes every shard file to disk itself (sync_files); rank 0 then flushes the rest before the swap.
    writer = FileSystemWriter(str(tmp), sync_files=fsync)
    if async_save:
        future = dcp.async_save(
            tensors,
            storage_writer=writer,
            async_stager=_stager(io.root_device),
            **_dcp_kwargs(io),
        )
        done: Future = Future()

        def finish(f: Future) -> None:
            try:
                f.result()
                # Every rank takes part (on the checkpoint group only: this may run in DCP's background thread
                # while training goes on, with its own collectives on the default group).
                _record_checksums(io, tmp, described, sums)
                if io.global_rank == 0:
                    # DCP's coordinator writes .metadata last, after every rank's shards: all are on disk.
                    if fsync:
                        atomic.fsync_tree(tmp)
                    atomic.replace(tmp, path, fsync=fsync)
                done.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - surfaces at the next save
                if io.global_rank == 0:
                    # DCP raised on every rank only after all of them stopped writing: nothing writes in it now.
                    atomic.discard(tmp)
                done.set_exception(_write_error(path, exc) if isinstance(exc, CheckpointException) else exc)

        future.add_done_callback(finish)
        return done
    try:
        dcp.save(tensors, storage_writer=writer, **_dcp_kwargs(io))
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        if io.global_rank == 0:
            atomic.discard(tmp)  # DCP raises on every rank once all stopped writing
        raise _write_error(path, exc) from exc
    failure, own = None, None
    try:
        _record_checksums(io, tmp, described, sums)
    except Exception as exc:  # noqa: BLE001 - rank 0 raises it for all (every rank learns of it below)
        own = exc
        failure = describe_failure(f"Cannot record the sharded checkpoint's checksums: {exc}", exc)
        if io.global_rank == 0:
            atomic.discard(tmp)
    if io.global_rank == 0 and failure is None:
        try:
            if fsync:
                atomic.fsync_tree(tmp)
            atomic.replace(tmp, path, fsync=fsync)
        except Exception as exc:  # noqa: BLE001
            own = exc
            failure = describe_failure(
                f"Cannot move the sharded checkpoint into place at {str(path)!r}: {exc}", exc
            )
            atomic.discard(tmp)
    if io.is_distributed:
        failure = io.broadcast(failure, src=0)
    raise_shared_failure(failure, 0, own if io.global_rank == 0 else None, CheckpointError)
    return None


# The shard files DCP's FileSystemWriter names after the rank (in the checkpoint group) that writes them.
_RANK_FILE = re.compile(r"__(\d+)_.*")


def _record_checksums(io: StateAccess, tmp: Path, described: dict[str, Any], sums: dict[str, Any]) -> None:
    """Every rank checksums the files it wrote (each its own shards, in parallel, while they are in its page
    cache; rank 0 also DCP's .metadata), rank 0 gathers them and writes torchloom.json again with them all.
    A rank's failure raises on rank 0 (which then discards the checkpoint); the other ranks learn of it from
    rank 0, as of any failure of the swap."""
    group = io.checkpoint_group if io.is_distributed and dist.is_initialized() else None
    rank = dist.get_rank(group) if group is not None else 0
    mine: dict[str, Any] = {}
    error = None
    try:
        for file in sorted(tmp.iterdir()):
            if file.name in (META_FILE, EXTRA_FILE) or not file.is_file():
                continue
            owner = _RANK_FILE.fullmatch(file.name)
            if (int(owner.group(1)) if owner else 0) == rank:
                mine[file.name] = integrity.entry(*integrity.file_digest(file))
    except Exception as exc:  # noqa: BLE001 - reported by rank 0, which all ranks hear from next
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered: list[Any] = [(mine, error)]
    if group is not None:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (mine, error), group=group)
    if io.global_rank != 0:
        return
    errors = [e for _, e in gathered if e]
    if errors:
        raise CheckpointError("Checksumming the written shards failed (" + "; ".join(errors) + ")")
    files = dict(sums)
    for part, _ in gathered:
        files.update(part)
    checksums = {"algorithm": integrity.ALGORITHM, "files": dict(sorted(files.items()))}
    (tmp / META_FILE).write_text(json.dumps(integrity.seal({**described, "checksums": checksums})))


def check_complete(path: Path, meta: dict[str, Any]) -> None:
    """Refuse a sharded checkpoint that lacks a file its record lists (or, for a record from before the list,
    extra.pt, which torchloom has always written since format version 2): loading the rest would leave the run's
    state (step counters, random generators, data position) silently as it was."""
    files = (meta.get("checksums") or {}).get("files")
    needed = list(files) if isinstance(files, dict) else []
    if meta.get("kinds") is not None and meta.get("version", FORMAT_VERSION) >= 2:
        needed.append(EXTRA_FILE)
    missing = sorted({name for name in needed if not (path / name).is_file()})
    if missing:
        what = ", ".join(repr(n) for n in missing)
        state = (
            " (it holds the run's state: step counters, random generators, the data position, LR schedulers "
            "and the other plain entries)"
            if EXTRA_FILE in missing
            else ""
        )
        raise CheckpointError(
            f"The sharded checkpoint {str(path)!r} is incomplete: its record lists {what}, which is missing"
            f"{state}. Loading the rest would resume from the wrong state. Restore the file from a copy of the "
            "checkpoint, or load another one (torchloom.latest_checkpoint skips incomplete checkpoints); to "
            "salvage only the model weights, `torchloom consolidate --model-only PATH OUT` reads DCP's files "
            "alone."
        )


def _checksums(path: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The recorded {file: entry} of a sharded checkpoint (None: written before checksums existed), after
    checking torchloom.json's own digest and the algorithm."""
    integrity.check_seal(path / META_FILE, meta)
    checksums = meta.get("checksums")
    if not isinstance(checksums, dict):
        return None
    integrity.check_algorithm(path / META_FILE, checksums.get("algorithm"))
    files = checksums.get("files")
    return files if isinstance(files, dict) else {}


def verify(io: StateAccess, path: Path, meta: dict[str, Any]) -> None:
    """Check every file's checksum, the work split over the ranks (the largest files first, each to the rank
    with the least to read so far); every rank raises if any file fails."""
    files = _checksums(path, meta)
    if not files:
        return

    def check(file: Path) -> None:
        error = integrity.check_file(file, files[file.name])
        if error is not None:
            raise error

    integrity.check_shared(io, {path / name: int(files[name].get("size", 0)) for name in files}, check)


def verify_all(
    path: Path, meta: dict[str, Any], skip: tuple[str, ...] = ()
) -> tuple[dict[str, Any] | None, list[str]]:
    """(the recorded checksums, the message of every file that fails, those in `skip` left out), in this
    process."""
    files = _checksums(path, meta)
    if files is None:
        return None, []
    failures = []
    for name in sorted(n for n in files if n not in skip):
        error = integrity.check_file(path / name, files[name])
        if error is not None:
            failures.append(str(error))
    return files, failures


def read_meta(path: Path, record_missing_ok: bool = False) -> dict[str, Any]:
    """torchloom.json of a sharded checkpoint, checked. A folder of DCP's files alone is a plain DCP checkpoint
    (another tool's). One that also holds torchloom's extra.pt but not torchloom.json lost its record: refused,
    as loading it as plain DCP would skip the checksums and the run's state in silence. `record_missing_ok`
    (for `torchloom inspect`): read it as plain DCP instead, marked `"record_missing": True`."""
    meta_file = path / META_FILE
    if not meta_file.exists():
        if (path / ".metadata").exists():
            plain = {"version": FORMAT_VERSION, "format": "sharded", "kinds": None}  # a plain DCP checkpoint
            if (path / EXTRA_FILE).exists():
                if not record_missing_ok:
                    raise CheckpointError(missing_record_message(path))
                plain["record_missing"] = True
            return plain
        raise CheckpointError(
            f"{str(path)!r} is a directory but not a checkpoint (no {META_FILE} or .metadata inside). "
            "Pass the path that loom.save wrote."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"Cannot read {str(meta_file)!r}: {exc}. The checkpoint's metadata is corrupt."
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != "sharded":
        raise CheckpointError(f"{str(meta_file)!r} is not torchloom checkpoint metadata.")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} was written by a newer torchloom (format version {meta['version']}; this one reads up to "
            f"{FORMAT_VERSION}). Upgrade torchloom to load it."
        )
    return meta


def missing_record_message(path: Path) -> str:
    return (
        f"The sharded checkpoint {str(path)!r} is incomplete: it holds torchloom's {EXTRA_FILE} but not {META_FILE}, "
        "its record (format, what kind each entry is, every file's checksum). Without it the files cannot be "
        "checked, nor the run's state restored as saved. Load the previous checkpoint "
        "(torchloom.latest_checkpoint skips this one), or restore the file from a copy of the checkpoint; "
        f"`torchloom inspect {str(path)}` lists what the folder still holds."
    )


def reader(path: Path, weights_only: bool = True) -> FileSystemReader:
    """The DCP reader of every read of a sharded checkpoint. With `weights_only`, one that runs no code from the
    checkpoint (`SafeReader`: DCP's own reader unpickles `.metadata` and non-tensor items unrestricted)."""
    return SafeReader(str(path)) if weights_only else FileSystemReader(str(path))


def read_dcp_metadata(path: Path, weights_only: bool = True) -> Any:
    """DCP's .metadata, with every shard file it names checked to exist and be long enough, so a damaged
    checkpoint fails here, on every rank alike, instead of inside a collective. With `weights_only`, metadata
    that refers to anything but DCP's own metadata classes is refused (every rank reads the same file, so
    every rank refuses it)."""
    try:
        md = reader(path, weights_only).read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(
            f"Cannot read {str(path / '.metadata')!r}: {type(exc).__name__}: {exc}. The checkpoint is incomplete "
            "or corrupt."
        ) from exc
    needed: dict[str, int] = {}
    for item in (md.storage_data or {}).values():
        rel = getattr(item, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(item.offset) + int(item.length))
    for rel, size in sorted(needed.items()):
        file = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            # DCP writes its shards inside the directory; a checkpoint from elsewhere must not read other files.
            raise CheckpointError(
                f"{str(path / '.metadata')!r} names shard file {rel!r}, outside the checkpoint directory; the "
                "checkpoint is corrupt or was tampered with."
            )
        if not file.exists():
            raise CheckpointError(f"The checkpoint is missing shard file {str(file)!r}; it cannot be loaded.")
        if file.stat().st_size < size:
            raise CheckpointError(
                f"Shard file {str(file)!r} is truncated ({file.stat().st_size} bytes, needs {size}); the checkpoint "
                "cannot be loaded."
            )
    return md


def tensor_entries(
    md: Any, names: list[str] | None = None
) -> dict[str, dict[str, tuple[torch.Size, torch.dtype]]]:
    """entry -> {name inside the entry: (shape, dtype)} for the tensors DCP stored. An entry's name may hold dots
    ("model.ema"): the entry a stored tensor belongs to is the first element of the path DCP recorded for it
    (its `planner_data`), else the longest of `names` (the checkpoint's model and optimizer entries) that
    prefixes it, else (a plain DCP checkpoint) what precedes the first dot."""
    planner_data = getattr(md, "planner_data", None) or {}
    by_length = sorted(names or (), key=len, reverse=True)
    out: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            entry = _entry_of(fqn, planner_data.get(fqn), by_length)
            rest = fqn[len(entry) + 1 :]
            out.setdefault(entry, {})[rest] = (item.size, item.properties.dtype)
    return out


def entry_kinds(meta: dict[str, Any], md: Any) -> dict[str, str]:
    """Entry -> kind ("module", "optimizer", "value", ...). torchloom's checkpoints record them; in a plain DCP
    checkpoint (torchtitan's, `dcp.save`'s) an entry holding tensors is read as a module's state and any other
    (a step count, a config) as a plain value, which DCP stored too (as byte items, not in extra.pt)."""
    if meta.get("kinds") is not None:
        return meta["kinds"]
    tensors = tensor_entries(md)
    planner_data = getattr(md, "planner_data", None) or {}
    stored = dict.fromkeys(_entry_of(fqn, planner_data.get(fqn), []) for fqn in md.state_dict_metadata)
    return {k: MODULE if k in tensors else VALUE for k in stored}


def _entry_of(fqn: str, path: Any, names: list[str]) -> str:
    if isinstance(path, (tuple, list)) and path and fqn.startswith(f"{path[0]}."):
        return str(path[0])
    for name in names:
        if fqn.startswith(f"{name}."):
            return name
    return fqn.partition(".")[0]


def check_flat_names(collected: dict[str, Any]) -> None:
    """DCP stores every tensor under its path joined by dots, so entry "model" holding "ema.weight" and entry
    "model.ema" holding "weight" would both be "model.ema.weight": refuse that before anything is written, naming
    both entries."""
    owners: dict[str, str] = {}
    for key, value in collected.items():
        for flat in _flat_names(key, value):
            other = owners.setdefault(flat, key)
            if other != key:
                raise CheckpointError(
                    f"Entries {other!r} and {key!r} both store a tensor named {flat!r} in a sharded checkpoint, "
                    "which joins names with dots. Rename one entry (e.g. 'model_ema' instead of 'model.ema')."
                )


def _flat_names(prefix: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in _flat_names(f"{prefix}.{k}", v)]
    if isinstance(value, (list, tuple)):
        return [n for i, v in enumerate(value) for n in _flat_names(f"{prefix}.{i}", v)]
    return [prefix]


_EMPTY_EXTRA_HINT = (
    " (A sharded checkpoint keeps nothing for extra state that was an empty dict when saved, as DCP stores no "
    "item for an empty dict; with strict=False the module then keeps its own.)"
)


def stored_extra_state(md: Any, entry: str) -> dict[str, Any]:
    """Module entry `entry`'s non-tensor items (its modules' `get_extra_state()`), as a load template: state-dict
    key -> the structure the save stored, with `None` where DCP's load puts each value. DCP flattens a nested dict
    into one item per leaf; `planner_data` maps each item back to its path, which rebuilds the saved structure
    whatever the module now returns (a template taken from the module would silently skip keys it lacks)."""
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    out: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        path = tuple(paths.get(fqn) or fqn.split(".", 1))
        if len(path) >= 2 and path[0] == entry:
            _place(out, path[1:], None)
    return out


def _place(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put `value` at `path` (dict keys, and list indices where the save went into a list) under `root`."""
    node: Any = root
    for part, following in zip(path[:-1], path[1:], strict=True):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
            node[part] = empty if node[part] is None else node[part]
        else:
            node.setdefault(part, empty)
        node = node[part]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def load(
    io: StateAccess,
    path: Path,
    entries: dict[str, Entry],
    strict: bool,
    weights_only: bool = True,
    verify_checksums: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore `entries` from the sharded checkpoint at `path`. Returns the saved plain values and leftovers
    (every entry, named or not, that is not loaded into an object), and the `__torchloom__` record. A file the
    record lists that is missing is refused; with `verify_checksums`, so is one whose checksum differs."""
    meta = read_meta(path)
    check_complete(path, meta)
    if verify_checksums:
        verify(io, path, meta)
    md = read_dcp_metadata(path, weights_only)
    known = meta.get("kinds")
    stored = tensor_entries(md, [k for k, kind in (known or {}).items() if kind in (MODULE, OPTIMIZER)])
    extra = read_extra(path, weights_only)
    run_state = record.pop_from_extra(extra, meta.get("version", FORMAT_VERSION))
    kinds = entry_kinds(meta, md)
    check_missing(entries, list(kinds), strict)

    template: dict[str, Any] = {}
    for key, entry in entries.items():
        if key not in kinds or kinds[key] not in (MODULE, OPTIMIZER):
            continue
        if kinds[key] == MODULE:
            # One state dict serves both the check and the template: each call walks the whole model.
            current = io.module_state_dict(_module_of(entry, key), full=False)
            check_module_keys(whole_module_shapes(io, current), stored.get(key, {}), strict, key)
            template[key] = {k: v for k, v in current.items() if k in stored.get(key, {})}
            # Extra state (get_extra_state) is stored as byte items, not tensors. DCP stores nothing for an
            # empty dict: the module's own empty one is what was saved.
            own, saved = extra_state_of(current), stored_extra_state(md, key)
            saved.update({k: v for k, v in own.items() if k not in saved and isinstance(v, dict) and not v})
            check_extra_state(own, saved, strict, key, _EMPTY_EXTRA_HINT)
            template[key].update({k: v for k, v in saved.items() if k in own})
        else:
            if entry.owner is None:
                raise CheckpointError(
                    f"Entry {key!r} is an optimizer whose parameters belong to no module set up with this Loom, so "
                    "its state cannot be matched by parameter name. Set up its model first."
                )
            prefix = f"{key}.state."
            check_joint_parts(
                key,
                entry.owner,
                {k[len(prefix) :].split(".")[0] for k in md.state_dict_metadata if k.startswith(prefix)},
            )
            template[key] = _stored_optimizer_state(
                io.optimizer_state_dict(entry.owner, entry.obj, full=False, template=True), key, md
            )
    if template:
        try:
            dcp.load(template, storage_reader=reader(path, weights_only), **_dcp_kwargs(io))
        except (Exception, CheckpointException) as exc:
            raise _load_error(path, exc) from exc
    for key, entry in entries.items():
        if key in template:
            if kinds[key] == MODULE:
                io.load_module_state_dict(entry.obj, template[key], strict=strict, full=False)
            else:
                io.load_optimizer_state_dict(entry.owner, entry.obj, template[key], full=False)
        elif key in extra:
            restore_entry(io, key, entry, extra[key], strict)
    wanted = [k for k in kinds if k not in entries or entries[k].kind == VALUE]
    values = {k: extra[k] for k in wanted if k in extra}
    tensor_keys = [k for k in wanted if k not in extra]
    if tensor_keys:
        values.update(read_entries(path, tensor_keys, weights_only))
    return values, run_state


def _stored_optimizer_state(current: dict[str, Any], key: str, md: Any) -> dict[str, Any]:
    """The load template for optimizer entry `key`: its state dict, less the state of parameters that had none
    when saved. An optimizer has state only for the parameters it has stepped (none before the first step or
    after a step the loss scaler skipped; none for a parameter that never got a gradient), but PyTorch gives a
    fresh optimizer state for every parameter to build the template. A parameter with none of its state keys in
    the checkpoint had no state; one with only some of them is still asked for whole, so a damaged checkpoint
    still fails to load."""
    saved = md.state_dict_metadata
    state = current.get("state")
    if not isinstance(state, dict):
        return current
    kept = {
        param: value
        for param, value in state.items()
        if not isinstance(value, dict) or any(f"{key}.state.{param}.{name}" in saved for name in value)
    }
    return {**current, "state": kept}


def _module_of(entry: Entry, key: str) -> Any:
    if entry.kind != MODULE:
        raise CheckpointError(
            f"Entry {key!r} of the checkpoint holds a model's state, but `state[{key!r}]` is not a module "
            f"(a {type(entry.obj).__name__}). Pass the model there."
        )
    return entry.obj


def read_extra(path: Path, weights_only: bool = True, mmap: bool = False) -> dict[str, Any]:
    """extra.pt of a sharded checkpoint (everything that is not a model or optimizer). With `weights_only`, only
    plain data is unpickled, so a checkpoint from elsewhere cannot run code when it is loaded. `mmap` maps its
    tensors instead of reading them (for a look at the small entries)."""
    extra_file = path / EXTRA_FILE
    if not extra_file.exists():
        return {}
    try:
        return torch.load(extra_file, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if weights_only and "weights only load failed" in str(exc).lower():
            raise unsafe_content_error(extra_file, exc) from exc
        raise CheckpointError(f"Cannot read {str(extra_file)!r}: {exc}. The checkpoint is corrupt.") from exc
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"Cannot read {str(extra_file)!r}: {exc}. The checkpoint is corrupt.") from exc


def read_entries(path: Path, keys: list[str] | None = None, weights_only: bool = True) -> dict[str, Any]:
    """The DCP-stored entries of a sharded checkpoint as plain nested dicts of full tensors, in this process,
    without a process group (what `torchloom consolidate` and `load` of unnamed entries use)."""
    # What torch's own `format_utils.dcp_to_torch_save` does, without writing a file: read every stored tensor
    # whole, in this process, into a state dict that needs no template.
    read_dcp_metadata(path, weights_only)
    out: dict[str, Any] = {}
    try:
        with torch_internal_warnings_filtered():
            _torch_compat.load_whole_checkpoint(out, reader(path, weights_only), keys)
    except _torch_compat.TorchAPIMissing:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        raise _load_error(path, exc, "Reading") from exc
    return out


def _write_error(path: Path, exc: BaseException) -> CheckpointError:
    """The error of a failed DCP write, on every rank: each failed rank's own exception, not DCP's gathered
    tracebacks."""
    failures = exc.failures if isinstance(exc, CheckpointException) else {}
    causes = "; ".join(f"rank {r}: {type(f[0]).__name__}: {f[0]}" for r, f in sorted(failures.items()))
    return CheckpointError(
        f"Writing the sharded checkpoint {str(path)!r} failed ({causes or exc}); the checkpoint that was there, "
        "if any, is unchanged."
    )


def _load_error(path: Path, exc: BaseException, doing: str = "Loading") -> CheckpointError:
    """The error of a failed DCP read. DCP gathers every rank's exception into one `CheckpointException` (a
    BaseException) raised on every rank; where one of them is torchloom's own (a refused item), that one, the
    same on every rank: the lowest rank's."""
    failures = exc.failures if isinstance(exc, CheckpointException) else {}
    for rank in sorted(failures):
        cause = failures[rank][0]
        if isinstance(cause, CheckpointError):
            return CheckpointError(str(cause))
    if isinstance(exc, CheckpointError):
        return CheckpointError(str(exc))
    return CheckpointError(f"{doing} the sharded checkpoint {str(path)!r} failed: {exc}")
