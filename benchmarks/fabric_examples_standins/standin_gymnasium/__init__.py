"""Stand-in for gymnasium: CartPole-v1, `spaces.Discrete`/`Box`, `vector.SyncVectorEnv` (gymnasium 0.29's
autoreset and `final_info`), `wrappers.RecordEpisodeStatistics` (see ../README.md)."""

from . import spaces, vector, wrappers  # noqa: F401
from .cartpole import make  # noqa: F401
