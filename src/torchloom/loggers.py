"""Metric loggers for `Loom(loggers=[...])`. `loom.log`/`loom.log_dict` write through them on rank 0 only."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import torch


class Logger:
    """Base class: receives metrics from rank 0."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        raise NotImplementedError

    def finalize(self) -> None:
        """Flush and close; called by `loom.finalize_loggers()` and at interpreter exit."""


class CSVLogger(Logger):
    """Appends rows to `<root_dir>/<name>/metrics.csv`, with no dependency beyond the standard library.

    Columns are `step` plus every metric name seen so far; a row has empty cells for metrics not logged at that
    step. When a new metric name appears, the file is rewritten with the wider header. With `append=True` an
    existing file is continued (a resumed run); otherwise it is replaced."""

    def __init__(
        self, root_dir: str | os.PathLike[str] = "runs", name: str = "torchloom", append: bool = False
    ) -> None:
        self.log_dir = Path(root_dir) / name
        self.path = self.log_dir / "metrics.csv"
        self._columns: list[str] = ["step"]
        self._rows: list[dict[str, Any]] = []
        if append and self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self._columns = list(reader.fieldnames or ["step"])
                self._rows = list(reader)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = {"step": step if step is not None else len(self._rows), **metrics}
        self._rows.append(row)
        new = [k for k in metrics if k not in self._columns]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if new or len(self._rows) == 1:
            self._columns += new
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._columns).writerow(row)

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._columns)
            writer.writeheader()
            writer.writerows(self._rows)
        os.replace(tmp, self.path)


class TensorBoardLogger(Logger):
    """Writes scalars with `torch.utils.tensorboard` (needs `pip install torchloom[tensorboard]`)."""

    def __init__(self, root_dir: str | os.PathLike[str] = "runs", name: str = "torchloom") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # tensorboard itself is missing
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package: pip install 'torchloom[tensorboard]'."
            ) from error
        self.log_dir = Path(root_dir) / name
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._step = 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        step = self._step if step is None else step
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._step = step + 1

    def finalize(self) -> None:
        self._writer.flush()
        self._writer.close()


def to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"loom.log needs a scalar; got a tensor of shape {tuple(value.shape)}. Reduce it first (e.g. "
                "tensor.mean()), or log each element under its own name."
            )
        return float(value.detach().item())
    return float(value)
