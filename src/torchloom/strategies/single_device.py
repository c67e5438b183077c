"""One process on one device: no wrapping, no communication."""

from __future__ import annotations

from torchloom.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Train in this process on `loom.device`. What `strategy="auto"` picks for a single process."""

    name = "single_device"
