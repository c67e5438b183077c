"""`Checkpointer`: the one owner of checkpoints. `Loom` holds one and delegates `save`, `load`, `load_raw` and
`save_raw` to it; it talks to the strategy only through `StateAccess` and to the precision only through
`ScalerState`.

It picks the format (the strategy's) when saving and detects it when loading, records torchloom's metadata and
the run's state (`record`), and owns the asynchronous save's life: at most one save is pending; the next save,
load, raw load or raw save waits for it first (one of them may be writing the very path), `close()` waits for it
at the end of the job, and interpreter exit waits for it if `close()` never ran.
"""

from __future__ import annotations

import atexit
import logging
import sys
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchloom.checkpointing import atomic, full, hf, record
from torchloom.checkpointing._interface import ScalerState, StateAccess
from torchloom.checkpointing.state import (
    OPTIMIZER,
    POSITIONAL_OPTIMIZER,
    VALUE,
    Entry,
    collect,
    is_resume,
    kinds_of,
    load_module,
    resolve,
    torch_internal_warnings_filtered,
)
from torchloom.errors import (
    CheckpointError,
    MisuseError,
    MisuseTypeError,
    MisuseValueError,
    describe_failure,
    raise_shared_failure,
)

log = logging.getLogger("torchloom")

#: `save(..., filter=)`: for an entry, a function `(name, value) -> bool` that keeps the matching items.
Filter = Callable[[str, Any], bool]


