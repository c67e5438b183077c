"""`PipelineStrategy`: pipeline parallelism (torch's schedules) on a 3-D mesh with data and tensor parallelism.

The stage code (splitting, schedules) lives in `torchloom.pipelining`; this file binds it to a `Loom`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim import Optimizer

from torchloom._layout import clean_name
from torchloom._text import count
from torchloom.errors import CheckpointError, ConfigurationError, MisuseError
from torchloom.pipelining import _checks, _grads, _schedule, _split, _state, _ties
from torchloom.strategies import _clipping
from torchloom.strategies._replicated import broadcast_tensors
from torchloom.strategies._sharded import holds_tensors
from torchloom.strategies.parallel import ParallelStrategy

PIPELINE_PARALLEL = "pipeline_parallel"
DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"


def _positive(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigurationError(f"PipelineStrategy({what}={value!r}): {what} must be a positive int.")


class PipelineStrategy(ParallelStrategy):
    """Pipeline parallelism: the model cut into stages, one (or several) per pipeline rank, run by one of
    torch's schedules; with data and tensor parallelism inside each stage on the same mesh.

    Args:
        parallelize_fn: optional `fn(stage_module, device_mesh) -> stage_module`, called once per stage of this
            rank, as `ModelParallelStrategy` calls it for the whole model: `parallelize_module` over
            `device_mesh["tensor_parallel"]`, `fully_shard` over `device_mesh["data_parallel"]` (or
            `**strategy.unit_kwargs()`). Parameters it leaves plain are kept identical on the stage's
            data-parallel ranks and their gradients averaged.
        pipeline_parallel_size: ranks a batch flows through, one after another.
        data_parallel_size: ranks that read different data. `pp x dp x tp` must be the world size.
        tensor_parallel_size: ranks that split each layer of a stage.
        split_points: module names where a stage begins (e.g. `["layers.4"]`), one fewer than the stages; the
            forward is traced (torch's `pipeline()`) on the meta device with `example_input`.
        split_fn: instead of split points, `fn(model, stage_index, num_stages) -> stage module`: a module that
            runs one stage, holding that stage's layers under their names in the model (a copy of the model with
            the other layers deleted). Needed for a forward the tracer cannot follow, and for tensor parallelism
            (its plans match `nn.Linear` children, which traced stages do not keep).
        example_input: one micro-batch of the model's input (a tensor or a tuple), for tracing `split_points`.
        schedule: "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
            "zbv_zero_bubble".
        n_microbatches: micro-batches each batch is cut into (must divide the per-rank batch).
        stages_per_rank: stages each pipeline rank holds (2 or more for the interleaved and zero-bubble ones).
        save_distributed_checkpoint: True: every rank writes its stage's shards (a directory); False: rank 0
            writes one file with the whole model.

    A batch runs with `loom.forward_backward(model, inputs, target, loss_fn)` and, forward only, with
    `loom.evaluate(...)` (between optimizer steps; not through "zbv_zero_bubble"); both are the plain forward
    (and backward) under any other strategy. Every precision works: `16-mixed` scales each micro-batch's loss
    and agrees on overflows over every rank. A model built under `loom.init_module(empty_init=True)` gets, on
    each rank's stages, the values one process draws from the same seed. `loom.save_raw` writes the whole model
    in Hugging Face's layout, each stage's files from that stage's ranks.
    """

    name = "pipeline"
    replaces_parameters = True
    replica_groups_refusal = (
        "a pipeline's gradients are reduced by its schedule, stage by stage, and its state is its stages', which "
        "the replica groups do not average or heal in this version; inside a replica group use "
        "ModelParallelStrategy (tensor parallel with fully_shard) or strategy='fsdp2'"
    )
    # `init_module(empty_init=True)` puts the parameters on the meta device: each rank then allocates and
    # initialises only its own stages (`_split.materialize`). Without it the base class would build the whole model
    # on the device with `torch.nn.init` skipped (Fabric's one-device rule), and the stages would train from
    # uninitialised memory.
    supports_meta_init = True
    #: Each rank's model holds only its stages: checkpoint loading checks keys against every rank's together.
    holds_module_parts = True
    # Each stage's ranks hold other gradients: fp16's loss scaler takes its found-inf decision over every rank
    # (`AgreedGradScaler`), so all skip the same steps and keep one scale.
    sharded_gradients = True

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
        pipeline_parallel_size: int = 2,
        data_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        *,
        split_points: Sequence[str] | None = None,
        split_fn: _split.SplitFn | None = None,
        example_input: Any = None,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        stages_per_rank: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend)
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ConfigurationError(
                f"PipelineStrategy(parallelize_fn={parallelize_fn!r}) must be a function (stage, device_mesh) -> "
                "stage, or None."
            )
        if (split_points is None) == (split_fn is None):
            raise ConfigurationError(
                "PipelineStrategy needs exactly one of split_points=[module names where a stage begins] and "
                "split_fn=fn(model, stage_index, num_stages) -> stage module."
            )
        if split_points is not None and example_input is None:
            raise ConfigurationError(
                "PipelineStrategy(split_points=...) traces the forward: pass example_input= one micro-batch of the "
                "model's input (a tensor or a tuple), or pass split_fn instead."
            )
        self.parallelize_fn = parallelize_fn
        self.pipeline_parallel_size = _positive(pipeline_parallel_size, "pipeline_parallel_size")
        self.data_parallel_size = _positive(data_parallel_size, "data_parallel_size")
        self.tensor_parallel_size = _positive(tensor_parallel_size, "tensor_parallel_size")
        self.split_points = list(split_points) if split_points is not None else None
        self.split_fn = split_fn
        self.example_input = example_input
        self.schedule = _schedule.schedule_name(schedule)
        self.stages_per_rank = _positive(stages_per_rank, "stages_per_rank")
        _schedule.check_stages_per_rank(self.schedule, self.stages_per_rank)
        self.n_microbatches = _positive(
            n_microbatches if n_microbatches is not None else self.num_stages, "n_microbatches"
        )
        if self.schedule == "1f1b" and self.n_microbatches < self.num_stages:
            raise ConfigurationError(
                f"schedule='1f1b' needs at least as many micro-batches as stages: n_microbatches="
                f"{self.n_microbatches} < {self.num_stages} stages. Raise n_microbatches (fewer leave the "
                "pipeline mostly idle), or use schedule='gpipe'."
            )
        self.save_distributed_checkpoint = bool(save_distributed_checkpoint)
        self._mesh: DeviceMesh | None = None
        self._runner: _schedule.Runner | None = None
        self._plain: list[nn.Parameter] = []
        self._named_plain: list[tuple[str, nn.Parameter]] = []
        self._checked_tp = False
        self._stage_group: dist.ProcessGroup | None = None
        self._syncing = True
        self._tie_groups: list[list[str]] = []
        self._ties: list[_ties.Tie] = []
        self._tie_bases: _ties.Bases | None = None
        self._mode_bound: list[str] = []

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {
            PIPELINE_PARALLEL: self.pipeline_parallel_size,
            DATA_PARALLEL: self.data_parallel_size,
            TENSOR_PARALLEL: self.tensor_parallel_size,
        }

    def validate(self) -> None:
        super().validate()
        pp, dp, tp, world = (*self.mesh_shape.values(), self.world_size)
        if pp * dp * tp != world:
            fix = (
                f"data_parallel_size={world // (pp * tp)}"
                if world % (pp * tp) == 0
                else f"pipeline_parallel_size={world}, data_parallel_size=1, tensor_parallel_size=1"
            )
            raise ConfigurationError(
                f"PipelineStrategy(pipeline_parallel_size={pp}, data_parallel_size={dp}, tensor_parallel_size={tp}) "
                f"makes a mesh of {pp} x {dp} x {tp} = {pp * dp * tp} ranks, but this job has "
                f"{count(world, 'process')}: the product must equal the world size (devices x num_nodes), e.g. "
                f"{fix}."
            )

    def setup_environment(self) -> None:
        self.validate()
        super().setup_environment()

    def teardown(self) -> None:
        self._runner = None
        self._mesh = None
        self._stage_group = None
        super().teardown()

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh ("pipeline_parallel", "data_parallel", "tensor_parallel"), made on first use."""
        if self._mesh is None:
            self._require_group("the 'pipeline' device mesh")
            shape = self.mesh_shape
            self._mesh = init_device_mesh(
                self.root_device.type, tuple(shape.values()), mesh_dim_names=tuple(shape)
            )
        return self._mesh

    def unit_kwargs(self) -> dict[str, Any]:
        """What to pass to `fully_shard` in `parallelize_fn`: the data-parallel mesh (and the precision's policy)."""
        kwargs: dict[str, Any] = {"mesh": self.device_mesh[DATA_PARALLEL]}
        compute = self.precision.autocast_dtype
        if compute is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            # Half-precision compute over fp32 sharded weights, gradients reduced in fp32 (as "fsdp2" does).
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        return kwargs

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Data is split over the data-parallel ranks only: a pipeline (and its tensor-parallel ranks) reads one
        batch."""
        mesh = self.device_mesh[DATA_PARALLEL]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @property
    def checkpoint_format(self) -> str:  # type: ignore[override]
        return "sharded" if self.save_distributed_checkpoint else "full"

    # ---- setup -------------------------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> nn.Module:
        """Cut the model into this rank's stages, place them, share tied weights across stages, start each stage's
        replicas from one set of values, apply `parallelize_fn`, and hand the stages to the schedule."""
        self._require_group("setup_module with PipelineStrategy")
        if self._runner is not None:
            raise MisuseError(
                "PipelineStrategy sets up one model per Loom: make a Loom for each pipelined model."
            )
        ties = _split.tie_groups(module)
        trainable = _split.tie_trainable(module, ties)
        stages, holdings = self._cut(module, ties)
        self._place(stages, module)
        self._share_ties(stages, ties, trainable, holdings)
        self._start_replicas_alike(stages)
        stages = self._parallelize(stages)
        self._named_plain = [
            (n, p) for s in stages.values() for n, p in s.named_parameters() if type(p.data) is torch.Tensor
        ]
        self._plain = [p for _, p in self._named_plain]
        _split.graft(module, [stages[i] for i in sorted(stages)])
        module.register_forward_pre_hook(_refuse_forward)
        pp_mesh = self.device_mesh[PIPELINE_PARALLEL]
        self._runner = _schedule.Runner(
            stages,
            self.num_stages,
            self.schedule,
            self.n_microbatches,
            self.root_device,
            pp_mesh.get_group(),
            [int(r) for r in _along_pp(self.device_mesh)],
        )
        return module

    def _cut(self, module: nn.Module, ties: Any) -> tuple[dict[int, nn.Module], list[Any]]:
        """This rank's stages (traced at `split_points`, or the user's `split_fn`), and which tied weights every
        rank's stages hold. Every rank learns every rank's problems, so all raise together instead of some
        waiting in a collective."""
        ids = _schedule.stage_ids_of(
            self.device_mesh[PIPELINE_PARALLEL].get_local_rank(),
            self.pipeline_parallel_size,
            self.stages_per_rank,
            self.schedule,
        )
        problems: list[str] = []
        stages: dict[int, nn.Module] = {}
        try:
            if self.split_points is not None:
                _split.check_split_points(module, self.split_points, self.num_stages)
                example = (
                    self.example_input if isinstance(self.example_input, tuple) else (self.example_input,)
                )
                stages = _split.trace_stages(module, self.split_points, example, ids)
            else:
                assert self.split_fn is not None
                stages = _split.user_stages(module, self.split_fn, self.num_stages, ids)
            problems = _split.stage_problems(stages)
        except MisuseError as error:
            problems = [str(error)]
        _ties.drop_unused(stages, ties)
        everyone = self.all_gather_object((problems, _split.tie_holdings(stages, ties)))
        found = sorted({p for rank_problems, _ in everyone for p in rank_problems})
        if found:
            raise MisuseError("Cannot cut the model into pipeline stages: " + "; ".join(found))
        return stages, [holdings for _, holdings in everyone]

    def _place(self, stages: dict[int, nn.Module], module: nn.Module) -> None:
        """The stages' tensors made real (a model built on the meta device gets one process's draw) on this
        rank's device."""
        _split.materialize(stages, module, self.root_device)
        # Every rank learns which traced modules of the whole pipeline ignore eval(), to refuse it together.
        self._mode_bound = sorted(
            {n for names in self.all_gather_object(_split.mode_bound(stages)) for n in names}
        )
        for stage in stages.values():
            stage.to(self.root_device)

    def _share_ties(
        self, stages: dict[int, nn.Module], ties: Any, trainable: Any, holdings: list[Any]
    ) -> None:
        """A weight tied across stages: a copy on each stage that uses it, kept equal by summing their gradients
        over a group of exactly the ranks that hold a copy."""
        _ties.retie(stages, ties)
        self._tie_groups = ties
        pp_rank_of = {
            i: r
            for r in range(self.pipeline_parallel_size)
            for i in _schedule.stage_ids_of(
                r, self.pipeline_parallel_size, self.stages_per_rank, self.schedule
            )
        }
        self._ties = _ties.plan(ties, trainable, holdings, pp_rank_of)
        _ties.make_groups(self._ties, self.device_mesh, self.backend)

    def _start_replicas_alike(self, stages: dict[int, nn.Module]) -> None:
        """The stage's data- and tensor-parallel ranks start from one set of values (their first rank's), and
        the copies of a tied weight from one value."""
        self._stage_group = self._make_stage_groups(self.device_mesh)
        for stage in stages.values() if self._stage_group is not None else ():
            broadcast_tensors(
                [t for t in (*stage.parameters(), *stage.buffers()) if type(t.data) is torch.Tensor],
                device=self.root_device,
                group=self._stage_group,
            )
        _ties.collect(self._ties, stages)
        _ties.sync_values(self._ties)

    def _parallelize(self, stages: dict[int, nn.Module]) -> dict[int, nn.Module]:
        """The user's `parallelize_fn` applied to each stage, and what it made checked."""
        if self.parallelize_fn is not None:
            for i in sorted(stages):
                result = self.parallelize_fn(stages[i], self.device_mesh)
                if not isinstance(result, nn.Module):
                    raise MisuseError(
                        f"parallelize_fn returned {type(result).__name__} for stage {i}, not the stage module: it "
                        "must end with `return model`."
                    )
                stages[i] = result
        self._check_parallelized(stages)
        return stages

    def _check_parallelized(self, stages: dict[int, nn.Module]) -> None:
        """What parallelize_fn made that cannot train correctly (found by the scenario engine), refused on every
        rank together: a weight tied between two `fully_shard` units (each unit would train its own copy), and
        tensor-parallel DTensors outside every unit at data_parallel_size > 1 (neither a unit nor the
        plain-gradient averaging would reduce their gradients: the replicas would train apart), as the sharded
        strategies and `ModelParallelStrategy` refuse them."""
        _ties.collect(self._ties, stages)  # parallelize_fn may have replaced the copies
        problems = _checks.parallelized_problems(
            stages, self.data_parallel_size, self.schedule, DATA_PARALLEL
        )
        everyone = self.all_gather_object((problems, _ties.layout_problems(self._ties)))
        found = sorted({p for rank_problems, _ in everyone for p in rank_problems})
        found += _ties.mismatches(self._ties, [layouts for _, layouts in everyone])
        if found:
            raise MisuseError("; ".join(found))

    def _make_stage_groups(self, mesh: DeviceMesh) -> dist.ProcessGroup | None:
        if self.data_parallel_size * self.tensor_parallel_size == 1:
            return None
        grid = mesh.mesh.reshape(self.pipeline_parallel_size, -1).tolist()
        group, _ = dist.new_subgroups_by_enumeration(grid, backend=self.backend)
        return group

    # ---- training ----------------------------------------------------------------------------------------------
    def forward_backward(
        self, module: nn.Module, inputs: tuple[Any, ...], target: Any, loss_fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """One batch's forward and backward through the schedule; the loss on every rank."""
        precision = self.precision
        if self._tie_bases is None:  # the first batch of an accumulation window
            self._tie_bases = _ties.window_start(self._ties)
        loss = self._run(module, inputs, target, loss_fn, precision.scale_for_backward(self.root_device))
        if self._syncing:
            if not self._checked_tp:
                self._check_plain_grads_agree_over_tp()
            self._average_plain_grads()
            # Before clipping and the step: every copy of a tied weight takes the sum of their gradients.
            _ties.sum_grads(self._ties, self._tie_bases)
            self._tie_bases = None
        return loss

    def evaluate(
        self, module: nn.Module, inputs: tuple[Any, ...], target: Any, loss_fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """One batch's forward through the schedule (torch's `schedule.eval`): no backward, gradients and
        the next training batch untouched; the loss on every rank. Refused while gradients are pending."""
        pending = torch.tensor(
            [float(any(_nonzero(p.grad) for p in module.parameters()))], device=self.root_device
        )
        dist.all_reduce(pending, op=dist.ReduceOp.MAX)  # every rank raises, or none
        if pending.item():
            # Measured: an evaluation between the micro-batches of an accumulation, under interleaved schedules
            # with fully_shard units inside a stage, leaves the accumulated gradients wrong (torch re-infers the
            # stages' metadata at each switch between training and evaluation, and resets FSDP's state).
            raise MisuseError(
                "loom.evaluate under pipeline parallelism runs between optimizer steps, not while gradients are "
                "pending (between the micro-batches of an accumulation): call it after optimizer.step() and "
                "optimizer.zero_grad()."
            )
        return self._run(module, inputs, target, loss_fn, None, train=False)

    def _run(
        self,
        module: nn.Module,
        inputs: tuple[Any, ...],
        target: Any,
        loss_fn: Callable[..., torch.Tensor],
        scale: Callable[[torch.Tensor], torch.Tensor] | None,
        train: bool = True,
    ) -> torch.Tensor:
        if self._runner is None:
            raise MisuseError("Set the model up with loom.setup_module before running a batch through it.")
        if self._mode_bound and not module.training:
            # `model.eval()` reaches every rank's model alike: all raise together.
            raise MisuseError(
                f"The model is in eval mode, but the traced pipeline stages run {self._mode_bound[:3]} as in "
                "training (torch's tracer fixes BatchNorm's and dropout's training flag in the graph): they would "
                "update the running statistics and use the batch's. Pass split_fn (stages of the model's own "
                "modules, which follow eval()), or keep the model in training mode under split_points."
            )
        precision = self.precision
        # The inputs as the model's forward gets them elsewhere (LoomModule); the target as the user passed it.
        inputs = precision.convert_input(tuple(inputs))
        with precision.forward_context():
            # The output as LoomModule hands it to the user's loss elsewhere (in the default dtype).
            return self._runner.run(
                tuple(inputs),
                target,
                lambda out, tgt: loss_fn(precision.convert_output(out), tgt),
                scale,
                train=train,
            )

    def _check_plain_grads_agree_over_tp(self) -> None:
        """Plain parameters are averaged over the data-parallel ranks only, which is right where their
        gradients are the same on every tensor-parallel rank (a layer before a column-parallel one, after a
        row-parallel one). Under sequence parallelism a plain norm sees a slice of the sequence: its gradient is a
        partial sum, and averaging would silently train it wrong. Checked once, on the first synchronising
        batch (the pattern comes from the plan, not the data)."""
        self._checked_tp = True
        if self.tensor_parallel_size == 1:
            return
        # Every rank learns every stage's finding, so all raise together, none waiting in the next collective.
        found = self.all_gather_object(self._plain_grads_that_differ_over_tp())
        differ = sorted({name for names in found for name in names})
        if differ:
            raise MisuseError(
                f"Parameter(s) {differ[:5]} left plain by parallelize_fn get different gradients on the "
                "tensor-parallel ranks of a stage (a norm under sequence parallelism sees a slice of the "
                "sequence). PipelineStrategy averages plain gradients over the data-parallel ranks only, which "
                "would train them wrong. Make them DTensors in parallelize_fn (e.g. SequenceParallel() for the "
                "norm, which reduces its gradient), or keep them outside the tensor-parallel region."
            )

    def _plain_grads_that_differ_over_tp(self) -> list[str]:
        return _grads.differing(
            self._named_plain, self.device_mesh[TENSOR_PARALLEL].get_group(), self.root_device
        )

    def _average_plain_grads(self) -> None:
        """Gradients of the parameters `parallelize_fn` left plain, averaged over the data-parallel ranks (units
        of `fully_shard` reduce their own)."""
        if self.data_parallel_size > 1:
            group = self.device_mesh[DATA_PARALLEL].get_group()
            _grads.average(self._plain, group, self.data_parallel_size)

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, **kwargs: Any) -> None:
        raise MisuseError(
            "Under pipeline parallelism the forward and backward run together through the schedule: call "
            "loss = loom.forward_backward(model, inputs, target, loss_fn) instead of model(...) and loom.backward."
        )

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Generator[None, None, None]:
        if not enabled:
            yield
            return
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _norm_groups(self, module: nn.Module) -> _clipping.NormGroups:
        """Each rank's stages' norm, combined over the pipeline ranks (the stages' own shards and tensor-parallel
        pieces combine by their placements)."""
        return _clipping.NormGroups(across=(self.device_mesh[PIPELINE_PARALLEL].get_group(),))

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module, full: bool = True) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not full:
            return get_model_state_dict(module)
        own = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        pieces = self._gather_pieces({k: _state.to_cpu(v) for k, v in own.items()})
        if pieces is None:
            return {}
        return _ties.alias_names(_state.merge_modules(pieces), self._tie_groups)

    def tied_weight_names(self) -> list[list[str]]:
        """Each tied weight's names (model order): a weight used on several stages is a copy on each."""
        return [list(names) for names in self._tie_groups]

    def load_module_state_dict(
        self, module: nn.Module, state: dict[str, Any], strict: bool = True, full: bool = True
    ) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if not full:
            return set_model_state_dict(module, state, options=StateDictOptions(strict=strict))
        own = {k for k in module.state_dict()}
        # A checkpoint that holds a tied weight under one of its names (Hugging Face's) serves every copy.
        state = _ties.alias_names(dict(state), self._tie_groups)
        missing = sorted(own - set(state))
        # Agreed before torch's load, whose collectives (distributing DTensors) the other stages would wait in.
        failure = (
            MisuseError(f"the checkpoint lacks this stage's keys {missing[:5]}")
            if strict and missing
            else None
        )
        self._raise_together(
            failure,
            "the model's state",
            "The checkpoint does not hold the whole model: load one saved from it",
        )
        mine = {k: v for k, v in state.items() if k in own}
        return set_model_state_dict(
            module, mine, options=StateDictOptions(full_state_dict=True, strict=strict)
        )

    def optimizer_state_dict(
        self, module: nn.Module, optimizer: Optimizer, full: bool = True, template: bool = False
    ) -> dict[str, Any]:
        if not full:
            state = super().optimizer_state_dict(module, optimizer, full=False, template=template)
            # Every copy of a tied weight under its first name: written once, read by every copy.
            state = _ties.optimizer_to_model_names(state, self._tie_groups)
            # DCP stores the param groups as one object that every rank writes under the same key (and keeps
            # one rank's): each rank's must be the whole model's, not its stage's.
            pp_group = self.device_mesh[PIPELINE_PARALLEL].get_group()
            stages: list[Any] = [None] * self.pipeline_parallel_size
            dist.all_gather_object(stages, state["param_groups"], group=pp_group)
            state["param_groups"] = _state.merge_optimizers({"state": {}, "param_groups": g} for g in stages)[
                "param_groups"
            ]
            return state
        # The base's: an optimizer without state, which torch steps to make some, stepped with its groups' kinds
        # apart (foreach SGD over plain and DTensor parameters fails otherwise), and its made state undone.
        own: Any = super().optimizer_state_dict(module, optimizer, full=True, template=template)
        own = _ties.optimizer_to_model_names(own, self._tie_groups)
        pieces = self._gather_pieces(_state.optimizer_to_cpu(own))
        return _state.merge_optimizers(pieces) if pieces is not None else {}

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool = True
    ) -> None:
        # Saved for the whole model (both formats): this stage's part.
        # The saved names are torch's (state-dict names: no `_checkpoint_wrapped_module.`, `_orig_mod.`).
        own = {clean_name(n) for n, _ in module.named_parameters()}
        failure = None
        try:
            state = _state.optimizer_of_stage(
                _ties.optimizer_to_stage_names(state, self._tie_groups, own), own
            )
            super().load_optimizer_state_dict(module, optimizer, state, full=full and holds_tensors(state))
        except Exception as error:  # noqa: BLE001 - raised below, on every rank
            failure = error
        # Each stage loads its own part, which may not fit on one stage only: that rank alone would raise, and the
        # others would train on until they wait for it in their next collective (found with a tied weight whose
        # head's copy was missing from its param group: rank 0 timed out in the data sampler's broadcast).
        self._raise_together(
            failure,
            "the optimizer's state",
            "The checkpoint's optimizer does not fit this one on those stages: build the optimizer (its "
            "parameters and param groups) as the run that saved it did",
        )

    def _raise_together(self, failure: BaseException | None, what: str, fix: str | None = None) -> None:
        everyone = self.all_gather_object(None if failure is None else f"{type(failure).__name__}: {failure}")
        failed = [(rank, text) for rank, text in enumerate(everyone) if text is not None]
        if not failed:
            return
        where = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise CheckpointError(
            f"Loading {what} failed on {count(len(failed), 'rank')} of {self.world_size} (each stage loads its "
            f"own part; every rank raises together): {where}. {fix}"
        ) from failure

    def _state_dict_options(self, full: bool, loading: bool = False, **kwargs: Any) -> Any:
        """Saving and loading alike: full (whole tensors, DTensors distributed) or each rank's own. A full load
        of an optimizer state without tensors (SGD without momentum) comes here as `full=False`: torch's full
        path finds no device to distribute on (`Expected device to be set`), and there is nothing to distribute:
        the param groups load as under ddp."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=full, **kwargs)

    def _gather_pieces(self, own: Any) -> list[Any] | None:
        """Every stage's piece on global rank 0 (None elsewhere): one rank of each stage sends."""
        mesh = self.device_mesh
        first_of_stage = (
            mesh[DATA_PARALLEL].get_local_rank() == 0 and mesh[TENSOR_PARALLEL].get_local_rank() == 0
        )
        gathered: list[Any] = [None] * self.world_size if self.global_rank == 0 else []
        dist.gather_object(
            own if first_of_stage else None, gathered if self.global_rank == 0 else None, dst=0
        )
        if self.global_rank != 0:
            return None
        return [g for g in gathered if g is not None]


def _nonzero(grad: torch.Tensor | None) -> bool:
    if grad is None:
        return False
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    return bool(local.count_nonzero())


def _along_pp(mesh: DeviceMesh) -> list[int]:
    """The global ranks of this rank's pipeline, by pipeline rank."""
    return [int(r) for r in mesh[PIPELINE_PARALLEL].mesh.tolist()]


def _refuse_forward(module: nn.Module, args: Any) -> None:
    raise MisuseError(
        "Under pipeline parallelism each rank holds only its stages, so the model cannot be called: run a batch "
        "with loss = loom.forward_backward(model, inputs, target, loss_fn), which works without pipeline "
        "parallelism too."
    )
