"""`loom.progress(...)` shows the throughput: tokens per second for batches of token ids, samples per second for
other batches (both global: this rank's batches times the world size), or what `count(...)` reports; user
postfix values stay beside it; without a bar nothing is counted."""

from __future__ import annotations

import itertools

import pytest
import torch

from torchloom import Loom, progress


@pytest.fixture
def clock(monkeypatch):
    """perf_counter returning 0, 1, 2, ... seconds: one second between two reads."""
    ticks = itertools.count()
    monkeypatch.setattr(progress.time, "perf_counter", lambda: float(next(ticks)))


def test_tokens_per_second_from_batches_of_ids(clock, monkeypatch):
    monkeypatch.setattr(progress, "_world_size", lambda: 2)
    batches = [(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))] * 5
    bar = Loom(accelerator="cpu").progress(batches, force=True)
    seen = []
    for batch in bar:
        seen.append(batch)
        bar.set_postfix(loss=1.5)
    # 4 batches done when the 5th was asked for, 64 tokens each, on 2 ranks, one second apart
    assert len(seen) == 5 and bar._postfix == {"tok/s": "128", "loss": "1.5"}
    bar.close()


def test_samples_per_second_and_input_ids_first(clock):
    bar = Loom(accelerator="cpu").progress([torch.randn(8, 3)] * 3, force=True)
    list(bar)
    assert bar._postfix == {"samples/s": "8"}
    mapping = {
        "labels": torch.zeros(2, dtype=torch.long),
        "input_ids": torch.zeros(2, 1000, dtype=torch.long),
    }
    bar = Loom(accelerator="cpu").progress([mapping] * 3, force=True)
    list(bar)
    assert bar._postfix == {"tok/s": "2k"}


def test_count_reports_steps_of_a_loop_over_steps(clock):
    bar = Loom(accelerator="cpu").progress(range(4), force=True)
    for _ in bar:
        bar.count(3_000_000)  # tokens of a global step
    assert bar._postfix == {"tok/s": "3M"}


def test_no_bar_no_counting():
    bar = Loom(accelerator="cpu").progress([torch.zeros(2, 2, dtype=torch.long)] * 2)
    assert not bar.enabled and len(list(bar)) == 2
    bar.count(5)
    assert bar._postfix == {}