class Checkpointer:
    """Saves and loads checkpoints for one Loom: `io` is its strategy, `scaler` its precision, `counters` the
    numbers the Loom keeps that a resumed run must continue from (saved with the run's state, updated in place by
    a load)."""

    def __init__(self, io: StateAccess, scaler: ScalerState, counters: dict[str, int] | None = None) -> None:
        self._io = io
        self._scaler = scaler
        self._counters = counters if counters is not None else {}
        self._pending: Future | None = None
        self._exit_hook = False

    # ---- the user's checkpoints ------------------------------------------------------------------------------
    def save(
        self,
        path: Path,
        state: dict[str, Any],
        modules: Iterable[nn.Module] = (),
        filter: dict[str, Filter] | None = None,
        async_save: bool = False,
        fsync: bool = True,
    ) -> None:
        """Every rank calls it. `modules` are the set-up modules an optimizer of `state` may belong to."""
        self.finish_pending_save()
        fmt = self._io.checkpoint_format
        # A `state` this rank cannot save (an optimizer no module owns) is refused on every rank at the check
        # that all ranks enter anyway: raising here alone would leave the others waiting in the save's
        # collectives until the timeout.
        failure: CheckpointError | None = None
        try:
            entries = resolve(state, modules)
        except CheckpointError as exc:
            entries, failure = {}, exc
        self._check_same_on_every_rank("save", entries, filter, failure)
        if filter:
            entries = self._filtered(entries, filter, fmt)
        with torch_internal_warnings_filtered():
            if fmt == "sharded":
                # torch.distributed.checkpoint (about a second to import) is loaded when a sharded checkpoint
                # is touched.
                from torchloom.checkpointing import sharded

                pending = sharded.save(
                    self._io, path, entries, self._record(fmt, entries), async_save=async_save, fsync=fsync
                )
            else:
                meta = self._record(fmt, entries) if full.needs_record(entries) else None
                pending = full.save(self._io, path, entries, meta, async_save=async_save, fsync=fsync)
        if async_save and pending is None:
            # Every rank holds a future after an async save (a finished one where it had nothing to write), so
            # all ranks agree on whether to meet in `finish_pending_save`.
            pending = Future()
            pending.set_result(None)
        self._pending = pending
        if pending is not None and not self._exit_hook:
            self._exit_hook = True
            atexit.register(self._wait_at_exit)

    def load(
        self,
        path: Path,
        state: dict[str, Any],
        modules: Iterable[nn.Module] = (),
        strict: bool = True,
        weights_only: bool = True,
        restore_run_state: bool | None = None,
        verify: bool = True,
    ) -> dict[str, Any]:
        """Restore `state` in place (plain values are replaced in it); return the entries it did not name.
        `restore_run_state`: whether the saved run's generators, loss scaler and counters come back too (None:
        when `state` names an optimizer or a set-up data loader, see `state.is_resume`). `verify`: check every
        file's checksum first (`integrity`)."""
        self.finish_pending_save()
        entries = resolve(state, modules)
        path = atomic.recover(path)
        with torch_internal_warnings_filtered():
            # A path that does not exist is reported by full.read, with the same words for both formats.
            if path.is_dir():  # a sharded checkpoint
                from torchloom.checkpointing import sharded

                values, run_state = sharded.load(
                    self._io, path, entries, strict, weights_only=weights_only, verify_checksums=verify
                )
            else:
                values, run_state = full.load(
                    self._io, path, entries, strict, weights_only=weights_only, verify=verify
                )
        if restore_run_state is None:
            restore_run_state = is_resume(entries)
        if restore_run_state:
            record.restore_run_state(self._io, self._scaler, self._counters, run_state)
        elif run_state and self._io.global_rank == 0:
            log.info(
                "%s loaded without the saved run's random generators, loss scaler and counters "
                "(`state` names no optimizer or data loader); pass restore_run_state=True to restore them.",
                path,
            )
        state.update({k: v for k, v in values.items() if k in entries})
        return {k: v for k, v in values.items() if k not in entries}

    def _check_same_on_every_rank(
        self,
        call: str,
        entries: dict[str, Entry],
        filter: dict[str, Filter] | None = None,
        failure: CheckpointError | None = None,
    ) -> None:
        """Refuse, on every rank, a `state` (or `filter`) whose entries differ between ranks: which entries hold
        modules, optimizers and other objects decides which collectives a save runs (gathering a model,
        recording the generators), so ranks given different ones would wait in different collectives until the
        timeout. Plain values may differ (a save writes rank 0's). A collective itself: only where every rank is
        known to have entered the call (`loom.save` checks it first). Not in `load`, which under DDP loads
        without any collective and may be called on some ranks only."""
        if not self._io.is_distributed:
            if failure is not None:
                raise failure
            return
        shown = {key: entry.kind for key, entry in entries.items() if entry.kind != VALUE}
        filtered = sorted(k for k in filter if k in shown) if isinstance(filter, dict) else filter is not None
        gathered = self._io.all_gather_object(
            (shown, filtered, describe_failure(str(failure), failure) if failure is not None else None)
        )
        # `failure` of the first rank that failed, raised on every rank (chained to its traceback elsewhere).
        failed = next(((r, f) for r, (_, _, f) in enumerate(gathered) if f is not None), None)
        if failed is not None:
            own = failure if failed[0] == self._io.global_rank else None
            raise_shared_failure(failed[1], failed[0], own, CheckpointError)
        answers = [(shown_, filtered_) for shown_, filtered_, _ in gathered]
        for rank, answer in enumerate(answers):
            if answer != answers[0]:
                raise MisuseError(
                    f"loom.{call}() was given different state on different ranks: rank 0 {_shown(*answers[0])}, "
                    f"rank {rank} {_shown(*answer)}. Pass every rank the same entries (modules, optimizers, "
                    "objects with state_dict()) and filter: the ranks gather them together. Plain values may "
                    "differ."
                )

    def _record(self, fmt: str, entries: dict[str, Entry]) -> dict[str, Any]:
        return {
            **record.describe(self._io, self._scaler, fmt, kinds_of(entries)),
            **record.run_state(self._io, self._scaler, self._counters),
        }

    def _filtered(self, entries: dict[str, Entry], filter: dict[str, Filter], fmt: str) -> dict[str, Entry]:
        """`entries` with each filtered one collected (every rank takes part: gathering may be a collective) and
        cut down to the items its filter keeps; an entry whose filter keeps nothing is left out, as Fabric does.
        A filtered module keeps its kind, so a sharded checkpoint stores it sharded and loads it back (with
        strict=False where items were left out)."""
        if not isinstance(filter, dict):
            raise MisuseTypeError(
                f"save(..., filter=) must be a dict of entry name -> function (name, value) -> bool, given "
                f"{filter!r}, e.g. filter={{'model': lambda k, v: 'adapter' in k}}."
            )
        for name, keep in filter.items():
            if not callable(keep):
                raise MisuseTypeError(
                    f"save(..., filter=) for entry {name!r} must be a function (name, value) -> bool, given {keep!r}."
                )
        unknown = [k for k in filter if k not in entries]
        if unknown:
            raise MisuseValueError(f"save(..., filter=) names entries {unknown} that `state` does not have.")
        if fmt == "sharded":
            optimizers = [k for k in filter if entries[k].kind in (OPTIMIZER, POSITIONAL_OPTIMIZER)]
            if optimizers:
                raise MisuseError(
                    f"save(..., filter=) on optimizer entries {optimizers}: a sharded checkpoint stores an "
                    "optimizer's state whole (its items are its state and param groups, which load only "
                    "together). Filter the model's entry, or save a full checkpoint (state_dict_type='full')."
                )
        # Collecting is a collective (FSDP gathers): every rank, every filtered entry, in the filter's order.
        values = {key: collect(self._io, entries[key], full=fmt == "full") for key in filter}
        kept, dropped = self._kept_items(values, filter, fmt)
        out = dict(entries)
        for key, names in kept.items():
            value = values[key]
            if names is not None:
                if key in dropped:
                    del out[key]
                    continue
                chosen = set(names)
                value = {k: v for k, v in value.items() if k in chosen}
            out[key] = replace(entries[key], collected=value)
        return out

    def _kept_items(
        self, values: dict[str, Any], filter: dict[str, Filter], fmt: str
    ) -> tuple[dict[str, list[str] | None], set[str]]:
        """Which items of each filtered entry the filters keep (None: the value is no dict, kept whole), and the
        entries kept by no rank (dropped from the save on every rank): which entries a save writes decides which
        collectives follow (the record gathers every rank's generators only for a checkpoint that holds a module
        or optimizer), so ranks that decided apart would wait in different collectives until the timeout.

        A full checkpoint is gathered to rank 0 alone under the FSDP layouts (the other ranks hold empty state
        dicts): rank 0, which writes the file, applies the filters to the full values and tells the others. A
        sharded one gives every rank its shards (a pipeline rank: its stages' names): every rank applies the
        filters (a filter may compute on a DTensor, a collective) and the ranks that hold an item must agree on
        it."""
        io = self._io
        decide = fmt != "full" or io.global_rank == 0
        failure, own, kept = None, None, {}
        if decide:
            key = None
            try:
                for key, keep in filter.items():
                    value = values[key]
                    kept[key] = (
                        [k for k, v in value.items() if keep(k, v)] if isinstance(value, dict) else None
                    )
            except Exception as exc:  # noqa: BLE001 - every rank raises it, or the others would wait for this one
                own = exc
                failure = describe_failure(
                    f"save(..., filter=) for entry {key!r} raised {type(exc).__name__} on rank {io.global_rank}: "
                    f"{exc}",
                    exc,
                )
        # The user's own error where the filter raised it (as one process would see it); the others' names it.
        if not io.is_distributed:
            if own is not None:
                raise own
            return kept, {k for k, names in kept.items() if names == []}
        if fmt == "full":
            failure, kept = io.broadcast((failure, kept), src=0)
            if own is not None:
                raise own
            raise_shared_failure(failure, 0, None, CheckpointError)
            return kept, {k for k, names in kept.items() if names == []}
        held = {k: list(v) if isinstance(v, dict) else None for k, v in values.items()} if decide else {}
        answers = io.all_gather_object((failure, kept, held))
        if own is not None:
            raise own
        rank, failure = next(((r, f) for r, (f, _, _) in enumerate(answers) if f), (0, None))
        raise_shared_failure(failure, rank, None, CheckpointError)
        dropped = set()
        for key in filter:
            _check_same_choice(key, [(k[key], h[key]) for _, k, h in answers])
            if all(k[key] == [] for _, k, _ in answers):
                dropped.add(key)
        return kept, dropped

    # ---- plain and Hugging Face files ------------------------------------------------------------------------
    def load_raw(
        self, path: Path, obj: Any, strict: bool = True, weights_only: bool = True, verify: bool = True
    ) -> Any:
        """A plain state dict file into a module (`obj` unwrapped) or optimizer, or a Hugging Face checkpoint
        into a module (returns its `(missing_keys, unexpected_keys)`)."""
        # A pending asynchronous save may be writing this very path: let it finish (and report) first.
        self.finish_pending_save()
        is_module = isinstance(obj, nn.Module)
        if hf.is_checkpoint(path):
            if not is_module:
                raise MisuseError("A safetensors checkpoint holds model weights: pass the model to load_raw.")
            if verify:  # every file that carries a checksum (torchloom wrote it), split over the ranks
                from torchloom.checkpointing import integrity

                files = {file: file.stat().st_size for file in hf.shard_files(path)}
                integrity.check_shared(self._io, files, integrity.check_safetensors)
            with torch_internal_warnings_filtered():
                return hf.load(self._io, obj, path, strict)
        if verify and path.is_file():
            # A file torchloom wrote carries its checksum (a plain torch.save file has none: nothing to check).
            from torchloom.checkpointing import integrity

            integrity.check_full_file_shared(self._io, path)
        raw = full.read(path, weights_only=weights_only)
        if is_module:
            load_module(self._io, obj, raw, strict, name=str(path))
        else:
            obj.load_state_dict(raw)
        return None

    def save_raw(
        self,
        out_dir: Path,
        module: nn.Module,
        dtype: torch.dtype | None = None,
        max_shard_size: int | str = "5GB",
        config: Any = None,
    ) -> None:
        self.finish_pending_save()
        with torch_internal_warnings_filtered():
            hf.save(self._io, module, out_dir, dtype, max_shard_size, config)

    # ---- the asynchronous save's life ------------------------------------------------------------------------
    def finish_pending_save(self) -> None:
        """Wait for the last `async_save`; raise here, on every rank, if it failed on any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        failure, own = None, None
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            own = exc
            failure = describe_failure(
                f"The previous asynchronous save failed: {type(exc).__name__}: {exc}", exc
            )
        rank = self._io.global_rank
        if self._io.is_distributed:
            # Every rank waits for rank 0, the one that moves the checkpoint into place.
            failures = self._io.all_gather_object(failure)
            rank, failure = next(((r, f) for r, f in enumerate(failures) if f), (rank, None))
            own = own if rank == self._io.global_rank else None
        raise_shared_failure(failure, rank, own, CheckpointError)

    def close(self) -> None:
        """The end of the job: wait for a pending save (raising if it failed); interpreter exit then has
        nothing left to wait for."""
        if self._exit_hook:
            atexit.unregister(self._wait_at_exit)
            self._exit_hook = False
        self.finish_pending_save()

    def _wait_at_exit(self) -> None:
        pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - the process is ending; say so, with the whole story
                print("torchloom: the last asynchronous save failed:", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)


def _shown(kinds: dict[str, str], filtered: list[str] | bool) -> str:
    """`{'model': 'module', 'opt': 'optimizer'} with filter on ['model']`, as the error names what a rank got."""
    text = repr(kinds) if kinds else "no modules, optimizers or objects with state"
    if filtered:
        text += f" with a filter on {filtered}" if isinstance(filtered, list) else " with filter="
    return text


def _check_same_choice(key: str, choices: list[tuple[list[str] | None, list[str] | None]]) -> None:
    """Every rank that holds an item made the same choice about it (a pipeline rank holds only its stages' items,
    so only the ranks that hold an item are compared)."""
    first: dict[str, tuple[int, bool]] = {}
    for rank, (kept, held) in enumerate(choices):
        if held is None:
            continue
        chosen = set(kept or ())
        for name in held:
            r, keep = first.setdefault(name, (rank, name in chosen))
            if keep != (name in chosen):
                raise MisuseError(
                    f"save(..., filter=) for entry {key!r} decided differently about {name!r} on different ranks "
                    f"(rank {r}: {'kept' if keep else 'left out'}, rank {rank}: "
                    f"{'kept' if name in chosen else 'left out'}): in a sharded checkpoint each rank's filter "
                    "sees only that rank's shard of each tensor. Decide by the item's name (the first argument), "
                    "which is the same on every rank."
                )
