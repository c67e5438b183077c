"""What checkpointing needs from the rest of torchloom, declared: the package depends on these two protocols and
on nothing in `torchloom.strategies`, so a strategy and the checkpoint code can each change alone.

Every strategy satisfies `StateAccess`; its precision satisfies `ScalerState`. `tests/checkpointing/
test_checkpointer.py` checks both, runs a save and a load with every undeclared member hidden, and checks that no
import points the other way.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.optim import Optimizer


@runtime_checkable
class StateAccess(Protocol):
    """A layout's state dicts, and the ranks checkpoint I/O coordinates over.

    `full=True` asks for the full form (every tensor whole: what one file holds), `full=False` for the form
    ranks hold (DTensors for sharded layouts: what the sharded format writes); unsharded layouts have one form.
    """

    #: The strategy's registry name, recorded in the checkpoint's metadata.
    name: str

    @property
    def checkpoint_format(self) -> str:
        """The format a save writes: "full" (one file) or "sharded" (a directory)."""
        ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_distributed(self) -> bool: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def checkpoint_group(self) -> Any:
        """The process group DCP coordinates over (None in one process)."""
        ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def module_state_dict(self, module: nn.Module, full: bool = True) -> dict[str, Any]: ...

    def tied_weight_names(self) -> list[list[str]]:
        """The names of each weight that the layout holds as several tensors although the model ties them (a
        pipeline's copies of a weight tied across stages), which a file stores once. Ties the module itself
        holds as one tensor need not be listed: they are found by identity."""
        ...

    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True, full: bool = True
    ) -> Any: ...

    def optimizer_state_dict(
        self, module: nn.Module, optimizer: Optimizer, full: bool = True, template: bool = False
    ) -> dict[str, Any]: ...

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool = True
    ) -> None: ...


@runtime_checkable
class ScalerState(Protocol):
    """The precision's name and its loss scaler's state (an empty dict without a scaler)."""

    name: str

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
