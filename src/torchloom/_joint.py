"""One optimizer over several set-up models (as Fabric allows): the `JointModule` that stands for them together
in checkpoints and clipping."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer


class JointModule(nn.Module):
    """Several set-up modules seen as one, each a child under its own name: what holds an optimizer over the
    parameters of several set-up modules (as Fabric allows) for checkpoints (its state is keyed by `name.parameter`,
    so a sharded state can be saved and loaded by name) and for clipping (the shard groups of every part). It is
    never trained, wrapped or registered anywhere: the parts stay the user's."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)

    @staticmethod
    def valid_name(name: str) -> bool:
        """Whether `name` can name a part (add_module's rules, and not an attribute every module has)."""
        return bool(name) and "." not in name and not hasattr(nn.Module, name)


def joint_owner(optimizer: Optimizer, named: dict[str, nn.Module]) -> JointModule | None:
    """A `JointModule` of the modules of `named` that hold the optimizer's parameters, when they hold all of them
    and no one of them does; else None."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    parts: dict[str, nn.Module] = {}
    held: set[int] = set()
    for name, module in named.items():
        own = {id(p) for p in module.parameters()}
        if ids & own and all(module is not m for m in parts.values()):
            parts[name] = module
            held |= own
    if len(parts) < 2 or not ids <= held or not all(JointModule.valid_name(n) for n in parts):
        return None
    return JointModule(parts)
