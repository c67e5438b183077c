"""The checks around `loom.save`, a call every rank must make together: that every rank entered it
(`diagnostics.meet`), and a timeout or lost peer inside it restated as an error of the call, naming the fix."""

from __future__ import annotations

from datetime import timedelta

from torchloom import diagnostics
from torchloom.errors import CollectiveMismatchError, CollectiveTimeoutError, MisuseError


def meet(call: str, rank: int, timeout: timedelta) -> bool:
    """Before a call whose collectives every rank must join: check through the job's store that every rank
    is in it (see `diagnostics.meet`), so that a call made on some ranks only fails with an error naming it
    instead of gloo's abort (or NCCL's hang) in its first collective. True: every rank was seen in it."""
    fix = (
        f"Call loom.{call} on every rank at the same point: it is a collective that writes the checkpoint once "
        f"for all ranks (drop any `if loom.is_global_zero:` around it)."
    )
    try:
        return diagnostics.meet(call, timeout)
    except diagnostics.PeersElsewhere as error:
        raise MisuseError(
            f"loom.{call}() on rank {rank} waits for the other ranks, but they did not call it: {error}. {fix}"
        ) from None
    except diagnostics.PeersLate as error:
        where = f" ({error})" if str(error) else ""
        raise CollectiveTimeoutError(
            f"loom.{call}() on rank {rank} timed out waiting for the other ranks after {timeout}{where}. {fix}"
        ) from None


def save_failure(
    error: CollectiveTimeoutError | CollectiveMismatchError, met: bool, rank: int, timeout: timedelta
) -> Exception | None:
    """The error `loom.save` raises for `error` from inside it (`met`: every rank was seen entering it), or
    None to raise `error` itself."""
    if str(error).startswith("loom.save()"):
        return None  # from `meet`: it names the call already
    if met:
        # Every rank was seen entering this save: the call is right, and what parted the ranks is inside
        # it (the desync report's culprit says what: a rank still writing, or torchloom's own collectives).
        culprit = getattr(error, "culprit", None) or (
            "culprit: unknown (no desync report); unless a rank was still writing a large checkpoint, "
            "this is a torchloom bug: please report it"
        )
        failed = f"timed out after {timeout}" if isinstance(error, CollectiveTimeoutError) else "lost a peer"
        return type(error)(
            f"loom.save() on rank {rank} {failed} inside the save: every rank entered this "
            f"loom.save() together (checked as each entered), so none skipped it or called it alone. "
            f"{culprit}."
        )
    if isinstance(error, CollectiveMismatchError):
        return None
    # The collective that timed out is one inside save; what the user must change is the call to save.
    return CollectiveTimeoutError(
        f"loom.save() on rank {rank} timed out waiting for the other ranks. Every rank "
        "must call loom.save at the same point (not only rank 0: drop any `if loom.is_global_zero:` "
        f"around it; rank 0 alone writes the file). {error}"
    )
