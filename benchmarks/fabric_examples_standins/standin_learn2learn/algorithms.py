"""`MAML(model, lr, first_order)`: `clone()` gives a learner whose parameters are differentiable copies of the
model's; `adapt(loss)` takes one SGD step on them, keeping the graph (second order) unless `first_order`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call


class MAML(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        lr: float,
        first_order: bool = False,
        params: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.module = model
        self.lr = lr
        self.first_order = first_order
        self._fast = params

    def forward(self, *args: Any) -> Any:
        if self._fast is None:
            return self.module(*args)
        return functional_call(self.module, self._fast, args)

    def clone(self) -> MAML:
        fast = {name: p.clone() for name, p in self.module.named_parameters()}
        return MAML(self.module, self.lr, self.first_order, fast)

    def adapt(self, loss: torch.Tensor) -> None:
        assert self._fast is not None, "adapt() a clone(), as learn2learn's MAML is used"
        names = list(self._fast)
        grads = torch.autograd.grad(loss, [self._fast[n] for n in names], create_graph=not self.first_order)
        self._fast = {n: self._fast[n] - self.lr * g for n, g in zip(names, grads, strict=True)}
