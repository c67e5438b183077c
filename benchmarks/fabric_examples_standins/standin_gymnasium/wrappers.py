from __future__ import annotations

from typing import Any

import numpy as np


class RecordEpisodeStatistics:
    """Adds info["episode"] = {"r", "l"} (1-element arrays) when an episode ends."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.action_space, self.observation_space = env.action_space, env.observation_space
        self.episode_return, self.episode_length = 0.0, 0

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict]:
        self.episode_return, self.episode_length = 0.0, 0
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.episode_return += reward
        self.episode_length += 1
        if terminated or truncated:
            info = {
                **info,
                "episode": {"r": np.array([self.episode_return]), "l": np.array([self.episode_length])},
            }
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        self.env.close()


class RecordVideo:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("stand-in gymnasium: no video recording (run without --capture-video)")
