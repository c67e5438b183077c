"""`Loom`: the one object a training script talks to. It checks arguments and delegates to its strategy."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Generator, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, overload

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from torchloom import checkpointing, diagnostics, launcher
from torchloom._layout import clean_name
from torchloom.connector import command_line_defaults, configure
from torchloom.diagnostics import RECORD as _record
from torchloom.environments import TorchElasticEnvironment
from torchloom.errors import CollectiveTimeoutError, MisuseError
from torchloom.loggers import Logger, to_float
from torchloom.progress import Progress
from torchloom.seed import seed_everything
from torchloom.strategies.base import Strategy
from torchloom.wrappers import (
    SETUP_MARK,
    LoomDataLoader,
    LoomModule,
    LoomOptimizer,
    state_module,
    unwrap_optimizer,
    with_distributed_sampler,
)


class Loom:
    """Runs a hand-written training loop on one process, many processes, GPUs or nodes.

    Args:
        accelerator: "auto", "cpu", "cuda" or "mps".
        devices: on CPU the number of processes per node; on CUDA an int, a list of GPU indices, or "auto".
        num_nodes: number of machines.
        strategy: "auto", "single_device", "ddp", "fsdp", "fsdp2" or a `torchloom.strategies.Strategy`.
        precision: "32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true" or "16-true" (see README).
        timeout: how long a collective may wait for the other ranks before it fails (default 30 minutes).
        loggers: metric loggers (`torchloom.loggers.CSVLogger`, `TensorBoardLogger`) for `log`/`log_dict`.

    Under `torchloom run`, arguments left at their defaults take the command line's values; arguments given
    here win, with a warning when they disagree with the command line.
    """

    def __init__(
        self,
        accelerator: str = "auto",
        devices: int | str | list[int] = "auto",
        num_nodes: int = 1,
        strategy: str | Strategy = "auto",
        precision: str = "32-true",
        timeout: timedelta | None = None,
        loggers: Logger | list[Logger] | None = None,
    ) -> None:
        accelerator, devices, num_nodes, strategy, precision = command_line_defaults(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            strategy=strategy,
            precision=precision,
        )
        self._strategy = configure(accelerator, devices, num_nodes, strategy, precision, timeout)
        self._launched = False
        self._closed = False
        self._preempted = False
        self._modules: list[LoomModule] = []
        self._loggers: list[Logger] = (
            [] if loggers is None else list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
        )

    # ---- where this rank is ----------------------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def device(self) -> torch.device:
        return self._strategy.root_device

    # ---- launching -------------------------------------------------------------------------------------------
    def launch(self, fn: Callable[..., Any] | None = None, *args: Any) -> Any:
        """Start the ranks and join the process group.

        Without `fn`, a plain `python train.py` that wants several local processes re-runs itself once per rank
        (the launching process waits for them and exits with their status; under torchrun or SLURM nothing is
        started). With `fn`, runs `fn(loom, *args)` on every rank and returns rank 0's result; `fn` must be
        importable (defined at module level) because ranks are started with the spawn method.
        """
        if self._launched:
            raise MisuseError("loom.launch() was called twice. Call it once, before setting up models.")
        if fn is not None and not callable(fn):
            raise MisuseError(
                f"loom.launch(fn) needs a callable, got {type(fn).__name__}. Pass a function defined at "
                "module level, `loom.launch(train, *args)`, which runs train(loom, *args) on every rank; or "
                "call loom.launch() without arguments."
            )
        self._launched = True
        env = self._strategy.cluster_environment
        assert env is not None
        if env.creates_processes_externally or env.world_size() == 1:
            self._setup_rank()
            return fn(self, *args) if fn is not None else None
        num_processes = len(self._strategy.parallel_devices)
        where = (num_processes, self._strategy.num_nodes, env.node_rank(), env.main_address, env.main_port)
        if fn is None:
            launcher.launch_script(*where)  # never returns: this process waits for the ranks, then exits
        return launcher.launch_function(self, fn, args, *where)

    def _setup_rank(self) -> None:
        # In a rank started by an elastic agent, the environment it inherited from its parent's Loom is stale.
        if TorchElasticEnvironment.detect() and not isinstance(
            self._strategy.cluster_environment, TorchElasticEnvironment
        ):
            self._strategy.cluster_environment = TorchElasticEnvironment()
        self._launched = True
        launcher.record_errors_in_rank()
        self._strategy.setup_environment()
        if self._strategy.is_distributed and self.world_size > 1:
            diagnostics.start(self.global_rank, self.world_size)

    def close(self) -> None:
        """End this process's part of the job: wait for a pending asynchronous save (raising if it failed),
        then, with several processes, wait until every rank has called `close` (at most `timeout`) and destroy
        the process group. Every rank must call it; later calls do nothing.

        It runs by itself when the interpreter exits normally, and at the end of `with Loom(...) as loom:`.
        Ending together matters: a rank that tears down its connections while a peer is still inside a
        collective makes that peer abort, so a finished job would exit non-zero."""
        if self._closed:
            return
        self._closed = True
        try:
            self._strategy.finish_pending_save()
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
        if self._strategy.is_distributed and not self._launched:
            raise MisuseError(
                f"{what} was called before loom.launch(). Call loom.launch() first: it starts the ranks and "
                "joins the process group."
            )

    # ---- models, optimizers, data ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Create modules directly on `loom.device` in the precision's dtype. With `empty_init=True`, sharding
        strategies create parameters on the meta device and initialise them shard by shard in `setup_module`."""
        with self._strategy.module_init_context(empty_init):
            yield

    @overload
    def setup(self, module: nn.Module) -> LoomModule: ...
    @overload
    def setup(self, module: nn.Module, *optimizers: Optimizer) -> tuple[Any, ...]: ...

    def setup(self, module: nn.Module, *optimizers: Optimizer) -> Any:
        """Set up a model and its optimizers; returns `model` or `(model, *optimizers)`."""
        names = {id(p): clean_name(n) for n, p in module.named_parameters()}
        module = self.setup_module(module)
        if not optimizers:
            return module
        if self._strategy.replaces_parameters:
            for optimizer in optimizers:
                _rebind_optimizer(optimizer, names, module.module)
        return (module, *self._setup_optimizers(optimizers))

    def setup_module(self, module: nn.Module) -> LoomModule:
        """Move and wrap `module` for the strategy; returns a `LoomModule`."""
        if isinstance(module, LoomModule) or getattr(module, SETUP_MARK, False):
            raise MisuseError(
                "setup_module was called twice on the same module. Set up each model once and keep the returned "
                "LoomModule."
            )
        if not isinstance(module, nn.Module):
            raise MisuseError(
                f"setup_module expects a torch.nn.Module, got {type(module).__name__}. Pass the model itself "
                "(an nn.Module), not its state_dict or parameters."
            )
        self._require_launch("setup_module")
        precision = self._strategy.precision
        assert precision is not None
        module = precision.convert_module(module)
        forward_module = self._strategy.setup_module(module)
        object.__setattr__(module, SETUP_MARK, True)
        wrapped = LoomModule(forward_module, module, precision)
        self._modules.append(wrapped)
        return wrapped

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Prepare optimizers made from the parameters of set-up modules; returns one or a tuple."""
        if not optimizers:
            raise MisuseError(
                "setup_optimizers needs at least one optimizer. Pass them: loom.setup_optimizers(optimizer), "
                "or loom.setup_optimizers(opt_a, opt_b)."
            )
        out = self._setup_optimizers(optimizers)
        return out[0] if len(out) == 1 else tuple(out)

    def _setup_optimizers(self, optimizers: tuple[Optimizer, ...]) -> list[LoomOptimizer]:
        known = {id(p) for m in self._modules for p in m.module.parameters()}
        out = []
        for optimizer in optimizers:
            if isinstance(optimizer, LoomOptimizer):
                raise MisuseError("setup_optimizers was called twice on the same optimizer. Set it up once.")
            if not isinstance(optimizer, Optimizer):
                raise MisuseError(
                    f"setup_optimizers expects torch.optim.Optimizer, got {type(optimizer).__name__}. "
                    "Pass an optimizer built from the set-up model, e.g. "
                    "torch.optim.AdamW(model.parameters())."
                )
            optimizer = self._strategy.setup_optimizer(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            stray = sum(id(p) not in known for p in params)
            if stray and self._strategy.replaces_parameters:
                raise MisuseError(
                    f"The optimizer {type(optimizer).__name__} holds {stray} parameter(s) that strategy "
                    f"{self._strategy.name!r} replaced with sharded ones in setup_module. Create the optimizer after "
                    "setup_module: `model = loom.setup_module(model); optimizer = torch.optim.AdamW(model.parameters())"
                    "`, or pass both to `loom.setup(model, optimizer)`, which rebinds a fresh optimizer for you."
                )
            if stray:
                raise MisuseError(
                    f"The optimizer {type(optimizer).__name__} updates {stray} parameter(s) that belong to no module "
                    "set up with loom.setup_module. Call setup_module(model) first and build the optimizer from "
                    "model.parameters()."
                )
            assert self._strategy.precision is not None
            out.append(LoomOptimizer(optimizer, self._strategy.precision))
        return out

    def setup_dataloaders(
        self, *dataloaders: DataLoader, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Give each rank its own part of the data (shuffle kept, epoch advanced per pass) and move batches to
        `loom.device`. Returns one loader or a tuple."""
        if not dataloaders:
            raise MisuseError("setup_dataloaders needs at least one DataLoader.")
        out = []
        for loader in dataloaders:
            if not isinstance(loader, DataLoader):
                raise MisuseError(
                    f"setup_dataloaders expects torch DataLoaders, got {type(loader).__name__}."
                )
            if use_distributed_sampler and self.world_size > 1:
                seed = int(os.environ.get("TORCHLOOM_SEED", 0))
                loader = with_distributed_sampler(loader, self.world_size, self.global_rank, seed=seed)
            out.append(LoomDataLoader(loader, self.device if move_to_device else None))
        return out[0] if len(out) == 1 else tuple(out)

    # ---- training calls --------------------------------------------------------------------------------------
    def backward(
        self, tensor: torch.Tensor, *args: Any, model: LoomModule | None = None, **kwargs: Any
    ) -> None:
        """`tensor.backward()` through the precision (loss scaling) and strategy."""
        self._strategy.backward(tensor, model.forward_module if model is not None else None, *args, **kwargs)

    def clip_gradients(
        self,
        module: LoomModule,
        optimizer: Optimizer,
        max_norm: float | None = None,
        clip_val: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """Clip gradients by global norm (`max_norm`, returns the total norm before clipping) or by value
        (`clip_val`, returns None). Pass exactly one of them."""
        if (max_norm is None) == (clip_val is None):
            raise ValueError(
                "clip_gradients needs exactly one of max_norm= (clip by global norm) or clip_val= (clip by value)."
            )
        forward_module = self._setup_of(module, "clip_gradients").forward_module
        optimizer = unwrap_optimizer(optimizer)
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

    @contextlib.contextmanager
    def no_backward_sync(self, module: LoomModule, enabled: bool = True) -> Generator[None, None, None]:
        """Skip gradient synchronisation for the forward and backward passes inside (gradient accumulation);
        the first backward outside the block synchronises everything accumulated."""
        forward_module = self._setup_of(module, "no_backward_sync").forward_module
        with self._strategy.no_backward_sync(forward_module, enabled=enabled):
            yield

    def _setup_of(self, module: Any, what: str) -> LoomModule:
        if isinstance(module, LoomModule):
            return module
        for wrapped in self._modules:
            if wrapped.module is module:
                return wrapped
        raise MisuseError(
            f"{what} got a module that was not set up. Pass the object returned by loom.setup_module(model)."
        )

    # ---- collectives -----------------------------------------------------------------------------------------
    def all_reduce(self, data: Any, reduce_op: str = "mean") -> Any:
        """Reduce tensors (or nested dicts/lists of them) over all ranks: "mean", "sum", "max", "min"."""
        self._require_launch("all_reduce")
        # Every collective entered here is recorded (see `diagnostics`): a hang can then say who is where.
        with _record("all_reduce", data):
            return self._strategy.all_reduce(data, reduce_op)

    def all_gather(self, data: Any) -> Any:
        """Gather tensors from all ranks; each tensor comes back stacked with a leading world-size dimension."""
        self._require_launch("all_gather")
        with _record("all_gather", data):
            return self._strategy.all_gather(data)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send any picklable object from rank `src` to every rank."""
        self._require_launch("broadcast")
        with _record("broadcast", detail=f"src={src}"):
            return self._strategy.broadcast(obj, src)

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
        async_save: bool = False,
        fsync: bool = True,
    ) -> None:
        """Save modules, optimizers, objects with `state_dict()` and plain values. Every rank must call it.

        The format is the strategy's: one file (single device, DDP, FSDP with state_dict_type="full") or a
        directory of shards (FSDP's default "sharded"). It is written beside `path` under a temporary name,
        flushed to disk (fsync) and swapped into place only when complete, so neither a crash mid-save nor a
        power loss afterwards replaces a good checkpoint with a broken one. With `async_save=True` the write
        continues in the background; the next save or load (or the end of the process) waits for it and raises
        if it failed.

        `fsync=False` skips the flush to disk (as `torch.save` does, and DCP's `sync_files=False`): the save
        returns once the data is in the operating system's cache, which is faster where the disk is slower
        than memory. The swap is still atomic, so a killed process never leaves a broken checkpoint; a power
        loss or kernel crash soon after the save can."""
        self._require_launch("save")
        try:
            with _record("save"):
                self._strategy.save_checkpoint(
                    Path(path), state, self._owner_of(state), async_save=async_save, fsync=fsync
                )
        except CollectiveTimeoutError as error:
            # The collective that timed out is one inside save; what the user must change is the call to save.
            raise CollectiveTimeoutError(
                f"loom.save() on rank {self.global_rank} timed out waiting for the other ranks. Every rank "
                "must call loom.save at the same point (not only rank 0: drop any `if loom.is_global_zero:` "
                f"around it; rank 0 alone writes the file). {error}"
            ) from error

    def load(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool = False,
    ) -> dict[str, Any]:
        """Restore the objects of `state` in place (plain values are replaced in `state`) and return the
        checkpoint's entries that `state` did not name. With no `state`, return everything."""
        self._require_launch("load")
        with _record("load"):
            return self._strategy.load_checkpoint(
                Path(path),
                state or {},
                strict=strict,
                owner_of=self._owner_of(state or {}),
                weights_only=weights_only,
            )

    def load_raw(self, path: str | os.PathLike[str], obj: nn.Module | Optimizer, strict: bool = True) -> Any:
        """Load a plain state dict saved by `torch.save(model.state_dict(), path)` into a module or optimizer, or
        a Hugging Face safetensors checkpoint (`model.safetensors`, or a directory with
        `model.safetensors.index.json`) into a module in any layout, each rank reading only what it holds. For
        the latter, returns `(missing_keys, unexpected_keys)` (non-empty only with `strict=False`)."""
        self._require_launch("load_raw")
        if checkpointing.hf.is_checkpoint(Path(path)):
            if not isinstance(obj, (nn.Module, LoomModule)):
                raise MisuseError("A safetensors checkpoint holds model weights: pass the model to load_raw.")
            with _record("load_raw"), checkpointing.torch_internal_warnings_filtered():
                return checkpointing.hf.load(self._strategy, state_module(obj), Path(path), strict)
        raw = checkpointing.full.read(Path(path), weights_only=True)
        if isinstance(obj, (nn.Module, LoomModule)):
            checkpointing.load_module(self._strategy, state_module(obj), raw, strict, name=str(path))
        else:
            unwrap_optimizer(obj).load_state_dict(raw)

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
        other files already there (tokenizer) are kept."""
        self._require_launch("save_raw")
        with _record("save_raw"), checkpointing.torch_internal_warnings_filtered():
            checkpointing.hf.save(
                self._strategy, state_module(model), Path(out_dir), dtype, max_shard_size, config
            )

    def _owner_of(self, state: dict[str, Any]) -> Callable[[Optimizer], nn.Module | None]:
        # A `state` that is not a dict is refused, with its fix, when the checkpoint is collected.
        values = state.values() if isinstance(state, dict) else ()
        candidates = [state_module(v) for v in values if isinstance(v, (nn.Module, LoomModule))]
        candidates += [m.forward_module for m in self._modules]

        def owner(optimizer: Optimizer) -> nn.Module | None:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for module in candidates:
                if ids <= {id(p) for p in module.parameters()}:
                    return module
            return None

        return owner

    # ---- preemption ------------------------------------------------------------------------------------------
    def on_preempt(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        """Catch these signals (default SIGTERM, what clusters send before preempting a job) instead of dying, so
        the training loop can write a final checkpoint. Check `loom.should_stop()` once per step:

            loom.on_preempt()
            for step in ...:
                train_step()
                if loom.should_stop():
                    loom.save(path, state)
                    break

        The launcher gives the ranks TORCHLOOM_SHUTDOWN_TIMEOUT seconds (default 5) after SIGTERM before it
        kills them; raise it if a final checkpoint takes longer."""
        for sig in signals:
            signal.signal(sig, self._note_preemption)

    def _note_preemption(self, signum: int, frame: Any) -> None:
        self._preempted = True

    def should_stop(self) -> bool:
        """True on every rank once any rank has caught a preemption signal (see `on_preempt`). It is a
        collective (one scalar all-reduce): every rank must call it at the same point of the loop, so that all
        of them stop, and checkpoint, at the same step."""
        flag = torch.tensor(1.0 if self._preempted else 0.0, device=self.device)
        if self._strategy.is_distributed:
            self._require_launch("should_stop")
            with _record("should_stop"):
                flag = self._strategy.all_reduce(flag, reduce_op="max")
        return bool(flag.item() > 0)

    # ---- logging and progress --------------------------------------------------------------------------------
    @property
    def loggers(self) -> list[Logger]:
        return self._loggers

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Send one scalar to every logger (rank 0 only; other ranks do nothing)."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Send scalars to every logger (rank 0 only). Tensors are converted with `.item()`."""
        if not self.is_global_zero or not self._loggers:
            return
        values = {k: to_float(v) for k, v in metrics.items()}
        for logger in self._loggers:
            logger.log_metrics(values, step=step)

    def finalize_loggers(self) -> None:
        """Flush and close the loggers (call at the end of training)."""
        if self.is_global_zero:
            for logger in self._loggers:
                logger.finalize()

    def progress(
        self, iterable: Iterable[Any], total: int | None = None, desc: str | None = None, force: bool = False
    ) -> Progress:
        """A progress bar over `iterable` on rank 0 when stderr is a terminal (or `force=True`); elsewhere a plain
        iterator. `.set_postfix(loss=...)` shows values, `.write(msg)` prints a line on rank 0."""
        show = force or sys.stderr.isatty()
        return Progress(iterable, total, desc, show_bar=show, is_global_zero=self.is_global_zero)

    # ---- conveniences ----------------------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    @staticmethod
    def seed_everything(seed: int) -> int:
        """Seed Python, NumPy (if installed) and torch; returns the seed."""
        return seed_everything(seed)

    def __repr__(self) -> str:
        return (
            f"Loom(strategy={self._strategy!r}, device={self.device}, world_size={self.world_size}, "
            f"precision={self._strategy.precision})"
        )


def _rebind_optimizer(optimizer: Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """Point a not-yet-stepped optimizer at the parameters that sharding put in place of the originals."""
    current = {id(p) for p in module.parameters()}
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
