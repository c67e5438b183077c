"""`torchloom.precision`: the loss scaler with several optimizers, against torch's own documented pattern."""

from __future__ import annotations

import torch
from torch import nn

from torchloom import Loom


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches() -> list[torch.Tensor]:
    return [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(5)]


def _reference(model: nn.Sequential, clip: bool) -> nn.Sequential:
    """torch's recipe for several optimizers: scale, backward, unscale each (to clip), step each, one update()."""
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.Adam(model[2].parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for x in _batches():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        for optimizer, params in ((first, model[0].parameters()), (second, model[2].parameters())):
            if clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, max_norm=0.05)
        scaler.step(first)
        scaler.step(second)
        scaler.update()
        first.zero_grad()
        second.zero_grad()
    return model


def _torchloom(model: nn.Sequential, clip: bool) -> nn.Sequential:
    loom = Loom(accelerator="cpu", precision="16-mixed")
    loom.strategy.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    wrapped = loom.setup_module(model)
    first, second = loom.setup_optimizers(
        torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.Adam(model[2].parameters(), lr=0.01)
    )
    for x in _batches():
        loom.backward(wrapped(x).float().pow(2).mean())
        if clip:
            loom.clip_gradients(wrapped, first, max_norm=0.05)
            loom.clip_gradients(wrapped, second, max_norm=0.05)
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    return model


def test_two_optimizers_under_16_mixed_follow_torchs_recipe():
    """Each optimizer unscales with the scale its loss was multiplied by, once: the scaler's update() waits for
    the next backward. It used to follow every step, so the second optimizer's clipped gradients were unscaled
    a second time (found by the scenario engine), and a scale that grew in between divided them again."""
    for clip in (False, True):
        ours, theirs = _torchloom(_model(), clip), _reference(_model(), clip)
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"clip={clip}")
