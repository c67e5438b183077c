"""Stand-in for learn2learn: Omniglot task sets, `OmniglotFC` and `MAML` only (see ../README.md)."""

from . import algorithms, vision  # noqa: F401
