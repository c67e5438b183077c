"""The exceptions torchloom raises. Each message says what went wrong and how to fix it."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn`, shown at the user's line: the first caller outside torchloom, however deep the call that
    warns sits (a fixed stacklevel points into torchloom whenever that depth differs between paths)."""
    frame: FrameType | None = sys._getframe(0)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class TorchloomError(Exception):
    """Base class of every error torchloom raises on purpose."""


class ConfigurationError(TorchloomError, ValueError):
    """An argument to `Loom(...)` or a strategy is invalid or cannot run on this machine."""


class MisuseError(TorchloomError, RuntimeError):
    """An API was called in the wrong order or on the wrong object."""


class MisuseTypeError(MisuseError, TypeError):
    """A `MisuseError` where Lightning Fabric raises `TypeError` for the same mistake, so `except TypeError` in code
    written for Fabric catches it too."""


class MisuseValueError(MisuseError, ValueError):
    """A `MisuseError` where Lightning Fabric raises `ValueError` for the same mistake (e.g. setting up twice)."""


class CheckpointError(TorchloomError, RuntimeError):
    """A checkpoint cannot be written or read back as asked."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path: a `CheckpointError` and, as in Fabric, a `FileNotFoundError`."""


class LaunchError(TorchloomError, RuntimeError):
    """One or more ranks failed; the message names the first failing rank and shows its traceback."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class CollectiveTimeoutError(TorchloomError, TimeoutError):
    """A collective waited longer than `Loom(timeout=...)` for the other ranks."""

    #: What parted the ranks, from the desync report, when the collective that failed knows it.
    culprit: str | None = None


class CollectiveMismatchError(TorchloomError, RuntimeError):
    """Ranks called different collectives, or passed different shapes to one; the message names the culprit."""

    #: What parted the ranks, from the desync report, when the collective that failed knows it.
    culprit: str | None = None


class RemoteError(TorchloomError):
    """An exception raised on another rank, carried over as its traceback text (exceptions do not always
    pickle): the cause of the error the other ranks raise for it, so every rank's traceback shows the real one."""

    def __init__(self, rank: int, traceback_text: str) -> None:
        super().__init__(f"raised on rank {rank}:\n{traceback_text.rstrip()}")
        self.rank = rank
        self.traceback_text = traceback_text


def describe_failure(message: str | None, exc: BaseException | None) -> tuple[str, str] | None:
    """What a rank sends the others about its failure: the message, and the traceback of `exc`."""
    if message is None:
        return None
    import traceback

    return message, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) if exc else ""


def raise_shared_failure(
    failure: tuple[str, str] | None, rank: int, own: BaseException | None, error: type[Exception]
) -> None:
    """Raise `error` for a failure every rank learnt of (`describe_failure` on rank `rank`): chained to the
    exception itself on the rank where it happened, to its traceback text (a `RemoteError`) elsewhere."""
    if failure is None:
        return
    message, traceback_text = failure
    if own is not None:
        raise error(message) from own
    raise error(message) from RemoteError(rank, traceback_text)
