"""Precision: parameter dtype, autocast during forward, and loss scaling for fp16.

Strategies that own their own mixed precision (FSDP) read `param_dtype` / `reduce_dtype` from here instead of
using autocast; see the precision table in README.md.

Loss scaling: one process, and DDP (whose gradients are the same on every rank), use torch's `GradScaler`. Under
FSDP each rank holds only its shard of most gradients, so an inf can appear on one rank alone; `AgreedGradScaler`
takes the found-inf decision over all ranks, so every rank skips the same steps and lowers the scale together.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from torchloom import _torch_compat
from torchloom.errors import ConfigurationError, MisuseError

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")

_ALIASES = {
    "32": "32-true",
    "64": "64-true",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    32: "32-true",
    64: "64-true",
}


def _apply_to_floats(data: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nested structure to `dtype`."""

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and torch.is_floating_point(t) else t

    return torch.utils._pytree.tree_map(cast, data)


class AgreedGradScaler(torch.amp.GradScaler):
    """A GradScaler for sharded gradients: unscales the local pieces of DTensor gradients (FSDP2) next to plain
    ones (FSDP1 shards, replicated leftovers), and takes the found-inf decision over every rank of `group`.

    torch's own ShardedGradScaler does not fit: it hands DTensor and plain gradients of one device to a single
    fused kernel (which refuses the mix), and all-reduces one found-inf tensor per device, a collective whose count
    may differ between ranks (a rank without gradients on some device)."""

    def __init__(self, device: str = "cuda", group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        #: The ranks that must agree; None: all of them (the default group).
        self.group = group

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        # Master weights are fp32 under "16-mixed", so fp16 gradients are allowed as FSDP's own scaler allows them.
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if grad.is_sparse:  # as GradScaler does: check the coalesced values (duplicates summed)
                        param.grad = grad = grad.coalesce()
                    local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's own shard
                    if local.is_sparse:
                        local = local._values()
                    if local.numel():
                        by_kind.setdefault((local.device, local.dtype), []).append(local)
            found_on: dict[torch.device, torch.Tensor] = {found_inf.device: found_inf}
            for (device, _), tensors in by_kind.items():
                if device not in found_on:
                    found_on[device] = torch.zeros_like(found_inf, device=device)
                _torch_compat.unscale_and_check(tensors, found_on[device], inv_scale.to(device))
            for found in found_on.values():
                if found is not found_inf:
                    torch.maximum(found_inf, found.to(found_inf.device), out=found_inf)
        # Exactly one collective per unscale on every rank, even one that holds no gradient at all.
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        return {found_inf.device: found_inf}


class Precision:
    """One of the precision strings. `param_dtype` is the dtype parameters live in; `autocast_dtype` the dtype
    forward computes in (None: no autocast). `sharded_gradients`: a strategy whose ranks hold different pieces
    of the gradients (FSDP), which needs the loss scaler that agrees over ranks."""

    def __init__(self, name: str, device_type: str, sharded_gradients: bool = False) -> None:
        self.name = name
        self.device_type = device_type
        self.param_dtype: torch.dtype = {
            "32-true": torch.float32,
            "64-true": torch.float64,
            "bf16-true": torch.bfloat16,
            "16-true": torch.float16,
        }.get(name, torch.float32)
        self.autocast_dtype: torch.dtype | None = {
            "bf16-mixed": torch.bfloat16,
            "16-mixed": torch.float16,
        }.get(name)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self._scaler: torch.amp.GradScaler | None = None
        if name == "16-mixed":
            scaler_cls = AgreedGradScaler if sharded_gradients else torch.amp.GradScaler
            self._scaler = scaler_cls(device_type)
        # Loss-scaled backward passes so far, and their count at each optimizer's last step: a step with
        # gradients but no `loom.backward` since the last one means the loss skipped the scaler.
        self._scaled_backwards = 0
        # The scaler's update() after a step waits while another optimizer of this iteration has yet to step
        # (until its step, the next backward, or a checkpoint): every optimizer must unscale with the scale its
        # loss was multiplied by, and update() may change the scale and forgets which optimizers
        # clip_gradients unscaled already (torch's recipe: step every optimizer, then update once).
        self._update_pending = False
        self._optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._backwards_at_step: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        # `launch(fn)` pickles the Loom for its ranks; a weak dictionary does not pickle (and a rank starts afresh).
        state = dict(self.__dict__)
        state["_backwards_at_step"] = None
        state["_optimizers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._backwards_at_step = weakref.WeakKeyDictionary()
        self._optimizers = weakref.WeakSet()

    def track(self, optimizer: Optimizer) -> None:
        """Count `optimizer` (set up with this precision) among those one iteration may step."""
        self._optimizers.add(optimizer)

    def _others_to_step(self, optimizer: Optimizer) -> bool:
        """Whether another tracked optimizer is in this iteration and has not stepped: unscaled already, or
        holding gradients it may still step with."""
        for other in list(self._optimizers):
            if other is optimizer:
                continue
            stage = _torch_compat.grad_scaler_optimizer_state(self._scaler, other)["stage"].name
            if stage == "UNSCALED":
                return True
            if stage == "READY" and any(p.grad is not None for g in other.param_groups for p in g["params"]):
                return True
        return False

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (16-mixed; None otherwise), its update after the last step applied: what it reports
        (`get_scale()`) is the scale the next backward uses."""
        if self._scaler is not None:
            self._finish_update()
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        self._scaler = scaler
        self._update_pending = False

    @property
    def is_mixed(self) -> bool:
        return self.autocast_dtype is not None

    @contextlib.contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        """Create parameters directly in `param_dtype`, so a bf16-true model never exists in fp32."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.param_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.param_dtype != torch.float32:
            return module.to(self.param_dtype)
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            yield

    def convert_input(self, data: Any) -> Any:
        # "true" precisions run the whole forward in param_dtype, so float inputs must match it.
        if self.autocast_dtype is None and self.param_dtype != torch.float32:
            return _apply_to_floats(data, self.param_dtype)
        return data

    def convert_output(self, data: Any) -> Any:
        # Under autocast, outputs come back in half precision; losses and metrics are safer in fp32.
        if self.autocast_dtype is not None:
            return _apply_to_floats(data, torch.get_default_dtype())
        return data

    def _finish_update(self) -> None:
        if self._update_pending:
            self._update_pending = False
            self._scaler.update()

    def backward(self, tensor: torch.Tensor, **kwargs: Any) -> None:
        if self._scaler is not None:
            self._finish_update()
            tensor = self._scaler.scale(tensor)
            self._scaled_backwards += 1
        tensor.backward(**kwargs)

    def scale_for_backward(self, device: torch.device) -> Any:
        """For a backward that runs outside `loom.backward` (a pipeline schedule's, one per micro-batch, on the last
        stage only): counts one loss-scaled backward on this rank and returns the function that scales each
        loss (the identity without a scaler). Every rank makes the scale on `device`, also one whose stages
        compute no loss, so that its unscale finds it."""
        if self._scaler is None:
            return lambda loss: loss
        self._finish_update()
        self._scaled_backwards += 1
        self._scaler.scale(torch.zeros((), device=device))  # makes the scale on this rank (lazily created)
        return self._scaler.scale

    def _check_loss_was_scaled(self, optimizer: Optimizer, call: str) -> None:
        """Under loss scaling, refuse gradients that did not come through `loom.backward`: a plain
        `loss.backward()` leaves them unscaled, and the scaler would either fail with torch's "_scale is None" or
        divide true gradients by the scale."""
        if self._backwards_at_step.get(optimizer, 0) != self._scaled_backwards:
            return
        if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            return
        raise MisuseError(
            f"{call} found gradients that did not come from loom.backward(loss). Under precision={self.name!r} "
            "the loss must go through loom.backward(loss), which scales it before the backward pass (the loss "
            "scaler keeps fp16 gradients from underflowing): replace loss.backward() with loom.backward(loss)."
        )

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring fp16-scaled gradients back to true scale before clipping (once per step)."""
        if self._scaler is None:
            return
        self._check_loss_was_scaled(optimizer, "clip_gradients")
        state = _torch_compat.grad_scaler_optimizer_state(self._scaler, optimizer)
        if state["stage"].name != "UNSCALED":
            self._scaler.unscale_(optimizer)

    def skip_step_for_nonfinite_norm(self, optimizer: Optimizer) -> bool:
        """Clipping met a non-finite gradient norm. With loss scaling that is the scaler's business: make sure
        this step is skipped (and the scale lowered) and return True. Without a scaler return False.

        The norm is the same on every rank, so every rank takes the same decision; it normally agrees with the
        scaler's own found-inf already, and also covers a norm that overflowed from finite gradients."""
        if self._scaler is None:
            return False
        state = _torch_compat.grad_scaler_optimizer_state(self._scaler, optimizer)
        for found_inf in state["found_inf_per_device"].values():
            found_inf.fill_(1.0)
        return True

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        if self._scaler is None:
            return optimizer.step(**kwargs)
        if "closure" not in kwargs:  # (torch's scaler refuses closures itself)
            self._check_loss_was_scaled(optimizer, "optimizer.step()")
        result = self._scaler.step(optimizer, **kwargs)
        self._update_pending = True
        if not self._others_to_step(optimizer):
            self._finish_update()
        self._backwards_at_step[optimizer] = self._scaled_backwards
        return result

    def loss_scale(self) -> float:
        """The scale the current gradients carry (1.0 without a loss scaler)."""
        if self._scaler is None or not self._scaler.is_enabled():
            return 1.0
        return float(self._scaler.get_scale())

    def abandon_step(self, optimizer: Optimizer) -> None:
        """The step of `optimizer` will not run (a replica group's step that did not commit, retried on the same
        batch): forget that its gradients were unscaled for it, so that the retried step's gradients are
        unscaled again (otherwise they would be applied at the loss scale)."""
        if self._scaler is not None:
            _torch_compat.reset_grad_scaler_optimizer_state(self._scaler, optimizer)

    def state_dict(self) -> dict[str, Any]:
        if self._scaler is None:
            return {}
        self._finish_update()
        return self._scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._scaler is not None and state:
            self._update_pending = False
            self._scaler.load_state_dict(state)

    def check_device(self, device: torch.device) -> None:
        """Refuse bf16 on a GPU without native bfloat16 (pre-Ampere GPUs only emulate it, slowly). Called in the
        rank once its device is current: asking in `Loom()` would create a CUDA context in the launching
        process (which must not initialise CUDA before it starts the ranks) and on GPU 0 in every rank."""
        if self.name not in ("bf16-mixed", "bf16-true") or device.type != "cuda":
            return
        with torch.cuda.device(device):  # the question is about this rank's GPU, whichever is current
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        if not native:
            raise ConfigurationError(
                f"precision={self.name!r} needs a GPU with native bfloat16 support (Ampere or newer); "
                f"{torch.cuda.get_device_name(device)} only emulates it. Use '16-mixed' instead."
            )

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"


# Spellings from other tools, and the precision each most likely means.
_OTHER_SPELLINGS = {
    "fp16": ("16-mixed", "16-true"),
    "float16": ("16-mixed", "16-true"),
    "half": ("16-mixed", "16-true"),
    "amp": ("16-mixed", "bf16-mixed"),
    "mixed": ("16-mixed", "bf16-mixed"),
    "fp16-mixed": ("16-mixed",),
    "16-mixed-precision": ("16-mixed",),
    "bfloat16": ("bf16-mixed", "bf16-true"),
    "bf16-amp": ("bf16-mixed",),
    "fp32": ("32-true",),
    "float32": ("32-true",),
    "float": ("32-true",),
    "full": ("32-true",),
    "fp64": ("64-true",),
    "float64": ("64-true",),
    "double": ("64-true",),
}


def _suggest_precision(precision: Any) -> str:
    """' Did you mean ...?' for a precision spelled as another tool spells it, or close to a valid one."""
    import difflib

    key = str(precision).strip().lower().replace("_", "-")
    close = _OTHER_SPELLINGS.get(key) or tuple(difflib.get_close_matches(key, PRECISIONS, n=2, cutoff=0.6))
    if not close:
        return ""
    notes = {
        "16-mixed": "fp16 autocast with loss scaling, fp32 weights",
        "16-true": "weights and compute in fp16",
        "bf16-mixed": "bf16 autocast, fp32 weights",
        "bf16-true": "weights and compute in bf16",
    }
    named = [f"{c!r} ({notes[c]})" if c in notes else repr(c) for c in close]
    return f" Did you mean {' or '.join(named)}?"


def select_precision(
    precision: str | int, accelerator_name: str, sharded_gradients: bool = False
) -> Precision:
    """Validate `precision=` against the accelerator and build it (`sharded_gradients`: see `Precision`)."""
    name = _ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise ConfigurationError(
            f"Unknown precision {precision!r}.{_suggest_precision(precision)} Valid precisions: "
            f"{', '.join(repr(p) for p in PRECISIONS)} (and Lightning's '16', 'bf16', '32', '64')."
        )
    if name == "16-mixed" and accelerator_name == "mps":
        raise ConfigurationError("precision='16-mixed' is not supported on MPS. Use '16-true' or '32-true'.")
    if name == "64-true" and accelerator_name == "mps":
        raise ConfigurationError("precision='64-true' is not supported on MPS (no float64). Use '32-true'.")
    return Precision(name, "cuda" if accelerator_name == "cuda" else accelerator_name, sharded_gradients)
