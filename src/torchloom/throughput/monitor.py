"""`Throughput` and `ThroughputMonitor`: Fabric's rolling-window throughput metrics, with Fabric's names, keys and
arithmetic, so a Fabric script that logs them runs with only its import changed.

Every rate is computed over the last `window_size` calls to `update` (the difference between the newest and the
oldest value in the window, divided by the time between them), and appears only once the window is full. Global
rates are the device rate times the world size: they assume every rank processes as much as rank 0 (as Fabric
does); for uneven ranks, reduce the counts yourself and use `Throughput(world_size=1)`.
"""

from __future__ import annotations

from collections import deque
from typing import Any, TypeVar

import torch

from torchloom.errors import MisuseValueError
from torchloom.throughput.flops import _warn_rank_zero, get_available_flops

_THROUGHPUT_METRICS = dict[str, int | float]

_T = TypeVar("_T", int, float)


class _MonotonicWindow(list[_T]):
    """The last `maxlen` values of a counter that must strictly increase: a timer or a counter that goes back (a
    reset clock, a per-step count given where a running total belongs) would make every rate silently wrong."""

    def __init__(self, maxlen: int) -> None:
        super().__init__()
        self.maxlen = maxlen

    def append(self, value: _T) -> None:
        if self and self[-1] >= value:
            raise ValueError(
                f"Expected the value to increase, last: {self[-1]}, current: {value}. `Throughput.update` takes "
                "running totals (elapsed time, batches, samples, lengths since the start), not per-step amounts."
            )
        list.append(self, value)
        if len(self) > self.maxlen:
            del self[0]

    def __setitem__(self, key: Any, value: Any) -> None:
        raise NotImplementedError("a monotonic window is only appended to")


class Throughput:
    """Throughput metrics over a rolling window of `update` calls (the API of Fabric's `Throughput`).

    Keys of `compute()` (with the default `separator="/"`):

    | key | value |
    |---|---|
    | `time`, `batches`, `samples`, `lengths` | the latest running totals given to `update` (`lengths` if given) |
    | `device/batches_per_sec`, `device/samples_per_sec` | per-device rates over the window |
    | `device/items_per_sec` | per-device items (e.g. tokens, padding included) per second, when `lengths` given |
    | `device/flops_per_sec` | per-device FLOPs per second, when `flops` given |
    | `device/mfu` | `device/flops_per_sec` over `available_flops`, when both are known |
    | `batches_per_sec`, `samples_per_sec`, `items_per_sec`, `flops_per_sec` | global rates, when `world_size > 1` |

    Args:
        available_flops: peak FLOPs of one device (`get_available_flops`), for MFU. Dense peak: pass
            `using_sparse_model=True` for a model that uses 2:4 structured sparsity.
        world_size: the number of devices; global rates are device rates times this.
        window_size: how many `update` calls a rate spans (at least 2).
        separator: between `device` and the metric name.
        using_sparse_model: `True` multiplies `available_flops` by `sparse_cuda_acceleration_factor`; `None`
            (default) assumes a dense model and says so once; `False` assumes it silently.
        sparse_cuda_acceleration_factor: the speed-up structured sparsity gives the peak (2 for NVIDIA 2:4).
    """

    def __init__(
        self,
        available_flops: float | None = None,
        world_size: int = 1,
        window_size: int = 100,
        separator: str = "/",
        using_sparse_model: bool | None = None,
        sparse_cuda_acceleration_factor: float = 2.0,
    ) -> None:
        if sparse_cuda_acceleration_factor < 1.0:
            raise MisuseValueError(
                f"sparse_cuda_acceleration_factor={sparse_cuda_acceleration_factor}: sparsity cannot lower the "
                "peak FLOPs; give a factor of at least 1 (2.0 for NVIDIA 2:4 sparsity)."
            )
        if world_size < 1:
            raise MisuseValueError(f"world_size={world_size}: give the number of devices, at least 1.")
        if window_size < 2:
            raise MisuseValueError(
                f"window_size={window_size}: a rate needs two updates to difference; give at least 2."
            )
        if using_sparse_model is None and available_flops is not None:
            _warn_rank_zero(
                "MFU assumes dense model FLOPs (no sparsity acceleration). Set 'using_sparse_model=True' for MFU "
                "to use sparse FLOPs (or False to silence this)."
            )
        if using_sparse_model and available_flops is not None:
            available_flops = available_flops * sparse_cuda_acceleration_factor
        self.available_flops = available_flops
        self.world_size = world_size
        self.separator = separator
        self._time: _MonotonicWindow[float] = _MonotonicWindow(window_size)
        self._batches: _MonotonicWindow[int] = _MonotonicWindow(window_size)
        self._samples: _MonotonicWindow[int] = _MonotonicWindow(window_size)
        self._lengths: _MonotonicWindow[int] = _MonotonicWindow(window_size)
        # FLOPs are per update (not running totals), already multiplied by the world size
        self._flops: deque[float] = deque(maxlen=window_size)

    def update(
        self,
        *,
        time: float,
        batches: int,
        samples: int,
        lengths: int | None = None,
        flops: float | None = None,
    ) -> None:
        """Record the running totals of this device: `time` (seconds since the start), `batches`, `samples` and
        optionally `lengths` (items, e.g. tokens) seen so far; `flops` done since the previous `update`
        (`measure_flops(...)` times the batches in between). On a GPU, synchronise before reading the clock."""
        if samples < batches:
            raise ValueError(f"Expected samples ({samples}) to be greater or equal than batches ({batches})")
        if lengths is not None and lengths < samples:
            raise ValueError(f"Expected lengths ({lengths}) to be greater or equal than samples ({samples})")
        self._time.append(time)
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            self._lengths.append(lengths)
            if len(self._lengths) != len(self._samples):
                raise RuntimeError(
                    f"If lengths are passed ({len(self._lengths)}), there needs to be the same number of samples"
                    f" ({len(self._samples)}): pass `lengths` in every `update` or in none."
                )
        if flops is not None:
            self._flops.append(flops * self.world_size)

    def compute(self) -> _THROUGHPUT_METRICS:
        """The metrics (see the class's table); rates appear once `window_size` updates were made."""
        sep = self.separator
        metrics: _THROUGHPUT_METRICS = {
            "time": self._time[-1],
            "batches": self._batches[-1],
            "samples": self._samples[-1],
        }
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        many = self.world_size > 1
        elapsed = self._time[-1] - self._time[0]
        if len(self._time) == self._time.maxlen:
            batch_rate = (self._batches[-1] - self._batches[0]) / elapsed
            sample_rate = (self._samples[-1] - self._samples[0]) / elapsed
            metrics[f"device{sep}batches_per_sec"] = batch_rate
            metrics[f"device{sep}samples_per_sec"] = sample_rate
            if many:
                metrics["batches_per_sec"] = batch_rate * self.world_size
                metrics["samples_per_sec"] = sample_rate * self.world_size
            if len(self._lengths) == self._lengths.maxlen:
                item_rate = (self._lengths[-1] - self._lengths[0]) / elapsed
                metrics[f"device{sep}items_per_sec"] = item_rate
                if many:
                    metrics["items_per_sec"] = item_rate * self.world_size
        if len(self._flops) == self._flops.maxlen:
            # the oldest entry is the work done before the window's first time stamp
            flops_rate = (sum(self._flops) - self._flops[0]) / elapsed
            if many:
                metrics["flops_per_sec"] = flops_rate
            metrics[f"device{sep}flops_per_sec"] = flops_rate / self.world_size
            if self.available_flops:
                metrics[f"device{sep}mfu"] = flops_rate / self.world_size / self.available_flops
        return metrics

    def reset(self) -> None:
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


