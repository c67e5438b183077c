"""`setup_optimizers` (and the optimizers of `setup`): the checks on each optimizer, rebinding a fresh one to
the parameters sharding put in place of the originals, refusing parameters no set-up module holds, and the
module that holds an optimizer's parameters when it updates several set-up models (for clipping)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Set
from typing import Any

from torch import nn
from torch.optim import Optimizer

from torchloom._layout import clean_name
from torchloom._optimizer_checks import check_fused_kernel
from torchloom.errors import MisuseError, MisuseValueError
from torchloom.strategies.base import Strategy
from torchloom.wrappers import LoomModule, LoomOptimizer, joint_owner


def rebind(
    strategy: Strategy,
    optimizers: Iterable[Optimizer],
    names: dict[int, str],
    module: LoomModule,
    modules: list[LoomModule],
) -> None:
    """`setup(model, *optimizers)`: point each optimizer at the parameters `module`'s set-up put in place of
    the originals (named by `names`, taken before), where the strategy replaces parameters."""
    if not strategy.replaces_parameters:
        return
    # Parameters of models set up before (one optimizer over several models) are sharded already.
    earlier = {id(p) for m in modules if m is not module for p in m.module.parameters()}
    for optimizer in optimizers:
        rebind_optimizer(optimizer, names, module.module, earlier)


def rebind_optimizer(
    optimizer: Optimizer, names: dict[int, str], module: nn.Module, earlier: Set[int] = frozenset()
) -> None:
    """Point a not-yet-stepped optimizer at the parameters that sharding put in place of the originals
    (`earlier`: those of other set-up models, left as they are)."""
    current = {id(p) for p in module.parameters()} | earlier
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(id(p) in current for p in params):
        return
    if optimizer.state:
        raise MisuseError(
            "The optimizer has already taken steps on the unsharded parameters, so it cannot be moved to the sharded "
            "ones. Create the optimizer after setup_module."
        )
    by_name = {clean_name(n): p for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        try:
            group["params"] = [by_name[names[id(p)]] if id(p) not in current else p for p in group["params"]]
        except KeyError:
            raise MisuseError(
                "The optimizer holds parameters of another model than the one passed to setup(); create it from "
                "model.parameters()."
            ) from None


def setup_optimizers(
    strategy: Strategy, optimizers: Iterable[Optimizer], modules: list[LoomModule], callbacks: list[Any]
) -> list[LoomOptimizer]:
    """Each optimizer prepared by the strategy and wrapped. `modules` (the Loom's own list, which may still
    grow) and `callbacks` are kept: parameters no set-up module holds are refused at the first step."""
    known = {id(p) for m in modules for p in m.module.parameters()}
    out = []
    for optimizer in optimizers:
        if isinstance(optimizer, LoomOptimizer):
            raise MisuseValueError("setup_optimizers was called twice on the same optimizer. Set it up once.")
        if not isinstance(optimizer, Optimizer):
            raise MisuseError(
                f"setup_optimizers expects torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "Pass an optimizer built from the set-up model, e.g. "
                "torch.optim.AdamW(model.parameters())."
            )
        optimizer = strategy.setup_optimizer(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        check_fused_kernel(optimizer, params)
        stray = sum(id(p) not in known for p in params)
        if stray and strategy.replaces_parameters:
            raise MisuseError(
                f"The optimizer {type(optimizer).__name__} holds {stray} parameter(s) that strategy "
                f"{strategy.name!r} replaced with sharded ones in setup_module. Create the optimizer after "
                "setup_module: `model = loom.setup_module(model); optimizer = torch.optim.AdamW(model.parameters())"
                "`, or pass both to `loom.setup(model, optimizer)`, which rebinds a fresh optimizer for you."
            )
        wrapped = LoomOptimizer(optimizer, strategy.precision, strategy, callbacks)
        checks: list[Callable[[], None]] = []
        if stray and strategy.is_distributed:
            # As in Fabric, the model may be set up after its optimizer (the parameters stay the same
            # objects without sharding); by the first step it must be, or those parameters' gradients
            # would never be averaged and the ranks would drift apart.
            checks.append(functools.partial(check_no_strays, optimizer, modules, strategy.world_size))
        if stray:
            # setup_module may yet convert these parameters to the precision's dtype (bf16-true), in place.
            checks.append(functools.partial(check_fused_kernel, optimizer))
        if checks:
            wrapped.before_first_step(functools.partial(_run_all, checks))
        out.append(wrapped)
    return out


def _run_all(checks: list[Callable[[], None]]) -> None:
    for check in checks:
        check()


def check_no_strays(optimizer: Optimizer, modules: list[LoomModule], world_size: int) -> None:
    """Refuse an optimizer that updates parameters no module in `modules` holds."""
    known = {id(p) for m in modules for p in m.module.parameters()}
    stray = sum(id(p) not in known for group in optimizer.param_groups for p in group["params"])
    if stray:
        raise MisuseError(
            f"The optimizer {type(optimizer).__name__} updates {stray} parameter(s) that belong to no module "
            f"set up with loom.setup_module; with {world_size} processes their gradients would never be "
            "averaged and the ranks would drift apart. Set up the model they belong to (before or after the "
            "optimizer, but before the first step)."
        )


def holder_of(
    forward_module: nn.Module,
    optimizer: Optimizer,
    forward_modules: list[nn.Module],
    joints: dict[tuple[int, ...], nn.Module],
) -> nn.Module:
    """The module whose parameters `optimizer` updates, for the strategy's norm (it combines each sharded
    gradient over that module's shard groups): `forward_module`, or, for an optimizer over several set-up
    models (`forward_modules`), one `JointModule` of them (kept in `joints`, so the strategy's per-module caches
    hold)."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if ids <= {id(p) for p in forward_module.parameters()}:
        return forward_module
    joint = joint_owner(optimizer, {str(i): m for i, m in enumerate(forward_modules)})
    if joint is None:
        return forward_module
    key = tuple(id(m) for m in joint.children())
    return joints.setdefault(key, joint)
