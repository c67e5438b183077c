"""Hugging Face safetensors checkpoints: pretrained weights in (`loom.load_raw`), shareable weights out
(`loom.save_raw`), for every layout.

    out_dir/
      model.safetensors                             one file, when the weights fit in `max_shard_size`
      model-00001-of-00002.safetensors, ...         or shards, named as `transformers` names them,
      model.safetensors.index.json                  with the index that maps each tensor to its shard
      config.json                                   when `config=` is given

Names are the module's own state-dict names; weights tied to another (`tie_word_embeddings`) are stored once.
Each file carries its checksum in its own header metadata (`integrity`: `"torchloom_checksum"` beside
`"format": "pt"`, which transformers ignores), checked by `load_raw` first; files written elsewhere have none.

Loading: every rank reads only what it holds, memory-mapped. A sharded parameter (a DTensor: FSDP2, or FSDP1's
sharded state dict) gets the slice DTensor says this rank owns; a replicated or unsharded one is read whole. So
a rank's extra memory while loading is its own part plus one tensor, never the model (see
benchmarks/hf_load.py). Checking happens before anything is read and is the same on every rank, so a bad
checkpoint fails everywhere alike, naming what is wrong.

Saving: the tensors are split into files in state-dict order (as `transformers` does), and file i is written
by rank i % world_size. The ranks walk the files in order; a sharded tensor is gathered whole (one tensor at a
time) and the writing rank keeps it, so no rank holds more than the file it is filling and the one it is
writing in the background. The files go into a temporary directory that replaces `out_dir` in one step,
carrying over everything `out_dir` held except the previous weights (`old_weights`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from torchloom._layout import analyze, clean_name
from torchloom.checkpointing import atomic, integrity
from torchloom.checkpointing._hf_reader import (
    INDEX_FILE,
    SINGLE_FILE,
    _copy_local,
    _fill,
    _Reader,
    _safetensors,
)
from torchloom.errors import CheckpointError

if TYPE_CHECKING:
    from torchloom.checkpointing._interface import StateAccess


class LoadResult(NamedTuple):
    """What `load_raw(..., strict=False)` left out: model keys the checkpoint did not provide (they keep their
    current values) and checkpoint keys the model has no place for."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def is_checkpoint(path: Path) -> bool:
    """A `.safetensors` file, or a directory holding `model.safetensors` or its index."""
    if path.is_dir():
        return (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file()
    return path.suffix == ".safetensors"


# ---- reading -------------------------------------------------------------------------------------------------
def _user_module(module: nn.Module) -> nn.Module:
    # DDP's wrapper adds a "module." prefix that the state-dict API strips; the model itself has the names.
    # (FSDP1's wrapper segments are removed by clean_name, and its wrapper forwards attribute lookups.)
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def _names_by_tensor(module: nn.Module, keys: set[str]) -> list[list[str]]:
    """The state-dict keys grouped by the tensor they name: a group of several is a set of tied weights."""
    module = _user_module(module)
    groups: dict[int, list[str]] = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        name = clean_name(name)
        if name in keys:
            groups.setdefault(id(tensor), [])
            if name not in groups[id(tensor)]:
                groups[id(tensor)].append(name)
    grouped = {n for names in groups.values() for n in names}
    # A key the module walk did not find (a state-dict hook's own entry) stands alone.
    return [*groups.values(), *([k] for k in keys if k not in grouped)]


def _ignored(module: nn.Module, attribute: str) -> list[re.Pattern[str]]:
    # transformers' own way of saying which keys a checkpoint may lack or carry extra (e.g. old rotary buffers).
    patterns = getattr(_user_module(module), attribute, None) or []
    return [re.compile(p) for p in patterns]


def load(io: StateAccess, module: nn.Module, path: Path, strict: bool = True) -> LoadResult:
    """Load a safetensors checkpoint into `module` as it is set up (any layout); see the module docstring."""
    _check_buffers(module)
    # The sharded state dict: DTensors for sharded parameters, plain tensors for the rest. For FSDP2 and unsharded
    # modules its values share storage with the parameters, so loading into them loads the model; FSDP1 builds
    # new tensors, which set_model_state_dict then copies in with PyTorch's own machinery.
    template = io.module_state_dict(module, full=False)
    template = {k: v for k, v in template.items() if isinstance(v, torch.Tensor)}
    groups = _names_by_tensor(module, set(template))
    with contextlib.ExitStack() as stack:
        reader = _Reader(path, stack)
        sources, missing, used, mismatched = _match(module, reader, template, groups, io.tied_weight_names())
        if io.is_distributed and io.world_size > 1:
            # Pipeline stages hold different parts of the model: a key is expected when some rank has a place
            # for it, and every rank raises the same error (a stage that raised alone would leave the others
            # training into its collectives).
            everyone = io.all_gather_object((missing, sorted(used), mismatched))
            missing = sorted({k for m, _, _ in everyone for k in m})
            used = {k for _, u, _ in everyone for k in u}
            mismatched = list(dict.fromkeys(x for _, _, m in everyone for x in m))
        if mismatched:
            raise CheckpointError(
                f"The checkpoint {str(path)!r} has tensors that do not fit the model: {'; '.join(mismatched)}. "
                "Build the model from the checkpoint's own config (hidden_size, vocab_size, number of heads...)."
            )
        ignore_unexpected = _ignored(module, "_keys_to_ignore_on_load_unexpected")
        unexpected = sorted(
            k for k in reader.files if k not in used and not any(p.search(k) for p in ignore_unexpected)
        )
        if missing and strict:
            raise CheckpointError(
                f"The checkpoint {str(path)!r} has no tensor for {len(missing)} of the model's parameters/buffers: "
                f"{_listing(missing)}. Loading it would leave them uninitialised. Load a checkpoint of this "
                "architecture (check the config), or pass strict=False to keep their current values for these "
                "keys (returned as missing_keys)."
            )
        if unexpected and strict:
            raise CheckpointError(
                f"The checkpoint {str(path)!r} has {len(unexpected)} tensor(s) the model has no place for: "
                f"{_listing(unexpected)}. Check that it is this architecture (a base model's checkpoint lacks "
                "the head's 'model.' prefix, and the other way round), or pass strict=False to skip them "
                "(returned as unexpected_keys)."
            )
        order = {file: i for i, file in enumerate(dict.fromkeys(reader.files.values()))}
        for names, source in sorted(sources, key=lambda item: order[reader.files[item[1]]]):
            first = template[names[0]]
            with torch.no_grad():
                _fill(first, reader, source)
                for other in names[1:]:
                    # Tied: the same tensor under several names, loaded once. Under FSDP1 the state dict holds
                    # a copy per name, so each copy gets the values.
                    _copy_local(template[other], first)
    if "fsdp" in analyze(module).flavours:
        io.load_module_state_dict(module, template, strict=False, full=False)
    if missing:
        warnings.warn(
            f"load_raw(strict=False): the checkpoint {str(path)!r} does not provide {_listing(missing)}; they keep "
            "their current values.",
            UserWarning,
            stacklevel=3,
        )
    return LoadResult(missing, unexpected)


def _match(
    module: nn.Module,
    reader: _Reader,
    template: dict[str, torch.Tensor],
    groups: list[list[str]],
    copies: list[list[str]],
) -> tuple[list[tuple[list[str], str]], list[str], set[str], list[str]]:
    """(names, checkpoint key) for every tensor the checkpoint provides; the missing keys, the checkpoint keys
    used, and the shape mismatches (errors whatever `strict` says: no value could be loaded). A pipeline stage's
    copy of a weight tied across stages (`copies`: each tie's names) loads from whichever of the tie's names the
    checkpoint holds: a file written by one process holds the weight once, under the name the others drop."""
    ignore_missing = _ignored(module, "_keys_to_ignore_on_load_missing")
    tie_of = {n: names for names in copies for n in names}
    sources, missing, used, mismatched = [], [], set(), []
    for names in groups:
        candidates = list(dict.fromkeys([*names, *(t for n in names for t in tie_of.get(n, ()))]))
        found = [n for n in candidates if n in reader.files]
        used.update(found)
        if not found:
            if not any(p.search(n) for p in ignore_missing for n in names):
                missing.append(names[0])
            continue
        want, got = tuple(template[names[0]].shape), reader.shape(found[0])
        if want != got:
            mismatched.append(f"{found[0]}: checkpoint shape {got} vs model shape {want}")
            continue
        sources.append((names, found[0]))
    return sources, missing, used, mismatched


def _on_mesh_device(value: Any) -> Any:
    """A DTensor on the device its mesh communicates on. Under cpu_offload a shard lives in host memory while its
    mesh is the GPUs' (NCCL), which cannot gather host tensors: gather a copy on the GPU instead, shard by shard,
    as torch's own full-state-dict gathering does."""
    mesh_type = value.device_mesh.device_type
    return value if value.device.type == mesh_type else value.to(mesh_type)


def _check_buffers(module: nn.Module) -> None:
    # Non-persistent buffers (rotary inv_freq) are in no checkpoint: they must already hold their values.
    # init_module(empty_init=True) creates buffers for real; one left on meta would be garbage after loading.
    meta = [clean_name(n) for n, b in module.named_buffers() if b is not None and b.is_meta]
    if meta:
        raise CheckpointError(
            f"The model's buffers {_listing(meta)} are on the meta device, and a checkpoint may not hold them "
            "(non-persistent buffers such as rotary inv_freq never are). Create the model under "
            "loom.init_module(empty_init=True), which creates buffers for real, and call setup_module before "
            "load_raw."
        )


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---- writing -------------------------------------------------------------------------------------------------
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string such as "5GB" (10**9, as transformers counts) or "500MiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if match is None:
            raise ValueError(
                f"max_shard_size={size!r} is not a size. Pass bytes as an int, or a string such as '5GB' or "
                "'500MiB'."
            )
        value = int(float(match.group(1)) * _UNITS[match.group(2) or "B"])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive.")
    return value


def _stored_names(module: nn.Module, template: dict[str, torch.Tensor], copies: list[list[str]]) -> list[str]:
    """The keys to store: every tensor once. Of tied names, the one transformers keeps (its `_tied_weights_keys`
    lists those it drops, e.g. lm_head.weight); otherwise the first in the model's order. `copies`: ties the
    layout holds as separate tensors (a pipeline's copies on several stages, names in model order), of which
    this rank may hold any: the kept name is chosen among all of a tie's names, so the stages agree on it and
    the file holds the weight once, as one process writes it."""
    tied = getattr(_user_module(module), "_tied_weights_keys", None) or {}
    dropped = set(tied) if isinstance(tied, (dict, list, tuple, set)) else set()
    drop: set[str] = set()
    for names in _names_by_tensor(module, set(template)):
        if len(names) > 1:
            ordered = sorted(names, key=list(template).index)
            keep = next((n for n in ordered if n not in dropped), ordered[0])
            drop.update(n for n in names if n != keep)
    for names in copies:
        keep = next((n for n in names if n not in dropped), names[0])
        drop.update(n for n in names if n != keep)
    return [k for k in template if k not in drop]


def plan_files(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensors into files in order, a new file when the next tensor would overflow this one (a tensor larger
    than `max_bytes` gets a file of its own), as transformers splits."""
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if files[-1] and used + size > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def _plan_by_holders(
    held: list[list[tuple[str, int]]], max_bytes: int
) -> tuple[dict[str, int], list[list[str]], list[int]]:
    """Every rank's (name, size) pairs -> the sizes of all tensors, the files (no file mixes tensors held by
    different ranks: pipeline stages) and the rank that writes each (the first that holds its tensors)."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for r, pairs in enumerate(held):
        for name, size in pairs:
            holders.setdefault(name, []).append(r)
            sizes.setdefault(name, size)
    runs: dict[tuple[int, ...], dict[str, int]] = {}  # in first-seen order: stage after stage
    for name, size in sizes.items():
        runs.setdefault(tuple(holders[name]), {})[name] = size
    files = [group for run in runs.values() for group in plan_files(run, max_bytes)]
    return sizes, files, [holders[group[0]][0] for group in files]


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def save(
    io: StateAccess,
    module: nn.Module,
    out_dir: Path,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    config: Any = None,
    fsync: bool = True,
) -> None:
    """Write `module`'s weights to `out_dir` in Hugging Face's layout; see the module docstring."""
    max_bytes = parse_size(max_shard_size)
    template = io.module_state_dict(module, full=False)
    template = {k: v for k, v in template.items() if isinstance(v, torch.Tensor)}
    names = _stored_names(module, template, io.tied_weight_names())
    _write({n: template[n] for n in names}, out_dir, dtype, max_bytes, config, fsync, io)


def write_dir(
    tensors: dict[str, torch.Tensor],
    out_dir: Path,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    fsync: bool = True,
) -> None:
    """In this process: write a plain state dict of full tensors in Hugging Face's layout (what
    `torchloom consolidate --format hf` does)."""
    _write(tensors, out_dir, dtype, parse_size(max_shard_size), None, fsync, None)


def _write(
    tensors: dict[str, torch.Tensor],
    out_dir: Path,
    dtype: torch.dtype | None,
    max_bytes: int,
    config: Any,
    fsync: bool,
    io: StateAccess | None,
) -> None:
    """Every rank (or one process, `io=None`) writes its files of `tensors` (DTensors or plain)."""
    from torch.distributed.tensor import DTensor

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    sizes = {n: int(torch.Size(t.shape).numel()) * out_dtype(t).itemsize for n, t in tensors.items()}
    distributed = io is not None and io.is_distributed and io.world_size > 1
    rank, world = (io.global_rank, io.world_size) if distributed else (0, 1)
    files = plan_files(sizes, max_bytes)
    writers = [i % world for i in range(len(files))]
    if distributed:
        assert io is not None
        held = io.all_gather_object(list(sizes.items()))
        if any(h != held[0] for h in held):
            # Pipeline stages: each rank holds (a shard of) its stages' tensors only. Each stage's tensors go to
            # files of their own, written by the stage's first rank, gathered among the stage's ranks alone.
            sizes, files, writers = _plan_by_holders(held, max_bytes)
    file_of = file_names(len(files))

    tmp: Path | None = None
    error: str | None = None
    if rank == 0:
        try:
            old_weights(out_dir)  # refuses what cannot be replaced before anything is written
            atomic.remove_stale_temporaries(out_dir)
            tmp = atomic.temporary_sibling(out_dir)
            tmp.mkdir(parents=True)
        except CheckpointError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"Cannot create a directory beside {str(out_dir)!r}: {type(exc).__name__}: {exc}"
    if distributed:
        error, tmp = io.broadcast((error, tmp), src=0)
    if error:
        raise CheckpointError(error)
    assert tmp is not None

    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchloom-save-raw")
    pending: Future | None = None
    try:
        for i, group in enumerate(files):
            # A rank whose own file failed writes nothing more, but goes on gathering with the others: leaving
            # the loop would leave them waiting in the next gather.
            mine = writers[i] == rank and error is None
            part: dict[str, torch.Tensor] = {}
            for name in group:
                value = tensors.get(name)
                if value is None:
                    continue  # another stage's tensor: its own ranks gather it
                # A collective over the tensor's mesh: every rank gathers, in the same order; the writer keeps it.
                whole = _on_mesh_device(value).full_tensor() if isinstance(value, DTensor) else value
                if mine:
                    part[name] = whole.detach().to("cpu", out_dtype(whole)).contiguous()
                del whole
            if mine:
                try:
                    if pending is not None:
                        pending.result()  # at most one file being written while the next is gathered
                    pending = writer.submit(_write_file, tmp / file_of[i], part, fsync)
                except Exception as exc:  # noqa: BLE001 - reported to every rank below
                    error, pending = f"rank {rank}: {type(exc).__name__}: {exc}", None
            del part
        if pending is not None:
            pending.result()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = error or f"rank {rank}: {type(exc).__name__}: {exc}"
    finally:
        writer.shutdown(wait=True)
    errors = io.all_gather_object(error) if distributed else [error]
    failed = [e for e in errors if e]
    error = None
    if rank == 0:
        try:
            if failed:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                _finish(tmp, out_dir, sizes, file_of, files, config, fsync)
        except Exception as exc:  # noqa: BLE001
            error = f"Cannot finish {str(out_dir)!r}: {type(exc).__name__}: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
    if distributed:
        error = io.broadcast(error, src=0)
    if failed or error:
        raise CheckpointError(
            f"Writing the weights to {str(out_dir)!r} failed ({'; '.join(failed) or error}); the previous "
            "contents of that directory are untouched. Check the disk space and permissions there."
        )


def _write_file(path: Path, tensors: dict[str, torch.Tensor], fsync: bool) -> None:
    integrity.write_safetensors(path, tensors, _safetensors().torch.save_file)
    if fsync:
        atomic.fsync_file(path)


def shard_files(path: Path) -> list[Path]:
    """The files of a safetensors checkpoint (the shards its index names, or the one file), each checked to be
    there."""
    with contextlib.ExitStack() as stack:
        return sorted(set(_Reader(path, stack).files.values()))


def _finish(
    tmp: Path,
    out_dir: Path,
    sizes: dict[str, int],
    file_of: list[str],
    files: list[list[str]],
    config: Any,
    fsync: bool,
) -> None:
    """Rank 0, after every file is written: the index, the config, what else `out_dir` held, then the swap."""
    if len(files) > 1:
        weight_map = {name: file_of[i] for i, group in enumerate(files) for name in group}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config is not None:
        config.save_pretrained(str(tmp))
    if out_dir.is_dir():
        # The directory is replaced as a whole; everything else the user keeps there (a tokenizer, its
        # subfolders, other weights such as model_ema.safetensors) is carried over, only the previous weights
        # (the old index, the shards it names, the old single file) are not.
        _carry_over(out_dir, tmp, skip=old_weights(out_dir))
        shutil.copymode(out_dir, tmp)
    if fsync:
        atomic.fsync_tree(tmp)
    # No check in the swap: `tmp` now holds everything of `out_dir` but its previous weights.
    atomic.replace(tmp, out_dir, fsync=fsync, check=False)


def old_weights(out_dir: Path) -> set[str]:
    """The names in `out_dir` that a new save's weights replace: the index, the shards it names, and the single
    file. Raises `CheckpointError` where `out_dir` cannot take a Hugging Face checkpoint: it is not a directory,
    or holds an index that cannot be read (which files are its shards is then unknown)."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return set()
    if not out_dir.is_dir():
        raise CheckpointError(
            f"Cannot write a Hugging Face checkpoint (a directory) at {str(out_dir)!r}: a file is there, and "
            "saving would delete it. Pass a directory (new, or one to add the weights to)."
        )
    names = {SINGLE_FILE}
    index_file = out_dir / INDEX_FILE
    if index_file.is_file():
        try:
            shards = json.loads(index_file.read_text())["weight_map"].values()
            names |= {INDEX_FILE, *(str(f) for f in shards)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"Cannot read {str(index_file)!r} ({type(exc).__name__}: {exc}), so which files in "
                f"{str(out_dir)!r} are the previous weights' shards is unknown. Remove the old index and "
                "shards yourself, or save to a new directory."
            ) from exc
    # Only plain safetensors file names in `out_dir` itself: an index naming anything else is not obeyed.
    return {n for n in names if n == INDEX_FILE or (n.endswith(".safetensors") and Path(n).name == n)}


def _carry_over(src: Path, dst: Path, skip: set[str]) -> None:
    """Put into `dst` everything in `src` except the names in `skip` and what `dst` already holds: files as
    hard links (no copy; a file system without them gets a copy), folders recreated, links as links."""
    for item in src.iterdir():
        target = dst / item.name
        if item.name in skip and not item.is_dir():
            continue
        if target.exists() or target.is_symlink():
            if item.is_dir() and not item.is_symlink():
                raise CheckpointError(
                    f"{str(item)!r} is a folder with the name of a file the save writes; it would be deleted. "
                    "Rename it, or save to another directory."
                )
            continue  # a file the save writes (config.json): the new one replaces it
        if item.is_symlink():
            os.symlink(os.readlink(item), target)
        elif item.is_dir():
            target.mkdir()
            _carry_over(item, target, skip=set())
            shutil.copymode(item, target)
        else:
            try:
                os.link(item, target)
            except OSError:
                shutil.copy2(item, target)