def _compute_dtype(loom: Any) -> torch.dtype:
    """The dtype the matmuls of `loom`'s precision run in: the autocast dtype, else the parameters' dtype."""
    precision = loom.strategy.precision
    return getattr(precision, "autocast_dtype", None) or getattr(precision, "param_dtype", torch.float32)


class ThroughputMonitor(Throughput):
    """`Throughput` that logs through `loom.log_dict` (Fabric's `ThroughputMonitor(fabric)`).

    `world_size` is the Loom's, `available_flops` the peak of its device in the dtype its precision computes in
    (`get_available_flops`; pass `available_flops=` to override, e.g. a measured CPU peak). Only global rank 0
    keeps the window: on the other ranks `update`, `compute`, `compute_and_log` and `reset` do nothing (and return
    `{}`), so every rank may call them. `compute_and_log(step=None)` logs at the next step (counting from 0)
    unless given one.
    """

    def __init__(self, loom: Any, **kwargs: Any) -> None:
        for needed in ("world_size", "device", "log_dict", "is_global_zero", "strategy"):
            if not hasattr(loom, needed):
                raise MisuseValueError(
                    f"ThroughputMonitor(loom) takes a torchloom `Loom`; got {type(loom).__name__}, which has no "
                    f"`{needed}`. For counts you log yourself, use `Throughput(...)`."
                )
        if "available_flops" not in kwargs:
            kwargs["available_flops"] = get_available_flops(loom.device, _compute_dtype(loom))
        kwargs.setdefault("world_size", loom.world_size)
        super().__init__(**kwargs)
        self._loom = loom
        self._active = bool(loom.is_global_zero)
        self.step = -1

    def update(self, **kwargs: Any) -> None:  # type: ignore[override]
        if self._active:
            super().update(**kwargs)

    def compute(self) -> _THROUGHPUT_METRICS:
        return super().compute() if self._active else {}

    def reset(self) -> None:
        if self._active:
            super().reset()

    def compute_and_log(self, step: int | None = None, **kwargs: Any) -> _THROUGHPUT_METRICS:
        """`compute()` and log the result with `loom.log_dict` at `step` (the previous step plus one if None)."""
        if not self._active:
            return {}
        self.step = self.step + 1 if step is None else step
        metrics = self.compute(**kwargs)
        self._loom.log_dict(metrics=metrics, step=self.step)
        return metrics
