"""`loom.progress(...)`: a progress bar on rank 0 (tqdm), a plain iterator everywhere else. The bar shows the
throughput: tokens per second when the batches it yields hold token ids (an integer tensor of 2 or more
dimensions), samples per second otherwise, or what `count(...)` reports."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

_WINDOW = 20  # updates a displayed rate spans: recent enough to follow a change, long enough not to flicker


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _batch_items(batch: Any) -> tuple[str, int] | None:
    """("tok", token count) for a batch whose first tensor (`input_ids` first in a mapping) holds integer ids in
    2 or more dimensions, ("samples", its length) for another tensor, None without a tensor."""
    import torch

    def first(value: Any) -> torch.Tensor | None:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, Mapping):
            values = [value["input_ids"], *value.values()] if "input_ids" in value else list(value.values())
            return next((t for t in map(first, values) if t is not None), None)
        if isinstance(value, (list, tuple)):
            return next((t for t in map(first, value) if t is not None), None)
        return None

    tensor = first(batch)
    if tensor is None or tensor.dim() == 0:
        return None
    if (
        tensor.dim() >= 2
        and not tensor.is_floating_point()
        and not tensor.is_complex()
        and tensor.dtype is not torch.bool
    ):
        return "tok", tensor.numel()
    return "samples", int(tensor.shape[0])


def _short(value: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


class Progress:
    """Iterates `iterable`; `set_postfix(loss=..., ...)` shows values on the bar. Without a bar (other ranks,
    output not a terminal) it is a plain iterator whose `set_postfix` and `count` do nothing.

    The throughput shown is global: the batches this rank yields times the world size (every rank reads as much
    as rank 0, as with a set-up loader). `count(n, unit="tok")` reports `n` items (already global) done since
    the last call instead, for a loop whose bar iterates steps rather than batches."""

    def __init__(
        self,
        iterable: Iterable[Any],
        total: int | None,
        desc: str | None,
        show_bar: bool,
        is_global_zero: bool,
    ) -> None:
        self._iterable = iterable
        self._bar = None
        self._speaks = is_global_zero
        self._postfix: dict[str, Any] = {}
        self._times: deque[tuple[float, float]] = deque(maxlen=_WINDOW)
        self._done = 0.0
        self._counted = False
        if show_bar and is_global_zero:
            from tqdm.auto import tqdm

            self._bar = tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)

    @property
    def enabled(self) -> bool:
        return self._bar is not None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable) if self._bar is None else self._counting(self._bar)

    def _counting(self, bar: Iterable[Any]) -> Iterator[Any]:
        scale = _world_size()
        pending: tuple[str, int] | None = None
        self._times.append((time.perf_counter(), 0.0))
        for item in bar:
            if (
                pending is not None and not self._counted
            ):  # the previous batch is done when the next is asked for
                self._advance(pending[1] * scale, pending[0])
            pending = _batch_items(item)
            yield item

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def count(self, items: float, unit: str = "tok") -> None:
        """Report `items` (global: all ranks together) processed since the last call; the bar shows `unit`/s."""
        if self._bar is not None:
            self._counted = True
            if not self._times:
                self._times.append((time.perf_counter(), 0.0))
            self._advance(items, unit)

    def _advance(self, items: float, unit: str) -> None:
        self._done += items
        now = time.perf_counter()
        self._times.append((now, self._done))
        then, done_then = self._times[0]
        if now > then:
            self._postfix[f"{unit}/s"] = _short((self._done - done_then) / (now - then))
            self._show(refresh=False)

    def _show(self, refresh: bool = True) -> None:
        assert self._bar is not None
        self._bar.set_postfix(self._postfix, refresh=refresh)

    def set_postfix(self, **values: Any) -> None:
        if self._bar is not None:
            self._postfix.update({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in values.items()})
            self._show()

    def write(self, message: str) -> None:
        """Print a line (rank 0 only) without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message)
        elif self._speaks:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
