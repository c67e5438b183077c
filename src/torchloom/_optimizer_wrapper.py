"""`LoomOptimizer`: what `setup_optimizers` returns, the user's optimizer with `step()` routed through the
precision and Fabric's `on_after_optimizer_step` hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

from torchloom._mixed_groups import _kinds_apart, _mixes_kinds
from torchloom.precision import Precision


class LoomOptimizer:
    """The user's optimizer with `step()` routed through the precision (fp16 loss scaling). After each step it
    calls `on_after_optimizer_step(strategy=..., optimizer=...)` on every callback that has it (Fabric's hook).

    It is an instance of the user's optimizer class (so LR schedulers accept it) and shares its parameter groups
    and state, so changes made through either object show in both.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        precision: Precision,
        strategy: Any = None,
        callbacks: list[Any] | tuple[Any, ...] = (),
    ) -> None:
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_precision"] = precision
        precision.track(optimizer)
        self.__dict__["_strategy"] = strategy
        # The Loom's own list, as Fabric shares its list: a callback registered later (a LightningModule set up
        # after this optimizer) gets this optimizer's hooks too.
        self.__dict__["_callbacks"] = callbacks if isinstance(callbacks, list) else list(callbacks)
        self.__class__ = type(f"Loom{type(optimizer).__name__}", (LoomOptimizer, type(optimizer)), {})

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    def before_first_step(self, check: Callable[[], None]) -> None:
        """Run `check` at the first `step()` (it raises to refuse the step)."""
        self.__dict__["_first_step_check"] = check

    def step(self, closure: Any = None) -> Any:
        check = self.__dict__.pop("_first_step_check", None)
        if check is not None:
            check()
        kwargs = {} if closure is None else {"closure": closure}
        replicas = getattr(self._strategy, "replicas", None)
        if replicas is not None and not replicas.should_commit(self._optimizer):
            # Fault tolerance: a replica group failed this step, which the survivors retry.
            self._precision.abandon_step(self._optimizer)
            return None
        with _kinds_apart(self._optimizer):
            output = self._precision.optimizer_step(self._optimizer, **kwargs)
        # Fabric's hook, called on every callback that has it after each step (skipped or not by the scaler).
        for callback in self._callbacks:
            hook = getattr(callback, "on_after_optimizer_step", None)
            if callable(hook):
                hook(strategy=self._strategy, optimizer=self._optimizer)
        return output

    def zero_grad(self, set_to_none: bool = True) -> None:
        defaults = self._optimizer.defaults
        if (
            set_to_none
            or not (defaults.get("foreach") or defaults.get("fused"))
            or not _mixes_kinds(self._optimizer)
        ):
            self._optimizer.zero_grad(set_to_none=set_to_none)
            return
        # torch zeroes the gradients of one device and dtype in one foreach call, across groups: mixed DTensor
        # and plain gradients fail there (see _kinds_apart). One tensor at a time instead, for this call.
        saved = {k: defaults[k] for k in ("foreach", "fused") if k in defaults}
        defaults.update(dict.fromkeys(saved, False))
        try:
            self._optimizer.zero_grad(set_to_none=False)
        finally:
            defaults.update(saved)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_optimizer"], name)

    def __repr__(self) -> str:
        return f"Loom{self._optimizer!r}"


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LoomOptimizer) else optimizer
