"""Metric loggers for `Loom(loggers=[...])`, spelled as Lightning Fabric spells them.

`CSVLogger` and `TensorBoardLogger` write to `root_dir/name/version_N/` (N one past the highest existing
`version_*` directory, or the `version=` given). Only global rank 0 writes anything, and nothing is created before
the first write: constructing a logger touches no file, so a process that only launches ranks creates nothing.
`loom.log`/`loom.log_dict` call the loggers on rank 0 only; calling a logger yourself on another rank is harmless.
"""

from __future__ import annotations

import atexit
import csv
import dataclasses
import enum
import inspect
import json
import math
import os
import re
import warnings
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchloom.environments import detect_environment


def mark_launching_process(loggers: list[Any]) -> None:
    """Called by `Loom` in a process that starts local ranks and is not one of them (a plain `python train.py`
    with `devices=2`): its loggers write nothing there, or it would take `version_0` before rank 0 does. The mark
    is not pickled, so the copies that `loom.launch(fn)` sends to the ranks write as usual."""
    for logger in loggers:
        if isinstance(logger, _VersionedLogger):
            logger._in_launching_process = True


def _this_rank() -> int:
    """This process's global rank: the process group's, else the one its launcher gave it."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # torchrun / `torchloom run` / `loom.launch()` ranks (RANK), SLURM tasks (SLURM_PROCID), else one process (0).
    return detect_environment(1, 1).global_rank()


class Logger:
    """Base class of the loggers `Loom(loggers=...)` takes; `loom.log` calls `log_metrics` on rank 0.

    A subclass needs only `log_metrics`; the rest have harmless defaults, as in Fabric's `Logger`."""

    group_separator = "/"

    @property
    def name(self) -> str | None:
        """The experiment's name (None by default)."""
        return None

    @property
    def version(self) -> int | str | None:
        """The run's version (None by default)."""
        return None

    @property
    def root_dir(self) -> str | None:
        """The directory the logger writes under (None by default)."""
        return None

    @property
    def log_dir(self) -> str | None:
        """The directory of this run's files (None by default)."""
        return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Record scalar `metrics` at `step`; the one method a subclass must implement."""
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Record the run's hyperparameters; raises `NotImplementedError` unless a subclass implements it."""
        raise NotImplementedError(f"{type(self).__name__} does not record hyperparameters.")

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Record the model's graph (where the logger can); does nothing by default."""

    def save(self) -> None:
        """Write what is buffered to disk."""

    def finalize(self, status: str = "success") -> None:
        """Flush and close; `loom.finalize_loggers()` calls it with "success"."""


class _NoOpExperiment:
    """What `.experiment` is on ranks other than 0: every method accepts anything and does nothing, so
    `logger.experiment.add_image(...)` may run on every rank."""

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return self._nothing

    def __getitem__(self, index: Any) -> _NoOpExperiment:
        return self

    def __setitem__(self, index: Any, value: Any) -> None:
        pass


