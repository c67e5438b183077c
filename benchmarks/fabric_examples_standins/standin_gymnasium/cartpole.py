"""CartPole-v1 with gymnasium's dynamics (Euler integration), termination thresholds and the 500-step limit."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .spaces import Box, Discrete


class CartPole:
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    theta_threshold = 12 * 2 * math.pi / 360
    x_threshold = 2.4
    max_episode_steps = 500

    def __init__(self) -> None:
        self.action_space = Discrete(2)
        self.observation_space = Box(-np.inf, np.inf, (4,))
        self.np_random = np.random.default_rng()
        self.state = np.zeros(4)
        self.steps = 0

    def reset(self, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
        self.state = self.np_random.uniform(-0.05, 0.05, size=(4,))
        self.steps = 0
        return self.state.astype(np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if int(action) == 1 else -self.force_mag
        total_mass = self.masspole + self.masscart
        polemass_length = self.masspole * self.length
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
        theta_acc = (self.gravity * sin - cos * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * cos**2 / total_mass)
        )
        x_acc = temp - polemass_length * theta_acc * cos / total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * x_acc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * theta_acc
        self.state = np.array([x, x_dot, theta, theta_dot])
        self.steps += 1
        terminated = bool(abs(x) > self.x_threshold or abs(theta) > self.theta_threshold)
        truncated = self.steps >= self.max_episode_steps
        return self.state.astype(np.float32), 1.0, terminated, truncated, {}

    def close(self) -> None:
        pass


def make(env_id: str, render_mode: Any = None, **_: Any) -> CartPole:
    if env_id != "CartPole-v1":
        raise NotImplementedError(f"stand-in gymnasium: only CartPole-v1, not {env_id!r}")
    return CartPole()
