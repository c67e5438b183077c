"""`Loom`: the one object a training script talks to. It checks arguments and delegates to its strategy."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import warnings
from collections.abc import Callable, Generator, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, overload

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from torchloom import (
    _callbacks,
    _launching,
    _loader_setup,
    _module_setup,
    _optimizer_setup,
    _preemption,
    _save_call,
    launcher,
)
from torchloom._convert import numbers_to_tensors, reduce_op_name
from torchloom._layout import clean_name
from torchloom._module_forward import explain_skipped_call as _explain_skipped_call
from torchloom._preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from torchloom._run_protocol import under_torchloom_run
from torchloom.checkpointing import Checkpointer
from torchloom.connector import command_line_defaults, configure
from torchloom.diagnostics import RECORD as _record
from torchloom.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigurationError,
    MisuseError,
    MisuseValueError,
)
from torchloom.loggers import Logger, finalize_logger, mark_launching_process, to_scalar
from torchloom.progress import Progress
from torchloom.seed import seed_everything
from torchloom.strategies.base import Strategy
from torchloom.wrappers import LoomModule, LoomOptimizer, state_module, unwrap_optimizer
from torchloom.wrappers import move_to_device as move_data_to_device

_NO_FUNCTION = _launching.NO_FUNCTION


class Loom:
    """Runs a hand-written training loop on one process, many processes, GPUs or nodes.

    Args:
        accelerator: "auto", "cpu", "cuda", "mps" or Fabric's "gpu" (CUDA, else MPS).
        devices: on CPU the number of processes per node; on CUDA an int, a list of GPU indices, or "auto".
        num_nodes: number of machines; by default the launcher's count (torchrun's nodes, SLURM's), else 1.
            Given, it must match the launcher's.
        strategy: "auto", "single_device", "ddp", "fsdp", "fsdp2" or a `torchloom.strategies.Strategy`; also
            Fabric's "ddp_spawn", "ddp_find_unused_parameters_true" and "fsdp_cpu_offload".
        precision: "32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true" or "16-true" (see README), or
            Fabric's aliases 16, "16", 32, "32", 64, "64", "bf16" and None (the default).
        timeout: how long a collective may wait for the other ranks before it fails (default 30 minutes). On
            NCCL the desync report comes out after `timeout` and NCCL aborts the rank 15 s later.
        loggers: metric loggers (`torchloom.loggers.CSVLogger`, `TensorBoardLogger`) for `log`/`log_dict`.
        callbacks: objects whose methods `loom.call(hook_name, ...)` calls.
        plugins: refused (Fabric's precision and environment plugins): see the error for what to use.
        elastic: `torchloom.Elastic(...)`, torchrun's elastic options (restarts, a node range, the c10d rendezvous)
            for the agent `launch()` starts; ignored where the processes exist already (torchrun, SLURM).

    Under `torchloom run`, arguments left at their defaults take the command line's values; arguments given
    here win, with a warning when they disagree with the command line.
    """

    #: A subclass's own `run` (Fabric's subclass entry point), which `run` starts on every rank.
    _user_run: ClassVar[Callable[..., Any]]

    def __init__(
        self,
        accelerator: str = "auto",
        devices: int | str | list[int] = "auto",
        num_nodes: int | None = None,
        strategy: str | Strategy = "auto",
        precision: str | int | None = "32-true",
        timeout: timedelta | None = None,
        loggers: Logger | list[Logger] | None = None,
        callbacks: Any = None,
        plugins: Any = None,
        elastic: launcher.Elastic | None = None,
    ) -> None:
        if plugins:
            raise ConfigurationError(
                "plugins= is not supported. Choose the precision with precision=... (e.g. 'bf16-mixed'); the cluster "
                "environment (torchrun, SLURM, local) is detected; pass a torchloom.strategies Strategy instance as "
                "strategy= for anything else."
            )
        if elastic is not None and not isinstance(elastic, launcher.Elastic):
            raise ConfigurationError(
                f"elastic= takes torchloom.Elastic(...), got {type(elastic).__name__}: e.g. "
                "Loom(elastic=torchloom.Elastic(max_restarts=2, nnodes='1:2', rdzv_backend='c10d', ...))."
            )
        if precision is None:
            precision = "32-true"  # Fabric's None: the default (or the command line's)
        accelerator, devices, num_nodes, strategy, precision = command_line_defaults(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            strategy=strategy,
            precision=precision,
        )
        self._strategy = configure(accelerator, devices, num_nodes, strategy, precision, timeout)
        # Checkpoints are the Checkpointer's; it reaches the strategy and its precision through declared protocols.
        self._counters: dict[str, int] = {}  # the run's counters a checkpoint keeps (none at present)
        self._checkpointer = Checkpointer(  # type: ignore[arg-type]
            self._strategy, self._strategy.precision, self._counters
        )
        self._launched = False
        self._closed = False
        self._rank_ready = False  # this process is a rank that has joined the process group
        self._preempted = False
        self._requeue = False
        self._elastic = elastic
        self._modules: list[LoomModule] = []
        self._joint_modules: dict[tuple[int, ...], nn.Module] = {}  # see _holder_of
        self._loggers: list[Logger] = _callbacks.as_list(loggers)
        env = self._strategy.cluster_environment
        if env is not None and not env.creates_processes_externally and env.world_size() > 1:
            mark_launching_process(self._loggers)  # this process launches the ranks and is none of them
        self._callbacks: list[Any] = _callbacks.as_list(callbacks)
        if under_torchloom_run():
            # Under `torchloom run` every rank constructs its Loom at the same point, so the group can be joined
            # here, as Fabric does under `fabric run`: a script may then use torch.distributed directly (e.g. an
            # optimizer wrapper that all-reduces gradients itself) before any torchloom call needs the group.
            # Elsewhere (torchrun, SLURM) the first call that needs the group joins it.
            self._join_if_started_externally()

    # ---- where this rank is ----------------------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        """The strategy in use: a `SingleDeviceStrategy`, `DDPStrategy`, `FSDPStrategy` or `FSDP2Strategy`."""
        return self._strategy

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job, 0..world_size-1."""
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        """The rank of this process's node (machine)."""
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        """The number of processes in the job (1 in one process)."""
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        """True on global rank 0."""
        return self.global_rank == 0

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: its GPU, or the CPU."""
        return self._strategy.root_device

    @property
    def accelerator(self) -> Any:
        """The accelerator (`torchloom.accelerators.Accelerator`) the strategy runs on."""
        return self._strategy.accelerator

    # ---- launching -------------------------------------------------------------------------------------------
    def launch(self, fn: Callable[..., Any] | None = _NO_FUNCTION, *args: Any, **kwargs: Any) -> Any:
        """Start the ranks and join the process group.

        Without `fn`, a plain `python train.py` that wants several local processes re-runs itself once per rank
        (the launching process waits for them and exits with their status). With `fn`, runs
        `fn(loom, *args, **kwargs)` on every rank and returns rank 0's result; `fn` must be importable (defined
        at module level) because ranks are started with the spawn method.

        Under `torchloom run`, torchrun or SLURM the processes exist already and the first call that needs the
        process group joins it, so launch() is optional there; a second call, or a call in a rank that already
        joined, starts nothing (with `fn`, it runs `fn` in this process).
        """
        fn = _launching.checked_function(fn)
        env = self._strategy.cluster_environment
        in_a_rank = self._rank_ready or env.creates_processes_externally
        start_method = _launching.start_method(self._strategy, fn, in_a_rank)
        self._launched = True
        if _launching.runs_here(self._strategy, self._rank_ready, self._elastic):
            if not self._rank_ready:
                self._setup_rank()
            return fn(self, *args, **kwargs) if fn is not None else None
        return _launching.start_ranks(self, self._strategy, fn, args, kwargs, self._elastic, start_method)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Fabric's subclass entry point. Override `run` in a subclass of Loom and call `loom.run(...)`: the
        ranks are started as `launch` starts them and your `run(*args, **kwargs)` runs on each (the subclass
        must be importable, as `launch`'s function must); rank 0's result is returned. Not overridden, it does
        nothing."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        user_run = cls.__dict__.get("run")
        if user_run is None:
            return
        cls._user_run = user_run

        @functools.wraps(user_run)
        def run(self: Loom, *args: Any, **kwargs: Any) -> Any:
            return self.launch(_run_users_run, *args, **kwargs)

        cls.run = run  # type: ignore[method-assign]

    def _setup_rank(self) -> None:
        self._launched = True
        _launching.set_up_rank(self._strategy)
        self._rank_ready = True

    def _join_if_started_externally(self) -> None:
        """Where the processes exist already (torchloom run, torchrun, SLURM), join the process group on the first
        call that needs it, so a script written for `fabric run` needs no launch(). Constructing a Loom does not
        block: the group is joined by the first setup, collective or checkpoint call, which every rank makes."""
        if _launching.joins_on_first_call(self._strategy, self._launched):
            self._setup_rank()

    def close(self) -> None:
        """End this process's part of the job: wait for a pending asynchronous save (raising if it failed),
        then, with several processes, wait until every rank has called `close` (at most `timeout`) and destroy
        the process group. Every rank must call it; later calls do nothing.

        It runs by itself when the interpreter exits normally, and at the end of `with Loom(...) as loom:`.
        Ending together matters: a rank that tears down its connections while a peer is still inside a
        collective makes that peer abort, so a finished job would exit non-zero. A later Loom in the same
        processes makes a new group; without a launcher, rank 0 keeps serving the job's store (on
        MASTER_PORT) until then or until it exits, so a peer that gets there first finds it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._checkpointer.close()
        finally:
            self._strategy.teardown()

    def __enter__(self) -> Loom:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # After an exception, peers may be inside a collective this rank will never join: do not wait for
        # them (the launcher stops the job); interpreter exit still waits for a pending save.
        if exc_type is None:
            self.close()

    def _require_launch(self, what: str) -> None:
        self._join_if_started_externally()
        if self._strategy.is_distributed and not self._launched:
            raise MisuseError(
                f"{what} was called before loom.launch(). Call loom.launch() first: it starts the ranks and "
                "joins the process group."
            )

    # ---- models, optimizers, data ----------------------------------------------------------------------------
    def sharded_model(self) -> contextlib.AbstractContextManager[None]:
        """Deprecated, as in Fabric: use `init_module()`, which this is (modules created inside land on
        `loom.device` in the precision's dtype, and `wrap()` makes units under strategy='fsdp')."""
        warnings.warn(
            "loom.sharded_model() is deprecated, as in Fabric: use loom.init_module().",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.init_module()

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Create modules directly on `loom.device` in the precision's dtype. With `empty_init=True`, sharding
        strategies create parameters on the meta device and initialise them shard by shard in `setup_module`."""
        self._join_if_started_externally()
        with self._strategy.module_init_context(empty_init):
            yield

    @overload
    def setup(self, module: nn.Module) -> LoomModule: ...
    @overload
    def setup(self, module: nn.Module, *optimizers: Optimizer) -> tuple[Any, ...]: ...

    def setup(
        self, module: nn.Module, *optimizers: Optimizer, scheduler: Any = None, move_to_device: bool = True
    ) -> Any:
        """Set up a model and its optimizers; returns `model` or `(model, *optimizers)`, with `scheduler` (an LR
        scheduler of one of the optimizers, returned unchanged) appended when given, as Fabric does."""
        names = {id(p): clean_name(n) for n, p in module.named_parameters()}
        if scheduler is not None and getattr(self._strategy, "replicas", None) is not None:
            self._strategy.replicas.add_scheduler(scheduler)  # it heals with the model (fault tolerance)
        module = self.setup_module(module, move_to_device=move_to_device)
        if not optimizers:
            self._after_setup(module)
            return module if scheduler is None else (module, scheduler)
        _optimizer_setup.rebind(self._strategy, optimizers, names, module, self._modules)
        out = (module, *self._setup_optimizers(optimizers))
        if hasattr(module.module, "_fabric_optimizers"):  # a LightningModule: self.optimizers() reads these
            setattr(module.module, "_fabric_optimizers", list(out[1:]))  # noqa: B010 - not a Module or Tensor
        self._after_setup(module)
        return out if scheduler is None else (*out, scheduler)

    def _after_setup(self, module: LoomModule) -> None:
        # Fabric's hook, called by keyword from setup() (not setup_module), once the optimizers are set up too.
        _callbacks.call_builtin_hook(
            self._callbacks, "on_after_setup", {"fabric": self, "module": module}, {"loom": self}
        )

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> LoomModule:
        """Move and wrap `module` for the strategy; returns a `LoomModule`. With `move_to_device=False` the model
        stays where it is (you placed it yourself, as in Fabric); sharding strategies refuse that, since they
        place every shard on `loom.device`.

        A model from `torch.compile` is set up as the module it compiled, and the strategy's wrapper is compiled
        the same way (backend, mode, options): the returned model's forward runs compiled; `.module` is the
        uncompiled model and checkpoints use its names."""
        earlier = _module_setup.set_up_before(module, self._modules)
        if earlier is not None:
            return earlier
        self._require_launch("setup_module")
        wrapped = _module_setup.wrap(self._strategy, module, move_to_device, self, self._callbacks)
        self._modules.append(wrapped)
        return wrapped

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Prepare optimizers made from the parameters of set-up modules; returns one or a tuple."""
        if not optimizers:
            raise MisuseValueError(
                "setup_optimizers needs at least one optimizer. Pass them: loom.setup_optimizers(optimizer), "
                "or loom.setup_optimizers(opt_a, opt_b)."
            )
        out = self._setup_optimizers(optimizers)
        return out[0] if len(out) == 1 else tuple(out)

    def _setup_optimizers(self, optimizers: tuple[Optimizer, ...]) -> list[LoomOptimizer]:
        out = _optimizer_setup.setup_optimizers(self._strategy, optimizers, self._modules, self._callbacks)
        if os.environ.get("TORCHLOOM_MEMORY_REPORT"):  # opt-in: the measured peaks after the first steps
            from torchloom.planning.measure import report_after_steps

            report_after_steps(self, out)
        return out

    def setup_dataloaders(
        self, *dataloaders: DataLoader, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Give each rank its own part of the data (shuffle kept, epoch advanced per pass) and move batches to
        `loom.device`. Returns one loader, or a list of them (as Fabric does).

        The order is Fabric's: in one process the loader's own sampler (a `RandomSampler` draws a new order from
        the global generator at every pass); with DDP or FSDP `DistributedSampler`'s order for the seed of the
        last `seed_everything` (the same for every loader; each set-up loader starts at epoch 0) in place of a
        `RandomSampler` or `SequentialSampler`, and any other sampler drawn whole at the start of each pass and
        split across ranks (rank 0's draw). Each pass is a new epoch. What each order came from is recorded, so a
        checkpoint resumes the same order inside an epoch, at any world size (see `torchloom.data`).

        DataLoader workers: every worker of every rank gets its own random seed (from the global seed, the rank
        and the worker id; see `torchloom.seed.seed_worker`), so random augmentations do not repeat across
        workers or ranks; a `worker_init_fn` of your own runs after it. `seed_everything(seed, workers=False)`
        turns this off."""
        if not dataloaders:
            raise MisuseValueError("setup_dataloaders needs at least one DataLoader.")
        out = _loader_setup.setup_dataloaders(
            self._strategy, dataloaders, use_distributed_sampler, self.device if move_to_device else None
        )
        # Before launch this process would split the data as rank 0 of a job that does not exist yet. Checked
        # after the loaders themselves, whose mistakes (a sampler without len()) are named first.
        self._require_launch("setup_dataloaders")
        return out[0] if len(out) == 1 else out  # several: a list, as Fabric returns them

    # ---- training calls --------------------------------------------------------------------------------------
    def backward(
        self, tensor: torch.Tensor, *args: Any, model: LoomModule | None = None, **kwargs: Any
    ) -> None:
        """`tensor.backward()` through the precision (loss scaling) and strategy."""
        # Whether this backward waits for the other ranks (DDP's gradient all-reduce runs inside it, in C++): what
        # a rank waiting in `loom.save` learns when it asks where this one is (see `diagnostics.meet`).
        _record.backward_syncs = any(
            getattr(m, "require_backward_grad_sync", False) for m in self._forward_modules()
        )
        try:
            self._strategy.backward(
                tensor, model.forward_module if model is not None else None, *args, **kwargs
            )
        except RuntimeError as error:
            _explain_skipped_call(error)
            raise
        finally:
            _record.backward_syncs = False

    def clip_gradients(
        self,
        module: LoomModule,
        optimizer: Optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """Clip gradients by value (`clip_val`, returns None) or by global norm (`max_norm`, returns the total
        norm before clipping). Pass exactly one of them. The order is Fabric's: `clip_gradients(model, opt, 0.5)`
        clips by value."""
        if (max_norm is None) == (clip_val is None):
            raise ValueError(
                "clip_gradients needs exactly one of max_norm= (clip by global norm) or clip_val= (clip by value)."
            )
        forward_module = _module_setup.set_up_one(module, self._modules, "clip_gradients").forward_module
        optimizer = unwrap_optimizer(optimizer)
        if self._strategy.replaces_parameters:
            forward_module = _optimizer_setup.holder_of(
                forward_module, optimizer, self._forward_modules(), self._joint_modules
            )
        if max_norm is not None:
            return self._strategy.clip_gradients_norm(
                forward_module,
                optimizer,
                float(max_norm),
                norm_type=norm_type,
                error_if_nonfinite=error_if_nonfinite,
            )
        self._strategy.clip_gradients_value(forward_module, optimizer, float(clip_val))  # type: ignore[arg-type]
        return None

    def forward_backward(
        self, model: LoomModule, inputs: Any, target: Any, loss_fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward of one batch, returning the loss (detached) on every rank: through the pipeline
        schedule under `PipelineStrategy`, else `loss_fn(model(*inputs), target)` and `backward(loss)`."""
        # Imported on first use: torch.distributed.pipelining is not needed by a run without a pipeline.
        from torchloom.pipelining import forward_backward

        module = _module_setup.set_up_one(model, self._modules, "forward_backward")
        return forward_backward(self._strategy, module, inputs, target, loss_fn, self.backward)

    def evaluate(
        self, model: LoomModule, inputs: Any, target: Any, loss_fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """Forward of one batch without a backward (evaluation), returning the loss (detached) on every rank:
        through the pipeline schedule under `PipelineStrategy` (gradients left alone), else
        `loss_fn(model(*inputs), target)` under `torch.no_grad()`."""
        from torchloom.pipelining import evaluate

        module = _module_setup.set_up_one(model, self._modules, "evaluate")
        return evaluate(self._strategy, module, inputs, target, loss_fn)

    @contextlib.contextmanager
    def no_backward_sync(self, module: LoomModule, enabled: bool = True) -> Generator[None, None, None]:
        """Skip gradient synchronisation for the forward and backward passes inside (gradient accumulation);
        the first backward outside the block synchronises everything accumulated."""
        forward_module = _module_setup.set_up_one(module, self._modules, "no_backward_sync").forward_module
        with self._strategy.no_backward_sync(forward_module, enabled=enabled):
            yield

    def mark_forward_method(self, method: Any) -> None:
        """Run a model method through the strategy like forward (see `LoomModule.mark_forward_method`), given as
        the bound method of a set-up model (`loom.mark_forward_method(model.generate)`) or by name, for every
        set-up model that has it."""
        for wrapped, name in _module_setup.forward_method_targets(method, self._modules):
            wrapped.mark_forward_method(name)

    # ---- collectives -----------------------------------------------------------------------------------------
    def all_reduce(self, data: Any, group: Any = None, reduce_op: str | ReduceOp = "mean") -> Any:
        """Reduce tensors and numbers (or nested dicts/lists/tuples of them) over all ranks, or over `group`:
        "mean", "sum", "max", "min", "product" or a `torch.distributed.ReduceOp`. Numbers come back as tensors
        on `loom.device`."""
        self._require_launch("all_reduce")
        op: str = reduce_op_name(_not_an_op(group, reduce_op))
        data = numbers_to_tensors(data, self.device)
        # Every collective entered here is recorded (see `diagnostics`): a hang can then say who is where.
        with _record("all_reduce", data):
            return self._strategy.all_reduce(data, op, group=group)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Gather tensors and numbers (or nested collections of them) from all ranks, or from `group`; each comes
        back as a tensor stacked with a leading dimension of the group's size (also in one process). With
        `sync_grads=True`, gradients flow back through the gather to every rank's input."""
        self._require_launch("all_gather")
        _not_an_op(group, None)
        data = numbers_to_tensors(data, self.device)
        with _record("all_gather", data):
            return self._strategy.all_gather(data, group=group, sync_grads=sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send any picklable object from rank `src` to every rank."""
        self._require_launch("broadcast")
        with _record("broadcast", detail=f"src={src}"):
            return self._strategy.broadcast(obj, src)

    def memory_summary(self, plan: str | dict[str, Any] | None = None) -> Any:
        """Each rank's measured peak memory (started by `torchloom.planning.track_memory()`), beside the
        prediction of `plan` (a `torchloom plan --json` file or its dict) if given. Every rank must call it."""
        from torchloom.planning.measure import memory_summary

        return memory_summary(self, plan)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank reaches this point."""
        self._require_launch("barrier")
        with _record("barrier"):
            self._strategy.barrier(name)

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
        async_save: bool = False,
        fsync: bool = True,
    ) -> None:
        """Save modules, optimizers, objects with `state_dict()` and plain values. Every rank must call it, with
        the same entries (plain values may differ: rank 0's are written) and the same `filter`.

        `filter` (Fabric's): for some entries of `state`, a function `(name, value) -> bool` that keeps only the
        matching items of that entry's state dict, e.g. `filter={"model": lambda k, v: "adapter" in k}`; an entry
        whose filter keeps nothing is not saved (as in Fabric). Both formats; a sharded checkpoint refuses a
        filter on an optimizer (its state loads only whole). Load a filtered model back with `strict=False`.

        The format is the strategy's: one file (single device, DDP, FSDP with state_dict_type="full") or a
        directory of shards (FSDP's default "sharded"). It is written beside `path` under a temporary name,
        flushed to disk (fsync) and swapped into place only when complete, so neither a crash mid-save nor a
        power loss afterwards replaces a good checkpoint with a broken one. Only a checkpoint (or a file) is
        replaced: a folder at `path` holding anything else raises `CheckpointError` before anything is written
        (save into it instead, e.g. `path / "step-100"`). With `async_save=True` the write
        continues in the background; the next save, load, load_raw or save_raw (or close) waits for it and raises
        if it failed.

        `fsync=False` skips the flush to disk (as `torch.save` does, and DCP's `sync_files=False`): the save
        returns once the data is in the operating system's cache, which is faster where the disk is slower
        than memory. The swap is still atomic, so a killed process never leaves a broken checkpoint; a power
        loss or kernel crash soon after the save can."""
        self._require_launch("save")
        if self._strategy.replicas is not None and not self._strategy.replicas.before_save(self._counters):
            return  # replica groups hold one state: one group writes it (torchloom.fault_tolerance.replica)
        met = False
        try:
            with _record("save"):
                met = _save_call.meet("save", self.global_rank, self._strategy.timeout)
                self._checkpointer.save(
                    Path(path), state, self._forward_modules(), filter, async_save=async_save, fsync=fsync
                )
        except (CollectiveTimeoutError, CollectiveMismatchError) as error:
            restated = _save_call.save_failure(error, met, self.global_rank, self._strategy.timeout)
            if restated is None:
                raise
            raise restated from error

    def load(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool = True,
        restore_run_state: bool | None = None,
        verify: bool = True,
    ) -> dict[str, Any]:
        """Restore the objects of `state` in place (plain values are replaced in `state`) and return the
        checkpoint's entries that `state` did not name. With no `state`, return everything.

        `restore_run_state`: whether the saved run's state comes back too: every rank's random generators (at
        the world size they were saved at), the loss scaler, and how many data loaders the Loom had set up.
        None (the default) restores it when `state` names an optimizer or a data loader set up with this Loom
        (a resume), and leaves this run's generators alone when it names only modules and values (weights to
        start another run from: two fine-tuning runs with different seeds keep drawing different numbers).
        Pass True to resume without those (a loop that sets up its loaders every epoch), False never to.

        `weights_only=True` (the default, as in `torch.load`) unpickles only plain data: tensors, numbers,
        strings, lists, dicts, which is all torchloom itself writes (models, optimizers, LR schedulers, the loss
        scaler, loaders, random generators). A checkpoint holding other objects of yours is refused with an error
        naming the object; pass `weights_only=False` to load it, only if you trust the file: unpickling can run
        any code its author chose.

        `verify=True` (the default) first checks every file of the checkpoint against the size and checksum
        recorded when it was saved, and raises `CheckpointError` naming a file that changed since (a flipped
        bit on disk or in a copy would otherwise load as different numbers); a file the checkpoint's record lists
        that is missing is always refused. `verify=False` skips the checksums. Checkpoints written before
        checksums were recorded load without them."""
        self._require_launch("load")
        replicas = self._strategy.replicas  # (fault tolerance: the job's place in the run, in the counters)
        with (
            _record("load"),
            contextlib.nullcontext() if replicas is None else replicas.loading(self._counters),
        ):
            return self._checkpointer.load(
                Path(path),
                state or {},
                self._forward_modules(),
                strict=strict,
                weights_only=weights_only,
                restore_run_state=restore_run_state,
                verify=verify,
            )

    def load_raw(
        self,
        path: str | os.PathLike[str],
        obj: nn.Module | Optimizer,
        strict: bool = True,
        weights_only: bool | None = None,
        verify: bool = True,
    ) -> Any:
        """Load a plain state dict saved by `torch.save(model.state_dict(), path)` into a module or optimizer
        (read with `weights_only=True` unless you pass False, for files holding other objects), or a Hugging
        Face safetensors checkpoint (`model.safetensors`, or a directory with `model.safetensors.index.json`)
        into a module in any layout, each rank reading only what it holds. For the latter, returns
        `(missing_keys, unexpected_keys)` (non-empty only with `strict=False`). A file `loom.save` wrote is
        checked against its checksum first, unless `verify=False`."""
        self._require_launch("load_raw")
        target = state_module(obj) if isinstance(obj, (nn.Module, LoomModule)) else unwrap_optimizer(obj)
        with _record("load_raw"):
            return self._checkpointer.load_raw(
                Path(path), target, strict, weights_only=weights_only is not False, verify=verify
            )

    def save_raw(
        self,
        out_dir: str | os.PathLike[str],
        model: nn.Module,
        dtype: torch.dtype | None = None,
        max_shard_size: int | str = "5GB",
        config: Any = None,
    ) -> None:
        """Write `model`'s weights as a Hugging Face checkpoint directory (safetensors shards named as
        `transformers` names them and their index, or one `model.safetensors`), in the module's own names, tied
        weights once, every rank writing its own files; `dtype` casts floating-point weights (e.g.
        torch.bfloat16 to publish). With `config` (a transformers config), config.json is written beside them,
        so `from_pretrained(out_dir)` loads it. Every rank must call it. `out_dir` is replaced in one step;
        everything else already there (a tokenizer, subfolders, other weights files) is kept, and only the
        previous weights (the old index, the shards it names, the old model.safetensors) are dropped."""
        self._require_launch("save_raw")
        if self._strategy.replicas is not None and not self._strategy.replicas.writes_checkpoints:
            return  # one replica group writes (see `save`)
        with _record("save_raw"):
            self._checkpointer.save_raw(Path(out_dir), state_module(model), dtype, max_shard_size, config)

    def _forward_modules(self) -> list[nn.Module]:
        """The modules set up with this Loom: an optimizer saved or loaded is matched to one by its parameters."""
        return [m.forward_module for m in self._modules]

    # ---- preemption ------------------------------------------------------------------------------------------
    def on_preempt(
        self,
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2),
        requeue: bool = False,
    ) -> None:
        """Catch these signals instead of dying, so the training loop can write a final checkpoint and stop at a
        step boundary. The defaults cover clusters' preemption (SIGTERM) and SLURM's warning before the time
        limit (`sbatch --signal=USR1@120`, or USR2). Check `loom.should_stop()` once per step:

            loom.on_preempt()
            for step in ...:
                train_step()
                if loom.should_stop():
                    loom.save(path, state)
                    loom.exit_for_restart()  # or `break` to end the job as finished

        A signal reaches every rank, or any one of them (`should_stop` tells all), or torchloom's launcher
        (`torchloom run`, `loom.launch()`), which passes SIGUSR1/SIGUSR2 on to its ranks. On SIGTERM torch's
        agent stops the ranks itself: it gives them TORCHLOOM_SHUTDOWN_TIMEOUT seconds (default 5) before
        SIGKILL; raise it if a final checkpoint takes longer.

        `requeue=True`: under SLURM, `exit_for_restart()` also puts the job back in SLURM's queue (rank 0 runs
        `scontrol requeue $SLURM_JOB_ID`; the job must be requeueable, `sbatch --requeue`), so it starts again
        and resumes from its newest checkpoint (`torchloom.latest_checkpoint`). Outside a SLURM job it is refused
        here, on every rank (not when the job is already stopping)."""
        _preemption.catch(signals, self._note_preemption, requeue)
        self._requeue = bool(requeue)

    def exit_for_restart(self) -> None:
        """End this attempt after its preemption checkpoint, so that the job is restarted: wait for the pending
        asynchronous save and end together with the other ranks (`close`), requeue the job under SLURM when
        `on_preempt(requeue=True)` asked for it (rank 0), then exit with status 75 (EX_TEMPFAIL). A non-zero
        status makes torch's agent restart the ranks when it has restarts left (`--max-restarts`), and shows a
        job that stopped before its end as not finished. Every rank must call it."""
        requeue = self._requeue and self.is_global_zero
        self.close()
        if requeue:
            _preemption.requeue_slurm_job()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _note_preemption(self, signum: int, frame: Any) -> None:
        self._preempted = True

    def should_stop(self) -> bool:
        """True on every rank once any rank has caught a preemption signal (see `on_preempt`). It is a
        collective (one scalar all-reduce): every rank must call it at the same point of the loop, so that all
        of them stop, and checkpoint, at the same step."""
        if self._strategy.is_distributed:
            self._require_launch("should_stop")
        return _preemption.any_rank_caught(self._strategy, self._preempted)

    # ---- logging and progress --------------------------------------------------------------------------------
    @property
    def loggers(self) -> list[Logger]:
        """The loggers given as `Loom(loggers=...)`, as a list."""
        return self._loggers

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Send one scalar to every logger (rank 0 only; other ranks do nothing)."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Send scalars to every logger (rank 0 only). Tensors are converted with `.item()`."""
        if not self.is_global_zero or not self._loggers:
            return
        values = {k: to_scalar(v) for k, v in metrics.items()}
        for logger in self._loggers:
            logger.log_metrics(metrics=values, step=step)  # by keyword, as Fabric calls loggers

    def finalize_loggers(self, status: str = "success") -> None:
        """Flush and close the loggers (call at the end of training): `logger.finalize(status)` on each."""
        if self.is_global_zero:
            for logger in self._loggers:
                finalize_logger(logger, status)

    def progress(
        self, iterable: Iterable[Any], total: int | None = None, desc: str | None = None, force: bool = False
    ) -> Progress:
        """A progress bar over `iterable` on rank 0 when stderr is a terminal (or `force=True`); elsewhere a plain
        iterator. `.set_postfix(loss=...)` shows values, `.write(msg)` prints a line on rank 0."""
        show = force or sys.stderr.isatty()
        return Progress(iterable, total, desc, show_bar=show, is_global_zero=self.is_global_zero)

    # ---- conveniences ----------------------------------------------------------------------------------------
    @property
    def logger(self) -> Logger | None:
        """The first of `loggers` (None without loggers)."""
        return self._loggers[0] if self._loggers else None

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call `hook_name(*args, **kwargs)` on every callback (`Loom(callbacks=...)`) that has such a method, as
        Fabric does: each gets only the keyword arguments its signature accepts (all of them with `**kwargs`), and
        an attribute of that name that is not callable is skipped with a warning."""
        _callbacks.call(self._callbacks, hook_name, args, kwargs)

    @contextlib.contextmanager
    def autocast(self) -> Generator[None, None, None]:
        """Run the code inside in the precision's autocast (what forward gets), e.g. a loss computed outside the
        model."""
        with self._strategy.precision.forward_context():
            yield

    def to_device(self, obj: Any) -> Any:
        """Move a module, a tensor, or the tensors in a nested collection to `loom.device`."""
        if isinstance(obj, nn.Module):
            return obj.to(self.device)
        return move_data_to_device(obj, self.device)

    @contextlib.contextmanager
    def init_tensor(self) -> Generator[None, None, None]:
        """Create tensors inside directly on `loom.device` in the precision's parameter dtype."""
        with self.device, self._strategy.precision.module_init_context():
            yield

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Rank 0 (of the job, or of each node with `local=True`) runs the code inside first, the other ranks
        after it, e.g. a download that the other ranks then read from disk. Every rank must enter it. The wait is
        bounded by `Loom(timeout=...)`."""
        rank = self.local_rank if local else self.global_rank
        if rank > 0:
            self.barrier()
        yield
        if rank == 0:
            self.barrier()

    def print(self, *args: Any, rank_zero: str = "local", **kwargs: Any) -> None:
        """`print(*args, **kwargs)` on local rank 0 of every node, as Fabric prints; with `rank_zero="global"`
        on global rank 0 only (one line for the whole job)."""
        if _prints_here(rank_zero, self.local_rank, self.global_rank):
            print(*args, **kwargs)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        """Seed Python, NumPy (if installed) and torch; returns the seed. See `torchloom.seed_everything`."""
        return seed_everything(seed, workers=workers, verbose=verbose)

    def __repr__(self) -> str:
        return (
            f"Loom(strategy={self._strategy!r}, device={self.device}, world_size={self.world_size}, "
            f"precision={self._strategy.precision})"
        )


def _run_users_run(loom: Loom, *args: Any, **kwargs: Any) -> Any:
    """What `Loom.run` runs on every rank: the subclass's own `run`."""
    return type(loom)._user_run(loom, *args, **kwargs)


def _not_an_op(group: Any, reduce_op: Any) -> Any:
    """Refuse a reduce op passed where the group goes (torchloom's order was `all_reduce(data, reduce_op)`;
    Fabric's, now ours, is `all_reduce(data, group, reduce_op)`)."""
    if isinstance(group, (str, ReduceOp)):
        raise MisuseError(
            f"The second argument of all_reduce/all_gather is the process group, got {group!r}. Pass the reduce "
            f"operation by name: all_reduce(data, reduce_op={group!r})."
        )
    return reduce_op


def _prints_here(rank_zero: str, local_rank: int, global_rank: int) -> bool:
    """Whether `loom.print(..., rank_zero=...)` prints on this rank."""
    if rank_zero == "local":
        return local_rank == 0
    if rank_zero == "global":
        return global_rank == 0
    raise MisuseError(
        f"loom.print(rank_zero={rank_zero!r}): use rank_zero='local' (local rank 0 of every node, the default, "
        "as Fabric prints) or rank_zero='global' (global rank 0 only)."
    )
