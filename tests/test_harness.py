"""The harness itself must report failures by rank and never hang."""

import os
import time

import pytest
from harness import run_ranks


def _ok(rank, world_size):
    return rank * 10 + world_size


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def _exit_on_zero(rank, world_size):
    if rank == 0:
        os._exit(3)
    time.sleep(60)


def _hang(rank, world_size):
    time.sleep(60)


def test_results_in_rank_order():
    assert run_ranks(_ok, 3) == [3, 13, 23]


def test_rank_failure_names_rank_and_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed.*ValueError: rank one is broken"):
        run_ranks(_fail_on_one, 2)


def test_silent_death_and_timeout_are_reported_quickly():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 died with exit code 3"):
        run_ranks(_exit_on_zero, 2, timeout=30)
    # Where each rank past the timeout waited: its stack, before it was killed.
    with pytest.raises(
        AssertionError, match=r"(?s)did not finish within 3s.*rank 0 ---.*in _hang.*rank 1 ---.*in _hang"
    ):
        run_ranks(_hang, 2, timeout=3)
    assert time.monotonic() - start < 25


def _environment_and_preloaded(rank, world_size, names):
    import multiprocessing
    import sys

    seen = [os.environ.get(name) for name in names]
    return seen, "torch._dynamo" in sys.modules, multiprocessing.get_start_method()


def test_ranks_see_the_callers_environment_of_the_call_and_start_with_torch_imported(monkeypatch):
    """Ranks start from a fork server that imported torch once (the first call starts it): each rank must still
    see the caller's environment as it is at the call, as a spawned rank would, set and unset variables alike,
    and start its own processes (DataLoader workers) as a rank under torchrun does: with the platform's default
    method, not with a fork server of its own (or a fresh interpreter each, as a spawned rank did)."""
    import multiprocessing

    platform_default = multiprocessing.get_context().get_start_method()
    monkeypatch.setenv("TORCHLOOM_HARNESS_GONE", "before")
    run_ranks(_ok, 2)  # the fork server runs from here on, with the variable set
    monkeypatch.setenv("TORCHLOOM_HARNESS_SET", "after")
    monkeypatch.delenv("TORCHLOOM_HARNESS_GONE")
    names = ["TORCHLOOM_HARNESS_SET", "TORCHLOOM_HARNESS_GONE"]
    for seen, preloaded, start_method in run_ranks(_environment_and_preloaded, 2, names):
        assert seen == ["after", None]
        assert preloaded, "the rank imported torch's lazy modules itself: they were not preloaded"
        assert start_method == platform_default
