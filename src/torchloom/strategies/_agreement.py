"""Cross-rank agreement checks of the sharded strategies: before a backward, every rank ran the same units; after
it, every rank's "fsdp2" unit parameters got a gradient or none did (see `_unit_watch`). One small all-reduce of
flags each, in host memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from torchloom.errors import MisuseError
from torchloom.strategies._unit_watch import UnitRuns

GroupGetter = Callable[[], "dist.ProcessGroup | None"]


def agree(flags: bytearray, names: list[str], group: dist.ProcessGroup | None) -> list[str]:
    """The names whose flag is 1 on some ranks and 0 on others (one all-reduce: MAX over [flags, not flags]).
    Vectorised: the flags are read in place, and only the names of mixed flags are looked up, so the cost
    per flag is a few bytes of tensor work, not Python (thousands of flags per backward in MoE models)."""
    if not flags:
        return []
    mine = torch.frombuffer(flags, dtype=torch.uint8)
    both = torch.cat([mine, 1 - mine]).to(torch.int32)  # gloo reduces int32 everywhere
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = len(flags)
    mixed = torch.logical_and(both[:n], both[n:]).nonzero().flatten().tolist()
    return [names[i] for i in mixed]


def check_unit_runs(watches: Iterable[UnitRuns], flag_group: GroupGetter) -> None:
    """Every rank's units that ran since the last backward must be the same (see `_unit_watch.watch_unit_runs`).
    `flag_group` gives the group the flags meet in."""
    for watch in watches:
        ran = watch.take()
        if not watch.checking or not ran:
            continue  # inside no_backward_sync this backward reduces nothing
        mixed = agree(ran, watch.paths, flag_group())
        if mixed:
            raise MisuseError(
                f"The FSDP unit(s) {mixed} ran forward on some ranks and not on others before this backward "
                "(e.g. an expert that got no tokens on one rank). FSDP reduces the gradients of the units "
                "that ran, one collective per unit, so the ranks would exchange different units' gradients: "
                "silently wrong results, or a hang. Call every unit on every rank (an expert with an empty "
                "batch when no token goes to it), keep the experts in one parameter (as transformers' MoE "
                "models do), or make no units of them."
            )


def check_unit_grads(watches: Iterable[UnitRuns], flag_group: GroupGetter) -> None:
    """After a backward that reduced: every rank's "fsdp2" unit parameters that this backward gave a gradient
    must be the same (see `_unit_watch.watch_unit_runs`). The reduction already happened, so this stops the
    step, not the damage."""
    for watch in watches:
        if not watch.checking or not watch.params:
            continue
        mixed = agree(watch.got, watch.names, flag_group())
        if mixed:
            raise MisuseError(
                f"Parameter(s) {mixed[:5]}{' ...' if len(mixed) > 5 else ''} of FSDP2 units got a gradient "
                "on some ranks and not on others in this backward (e.g. an expert inside a unit that got no "
                "tokens on one rank). fully_shard reduces only the parameters that have a gradient, so the "
                "ranks reduced different parameters together: these gradients are wrong; do not step. Make "
                "every parameter get a gradient on every rank (call every expert, with an empty batch when no "
                "token goes to it), or use strategy='fsdp' (its flat parameters reduce missing gradients as "
                "zeros) or DDPStrategy(find_unused_parameters=True)."
            )
