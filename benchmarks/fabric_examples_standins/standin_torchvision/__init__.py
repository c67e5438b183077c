"""Stand-in for torchvision: only what Lightning's Fabric examples use (see ../README.md)."""

from . import datasets, transforms, utils  # noqa: F401
