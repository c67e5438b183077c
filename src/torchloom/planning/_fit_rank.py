"""The simulated rank's side of fitting a budget (`torchloom plan --budget`): what the base plan observes for
`torchloom.planning.fit` to choose and cost its changes (the blocks worth checkpointing and their forward FLOPs,
the micro-batch, the strategy's sharding options), and the changes themselves, applied to the unchanged script
where the strategy sets up the model: activation checkpointing of chosen blocks (full or
selective) and FSDP2's `reshard_after_forward`.

`install(config, account)` is called by `_fake_rank` before the script runs; `Fitting.report()` after it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from torchloom import _torch_compat

#: The operations whose outputs selective activation checkpointing keeps (the compute-heavy ones): everything
#: else in a checkpointed block (pointwise work, norms) is recomputed in backward.
SAVED_OPS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.convolution.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
)


def user_class(module: nn.Module) -> type:
    """The user's class of `module`: FSDP2 makes each unit an instance of a subclass it creates
    (`FSDPBlock`), and a checkpoint wrapper holds the block it wraps."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed"):
            return cls
    return type(module)


def class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks worth checkpointing: the instances (outermost first) of the repeated, non-leaf class that
    holds the most parameters (a transformer's or a residual stack's block)."""
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if not name or not any(True for _ in module.children()):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        if type(module).__name__ == "CheckpointWrapper":
            continue
        by_class.setdefault(user_class(module), []).append((name, module))
    best: list[tuple[str, nn.Module]] = []
    best_params = 0
    for found in by_class.values():
        if len(found) < 2:
            continue
        outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
        params = sum(p.numel() for _, m in outer for p in m.parameters())
        if params > best_params:
            best, best_params = outer, params
    return best


def saved_ops() -> list[str]:
    """The names in `SAVED_OPS` that this torch has: what the plan keeps, and what the fit's `apply:` code
    prints (`torch.ops.aten.mm.default`, ...), so that the code applied is the plan."""
    found = []
    for name in SAVED_OPS:
        _, op, overload = name.split(".")
        packet = getattr(torch.ops.aten, op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(f"torch.ops.{name}")
    return found


def _selective_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    ops = []
    for name in saved_ops():
        op, overload = name.split(".")[-2:]
        ops.append(getattr(getattr(torch.ops.aten, op), overload))
    return functools.partial(create_selective_checkpoint_contexts, ops)


def apply_checkpointing(model: nn.Module, count: int | None, selective: bool) -> list[str]:
    """Checkpoint the first `count` (None: all) repeated blocks of `model`, as the fit's code says; returns
    their names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    blocks = repeated_blocks(model)[:count]
    chosen = {id(module) for _, module in blocks}
    wrapper: Any = checkpoint_wrapper
    if selective:
        wrapper = functools.partial(checkpoint_wrapper, context_fn=_selective_context())
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda module: id(module) in chosen
    )
    return [name for name, _ in blocks]


