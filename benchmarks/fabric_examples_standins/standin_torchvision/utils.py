"""`save_image` writes the tensor with torch.save (no image library needed)."""

from typing import Any

import torch


def save_image(tensor: torch.Tensor, fp: Any, **_: Any) -> None:
    torch.save(tensor.detach().cpu(), fp)
