"""The exceptions torchloom raises. Each message says what went wrong and how to fix it."""

from __future__ import annotations


class TorchloomError(Exception):
    """Base class of every error torchloom raises on purpose."""


class ConfigurationError(TorchloomError, ValueError):
    """An argument to `Loom(...)` or a strategy is invalid or cannot run on this machine."""


class MisuseError(TorchloomError, RuntimeError):
    """An API was called in the wrong order or on the wrong object."""


class CheckpointError(TorchloomError, RuntimeError):
    """A checkpoint cannot be written or read back as asked."""


class LaunchError(TorchloomError, RuntimeError):
    """One or more ranks failed; the message names the first failing rank and shows its traceback."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class CollectiveTimeoutError(TorchloomError, TimeoutError):
    """A collective waited longer than `Loom(timeout=...)` for the other ranks."""


class CollectiveMismatchError(TorchloomError, RuntimeError):
    """Ranks called different collectives, or passed different shapes to one; the message names the culprit."""
