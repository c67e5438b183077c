"""`loom.launch()`: the checks on its function, starting the local ranks through `torchloom.launcher` (or
running the function here, where the processes exist already), and what a rank does before its first call:
read its place from the cluster environment and join the process group."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torchloom import launcher
from torchloom._callbacks import takes_the_loom
from torchloom.environments import LocalEnvironment, TorchElasticEnvironment
from torchloom.errors import MisuseTypeError
from torchloom.strategies.base import Strategy
from torchloom.strategies.parallel import ParallelStrategy

#: `launch()`'s default: no function (an explicit None is `launch(train(loom))`, refused as Fabric does).
NO_FUNCTION: Any = object()


def checked_function(fn: Any) -> Callable[..., Any] | None:
    """`launch`'s `fn`: None when none was given; refused when it is not a function of the Loom."""
    if fn is NO_FUNCTION:
        return None
    if not callable(fn):
        # `launch(train(loom))` (None, or whatever train returned): Fabric's TypeError, with the same hint.
        raise MisuseTypeError(
            f"loom.launch(fn) needs a callable, got {'None' if fn is None else type(fn).__name__}. HINT: do `loom.launch(train)` instead of "
            "`loom.launch(train(loom))`. Pass a function defined at module level, `loom.launch(train, *args)`, "
            "which runs train(loom, *args) on every rank; or call loom.launch() without arguments."
        )
    if not takes_the_loom(fn):
        raise MisuseTypeError(
            f"loom.launch({getattr(fn, '__qualname__', fn)}) needs a function that takes at least one "
            "argument: every rank calls it as fn(loom, *args, **kwargs). Add the parameter, e.g. "
            "`def train(loom): ...`."
        )
    return fn


def start_method(strategy: Strategy, fn: Callable[..., Any] | None, in_a_rank: bool) -> str:
    """How the strategy starts its ranks ("spawn", or "fork" for "ddp_fork"/"ddp_notebook"); a forking
    strategy refuses a launch without a function where it would start ranks (`in_a_rank`: it would not)."""
    method = getattr(strategy, "start_method", "spawn")
    if fn is None and method == "fork" and not in_a_rank:
        # Fabric's TypeError for its forking strategies, on one device too (the same notebook then fails the
        # same way at devices=1 and devices=2). A forked rank runs a function: there is no script to re-run.
        raise MisuseTypeError(
            "strategy='ddp_notebook' (or 'ddp_fork') forks ranks that run a function: call loom.launch(train) "
            "with train(loom, ...) defined anywhere, even in a notebook cell (loom.launch() without a "
            "function leaves them nothing to run)."
        )
    return str(method)


def runs_here(strategy: Strategy, rank_ready: bool, elastic: launcher.Elastic | None) -> bool:
    """Whether `launch` runs in this process, which is a rank already (or the only one), rather than starting
    the local ranks."""
    env = strategy.cluster_environment
    # With elastic options the rendezvous decides the world, so even one local process gets an agent.
    alone = env.world_size() == 1 and elastic is None
    return rank_ready or env.creates_processes_externally or alone


def start_ranks(
    loom: Any,
    strategy: Strategy,
    fn: Callable[..., Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    elastic: launcher.Elastic | None,
    method: str,
) -> Any:
    """Start the local ranks: re-run this script on each (no `fn`: never returns), or run `fn(loom, *args,
    **kwargs)` on each and return rank 0's result."""
    env = strategy.cluster_environment
    num_processes = len(strategy.parallel_devices)
    where = (num_processes, strategy.num_nodes, env.node_rank(), env.main_address, env.main_port)
    # A port drawn here may be taken before the agent binds it: drawn again then. One the user set is kept.
    redraw = None
    if isinstance(env, LocalEnvironment) and env.drew_port and not (elastic and elastic.rdzv_endpoint):
        redraw = env.draw_port_again
    if method == "fork":
        launcher.check_fork_is_safe(fn)
    if fn is None:
        # never returns: this process waits for the ranks, then exits
        launcher.launch_script(*where, elastic, redraw=redraw)
        return None
    if kwargs:
        fn = functools.partial(fn, **kwargs)  # picklable when fn is
    return launcher.launch_function(loom, fn, args, *where, elastic, start_method=method, redraw=redraw)


def set_up_rank(strategy: Strategy) -> None:
    """What every rank runs before its first call: its place from the cluster environment, the process group,
    and the collective record that explains a hang."""
    # In a rank started by an elastic agent, the environment it inherited from its parent's Loom is stale.
    if TorchElasticEnvironment.detect() and not isinstance(
        strategy.cluster_environment, TorchElasticEnvironment
    ):
        strategy.cluster_environment = TorchElasticEnvironment()
    launcher.record_errors_in_rank()
    strategy.setup_environment()
    if isinstance(strategy, ParallelStrategy) and strategy.world_size > 1:
        strategy.start_diagnostics()


def joins_on_first_call(strategy: Strategy, launched: bool) -> bool:
    """Whether this process is a rank that someone else started (torchloom run, torchrun, SLURM) and has not
    joined the process group yet: the first call that needs the group joins it."""
    env = strategy.cluster_environment
    return not launched and strategy.is_distributed and env.creates_processes_externally
