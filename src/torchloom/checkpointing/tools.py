"""Offline checkpoint tools behind `torchloom inspect` and `torchloom consolidate`: no process group needed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from torchloom._text import count
from torchloom.checkpointing import atomic, full, hf, integrity, record, sharded
from torchloom.checkpointing.state import FORMAT_VERSION, META_KEY, MODULE, VALUE
from torchloom.errors import CheckpointError, CheckpointNotFoundError


def _tensors(prefix: str, value: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(
            {
                "name": prefix,
                "shape": list(value.shape),
                "dtype": str(value.dtype).replace("torch.", ""),
                "bytes": value.numel() * value.element_size(),
            }
        )
    elif isinstance(value, dict):
        for k, v in value.items():
            _tensors(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _tensors(f"{prefix}.{i}", v, out)


# What `inspect` shows of a plain entry: short strings, small sequences.
_SHORT_TEXT = 60
_FEW_ITEMS = 8


def _small_value(value: Any) -> tuple[bool, Any]:
    """(True, a JSON-ready form of `value`) for a value small enough to show in a line (a number, a bool, a short
    string, a one-element tensor, a short list or tuple of those), else (False, None). One-element tensors are
    read as one number; no larger tensor is touched (full checkpoints are memory-mapped)."""
    if value is None or isinstance(value, (bool, int, float)):
        return True, value
    if isinstance(value, str):
        return (True, value) if len(value) <= _SHORT_TEXT else (False, None)
    if isinstance(value, torch.Tensor):
        return (True, value.item()) if value.numel() == 1 and not value.is_meta else (False, None)
    if isinstance(value, (list, tuple)) and len(value) <= _FEW_ITEMS:
        items = [_small_value(v) for v in value]
        if all(ok and not isinstance(v, (list, tuple, dict)) for ok, v in items):
            return True, type(value)(v for _, v in items) if isinstance(value, tuple) else [
                v for _, v in items
            ]
    return False, None


def _small_values(entries: dict[str, Any], names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        if name in entries:
            ok, shown = _small_value(entries[name])
            if ok:
                out[name] = shown
    return out


_DESCRIBED = ("version", "world_size", "strategy", "precision", "mesh")


# safetensors' dtype names -> (torch's name, bytes per element)
_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


def _safetensors_tensors(path: Path) -> list[dict[str, Any]]:
    """Every tensor of a safetensors checkpoint (name, shape, dtype, bytes), from the files' headers alone."""
    out = []
    for file in hf.shard_files(path):
        with hf._safetensors().safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                torch_name, size = _DTYPES.get(piece.get_dtype(), (piece.get_dtype().lower(), 0))
                shape = list(piece.get_shape())
                numel = int(torch.Size(shape).numel())
                out.append({"name": name, "shape": shape, "dtype": torch_name, "bytes": numel * size})
    return sorted(out, key=lambda t: t["name"])


def _verify_safetensors(path: Path) -> dict[str, Any]:
    """`torchloom inspect --verify` of a safetensors checkpoint (a file, or a folder with its index), in this
    process: {"checked": the files with a checksum (None if none has one: written elsewhere), "failures": one
    message per file that fails}."""
    failures, checked = [], []
    try:
        files = hf.shard_files(path)
    except CheckpointError as error:
        return {"checked": [], "failures": [str(error)]}
    for file in files:
        try:
            if integrity.check_safetensors(file):
                checked.append(file.name)
        except CheckpointError as error:
            checked.append(file.name)
            failures.append(str(error))
    return {"checked": checked or None, "failures": failures}


def verify(path: str | Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its recorded size and checksum, in this process: {"checked":
    [file names] or None where the checkpoint records no checksums (written before they existed, or not by
    torchloom), "failures": [one message per file that fails]}."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}.")
    if hf.is_checkpoint(path):
        return _verify_safetensors(path)
    if path.is_dir():
        failures = []
        try:
            meta = sharded.read_meta(path)
            sharded.check_complete(path, meta)
            files, failures = sharded.verify_all(path, meta)
        except CheckpointError as error:
            files, failures = {}, [*failures, str(error)]
        return {"checked": None if files is None else sorted(files), "failures": failures}
    try:
        carried = full.verify_file(path)
    except CheckpointError as error:
        return {"checked": [path.name], "failures": [str(error)]}
    return {"checked": [path.name] if carried else None, "failures": []}