class _VersionedLogger(Logger):
    """What both loggers share: the `root_dir/name/version_N` directory and the rank-0-only rule."""

    # Fabric joins a prefix and a metric name with "-".
    _PREFIX_JOIN = "-"

    def __init__(
        self, root_dir: str | os.PathLike[str], name: str | None, version: int | str | None, prefix: str
    ) -> None:
        self._root_dir = os.fspath(root_dir)
        self._name = name or ""
        self._version = version
        self._prefix = prefix
        self._warned_launcher = False
        self._in_launching_process = False
        self._experiment: Any = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        """The version given, else one past the highest `version_N` directory under `root_dir/name` when first
        asked. Each rank asks the disk on its own: on ranks other than 0, ask before rank 0 writes if you need the
        same number there."""
        if self._version is None:
            self._version = self._next_version()
        return self._version

    @property
    def root_dir(self) -> str:
        return self._root_dir

    @property
    def log_dir(self) -> str:
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        return os.path.join(self._root_dir, self._name, version)

    def _existing_versions(self) -> list[int]:
        parent = Path(self._root_dir, self._name)
        if not parent.is_dir():
            return []
        found = []
        for entry in parent.iterdir():
            number = entry.name.removeprefix("version_")
            if entry.is_dir() and entry.name.startswith("version_") and number.isdigit():
                found.append(int(number))
        return found

    def _next_version(self) -> int:
        return max(self._existing_versions(), default=-1) + 1

    def _writes_here(self) -> bool:
        if not self._in_launching_process:
            return _this_rank() == 0
        if not self._warned_launcher:
            self._warned_launcher = True
            warnings.warn(
                f"{type(self).__name__}: this process starts the ranks and is not one of them, so it writes no "
                "logs. Log after loom.launch() (which runs in the ranks), where rank 0 writes them.",
                stacklevel=3,
            )
        return False

    def __getstate__(self) -> dict[str, Any]:
        # `loom.launch(fn)` sends the Loom, loggers included, to the ranks: the writer (none exists before launch)
        # stays behind, and the ranks are not the launching process.
        state = self.__dict__.copy()
        state["_experiment"] = None
        state["_in_launching_process"] = False
        return state

    def _prefixed(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        if not self._prefix:
            return dict(metrics)
        return {f"{self._prefix}{self._PREFIX_JOIN}{key}": value for key, value in metrics.items()}


def to_scalar(value: Any) -> Any:
    """A logged value as a Python number: one-element tensors and NumPy scalars are `.item()`-ed (ints stay
    ints, as in Fabric), dicts keep their keys (TensorBoard draws them as one chart)."""
    if isinstance(value, Mapping):
        return {key: to_scalar(v) for key, v in value.items()}
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"loom.log needs a scalar; got a tensor of shape {tuple(value.shape)}. Reduce it first (e.g. "
                "tensor.mean()), or log each element under its own name."
            )
        return value.detach().item()
    if isinstance(value, (bool, int, float)):
        return value
    if hasattr(value, "item"):  # NumPy scalars
        return value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"cannot log {value!r} ({type(value).__name__}): log a number, a one-element tensor, or a dict of them "
            "(text and other objects go to logger.experiment, e.g. add_text on TensorBoard)."
        ) from None


# ---- CSV ---------------------------------------------------------------------------------------------------------
class _CSVWriter:
    """`CSVLogger.experiment`: buffers rows and writes `metrics.csv` (and `hparams.yaml`) in its directory.

    The header is every key seen so far, sorted (`step` among them), as Fabric writes it; when a new key appears
    the file is rewritten with the wider header (atomically: a crash leaves the old file or the new one)."""

    METRICS_FILE = "metrics.csv"
    HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str, append: bool) -> None:
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.METRICS_FILE)
        self.metrics: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = []
        self.hparams: dict[str, Any] = {}
        self.rows_logged = 0
        path = Path(self.metrics_file_path)
        if append and path.is_file():
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                self.metrics_keys = list(reader.fieldnames or [])
                self.rows_logged = sum(1 for _ in reader)
        elif path.is_file():
            # Only a metrics file is replaced: the folder may already hold other files of this run (the traces
            # `profile_steps` writes into `log_dir/profile` before the first metrics).
            warnings.warn(
                f"Experiment logs directory {log_dir} exists and is not empty; its {self.METRICS_FILE} is "
                "replaced by this run's (pass append=True to continue it, or another version=).",
                stacklevel=4,
            )
            path.unlink(missing_ok=True)
        os.makedirs(log_dir, exist_ok=True)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        row = {key: to_scalar(value) for key, value in metrics.items()}
        row["step"] = self.rows_logged if step is None else step
        self.metrics.append(row)
        self.rows_logged += 1

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        """Merge `params` into the recorded hyperparameters and rewrite `hparams.yaml`."""
        self.hparams.update(params)
        _write_yaml(os.path.join(self.log_dir, self.HPARAMS_FILE), self.hparams)

    def save(self) -> None:
        if not self.metrics:
            return
        new = sorted(set().union(*self.metrics) - set(self.metrics_keys))
        exists = os.path.isfile(self.metrics_file_path)
        self.metrics_keys = sorted(self.metrics_keys + new)
        if new and exists:
            with open(self.metrics_file_path, newline="") as f:
                old_rows = list(csv.DictReader(f))
            self._write("w", old_rows + self.metrics)
        else:
            self._write("a" if exists else "w", self.metrics)
        self.metrics = []

    def _write(self, mode: str, rows: list[dict[str, Any]]) -> None:
        target = self.metrics_file_path if mode == "a" else self.metrics_file_path + ".tmp"
        with open(target, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)
        if mode == "w":
            os.replace(target, self.metrics_file_path)


