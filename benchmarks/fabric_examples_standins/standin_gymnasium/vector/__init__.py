"""`SyncVectorEnv` with gymnasium 0.29's autoreset: a finished sub-environment is reset in the same `step`, its
last info goes to info["final_info"][i] (None for the others)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class SyncVectorEnv:
    def __init__(self, env_fns: list[Callable[[], Any]]) -> None:
        self.envs = [fn() for fn in env_fns]
        self.num_envs = len(self.envs)
        self.single_action_space = self.envs[0].action_space
        self.single_observation_space = self.envs[0].observation_space

    def reset(self, seed: int | None = None, **_: Any) -> tuple[np.ndarray, dict]:
        seeds = [None if seed is None else seed + i for i in range(self.num_envs)]
        return np.stack([env.reset(seed=s)[0] for env, s in zip(self.envs, seeds, strict=True)]), {}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        observations, rewards, terminateds, truncateds = [], [], [], []
        final_info: list[Any] = [None] * self.num_envs
        for i, (env, action) in enumerate(zip(self.envs, actions, strict=True)):
            obs, reward, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                final_info[i] = info
                obs, _ = env.reset()
            observations.append(obs)
            rewards.append(reward)
            terminateds.append(terminated)
            truncateds.append(truncated)
        infos: dict[str, Any] = {}
        if any(f is not None for f in final_info):
            infos["final_info"] = np.array(final_info, dtype=object)
            infos["_final_info"] = np.array([f is not None for f in final_info])
        return np.stack(observations), np.array(rewards), np.array(terminateds), np.array(truncateds), infos

    def close(self) -> None:
        for env in self.envs:
            env.close()
