"""`meet`: calls every rank must make together (`loom.save`, ...), checked through the job's store before their
collectives start, and `skipped_call`, which tells a rank that another gave up waiting for it in one. See
`torchloom.diagnostics`."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

from torchloom.diagnostics.record import POLL_SECONDS, RECORD, TORCHLOOM_DIR, store_key, user_stack


class PeersElsewhere(Exception):
    """`meet`: other ranks are in another call and will not come (see `ranks`, rank -> where)."""

    def __init__(self, ranks: dict[int, str]) -> None:
        super().__init__(", ".join(f"rank {r} is {where}" for r, where in sorted(ranks.items())))
        self.ranks = ranks


class PeersLate(TimeoutError):
    """`meet`: some ranks did not arrive within the timeout (`ranks`: rank -> where, where known)."""

    def __init__(self, ranks: dict[int, str]) -> None:
        super().__init__(", ".join(f"rank {r} is {where}" for r, where in sorted(ranks.items())))
        self.ranks = ranks


# How long a rank waits in `meet` before it first asks where the others are, and between asks.
_MEET_ASK_AFTER = 0.5
_MEET_ASK_EVERY = 1.0


def meet(call: str, timeout: timedelta) -> bool:
    """Wait, through the job's store, until every rank has entered its same `call` (its n-th one on each rank), so
    that a call every rank must make does not start its collectives on some ranks only: those would pair with
    whatever collectives the others are in, which gloo answers by aborting the process (SIGABRT) and NCCL by
    hanging. Costs two store round trips when the ranks arrive together.

    While it waits, it asks the other ranks' watchdogs where they are. A rank that is blocked in a collective
    (or in the job's exit), or in another such call, cannot come here: `PeersElsewhere` names them once two asks
    a second apart agree. After `timeout`, `PeersLate`. Returns True once every rank is in it; without a store (no
    process group) it returns False at once."""
    store, world_size = RECORD.store, RECORD.world_size
    if store is None or world_size < 2:
        return False
    n = RECORD.meetings.get(call, 0) + 1
    RECORD.meetings[call] = n
    RECORD.meeting = (call, n)
    arrived, everyone = store_key(f"meet/{call}/{n}"), store_key(f"meet/{call}/{n}/all")
    try:
        if store.add(arrived, 1) >= world_size:
            store.set(everyone, "1")
            return True
        start = time.monotonic()
        next_ask, pause = start + _MEET_ASK_AFTER, 0.001
        blocked_before: dict[int, str] = {}
        while not store.check([everyone]):
            now = time.monotonic()
            if now - start > timeout.total_seconds():
                raise PeersLate(_where_others(store, call, n)[1])
            if now >= next_ask:
                blocked, elsewhere = _where_others(store, call, n)
                # Blocked twice in the same place: not a collective among other ranks that is about to finish.
                settled = {r: w for r, w in blocked.items() if blocked_before.get(r) == w}
                if settled:
                    # For the ranks that skipped the call: their collective fails once this rank's process ends
                    # (or at its timeout), and `skipped_call` then names what they missed.
                    store.set(store_key("skipped"), json.dumps({"rank": RECORD.rank, "call": call, "n": n}))
                    raise PeersElsewhere({**settled, **{r: w for r, w in elsewhere.items() if r in settled}})
                blocked_before = blocked
                next_ask = time.monotonic() + _MEET_ASK_EVERY
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return True
    finally:
        RECORD.meeting = None


def skipped_call() -> str | None:
    """On a rank whose collective failed: if another rank gave up waiting for it in a call every rank must make
    (`meet`), say so (one store round trip, on the failure path only); else None."""
    store = RECORD.store
    if store is None:
        return None
    try:
        if not store.check([store_key("skipped")]):
            return None
        skipped = json.loads(store.get(store_key("skipped")))
    except Exception:  # noqa: BLE001 - the store is gone with the job: no better message then
        return None
    call, rank, n = skipped["call"], skipped["rank"], skipped["n"]
    if RECORD.meetings.get(call, 0) >= n:
        return None
    return (
        f"rank {rank} waited in loom.{call}() (its call #{n}), which rank {RECORD.rank} did not make: rank "
        f"{RECORD.rank} went on to other collectives instead. Call loom.{call} on every rank at the same point "
        f"(drop any `if loom.is_global_zero:` around it)."
    )


def _where_others(store: Any, call: str, n: int) -> tuple[dict[int, str], dict[int, str]]:
    """Ask every other rank's watchdog where its main thread is. Returns (the ranks that cannot come to `call`
    #`n`: blocked in a collective, in the job's exit, or in another such call; every rank not in it, with where
    it is)."""
    asked = store.add(store_key("where"), 1)
    answers: dict[int, dict[str, Any]] = {}
    others = [r for r in range(RECORD.world_size) if r != RECORD.rank]
    deadline = time.monotonic() + POLL_SECONDS * 3
    while len(answers) < len(others) and time.monotonic() < deadline:
        for r in others:
            key = store_key(f"where/{r}")
            if r not in answers and store.check([key]):
                answer = json.loads(store.get(key))
                if answer["asked"] >= asked:
                    answers[r] = answer
        time.sleep(0.02)
    blocked, elsewhere = {}, {}
    for r in others:
        answer = answers.get(r)
        if answer is None:
            elsewhere[r] = "not answering"
            continue
        meeting = answer.get("meeting")
        if meeting == [call, n]:
            continue
        where = answer["at"]
        if meeting:
            where = f"in loom.{meeting[0]}() #{meeting[1]} (this rank is in #{n}), {where}"
            blocked[r] = where
        elif answer["blocked"]:
            blocked[r] = where
        elsewhere[r] = where
    return blocked, elsewhere


# Where a rank's main thread waits for the others when it is inside these (torchloom's end of the job).
_EXIT_FUNCTIONS = ("agree_to_exit", "shutdown_process_group")


def where_now(frame: Any, asked: int) -> dict[str, Any]:
    """Where the main thread is, for `meet`: its innermost user line, whether it is blocked in a collective
    (its innermost Python frame is in torch.distributed) or in the job's exit, and the `meet` it is in."""
    innermost: Any = frame.f_code if frame is not None else None
    # torch.distributed's collectives, and DDP's own (its bucket and buffer broadcasts in forward), wait in C++
    # below their Python frame.
    in_collective = innermost is not None and any(
        os.sep + os.path.join("torch", *package) + os.sep in innermost.co_filename
        for package in (("distributed",), ("nn", "parallel"))
    )
    # DDP all-reduces gradients inside autograd's C++ engine: its frame is the innermost Python one.
    in_backward = (
        RECORD.backward_syncs
        and innermost is not None
        and os.sep + os.path.join("torch", "autograd") + os.sep in innermost.co_filename
    )
    exiting = False
    f = frame
    while f is not None:
        if f.f_code.co_name in _EXIT_FUNCTIONS and f.f_code.co_filename.startswith(TORCHLOOM_DIR):
            exiting = True
            break
        f = f.f_back
    stack = user_stack(frame)
    at = _line_of(stack[-1]) if stack else "outside your code"
    if exiting:
        at = f"ending the job (loom.close() or the end of the script), last in your code at {at}"
    elif in_collective:
        at = f"in a collective ({innermost.co_name} in {os.path.basename(innermost.co_filename)}) called from {at}"
    elif in_backward:
        at = f"in a backward that synchronises gradients with the other ranks, called from {at}"
    else:
        at = f"at {at}"
    meeting = list(RECORD.meeting) if RECORD.meeting else None
    return {"asked": asked, "blocked": in_collective or exiting or in_backward, "at": at, "meeting": meeting}


def _line_of(frame_text: str) -> str:
    """`train.py:42 in main` from a formatted stack entry."""
    head = frame_text.strip().splitlines()[0]
    try:
        file, rest = head[len('File "') :].split('", line ', 1)
        line, function = rest.split(", in ", 1)
        return f"{os.path.basename(file)}:{line} in {function}"
    except ValueError:
        return head
