"""`Throughput` and `ThroughputMonitor` side by side with Lightning's (`lightning.fabric.utilities.throughput`,
the installed 2.6.6) on the same inputs: the same keys and values for every window, world size, separator and mix of
optional counts; the same refusals; and `ThroughputMonitor(loom)` on 1 process and on 2 gloo ranks (only rank 0
keeps the window and logs, the global rates count both ranks), through a training loop with gradient accumulation
and varying sequence lengths."""

from __future__ import annotations

import random
import time
import warnings

import pytest
import torch
from harness import run_ranks
from lightning.fabric.utilities import throughput as fabric_tp

from torchloom import Loom
from torchloom.loggers import Logger
from torchloom.throughput import Throughput, ThroughputMonitor


def _updates(seed: int, n: int, with_lengths: bool, with_flops: bool) -> list[dict]:
    """A run's running totals: uneven step times, batch sizes and sequence lengths."""
    rng = random.Random(seed)
    t = batches = samples = lengths = 0
    out = []
    for _ in range(n):
        t += rng.uniform(0.05, 0.5)
        batches += 1
        size = rng.randint(1, 8)
        samples += size
        lengths += size * rng.randint(3, 128)  # tokens: the sequence length varies per batch
        kwargs: dict = {"time": t, "batches": batches, "samples": samples}
        if with_lengths:
            kwargs["lengths"] = lengths
        if with_flops:
            kwargs["flops"] = size * 1_000_003
        out.append(kwargs)
    return out


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("window_size", [2, 5])
@pytest.mark.parametrize("separator", ["/", "|"])
def test_same_metrics_as_fabric_after_every_update(world_size, window_size, separator):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed, (with_lengths, with_flops) in enumerate(
            [(False, False), (True, False), (True, True), (False, True)]
        ):
            ours = Throughput(
                available_flops=7e9, world_size=world_size, window_size=window_size, separator=separator
            )
            theirs = fabric_tp.Throughput(
                available_flops=7e9, world_size=world_size, window_size=window_size, separator=separator
            )
            for kwargs in _updates(seed, 12, with_lengths, with_flops):
                ours.update(**kwargs)
                theirs.update(**kwargs)
                got, expected = ours.compute(), theirs.compute()
                assert got.keys() == expected.keys()
                assert got == pytest.approx(expected, rel=1e-12)
            # the keys Fabric documents appear once the window is full
            if with_flops:
                assert f"device{separator}mfu" in got
            assert (f"device{separator}items_per_sec" in got) == with_lengths
            assert ("samples_per_sec" in got) == (world_size > 1)
            ours.reset()
            theirs.reset()
            ours.update(time=1.0, batches=1, samples=1)
            theirs.update(time=1.0, batches=1, samples=1)
            assert ours.compute() == theirs.compute()


