"""The random generators a drawn order comes from: their states captured just before a sampler draws a pass's
order, and restored to draw the same order again on a resumed pass (see `torchloom.data.order`)."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from typing import Any, cast

import torch

from torchloom.errors import CheckpointError


def own_generator(sampler: Any) -> Any:
    """The generator of its own a sampler draws from (its `generator`), if any."""
    generator = getattr(sampler, "generator", None)
    return None if generator is torch.default_generator else generator


def capture(own: Any) -> dict[str, torch.Tensor]:
    """The states of torch's, Python's and NumPy's global generators (and of `own`, a torch.Generator), as
    tensors (a checkpoint of any format holds them)."""
    version, internal, gauss = random.getstate()
    states = {
        "torch": torch.default_generator.get_state(),
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor(math.nan if gauss is None else gauss, dtype=torch.float64),
    }
    try:
        import numpy
    except ImportError:
        numpy = None  # type: ignore[assignment]
    if numpy is not None:
        # The legacy tuple (get_state's default) of the MT19937 generator behind numpy.random's functions.
        _, keys, pos, has_gauss, cached = cast("tuple[Any, ...]", numpy.random.get_state())
        states["numpy"] = torch.from_numpy(keys.astype(numpy.int64))
        states["numpy_rest"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    if isinstance(own, torch.Generator):
        states["own"] = own.get_state()
    return states


def restore(states: dict[str, torch.Tensor], own: Any) -> None:
    torch.default_generator.set_state(states["torch"])
    python = states["python"].tolist()
    gauss = float(states["python_gauss"])
    random.setstate((python[0], tuple(python[1:]), None if math.isnan(gauss) else gauss))
    if "numpy" in states:
        import numpy

        pos, has_gauss, cached = states["numpy_rest"].tolist()
        numpy.random.set_state(
            ("MT19937", states["numpy"].numpy().astype(numpy.uint32), int(pos), int(has_gauss), cached)
        )
    if "own" in states:
        own.set_state(states["own"])


@contextlib.contextmanager
def replaying(states: dict[str, torch.Tensor], own: Any) -> Iterator[None]:
    """The generators set to `states` inside; the global ones back as they were on leaving (the sampler's own
    generator stays where the replayed draw left it, as the interrupted pass left it)."""
    if "own" in states and not isinstance(own, torch.Generator):
        raise CheckpointError(
            "The checkpoint holds the state of the loader's sampler's own generator, but this loader's sampler "
            f"({type(own).__name__} generator) has no torch.Generator. Build the sampler as the saved run did "
            "(with generator=...)."
        )
    before = capture(None)
    restore(states, own)
    try:
        yield
    finally:
        restore(before, None)
