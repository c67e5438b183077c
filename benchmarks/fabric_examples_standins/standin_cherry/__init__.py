"""Stand-in for cherry-rl: `optim.Distributed` only (see ../README.md)."""

from . import optim  # noqa: F401
