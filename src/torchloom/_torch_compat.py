"""Every private PyTorch API torchloom relies on, in one place.

Each accessor checks that the API still exists and fails loudly, naming the torch version, when a torch upgrade
renamed or removed it; `tests/test_torch_compat.py` checks each one against the installed torch. Nothing else in
torchloom reaches into torch's private names.
"""

from __future__ import annotations

from typing import Any

import torch


class TorchAPIMissing(RuntimeError):
    """A private torch API torchloom needs is not there in the installed torch."""


def _missing(what: str, where: str) -> TorchAPIMissing:
    return TorchAPIMissing(
        f"torchloom needs {what} ({where}), which torch {torch.__version__} does not have. This torch version is "
        "not supported yet: install a torch version the README lists as tested, or report it."
    )


def grad_scaler_optimizer_state(scaler: torch.amp.GradScaler, optimizer: Any) -> dict[str, Any]:
    """The scaler's per-optimizer record: {"stage": OptState, "found_inf_per_device": {device: tensor}}."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _missing("GradScaler._per_optimizer_states", "torch.amp.grad_scaler")
    state = states[id(optimizer)]
    if "stage" not in state or "found_inf_per_device" not in state:
        raise _missing(
            "the 'stage' and 'found_inf_per_device' entries of GradScaler's per-optimizer state",
            "torch.amp.grad_scaler",
        )
    return state
