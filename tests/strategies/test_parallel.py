"""The start-up agreement of `ParallelStrategy`: the store namespace a group's ranks share (in-process, on a
real TCPStore; the jobs that restart under torchrun are in tests/test_elastic.py)."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from torchloom.strategies.parallel import agree_on_namespace

TIMEOUT = timedelta(seconds=20)


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)


def _agree(
    server: dist.TCPStore, ranks: list[int], world_size: int, late: dict[int, float] | None = None
) -> dict:
    """Run `agree_on_namespace` for `ranks` in threads (rank r starting `late[r]` seconds late)."""
    found: dict[int, str] = {}
    started = threading.Event()

    def rank(r: int) -> None:
        if late and r in late:
            started.wait(late[r])
        found[r] = agree_on_namespace(_client(server), r, world_size, TIMEOUT)

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return found


def test_a_restarted_attempt_gets_a_namespace_of_its_own_despite_the_failed_attempts_keys():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    first = _agree(server, [0, 1, 2], 3)
    assert len(set(first.values())) == 1  # one namespace for the whole group
    # A failed attempt: ranks 1 and 2 asked, rank 0 died before answering. Their ids stay in the store.
    server.append("torchloom/joins", "deadbeef1 deadbeef2 ")
    # The next attempt, rank 0 starting last: ranks 1 and 2 must wait for it rather than take the earlier
    # attempt's answer or counters.
    second = _agree(server, [0, 1, 2], 3, late={0: 1.0})
    assert len(set(second.values())) == 1
    assert set(second.values()) != set(first.values())
    assert second[0].startswith("torchloom/")
    # The list of ids was emptied once answered, so it does not grow with every restart.
    assert server.get("torchloom/joins") == b""


def test_one_process_needs_no_store():
    assert agree_on_namespace(None, 0, 1, TIMEOUT).startswith("torchloom/")