def test_refusals_match_fabric():
    for cls in (Throughput, fabric_tp.Throughput):
        t = cls(window_size=2)
        t.update(time=1.0, batches=1, samples=1, lengths=2)
        with pytest.raises(ValueError, match="Expected the value to increase"):
            t.update(time=1.0, batches=2, samples=2, lengths=4)
        with pytest.raises(ValueError, match="greater or equal than batches"):
            cls().update(time=1.0, batches=2, samples=1)
        with pytest.raises(ValueError, match="greater or equal than samples"):
            cls().update(time=1.0, batches=1, samples=2, lengths=1)
        t = cls()
        t.update(time=1.0, batches=1, samples=1)
        with pytest.raises(RuntimeError, match="same number of samples"):
            t.update(time=2.0, batches=2, samples=2, lengths=4)
    for bad in ({"window_size": 1}, {"world_size": 0}, {"sparse_cuda_acceleration_factor": 0.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Throughput(**bad)


def test_dense_by_default_sparse_on_request():
    with pytest.warns(UserWarning, match="assumes dense"):
        Throughput(available_flops=1e12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Throughput(available_flops=1e12, using_sparse_model=False).available_flops == 1e12
    assert Throughput(available_flops=1e12, using_sparse_model=True).available_flops == 2e12
    sparse = Throughput(available_flops=1e12, using_sparse_model=True, sparse_cuda_acceleration_factor=1.5)
    assert sparse.available_flops == 1.5e12


class _Capture(Logger):
    def __init__(self) -> None:
        self.rows: list[tuple[int | None, dict]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


def _train(loom: Loom, monitor: ThroughputMonitor, accumulate: int, steps: int) -> list[dict]:
    """A tiny LM-like loop: batches of varying sequence length, `accumulate` micro-batches per optimizer step,
    the monitor updated after each optimizer step with the running totals, as litgpt does."""
    model = loom.setup_module(torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)))
    optimizer = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(loom.global_rank)
    t0 = time.perf_counter()
    micro = samples = tokens = 0
    computed = []
    for _ in range(steps):
        for _ in range(accumulate):
            length = int(torch.randint(4, 33, (1,), generator=gen))
            x = torch.randint(0, 50, (3, length), generator=gen)
            with loom.no_backward_sync(model, enabled=micro % accumulate != accumulate - 1):
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
                loom.backward(loss / accumulate)
            micro += 1
            samples += x.shape[0]
            tokens += x.numel()
        optimizer.step()
        optimizer.zero_grad()
        monitor.update(time=time.perf_counter() - t0, batches=micro, samples=samples, lengths=tokens)
        computed.append(monitor.compute_and_log())
    return computed


def _monitor_body(rank: int, world_size: int) -> dict:
    logger = _Capture()
    loom = Loom(
        accelerator="cpu", devices=world_size, strategy="ddp" if world_size > 1 else "auto", loggers=logger
    )
    loom.launch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = ThroughputMonitor(loom, window_size=3)
        no_peak = [str(w.message) for w in caught]
    computed = _train(loom, monitor, accumulate=2, steps=4)
    # the same counts through Fabric's Throughput give the same metrics
    fabric = fabric_tp.Throughput(world_size=world_size, window_size=3)
    for_fabric = []
    if rank == 0:
        for row in monitor._time, monitor._batches, monitor._samples, monitor._lengths:
            assert len(row) == 3
        fabric.update(
            time=monitor._time[0],
            batches=monitor._batches[0],
            samples=monitor._samples[0],
            lengths=monitor._lengths[0],
        )
        fabric.update(
            time=monitor._time[1],
            batches=monitor._batches[1],
            samples=monitor._samples[1],
            lengths=monitor._lengths[1],
        )
        fabric.update(
            time=monitor._time[2],
            batches=monitor._batches[2],
            samples=monitor._samples[2],
            lengths=monitor._lengths[2],
        )
        for_fabric = [fabric.compute()]
    explicit = ThroughputMonitor(loom, available_flops=4e9, using_sparse_model=False, window_size=2)
    explicit.update(time=1.0, batches=1, samples=2, flops=1e9)
    explicit.update(time=2.0, batches=2, samples=4, flops=1e9)
    mfu = explicit.compute_and_log(step=100)
    loom.close()
    return {
        "computed": computed,
        "rows": logger.rows,
        "fabric": for_fabric,
        "no_peak": no_peak,
        "mfu": mfu,
        "world": monitor.world_size,
    }


def _check_monitor(results: list[dict], world_size: int) -> None:
    zero = results[0]
    assert zero["world"] == world_size
    # step counts from 0 like Fabric's; the rates appear once the window (3 updates) is full
    assert [step for step, _ in zero["rows"]] == [0, 1, 2, 3, 100]
    assert [row for _, row in zero["rows"][:4]] == zero["computed"]
    last = zero["computed"][-1]
    assert last["batches"] == 8 and last["samples"] == 24  # 4 optimizer steps x 2 micro-batches x 3 samples
    assert last == pytest.approx(zero["fabric"][0])
    assert "device/items_per_sec" in last and "device/mfu" not in last
    assert ("items_per_sec" in last) == (world_size > 1)
    if world_size > 1:
        assert last["samples_per_sec"] == pytest.approx(world_size * last["device/samples_per_sec"])
    assert zero["mfu"]["device/mfu"] == pytest.approx(0.25)  # 1e9 FLOPs a second of a 4e9 peak
    assert any("No peak FLOPs are known for a 'cpu' device" in m for m in zero["no_peak"])
    for other in results[1:]:
        assert other["rows"] == [] and other["computed"] == [{}] * 4 and other["mfu"] == {}
        assert other["no_peak"] == []  # the warning is rank 0's


def test_monitor_on_one_process():
    _check_monitor([_monitor_body(0, 1)], 1)


def test_monitor_on_two_ranks():
    _check_monitor(run_ranks(_monitor_body, 2, timeout=120), 2)


def test_monitor_refuses_what_is_not_a_loom():
    with pytest.raises(ValueError, match="takes a torchloom `Loom`"):
        ThroughputMonitor(object())


def _litgpt_loop(monitor) -> None:
    """litgpt's pattern with fake times: update with running totals after each step, then compute_and_log."""
    lengths = 0
    for iteration in range(1, 7):
        lengths += 3 * (2 + iteration)  # 3 sequences, growing lengths
        monitor.update(
            time=iteration + 0.5, batches=iteration, samples=3 * iteration, lengths=lengths, flops=10
        )
        monitor.compute_and_log()


@pytest.mark.parametrize("separator", ["/", "|"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_monitor_logs_what_fabrics_logs(separator, world_size):
    from unittest import mock

    from lightning.fabric import Fabric

    fabric_logger = mock.Mock()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=fabric_logger)
    ours_logger = _Capture()
    loom = Loom(accelerator="cpu", loggers=ours_logger)
    with (
        mock.patch("lightning.fabric.utilities.throughput.get_available_flops", return_value=100),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        theirs = fabric_tp.ThroughputMonitor(fabric, window_size=4, separator=separator)
        ours = ThroughputMonitor(loom, window_size=4, separator=separator, available_flops=100)
    theirs.world_size = ours.world_size = world_size  # as Fabric's own test simulates 2 devices
    _litgpt_loop(theirs)
    _litgpt_loop(ours)
    expected = [(c.kwargs["step"], c.kwargs["metrics"]) for c in fabric_logger.log_metrics.mock_calls]
    assert len(expected) == 6 and ours_logger.rows == expected
    assert f"device{separator}mfu" in expected[-1][1]
