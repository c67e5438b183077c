"""The Strategy interface: how modules are wrapped, gradients synchronised, and state collected.

`Loom` delegates every distributed decision to its strategy. A strategy is built in two steps: its constructor
takes the user's options (`FSDPStrategy(auto_wrap_policy=...)` is a configuration), and the connector
(`torchloom.connector`) completes it once with `_bind(...)`: the accelerator, precision, cluster environment and
devices that `Loom(...)`'s arguments select. After that step every property below is set; before it, reading one
raises an error that says to pass the strategy to `Loom(strategy=...)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode

from torchloom import _torch_compat
from torchloom.accelerators import Accelerator
from torchloom.environments import ClusterEnvironment
from torchloom.errors import ConfigurationError, MisuseError
from torchloom.precision import Precision
from torchloom.strategies import _clipping
from torchloom.wrappers import steps_kinds_apart

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

DEFAULT_TIMEOUT = timedelta(minutes=30)

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


@dataclass(frozen=True)
class _Binding:
    """What `Loom(...)`'s arguments decide for a strategy; see `Strategy._bind`."""

    accelerator: Accelerator
    precision: Precision
    cluster_environment: ClusterEnvironment
    parallel_devices: list[torch.device]
    num_nodes: int
    timeout: timedelta


class _SkipNNInit(TorchFunctionMode):
    """Inside, the functions of `torch.nn.init` return their tensor unchanged (Fabric's `_EmptyInit`)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


class Strategy:
    """Single-process base: no wrapping, collectives are the identity.

    Args:
        timeout: how long a collective waits for the other ranks (default 30 minutes); the same as
            `Loom(timeout=...)`, which may be given instead (giving both, with different values, is refused).
    """

    #: Registry name, e.g. "ddp".
    name: str = ""
    #: This rank's replica group under `torchloom run --replica-groups` (a `torchloom.fault_tolerance.ReplicaGroup`,
    #: set by the strategies that support it), else None.
    replicas: Any = None
    #: Why this strategy cannot run inside a replica group, and what to use instead; None where it can (its model
    #: is data-parallel across the groups, and rank r of every group holds the same pieces of it, which
    #: `torchloom.fault_tolerance.exchange` averages and heals piece by piece).
    replica_groups_refusal: str | None = (
        "it runs one process; a replica group runs strategy 'ddp' (the default), 'fsdp2' or ModelParallelStrategy"
    )

    def __init__(self, timeout: timedelta | None = None) -> None:
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ConfigurationError(f"timeout must be a datetime.timedelta, got {timeout!r}.")
        self._timeout = timeout
        self._binding: _Binding | None = None

    # ---- the one step that completes a strategy --------------------------------------------------------------
    def _bind(
        self,
        accelerator: Accelerator,
        precision: Precision,
        cluster_environment: ClusterEnvironment,
        parallel_devices: list[torch.device],
        num_nodes: int,
        timeout: timedelta | None = None,
    ) -> None:
        """Complete the strategy with what `Loom(...)` selected, then check the options against it (before any
        process starts). Called once, by the connector; a strategy belongs to one `Loom`."""
        if self._binding is not None:
            raise ConfigurationError(
                f"This {type(self).__name__} already belongs to another Loom. Construct a new strategy for each "
                "Loom: it holds that Loom's process groups and modules."
            )
        if timeout is not None and self._timeout is not None and timeout != self._timeout:
            raise ConfigurationError(
                f"Loom(timeout={timeout!r}) and {type(self).__name__}(timeout={self._timeout!r}) disagree. Pass "
                "the timeout in one place."
            )
        self._binding = _Binding(
            accelerator,
            precision,
            cluster_environment,
            list(parallel_devices),
            num_nodes,
            timeout or self._timeout or DEFAULT_TIMEOUT,
        )
        try:
            self.validate()
        except BaseException:
            self._binding = None  # a strategy refused here can be fixed and passed again
            raise

    @property
    def _bound(self) -> _Binding:
        if self._binding is None:
            raise MisuseError(
                f"This {type(self).__name__} is not part of a Loom yet, so it has no accelerator, precision or "
                f"processes. Pass it to Loom(strategy=...), which completes it, and use loom.strategy."
            )
        return self._binding

    @property
    def accelerator(self) -> Accelerator:
        return self._bound.accelerator

    @property
    def precision(self) -> Precision:
        return self._bound.precision

    @property
    def cluster_environment(self) -> ClusterEnvironment:
        return self._bound.cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, environment: ClusterEnvironment) -> None:
        # A rank started by an elastic agent replaces the environment it inherited from the launching process,
        # and learns the node count of its attempt (an elastic rendezvous decides it only now).
        nodes = environment.num_nodes() or self._bound.num_nodes
        self._binding = replace(self._bound, cluster_environment=environment, num_nodes=nodes)

    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._bound.parallel_devices

    @property
    def num_nodes(self) -> int:
        return self._bound.num_nodes

    @property
    def timeout(self) -> timedelta:
        return self._bound.timeout

    # ---- placement -------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    @property
    def is_distributed(self) -> bool:
        return False

    def validate(self) -> None:
        """Check options against the accelerator and precision, before any process starts."""

    def setup_environment(self) -> None:
        """Called once per rank by `Loom.launch()` before the user's code runs."""
        self.accelerator.setup_device(self.root_device)
        self.precision.check_device(self.root_device)

    def teardown(self) -> None:
        """Release what `setup_environment` took."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """How data is split (Fabric's name): `num_replicas` ranks read different samples, this rank is `rank` of
        them. Every rank reads its own part here; "model_parallel" splits over the data-parallel ranks only."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ---- modules and optimizers ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Modules created inside land on the right device and dtype. `empty_init=True` skips initialisation
        work: strategies that can materialise create parameters on the meta device (buffers stay real, so the
        ones computed in `__init__`, such as rotary `inv_freq`, keep their values); others (one device, DDP)
        create everything on the target device and skip `torch.nn.init`, as Fabric does there: the parameters
        hold uninitialised memory until loaded or reset, and no random numbers are drawn, so a program that
        calls `reset_parameters()` afterwards starts from Fabric's weights."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.root_device)
            if empty_init and self.supports_meta_init:
                stack.enter_context(parameters_on_meta())
            elif empty_init:
                stack.enter_context(_SkipNNInit())
            stack.enter_context(self.precision.module_init_context())
            yield

    #: Whether `setup_module` can materialise a model created on the meta device.
    supports_meta_init: bool = False
    #: Whether `setup_module` replaces the module's parameters (sharding), so optimizers must come after it.
    replaces_parameters: bool = False
    #: Whether ranks hold different pieces of the gradients, so fp16 loss scaling must agree over ranks.
    sharded_gradients: bool = False

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> nn.Module:
        """Move/wrap `module` and return what the forward should run through (`move_to_device=False`: leave it
        where it is; sharding strategies do not take that argument)."""
        self._check_not_meta(module)
        self.precision.check_device(self.root_device)  # one process may never call launch()
        return module.to(self.root_device) if move_to_device else module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, **kwargs: Any) -> None:
        self.precision.backward(tensor, **kwargs)

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Generator[None, None, None]:
        """Skip gradient synchronisation for backward passes inside (gradient accumulation)."""
        yield

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Scale the gradients to a global norm of at most `max_norm`; return the norm before (`_clipping`)."""
        return _clipping.clip_by_norm(
            self.precision,
            optimizer,
            max_norm,
            norm_type,
            error_if_nonfinite,
            self.root_device,
            self._norm_groups(module),
        )

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        """Clamp every gradient element to [-clip_val, clip_val] (`_clipping`)."""
        _clipping.clip_by_value(self.precision, optimizer, clip_val)

    def _norm_groups(self, module: nn.Module) -> _clipping.NormGroups:
        """Where the pieces of `module`'s gradient norm meet beyond their own placements (see
        `_clipping.NormGroups`): nowhere for one process and DDP, whose gradients are the same on every rank."""
        return _clipping.NormGroups()

    def _check_not_meta(self, module: nn.Module) -> None:
        meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if meta:
            raise MisuseError(
                f"The module has {len(meta)} tensor(s) on the meta device (e.g. {meta[0]!r}), and strategy "
                f"{self.name!r} cannot materialise them. Create the model with `loom.init_module()` "
                "(empty_init=False), or use strategy='fsdp'/'fsdp2', which initialise meta-device models shard by shard."
            )

    # ---- state for checkpoints -------------------------------------------------------------------------------
    # What `torchloom.checkpointing` needs from a strategy (its `StateAccess` protocol: these state-dict
    # methods, the checkpoint format and group, ranks, broadcast and all_gather_object); the checkpoints
    # themselves are the Checkpointer's, which `Loom` holds. torch.distributed.checkpoint's state-dict API serves
    # every strategy: keys are the original module's own names, and optimizer state is keyed by parameter name
    # rather than position. `full=False` asks for the sharded form (DTensors) that the sharded checkpoint format
    # writes; unsharded strategies have only one form. The API is imported on first use: it pulls in FSDP and
    # DTensor (about a second), which the launching process and a job that never saves do not need.

    #: The checkpoint format `loom.save` writes: "full" (one file) or "sharded" (a directory).
    checkpoint_format: str = "full"

    def _state_dict_options(self, full: bool, loading: bool = False, **kwargs: Any) -> StateDictOptions:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(**kwargs)

    def module_state_dict(self, module: nn.Module, full: bool = True) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module, options=self._state_dict_options(full))

    def tied_weight_names(self) -> list[list[str]]:
        """Ties held as separate tensors: none here (a tie inside the module is one parameter)."""
        return []

    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True, full: bool = True
    ) -> Any:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        return set_model_state_dict(
            module, state, options=self._state_dict_options(full, loading=True, strict=strict)
        )

    def optimizer_state_dict(
        self, module: nn.Module, optimizer: Optimizer, full: bool = True, template: bool = False
    ) -> dict[str, Any]:
        """The optimizer's state dict. With `template`, the template to load a checkpoint into: state for every
        parameter, which PyTorch creates (a zero-gradient step at lr 0) if the optimizer has none yet."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        had_state = bool(optimizer.state)
        with steps_kinds_apart(optimizer):  # PyTorch steps an optimizer without state (see there)
            state = get_optimizer_state_dict(module, optimizer, options=self._state_dict_options(full))
        if not had_state and not template:
            # PyTorch gives an optimizer without state and without gradients (before its first step) state to
            # save by stepping it with zero gradients at lr 0: that would leave the live optimizer one step count
            # ahead (Adam's next update then uses the wrong bias correction) and save state it never had. Undo
            # both, so a checkpoint holds exactly the state the optimizer had.
            optimizer.state.clear()
            state["state"] = {}
        return state

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool = True
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        stateless = _params_without_state(optimizer, state)
        # strict=False: a parameter without saved state is no damage, it had none when saved (it never got a
        # gradient); with strict, PyTorch refuses it. A truncated sharded checkpoint still fails in DCP's load,
        # which asks for every key of every parameter that has state (`sharded._stored_optimizer_state`).
        with steps_kinds_apart(optimizer):  # PyTorch steps an optimizer without state (see there)
            set_optimizer_state_dict(
                module,
                optimizer,
                _torch_compat.optimizer_state_to_load(state),
                options=self._state_dict_options(full, loading=True, strict=False),
            )
        # PyTorch initialises the optimizer's state (a zero-gradient step at lr 0) before it loads, and the full
        # format's load keeps that state for parameters the checkpoint has none for; a parameter that had no state
        # when saved (before the first step, after a skipped one, or one that never got a gradient) gets none.
        for param in stateless:
            optimizer.state.pop(param, None)

    @property
    def checkpoint_group(self) -> Any:
        """The process group checkpoint I/O coordinates over (None in one process)."""
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    # ---- collectives (identity in one process) ---------------------------------------------------------------
    def all_reduce(self, data: Any, reduce_op: str = "mean", group: Any = None) -> Any:
        _reduce_op(reduce_op)
        return data

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return torch.utils._pytree.tree_map(
            lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, data
        )

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self, name: str | None = None) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@contextlib.contextmanager
def parameters_on_meta() -> Generator[None, None, None]:
    """Parameters registered inside move to the meta device as they are registered; buffers do not (what
    `accelerate.init_empty_weights(include_buffers=False)` does). Modules call `reset_parameters()` after
    registering their parameters, so that initialisation runs on meta and costs nothing; only the empty tensor
    a module allocates for one parameter exists for a moment."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        param = module._parameters.get(name)
        # Plain tensors only: a DTensor registered here is fully_shard's, already sharded. A fake tensor (the
        # planner's run) stands for a plain one.
        if (
            param is not None
            and not param.is_meta
            and (type(param.data) is torch.Tensor or _torch_compat.is_fake(param.data))
        ):
            extra = dict(param.__dict__)  # attributes some libraries hang on parameters
            kind = (
                nn.Parameter if _torch_compat.is_fake(param) else type(param)
            )  # a fake Parameter is a FakeTensor
            meta = kind(param.to("meta"), requires_grad=param.requires_grad)
            # (a fake tensor's own attributes, its device among them, stay the new tensor's)
            meta.__dict__.update({key: value for key, value in extra.items() if key not in meta.__dict__})
            module._parameters[name] = meta

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextlib.contextmanager
def real_parameters() -> Generator[None, None, None]:
    """Inside `parameters_on_meta()`: register parameters as they are, for a wrapper such as FSDP1 that
    re-registers views of its own (real) flat parameter."""
    patched = nn.Module.register_parameter
    nn.Module.register_parameter = _REGISTER_PARAMETER  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = patched  # type: ignore[method-assign]


_REGISTER_PARAMETER = nn.Module.register_parameter


def _reduce_op(name: str) -> dist.ReduceOp.RedOpType:
    key = name.lower() if isinstance(name, str) else name
    if key not in _REDUCE_OPS:
        raise ValueError(f"Unknown reduce_op {name!r}. Valid: {', '.join(repr(k) for k in _REDUCE_OPS)}.")
    return _REDUCE_OPS[key]


def _params_without_state(optimizer: Optimizer, state: dict[str, Any]) -> list[torch.Tensor]:
    """The optimizer's parameters that `state` (a name-keyed optimizer state dict) holds no state for. Its groups
    list parameter names in the optimizer's own order (what PyTorch's loading relies on too); where the layout
    differs (FSDP1's flat parameters), none are named and PyTorch's load alone decides."""
    saved_state, saved_groups = state.get("state"), state.get("param_groups")
    if not isinstance(saved_state, dict) or not isinstance(saved_groups, list):
        return []
    if not saved_state:
        return [p for group in optimizer.param_groups for p in group["params"]]
    if len(saved_groups) != len(optimizer.param_groups):
        return []
    out: list[torch.Tensor] = []
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        names = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(names, list) or len(names) != len(group["params"]):
            return []
        out.extend(p for name, p in zip(names, group["params"], strict=True) if name not in saved_state)
    return out
