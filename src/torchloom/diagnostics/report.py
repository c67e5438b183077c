"""The desync report: on a rank whose collective failed, every rank's record gathered through the job's store,
one report printed, and its `culprit:` line (`explain`). See `torchloom.diagnostics`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Generator
from typing import Any

from torchloom.diagnostics.record import RECORD, store_key

# How long the asking rank waits for the answers. A live rank answers within one poll of its watchdog; the wait
# is for a rank that never will.
_ANSWER_SECONDS = 3.0


def explain(failed: str, timed_out: bool, frame: Any = None) -> str | None:
    """On a rank whose collective `failed` (timed out, or a peer died in it): gather every rank's record through
    the store and print one desync report on the first rank to ask. Returns the `culprit:` line, or None when
    the failure is no desync (a peer that died for its own reasons). `frame`: where the rank's main thread is
    (by default, the caller's)."""
    store, rank, world_size = RECORD.store, RECORD.rank, RECORD.world_size
    if store is None:
        return None
    with _deferring_sigterm():
        try:
            mine = RECORD.snapshot(frame or sys._getframe(1), "failed")
            store.set(store_key(f"answer/{rank}"), json.dumps(mine))
            if store.add(store_key("requests"), 1) != 1:
                return _wait_for(store, store_key("culprit"), _ANSWER_SECONDS + 2.0)
            answers, published = _collect(
                store, world_size, _ANSWER_SECONDS if timed_out else _ANSWER_SECONDS / 2
            )
            culprit = _culprit(answers, published, world_size, evidence_only=not timed_out)
            if culprit is None and not timed_out:
                store.set(store_key("culprit"), "")
                return None
            culprit = culprit or "culprit: none found: every rank that answered is in the same collective"
            report = _report(answers, published, world_size, rank, failed, culprit)
            print(report, file=sys.stderr, flush=True)
            store.set(store_key("culprit"), culprit)
            return culprit
        except Exception:  # noqa: BLE001 - the store went away meanwhile: fail with PyTorch's own error
            return None


@contextlib.contextmanager
def _deferring_sigterm() -> Generator[None, None, None]:
    """Hold off SIGTERM while the report is gathered and printed: the agent stops every rank as soon as one
    fails, and the report is worth the few seconds. Delivered (to the previous handler) afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    if previous is None:  # a handler installed outside Python: the default is the closest we can restore
        previous = signal.SIG_DFL
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if caught:
            os.kill(os.getpid(), signal.SIGTERM)


def _wait_for(store: Any, key: str, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if store.check([key]):
            return store.get(key).decode() or None
        time.sleep(0.05)
    return None


def _collect(store: Any, world_size: int, seconds: float) -> tuple[dict[int, Any], dict[int, Any]]:
    """Every rank's answer, and what every rank last published."""
    answers: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + seconds
    while True:
        for r in range(world_size):
            if r not in answers and store.check([store_key(f"answer/{r}")]):
                answers[r] = json.loads(store.get(store_key(f"answer/{r}")))
        if len(answers) == world_size or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    published = {}
    for r in range(world_size):
        if store.check([store_key(f"published/{r}")]):
            published[r] = json.loads(store.get(store_key(f"published/{r}")))
    return answers, published


def _where(rec: dict[str, Any]) -> str:
    return f"{os.path.basename(rec['file'])}:{rec['line']}" if rec.get("file") else "?"


def _call(rec: dict[str, Any]) -> str:
    """`all_reduce #7 ((4,) float32)` or `barrier #7`."""
    if not rec.get("name"):
        return "no collective yet"
    extra = ", ".join(x for x in (rec.get("shapes"), rec.get("detail")) if x)
    return f"{rec['name']} #{rec['seq']}" + (f" ({extra})" if extra else "")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _current_line(rec: dict[str, Any]) -> str:
    """Where a rank's main thread is, from its innermost user frame: `train.py:42 in load_batch`."""
    for line in reversed(rec.get("stack") or []):
        head = line.strip().splitlines()[0]
        if head.startswith("File "):
            file, rest = head[len('File "') :].split('", line ', 1)
            number, function = rest.split(", in ", 1)
            return f"{os.path.basename(file)}:{number} in {function}"
    return "an unknown place"


def _culprit(
    answers: dict[int, Any], published: dict[int, Any], world_size: int, evidence_only: bool
) -> str | None:
    """The `culprit:` line: which rank(s) broke step with the others, and how. With `evidence_only`, only a
    mismatch the records prove (a peer that died may have died for reasons of its own)."""
    silent = [r for r in range(world_size) if r not in answers]
    waiting = {r: a for r, a in answers.items() if a["inside"]}
    if not waiting:
        return None
    # The first collective that did not complete everywhere.
    target = min(a["seq"] for a in waiting.values())
    ref = waiting[min(r for r, a in waiting.items() if a["seq"] == target)]
    # A live rank outside every collective, behind the others: stuck in its own code.
    behind = sorted(r for r, a in answers.items() if not a["inside"] and a["seq"] < target)
    if behind and not evidence_only:
        r = behind[0]
        last = (
            f"its last collective was {_call(answers[r])} at {_where(answers[r])}"
            if answers[r]["name"]
            else ""
        )
        return (
            f"culprit: {_ranks(behind)} never reached {ref['name']} #{target} ({_where(ref)}); "
            f"{'it is' if len(behind) == 1 else f'rank {r} is'} in user code at {_current_line(answers[r])}"
            + (f" ({last})" if last else "")
        )
    # What each rank did at `target`: its answer, or, for a rank past it or dead, what it published then (a
    # mismatched call is a new path for at least one rank, so it was published).
    at = {r: a for r, a in answers.items() if a["seq"] == target}
    at.update({r: p for r, p in published.items() if r not in at and p["seq"] == target})
    mismatch = _mismatch(at)
    if mismatch:
        return mismatch
    # Every rank answered (none died), from inside the same Loom call: evidence enough, whatever failed.
    inside = _inside_library_call(answers, world_size)
    if inside:
        return inside
    for r in silent:
        clue = _dead_clue(published[r], ref) if r in published else None
        if clue:
            return clue
    if evidence_only:
        return None
    ahead = sorted(r for r, a in answers.items() if a["seq"] > target)
    if ahead:
        a = answers[ahead[0]]
        return (
            f"culprit: {_ranks(ahead)} went past {ref['name']} #{target} ({_where(ref)}) without the others "
            f"(their collectives no longer line up); {'it is' if len(ahead) == 1 else f'rank {ahead[0]} is'} "
            f"in {_call(a)} at {_where(a)}"
        )
    if silent:
        r = silent[0]
        gone = "its process died, or it is blocked in native code holding the GIL"
        if r in published:
            gone += f"; it last recorded {_call(published[r])} at {_where(published[r])}"
        return f"culprit: {_ranks(silent)} did not answer ({gone})"
    return None


#: The Loom's calls that run collectives of torchloom's own inside them (the record sees the call, not those).
_LIBRARY_CALLS = ("save", "load", "load_raw", "save_raw")


def _inside_library_call(answers: dict[int, Any], world_size: int) -> str | None:
    """Every rank answered from inside the same loom.save() (or load...): none skipped it or called it alone, so
    what parted them is inside torchloom. Either a rank is still working there (not in a collective: writing a
    large file) while the others wait, or the ranks wait in different collectives of torchloom's (a defect)."""
    if len(answers) < world_size or not all(a["inside"] for a in answers.values()):
        return None
    calls = {(a["name"], a["seq"]) for a in answers.values()}
    name, seq = next(iter(calls))
    if len(calls) != 1 or name not in _LIBRARY_CALLS:
        return None
    call = f"loom.{name}() #{seq} ({_where(answers[min(answers)])})"
    working = sorted(r for r, a in answers.items() if not a.get("in_distributed", True))
    if working and len(working) < len(answers):
        return (
            f"culprit: {_ranks(working)} {'is' if len(working) == 1 else 'are'} still working inside {call}, at "
            f"{_internal(answers[working[0]])}, while the others wait for it in a collective: the checkpoint takes "
            "longer to write or read than Loom(timeout=...) allows; raise the timeout"
        )
    places: dict[tuple[str, ...], list[int]] = {}
    for r, a in sorted(answers.items()):
        places.setdefault(_place(a.get("internal") or []), []).append(r)
    if len(places) < 2:
        return (
            f"culprit: none found: every rank is inside {call}, in the same collective "
            f"({_internal(answers[min(answers)])}), so none skipped the call or made it alone"
        )
    parts = "; ".join(f"{_ranks(ranks)} in {_internal(answers[ranks[0]])}" for ranks in places.values())
    if name == "save":
        # loom.save checks that every rank entered it and was given the same entries and filter.
        return (
            f"culprit: torchloom itself, not your code: every rank is inside the same {call}, but they wait in "
            f"different collectives inside it ({parts}). Please report this as a torchloom bug, with this report"
        )
    return (
        f"culprit: every rank is inside the same {call}, but they wait in different collectives inside it "
        f"({parts}): the ranks were given different arguments (`state` must name the same modules and "
        "optimizers on every rank), or this is a torchloom bug: please report it, with this report"
    )


def _place(internal: list[str]) -> tuple[str, ...]:
    """Where a rank waits inside torchloom, to compare ranks: its frames, the innermost without its line (a
    failed collective's frame is at its `with` statement, a waiting one's at the call inside)."""
    if not internal:
        return ()
    *outer, innermost = internal
    file, _, function = innermost.partition(" in ")
    return (*outer, file.rsplit(":", 1)[0], function)


def _internal(rec: dict[str, Any]) -> str:
    """Where inside the Loom's call a rank is: `full.py:126 in save > parallel.py:318 in broadcast`."""
    frames = (rec.get("internal") or [])[1:]  # the first is the Loom method the user called
    return " > ".join(frames[-4:]) or "an unknown place"


def _mismatch(ahead: dict[int, dict[str, Any]]) -> str | None:
    """Ranks at the same sequence number in different collectives, or with different shapes."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, a in sorted(ahead.items()):
        groups.setdefault((a["name"], a["shapes"], a["detail"]), []).append(r)
    if len(groups) < 2:
        return None
    # The odd one out: the minority when there is one; otherwise the ranks that took a path they never took
    # before (a skipped or extra call, or new shapes), while the others repeat what they did every step.
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    if sizes[0] > sizes[1]:
        majority = max(groups.values(), key=len)
        odd = sorted(r for r in ahead if r not in majority)
    else:
        odd = sorted(r for r, a in ahead.items() if a["new_path"] or a["new_shape"])
        if not odd or len(odd) == len(ahead):
            odd = sorted(ahead)[1:]
        majority = [r for r in ahead if r not in odd]
    ref = ahead[majority[0]] if majority else ahead[min(ahead)]
    r = odd[0]
    a = ahead[r]
    if a["name"] != ref["name"]:
        if a["new_site"]:
            return (
                f"culprit: {_ranks(odd)} called an extra {a['name']} #{a['seq']} at {_where(a)}, which "
                f"{_ranks(majority)} did not call (it is in {_call(ref)} at {_where(ref)})"
            )
        return (
            f"culprit: {_ranks(odd)} never reached {ref['name']} #{ref['seq']} ({_where(ref)}); "
            f"{'it is' if len(odd) == 1 else f'rank {r} is'} in {_call(a)} at {_where(a)}"
        )
    return (
        f"culprit: {_ranks(odd)} passed {a['shapes'] or a['detail']} to {a['name']} #{a['seq']} at {_where(a)}, "
        f"where {_ranks(majority)} passed {ref['shapes'] or ref['detail']} ({_where(ref)})"
    )


def _dead_clue(pub: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """A rank that died without answering, seen through what it last published (`pub`) and a live rank
    (`ref`)."""
    # The dead rank published nothing since: it repeated paths it had taken before. The live rank took a new
    # one, with shapes it never passed there: gloo aborts the peer that receives more than it expects.
    if pub["seq"] < ref["seq"] and ref["new_shape"] and not ref["new_site"]:
        return (
            f"culprit: rank {ref['rank']} passed {ref['shapes']} to {ref['name']} #{ref['seq']} at {_where(ref)}, "
            f"shapes it never passed there before; rank {pub['rank']} died in that collective (it repeated "
            f"earlier calls since {pub['name']} #{pub['seq']} at {_where(pub)})"
        )
    return None


def _report(
    answers: dict[int, Any], published: dict[int, Any], world_size: int, me: int, failed: str, culprit: str
) -> str:
    lines = [f"torchloom desync report (rank {me}: {failed})"]
    mesh = RECORD.mesh if RECORD.mesh is not None and math.prod(RECORD.mesh[1]) == world_size else None
    if mesh is not None:
        lines.append("device mesh: " + " x ".join(f"{n} {s}" for n, s in zip(*mesh, strict=True)))
    for r in range(world_size):
        a = answers.get(r)
        rank = f"rank {r}{_mesh_position(r, mesh)}"
        if a is None:
            pub = published.get(r)
            last = f"; last new call: {_call(pub)} at {_where(pub)}" if pub else ""
            lines.append(f"{rank}: no answer (its process died, or it is blocked in native code){last}")
            a = pub or {"stack": []}
        elif a.get("queued"):
            lines.append(
                f"{rank} (pid {a['pid']}): in {_call(a)} at {_where(a)}, queued on the device and not completed; "
                f"its main thread is at {_current_line(a)}"
            )
        elif a["inside"]:
            inner = (
                f", inside it at {_internal(a)}" if a["name"] in _LIBRARY_CALLS and a.get("internal") else ""
            )
            lines.append(f"{rank} (pid {a['pid']}): in {_call(a)} at {_where(a)}{inner}")
        else:
            last = f"; last collective: {_call(a)} at {_where(a)}" if a["name"] else ""
            lines.append(f"{rank} (pid {a['pid']}): in user code at {_current_line(a)}{last}")
        lines.extend("    " + line for block in a["stack"] for line in block.splitlines())
    lines.append(culprit)
    return "\n".join(lines)


def _mesh_position(rank: int, mesh: tuple[tuple[str, ...], tuple[int, ...]] | None) -> str:
    """` [data_parallel 1, tensor_parallel 0]`: where `rank` sits on a row-major mesh (as init_device_mesh lays
    ranks out); empty without a mesh."""
    if mesh is None:
        return ""
    names, sizes = mesh
    coords = []
    for size in reversed(sizes):
        coords.append(rank % size)
        rank //= size
    return " [" + ", ".join(f"{n} {c}" for n, c in zip(names, reversed(coords), strict=True)) + "]"
