"""torchft, imported on demand: the `ft` extra is optional, and a job without replica groups never loads it."""

from __future__ import annotations

from types import ModuleType

from torchloom.errors import ConfigurationError


def require_torchft() -> ModuleType:
    """The `torchft` package, or a `ConfigurationError` naming the extra that installs it."""
    try:
        import torchft
    except ImportError as error:
        raise ConfigurationError(
            f"Replica groups (--replica-groups) need torchft, which is not installed ({error}). Install it with "
            "`pip install torchloom[ft]`."
        ) from None
    return torchft


def lighthouse_url(address: str) -> str:
    """torchft's form of a lighthouse address: `HOST:PORT` becomes `http://HOST:PORT`."""
    return address if "://" in address else f"http://{address}"