class CSVLogger(_VersionedLogger):
    """Writes `root_dir/name/version_N/metrics.csv` (and `hparams.yaml`), needing nothing beyond the standard
    library. Fabric's arguments and file format.

    Args:
        root_dir: the directory holding every experiment.
        name: the experiment's directory under `root_dir` ("" or None: none).
        version: an int gives `version_<int>`, a string is the directory's name as is; None takes one past the
            highest existing `version_N`.
        prefix: put before every metric name, joined with "-".
        flush_logs_every_n_steps: rows are buffered and written when `(step + 1)` is a multiple of this, on
            `save()`, `finalize()` and at interpreter exit.
        append: torchloom's addition for resumed runs: continue the existing `metrics.csv` (by default the latest
            `version_N`) instead of replacing it.

    Only global rank 0 creates the directory and files, at its first write; `.experiment` is the writer there and
    a no-op object on the other ranks."""

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        append: bool = False,
    ) -> None:
        super().__init__(root_dir, name, version, prefix)
        if flush_logs_every_n_steps < 1:
            raise ValueError(f"flush_logs_every_n_steps must be at least 1, got {flush_logs_every_n_steps}.")
        self._flush_every = flush_logs_every_n_steps
        self._append = append

    def _next_version(self) -> int:
        if self._append:  # a resumed run continues the latest version
            return max(self._existing_versions(), default=0)
        return super()._next_version()

    @property
    def experiment(self) -> _CSVWriter | _NoOpExperiment:
        if not self._writes_here():
            return _NoOpExperiment()
        if self._experiment is None:
            self._experiment = _CSVWriter(self.log_dir, self._append)
            _flush_at_exit(self._experiment)
        return self._experiment

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if not self._writes_here():
            return
        writer = self.experiment
        assert isinstance(writer, _CSVWriter)
        writer.log_metrics(self._prefixed(metrics), step)
        logged_step = writer.metrics[-1]["step"]
        if (logged_step + 1) % self._flush_every == 0:
            self.save()

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Write `params` to `hparams.yaml` in `log_dir` (merged with earlier calls). Fabric's CSVLogger raises
        NotImplementedError here; this writes what Lightning's Trainer `CSVLogger` writes."""
        if self._writes_here():
            writer = self.experiment
            assert isinstance(writer, _CSVWriter)
            writer.log_hparams(vars(params) if isinstance(params, Namespace) else dict(params))

    def save(self) -> None:
        if self._experiment is not None and self._writes_here():
            self._experiment.save()

    def finalize(self, status: str = "success") -> None:
        self.save()


# Every CSV writer of this process (rank 0 only), held until exit: rows buffered since the last flush are written
# then, even when the script never calls finalize() or dropped its logger.
_writers: list[_CSVWriter] = []


def _flush_at_exit(writer: _CSVWriter) -> None:
    if not _writers:
        atexit.register(_flush_writers)
    _writers.append(writer)


def _flush_writers() -> None:
    for writer in _writers:
        writer.save()