def inspect(path: str | Path, weights_only: bool = True, verify_files: bool = False) -> dict[str, Any]:
    """Format, writer's layout (world size, strategy, mesh), every tensor (name, shape, dtype, bytes), total
    size and the other entries; with `verify_files`, also `verify`'s result (under "verify"), checked first.
    `weights_only=False` also reads files that hold arbitrary pickled objects (only for files you trust)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}.")
    checked = verify(path) if verify_files else None
    safetensors = hf.is_checkpoint(path)
    if checked is not None and checked["failures"]:
        # A damaged file may not even unpickle: report what is wrong without reading the rest.
        fmt = "safetensors" if safetensors else "sharded" if path.is_dir() else "full"
        return {"format": fmt, "verify": checked}
    tensors: list[dict[str, Any]] = []
    if (
        safetensors
    ):  # weights only (save_raw, consolidate --format hf/safetensors): no record, no other entries
        tensors = _safetensors_tensors(path)
        info: dict[str, Any] = {"format": "safetensors"}
        kinds, extra, values = {}, [], {}
    elif path.is_dir():
        meta = sharded.read_meta(path, record_missing_ok=True)
        md = sharded.read_dcp_metadata(path, weights_only)
        for entry, items in sharded.tensor_entries(md).items():
            for name, (shape, dtype) in items.items():
                numel = int(torch.Size(shape).numel())
                tensors.append(
                    {
                        "name": f"{entry}.{name}",
                        "shape": list(shape),
                        "dtype": str(dtype).replace("torch.", ""),
                        "bytes": numel * torch.empty((), dtype=dtype).element_size(),
                    }
                )
        kinds = sharded.entry_kinds(meta, md)
        extra = [k for k, kind in kinds.items() if kind not in ("module", "optimizer")]
        info = {"format": "sharded", **{k: meta.get(k) for k in _DESCRIBED}}
        if meta.get("record_missing"):
            info["incomplete"] = sharded.missing_record_message(path)
        info["shard_files"] = sorted(p.name for p in path.glob("*.distcp"))
        # The plain entries live in extra.pt (plain data only with weights_only), memory-mapped like full files.
        stored_apart = sharded.read_extra(path, weights_only, mmap=True)
        if meta.get("record_missing"):  # what extra.pt holds is all there is to know of the other entries
            extra = [k for k in stored_apart if k != META_KEY]
        values = _small_values(stored_apart, extra)
        if meta.get("kinds") is None and extra and not meta.get("record_missing"):
            # a plain DCP checkpoint keeps its values in DCP
            values = _small_values(sharded.read_entries(path, extra, weights_only), extra)
    else:
        checkpoint = full.read(path, weights_only=weights_only)
        meta = checkpoint.get(META_KEY) or {}
        kinds = meta.get("kinds") or {}
        for key, value in checkpoint.items():
            if key != META_KEY:
                _tensors(key, value, tensors)
        extra = [k for k in checkpoint if k != META_KEY and kinds.get(k) not in ("module", "optimizer")]
        info = {"format": "full" if meta else "plain torch file", **{k: meta.get(k) for k in _DESCRIBED}}
        values = _small_values(checkpoint, extra)
    info["entries"] = kinds
    info["extra_entries"] = extra
    info["values"] = values
    info["tensors"] = tensors
    info["total_bytes"] = sum(t["bytes"] for t in tensors)
    if checked is not None:
        info["verify"] = checked
    return info


def _ranks(world_size: Any) -> str:
    return count(world_size, "rank") if isinstance(world_size, int) else f"{world_size} rank(s)"


def _mesh(mesh: Any) -> str:
    if not isinstance(mesh, dict) or not mesh:
        return "none recorded" if mesh is None else repr(mesh)
    return " x ".join(f"{name} {size}" for name, size in mesh.items())


def format_verification(checked: dict[str, Any]) -> list[str]:
    if checked["checked"] is None and not checked["failures"]:
        return ["verify: no checksums recorded (written before torchloom recorded them, or not by torchloom)"]
    if not checked["failures"]:
        return [f"verify: ok, {count(len(checked['checked']), 'file')} match their recorded checksums"]
    lines = [f"verify: FAILED, {count(len(checked['failures']), 'problem')}:"]
    lines += [f"  {message}" for message in checked["failures"]]
    return lines


def format_inspection(info: dict[str, Any]) -> str:
    if "tensors" not in info:  # verification failed: nothing else was read
        return "\n".join([f"format: {info['format']}", *format_verification(info["verify"])])
    lines = [
        f"format: {info['format']}",
        f"written by: {_ranks(info.get('world_size'))}, strategy {info.get('strategy')!r}, "
        f"precision {info.get('precision')!r}",
        f"mesh: {_mesh(info.get('mesh'))}",
    ]
    if "incomplete" in info:
        lines.append(f"INCOMPLETE: {info['incomplete']}")
    if "verify" in info:
        lines += format_verification(info["verify"])
    if info.get("shard_files"):
        lines.append(f"shard files: {len(info['shard_files'])}")
    lines.append(f"tensors: {len(info['tensors'])}, total {info['total_bytes'] / 2**20:.2f} MiB")
    width = max((len(t["name"]) for t in info["tensors"]), default=0)
    for t in info["tensors"]:
        lines.append(f"  {t['name']:<{width}}  {t['dtype']:<9} {tuple(t['shape'])}")
    values = info.get("values", {})
    if not info["extra_entries"]:
        lines.append("other entries: (none)")
    else:
        lines.append("other entries:")
        for name in info["extra_entries"]:
            lines.append(f"  {name} = {values[name]!r}" if name in values else f"  {name}")
    return "\n".join(lines)


def _progress(items: list[str], desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="entry", disable=not sys.stderr.isatty())
    except ImportError:
        return items


def consolidate(
    checkpoint: str | Path,
    out_file: str | Path,
    model_only: bool = False,
    fmt: str = "torch",
    max_shard_size: int | str = "5GB",
    weights_only: bool = True,
    verify_files: bool = True,
) -> dict[str, Any]:
    """Turn a sharded checkpoint directory into one file, in this process. Returns what was written.
    `weights_only=False` also unpickles arbitrary objects among the extra entries (only for checkpoints you
    trust). With `verify_files`, the files it reads are checked against their recorded checksums first (the new
    file gets a checksum of its own: consolidating a damaged checkpoint must not make it look intact).

    The result is torchloom's full format (model weights under their own names, optimizer state by parameter
    name, the other entries as saved), readable with plain `torch.load`. `model_only` keeps only the models:
    with one model, the file is its plain state dict. `fmt="safetensors"` writes the weights with safetensors;
    `fmt="hf"` writes a Hugging Face checkpoint directory at `out_file` (what `loom.save_raw` writes: shards of
    at most `max_shard_size` and their index, or one model.safetensors) that `from_pretrained` loads once its
    config.json is beside it. A tied weight stays under each of its names there (the checkpoint does not say
    which are tied); `from_pretrained` ties them again."""
    path, out = Path(checkpoint), Path(out_file)
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a sharded checkpoint directory. Pass the directory that loom.save wrote "
            "with state_dict_type='sharded'; a full checkpoint is already one file and needs no "
            "consolidation."
        )
    if fmt not in ("torch", "safetensors", "hf"):
        raise CheckpointError(f"Unknown output format {fmt!r}: use 'torch', 'safetensors' or 'hf'.")
    _check_output(path, out, fmt)
    meta = sharded.read_meta(path)
    if not model_only:
        sharded.check_complete(path, meta)
    if verify_files:
        _, failures = sharded.verify_all(path, meta, skip=(sharded.EXTRA_FILE,) if model_only else ())
        if failures:
            raise CheckpointError(
                " ".join(failures) + " (torchloom consolidate: pass --no-verify to consolidate it anyway)"
            )
    md = sharded.read_dcp_metadata(path, weights_only)
    kinds = sharded.entry_kinds(meta, md)
    wanted = [
        k
        for k, kind in kinds.items()
        if kind in ("module", "optimizer") and (not model_only or kind == MODULE)
    ]
    result: dict[str, Any] = {}
    for key in _progress(wanted, "consolidating"):
        result.update(sharded.read_entries(path, keys=[key], weights_only=weights_only))
    if not model_only:
        if meta.get("kinds") is None:  # a plain DCP checkpoint: its values are DCP items, not in extra.pt
            values = [k for k, kind in kinds.items() if kind == VALUE]
            if values:
                result.update(sharded.read_entries(path, keys=values, weights_only=weights_only))
        extra = sharded.read_extra(path, weights_only)
        run_state = record.pop_from_extra(extra, meta.get("version", FORMAT_VERSION))
        result.update(extra)
        # The record a full save writes, in this torchloom's format version (the layout of any version read).
        result[META_KEY] = {
            **meta,
            "version": FORMAT_VERSION,
            "format": "full",
            **run_state,
            "consolidated_from": str(path),
            "checksum": integrity.ALGORITHM,  # full.write_file puts it in the file's zip comment
        }
        result[META_KEY].pop("checksums", None)  # the sharded checkpoint's files, not this one's
        result[META_KEY].pop(integrity.RECORD_DIGEST, None)
    elif len(wanted) == 1:
        result = result[wanted[0]]
    if fmt == "hf":
        if not model_only or len(wanted) != 1:
            raise CheckpointError(
                "--format hf writes one model's weights: add --model-only"
                + (f" (the checkpoint holds {len(wanted)} models: {wanted})" if len(wanted) > 1 else "")
                + "."
            )
        tensors = {}
        _flatten(result, "", tensors)
        hf.write_dir(tensors, out, max_shard_size=max_shard_size)
    elif fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401 - hf.write_file writes with it
        except ImportError as exc:
            raise CheckpointError(
                "--format safetensors needs the safetensors package: pip install safetensors"
            ) from exc
        if not model_only:
            raise CheckpointError("--format safetensors stores weights only: add --model-only.")
        tensors: dict[str, torch.Tensor] = {}
        _flatten(result, "", tensors)
        _write_safetensors({k: v.contiguous() for k, v in tensors.items()}, out)
    else:
        full.write_file(result, out)
    return result


def _check_output(checkpoint: Path, out: Path, fmt: str) -> None:
    """Refuse, before anything is read, an output that would replace the checkpoint being read (or be written
    into it), or anything that is not a checkpoint (a folder such as the run's, holding the checkpoint)."""
    source, target = checkpoint.resolve(), out.resolve()
    if target == source or source in target.parents:
        raise CheckpointError(
            f"The output {str(out)!r} is the checkpoint being consolidated, or inside it: writing it would "
            f"replace or alter {str(checkpoint)!r}. Write it beside the checkpoint instead (e.g. "
            f"{str(checkpoint.with_name(checkpoint.name + '.consolidated'))!r})."
        )
    if fmt == "hf":
        hf.old_weights(out)
    else:
        atomic.check_replaceable(out, directory=False)


def _write_safetensors(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """One safetensors file (with its checksum) into a temporary file beside `out`, flushed to disk, then swapped
    into place; on any failure the temporary file is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temporaries(out)
    tmp = atomic.temporary_sibling(out)
    try:
        integrity.write_safetensors(tmp, tensors, hf._safetensors().torch.save_file)
        atomic.fsync_file(tmp)
        atomic.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _flatten(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
