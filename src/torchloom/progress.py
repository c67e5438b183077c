"""`loom.progress(...)`: a progress bar on rank 0 (tqdm), a plain iterator everywhere else."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any


class Progress:
    """Iterates `iterable`; `set_postfix(loss=..., ...)` shows values on the bar. Without a bar (other ranks,
    output not a terminal) it is a plain iterator whose `set_postfix` does nothing."""

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
        if show_bar and is_global_zero:
            from tqdm.auto import tqdm

            self._bar = tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)

    @property
    def enabled(self) -> bool:
        return self._bar is not None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._bar if self._bar is not None else self._iterable)

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def set_postfix(self, **values: Any) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in values.items()})

    def write(self, message: str) -> None:
        """Print a line (rank 0 only) without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message)
        elif self._speaks:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