def _yaml_scalar(value: Any) -> str:
    """One value in YAML (1.1, what PyYAML reads) without depending on a YAML package."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        if "e" in text and "." not in text.split("e")[0]:  # YAML 1.1 floats need a dot: 1e-05 -> 1.0e-05
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent}"
        return text
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_yaml_key(k)}: {_yaml_scalar(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_scalar(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid double-quoted YAML string


def _yaml_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Namespace):
        return vars(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


# Keys written without quotes: names that YAML 1.1 reads back as the same string (not as true, null, 1.5, ...).
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def _yaml_key(key: Any) -> str:
    key = str(key)
    plain = _PLAIN_KEY.fullmatch(key) and key.lower() not in _YAML_WORDS
    return key if plain else _yaml_scalar(key)


def _write_yaml(path: str, params: Mapping[str, Any]) -> None:
    lines = [f"{_yaml_key(key)}: {_yaml_scalar(_yaml_value(value))}" for key, value in params.items()]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


# ---- TensorBoard -------------------------------------------------------------------------------------------------
def _require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "TensorBoardLogger needs the tensorboard package: pip install 'torchloom[tensorboard]'."
        ) from error


def _flatten(params: Mapping[str, Any], parent: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a/b": 1}`: TensorBoard's hyperparameter table is flat."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else str(key)
        value = _yaml_value(value)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


class TensorBoardLogger(_VersionedLogger):
    """Writes TensorBoard event files to `root_dir/name/version_N[/sub_dir]` with `torch.utils.tensorboard`
    (needs `pip install torchloom[tensorboard]`). Fabric's arguments; `**kwargs` go to `SummaryWriter`
    (e.g. `flush_secs`, `max_queue`).

    Only global rank 0 creates the `SummaryWriter`, at its first use; `.experiment` is that writer there and a
    no-op object elsewhere. A call without `step` uses the step after the last one logged (Fabric leaves it to
    the writer, which puts every such point at step 0)."""

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        _require_tensorboard()
        super().__init__(root_dir, name, version, prefix)
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._default_hp_metric = default_hp_metric
        self._kwargs = kwargs
        self._next_step = 0

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    @property
    def log_dir(self) -> str:
        path = super().log_dir
        if self._sub_dir is not None:
            path = os.path.join(path, self._sub_dir)
        return os.path.expanduser(os.path.expandvars(path))

    @property
    def experiment(self) -> Any:
        """The `torch.utils.tensorboard.SummaryWriter` on rank 0; a no-op object on the other ranks."""
        if not self._writes_here():
            return _NoOpExperiment()
        if self._experiment is None:
            from torch.utils.tensorboard import SummaryWriter

            self._experiment = SummaryWriter(log_dir=self.log_dir, **self._kwargs)
        return self._experiment

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if not self._writes_here():
            return
        step = self._next_step if step is None else step
        for name, value in self._prefixed(metrics).items():
            value = to_scalar(value)
            if isinstance(value, dict):
                self.experiment.add_scalars(name, value, step)
            else:
                self.experiment.add_scalar(name, value, step)
        self._next_step = step + 1

    def log_hyperparams(
        self,
        params: dict[str, Any] | Namespace,
        metrics: dict[str, Any] | float | None = None,
        step: int | None = None,
    ) -> None:
        """Record hyperparameters for TensorBoard's HPARAMS tab, with `metrics` (a dict, or one number under
        `hp_metric`; without it `hp_metric=-1` unless `default_hp_metric=False`, in which case nothing is
        written)."""
        if not self._writes_here():
            return
        flat = _flatten(vars(params) if isinstance(params, Namespace) else dict(params))
        # The hparams summary takes numbers, strings and booleans; anything else is shown as its text.
        flat = {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in flat.items()}
        if metrics is None:
            metrics = {"hp_metric": -1} if self._default_hp_metric else None
        elif not isinstance(metrics, dict):
            metrics = {"hp_metric": metrics}
        if not metrics:
            return
        self.log_metrics(metrics, step)
        from torch.utils.tensorboard.summary import hparams

        file_writer = self.experiment._get_file_writer()
        for summary in hparams(flat, metrics):
            file_writer.add_summary(summary, step)

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Add the model's graph, traced with `input_array` (or the model's `example_input_array`)."""
        if not self._writes_here():
            return
        module = getattr(model, "module", model)  # a LoomModule's own module
        input_array = getattr(module, "example_input_array", None) if input_array is None else input_array
        if input_array is None:
            warnings.warn(
                "TensorBoardLogger.log_graph: no input to trace the model with. Pass input_array= or set "
                "model.example_input_array.",
                stacklevel=2,
            )
            return
        self.experiment.add_graph(module, input_array)

    def save(self) -> None:
        if self._experiment is not None and self._writes_here():
            self._experiment.flush()

    def finalize(self, status: str = "success") -> None:
        if self._experiment is not None and self._writes_here():
            self._experiment.flush()
            self._experiment.close()


def finalize_logger(logger: Any, status: str = "success") -> None:
    """Call `logger.finalize`, with `status` where it takes one (Fabric's loggers do; a torchloom `Logger`
    subclass written before it did may not)."""
    try:
        parameters = inspect.signature(logger.finalize).parameters
    except (TypeError, ValueError):
        parameters = {"status": None}  # type: ignore[assignment]
    if parameters:
        logger.finalize(status)
    else:
        logger.finalize()