class Fitting:
    """The base plan's observations, and the changes of a re-plan."""

    def __init__(self, config: dict[str, Any], account: Any) -> None:
        self.config = config
        self.account = account
        self.observed: dict[str, Any] = {
            "micro_batch": None,
            "micro_batches": 0,
            "block_forward_flops": 0,
            "blocks": [],
            "param_bytes": 0,
            "unit_param_bytes": 0,
        }
        self._counting: Any = None
        self._depth = 0

    # ---- what the base plan observes ----------------------------------------------------------------------
    def _strategy_facts(self, strategy: Any, model: nn.Module) -> None:
        precision = getattr(strategy, "precision", None)
        self.observed["strategy"] = {
            "name": getattr(strategy, "name", type(strategy).__name__),
            "class": type(strategy).__name__,
            "reshard_after_forward": getattr(strategy, "reshard_after_forward", None),
            "hybrid": bool(getattr(strategy, "hybrid", False)),
            "cpu_offload": bool(getattr(strategy, "cpu_offload", False)),
            "precision": getattr(precision, "name", None),
        }
        blocks = repeated_blocks(model)
        if blocks:
            cls = user_class(blocks[0][1])
            self.observed["blocks"] = [name for name, _ in blocks]
            self.observed["block_class"] = cls.__qualname__
            self.observed["block_class_key"] = class_key(cls)
            self.observed["block_param_numel"] = sum(p.numel() for p in blocks[0][1].parameters())
            for _, block in blocks:
                block.register_forward_pre_hook(self._block_start)
                block.register_forward_hook(self._block_end)
        units = [m for m in model.modules() if type(m).__name__.startswith("FSDP")]
        self.observed["units"] = len(units)

    def _training_forward(self) -> bool:
        return (
            torch.is_grad_enabled()
            and self.account.step == 0
            and _torch_compat.current_graph_task_id() == -1  # not a checkpoint's recomputation
        )

    def _block_start(self, module: nn.Module, args: Any) -> None:
        if not self._training_forward():
            return
        self._depth += 1
        if self._depth == 1:
            from torch.utils.flop_counter import FlopCounterMode

            self._counting = FlopCounterMode(display=False)
            self._counting.__enter__()

    def _block_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._counting is None or not self._training_forward():
            return
        self._depth -= 1
        if self._depth == 0:
            self._counting.__exit__(None, None, None)
            self.observed["block_forward_flops"] += self._counting.get_total_flops()
            self._counting = None

    def _first_input(self, module: nn.Module, args: Any) -> None:
        if not self._training_forward():
            return
        self.observed["micro_batches"] += 1
        if self.observed["micro_batch"] is None:
            for value in args:
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    self.observed["micro_batch"] = int(value.shape[0])
                    return

    def _parameter_bytes(self, model: nn.Module) -> None:
        """The full (unsharded) bytes of every parameter, and of those inside FSDP units (what FSDP gathers)."""
        from torch.distributed.tensor import DTensor

        for name, param in model.named_parameters():
            numel = param.numel()  # a DTensor's is the full size
            unsharded = getattr(param, "_unpadded_unsharded_size", None)  # FSDP1's flat parameter
            if unsharded is not None:
                numel = unsharded.numel()
            nbytes = numel * param.element_size()
            self.observed["param_bytes"] += nbytes
            if isinstance(param, DTensor) or unsharded is not None or "_fsdp_wrapped_module" in name:
                self.observed["unit_param_bytes"] += nbytes

    # ---- the changes --------------------------------------------------------------------------------------
    def setup(self, original: Any, strategy: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        checkpointing = self.config.get("checkpointing")
        if checkpointing is not None:
            applied = apply_checkpointing(
                module, checkpointing.get("count"), checkpointing.get("selective", False)
            )
            self.observed["checkpointed"] = applied
        if self.config.get("observe"):
            self._strategy_facts(strategy, module)
            module.register_forward_pre_hook(self._first_input)
        wrapped = original(strategy, module, *args, **kwargs)
        if self.config.get("observe"):
            self._parameter_bytes(wrapped)
        reshard = self.config.get("reshard_after_forward")
        if reshard is not None:
            for unit in wrapped.modules():
                if hasattr(unit, "set_reshard_after_forward"):
                    unit.set_reshard_after_forward(reshard, recurse=False)
        return wrapped

    def report(self) -> dict[str, Any]:
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
        return self.observed


def install(config: dict[str, Any] | None, account: Any) -> Fitting | None:
    """Apply the changes `config` asks for (and observe the base plan) in this simulated rank; None: no fit.

    Every strategy's `setup_module` is wrapped (the outermost call only: a strategy's calls its parent's), the
    point where `Loom.setup` hands the model, converted by the precision, to the strategy."""
    if not config:
        return None
    from torchloom.strategies.base import Strategy

    fitting = Fitting(config, account)
    classes, pending = [], [Strategy]
    while pending:
        cls = pending.pop()
        classes.append(cls)
        pending.extend(cls.__subclasses__())
    depth = [0]
    for cls in classes:
        if "setup_module" not in cls.__dict__:
            continue

        def setup_module(
            self: Any,
            module: nn.Module,
            *args: Any,
            _original: Any = cls.__dict__["setup_module"],
            **kwargs: Any,
        ) -> Any:
            if depth[0]:
                return _original(self, module, *args, **kwargs)
            depth[0] += 1
            try:
                return fitting.setup(_original, self, module, *args, **kwargs)
            finally:
                depth[0] -= 1

        cls.setup_module = setup_module  # type: ignore[method-assign]
    return fitting
