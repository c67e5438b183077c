"""The axes of a scenario: one value on each is one way a user can set up a training run.

A scenario is a frozen mapping axis -> value. `conflicts` says which combinations cannot be written down at all
(a sharded checkpoint under DDP has no meaning); those are never generated. Combinations that can be written
but that torchloom must refuse are declared in `refusals.py`, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The schedules that hold several stages per pipeline rank (2 here; zbv's V needs exactly 2).
MULTI_STAGE = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
SCHEDULES = ("none", "gpipe", "1f1b", *MULTI_STAGE)
# pinned (1, "none", 1, 1, "fn") outside "pipeline"
PIPELINE_AXES = ("pp", "schedule", "microbatches", "load_pp", "split")

AXES: dict[str, tuple[Any, ...]] = {
    # "model_parallel": ModelParallelStrategy, tensor parallel on the blocks' MLPs with fully_shard over the
    # data-parallel ranks, in the user's parallelize_fn (model.parallelize).
    # "pipeline": PipelineStrategy, the model cut into stages by the user's split_fn (the blocks' MLPs tensor
    # parallel and fully_shard over the data-parallel ranks in parallelize_fn, per stage, as model_parallel's);
    # the script runs every batch through `loom.forward_backward` under every strategy.
    "strategy": ("single", "ddp", "fsdp", "fsdp2", "model_parallel", "pipeline"),
    # pipeline: pipeline_parallel_size (1 elsewhere).
    "pp": (1, 2),
    "world_size": (1, 2, 3, 4),
    # The device mesh. "flat": the strategy's 1-D default. "RxC" under fsdp2: HSDP, device_mesh=(R replicas, C
    # shards); under model_parallel: data_parallel_size=R x tensor_parallel_size=C; under pipeline: "flat"
    # (tensor_parallel_size=1) or "1x2" (tensor_parallel_size=2), data parallel over the ranks left.
    "mesh": ("flat", "1x2", "2x1", "2x2"),
    # pipeline: torch's schedule ("none" elsewhere); the multi-stage ones hold 2 stages per pipeline rank.
    "schedule": SCHEDULES,
    # pipeline: n_microbatches, each data-parallel rank's batch cut into this many (1 elsewhere).
    "microbatches": (1, 2, 4),
    # pipeline: how the user cuts the stages: "fn" (split_fn, model.split_fn: the model's modules per stage),
    # "points" (split_points at the blocks, the forward traced by torch's pipeline(); without tensor parallel,
    # whose plans need the nn.Linear children that traced stages do not keep). "fn" elsewhere.
    "split": ("fn", "points"),
    # FSDP layouts: "hand" = units made by the user (wrap()/fully_shard on the blocks), "root" = the root is a
    # unit around the blocks' units (a policy, or unsharded_params="shard"), "none" = no unit but the root.
    "units": ("hand", "root", "none"),
    # Parameters outside every block unit (the input and output projections) stay outside every unit.
    "leftovers": (True, False),
    "tied": (False, True),  # the output projection's weight is the input projection's
    # The position embedding (fed by torch.arange(x.shape[1], device=x.device) in the forward) frozen by the
    # user (requires_grad=False) before setup; every optimizer is given all parameters, as a user's often is.
    "frozen": (False, True),
    # A BatchNorm1d after the input projection: buffers (running statistics) updated by every training forward.
    # Its statistics are those of each rank's batch: only where one rank reads the whole global batch (data
    # parallel 1, one pipeline micro-batch) is one process on the global batch the oracle (conflicts).
    "batchnorm": (False, True),
    # The model built under loom.init_module(empty_init=True): on the meta device where the strategy
    # materialises it (fsdp, fsdp2, model_parallel, pipeline), else with torch.nn.init skipped and the user's
    # reset_parameters() after (single, ddp: Fabric's rule).
    "empty_init": (False, True),
    # model.eval(); loom.evaluate(model, x, y, loss_fn) on a validation batch; model.train(), after step 2.
    "evaluate": (False, True),
    # model_parallel with tensor parallel: "blocks": the blocks' norms are SequenceParallel, and the residual
    # stream inside each block is sharded along the sequence between the tensor-parallel regions; "blocks+norm":
    # the final norm too (outside the units with leftovers: a tensor-parallel leftover).
    "seq_parallel": (False, "blocks", "blocks+norm"),
    # Activation checkpointing of the blocks: the strategy's activation_checkpointing_policy (fsdp, fsdp2), or
    # the user's checkpoint_wrapper (single, ddp: before setup; model_parallel: in parallelize_fn).
    "act_ckpt": (False, True),
    # torch.compile (backend "aot_eager": dynamo and AOT autograd, without inductor's C++ build, which takes a
    # minute per process on CPU): the whole model before setup_module, or each block in parallelize_fn.
    "compile": (False, True),
    # cpu_offload=True (fsdp, fsdp2): a CPU job refuses it (declared refusal); the CUDA suite runs it.
    "offload": (False, True),
    # "sgd": with momentum; "plain_sgd": without (an optimizer that holds no state); Adam; AdamW.
    "optimizer": ("sgd", "plain_sgd", "adam", "adamw"),
    "impl": ("forloop", "foreach", "fused"),
    "n_opt": (1, 2),  # one optimizer, or one for the blocks and one for the rest
    "groups": (1, 2),  # param groups per optimizer: weights, and biases at half the lr without decay
    "scheduler": (False, True),
    "precision": ("32-true", "bf16-mixed", "16-mixed", "bf16-true"),
    "accum": ("none", "no_backward_sync", "plain"),  # 2 micro-batches per step, with or without the context
    "set_to_none": (True, False),
    "clip": ("none", "norm", "value"),
    # The main loader's sampler, as the user builds it: "auto" (shuffle=True with its own generator: the
    # strategy's DistributedSampler), "user_dist" (the user's own DistributedSampler over the data-parallel
    # ranks), "custom" (a Sampler class of the user's with __len__, drawing from its own generator),
    # "batch_sampler" (DataLoader(batch_sampler=BatchSampler(RandomSampler(generator=...)))).
    "sampler": ("auto", "user_dist", "custom", "batch_sampler"),
    # "subset": epochs over a loader whose sampler is a SubsetRandomSampler with its own generator (one device
    # reads it as it is, DDP and FSDP draw it whole each pass and split it, as Fabric's DistributedSamplerWrapper).
    "loop": ("endless", "epoch", "break", "two_loaders", "subset"),
    "checkpoint": ("none", "full", "sharded", "async"),
    # What the checkpoint holds: "all"; "filter": save(filter={"model": blocks only}), loaded with strict=False
    # (the projections restart from their initial values); "partial": the optimizers neither saved nor loaded
    # (they restart empty); "raw": the model's weights through save_raw/load_raw (Hugging Face safetensors,
    # each rank its own files and slices), the rest through save/load (an exact resume, as "all").
    "ckpt_state": ("all", "filter", "partial", "raw"),
    "save_step": (1, 3),
    "load_world_size": (1, 2, 3, 4),
    # model_parallel: the tensor-parallel size at load (data-parallel size = load_world_size / load_tp).
    "load_tp": (1, 2),
    # pipeline: where the checkpoint resumes: PipelineStrategy at pipeline degree 1 or 2 (same schedule and
    # micro-batches), or "ddp" / "fsdp2" (one unit at the root) without a pipeline. 1 elsewhere.
    "load_pp": (1, 2, "ddp", "fsdp2"),
    # Fault tolerance's replica groups (`torchloom run --replica-groups`, torchloom.fault_tolerance): the job is
    # this many groups of `world_size` ranks each (and of `load_world_size` at the resume), averaged across the
    # groups through torchft, every group reading its own shard of each global batch; no fault (the faults are
    # tests/fault_tolerance's). 1: no replica groups. Outside `replica_scenarios` pinned to 1 (like the
    # pipeline's axes): the pairwise set stays the one it was before it.
    "replicas": (1, 2),
}

SHARDED = ("fsdp", "fsdp2")
MESHES = {"1x2": (1, 2), "2x1": (2, 1), "2x2": (2, 2)}

# Values the pairwise set of `make test` leaves out (each costs much more than a scenario: 4 ranks on 2 cores,
# a compile), run there by a few scenarios of their own (generator.extras) and by the random samples.
COSTLY: dict[str, tuple[Any, ...]] = {
    "world_size": (4,),
    "mesh": ("2x2",),
    "load_world_size": (4,),
    "compile": (True,),
    "offload": (True,),
    # The pipeline's scenarios start a schedule each (threads, p2p): `make test` holds a few of its own
    # (generator.pipeline_scenarios); the random samples draw it as often as any other strategy.
    "strategy": ("pipeline",),
}
# How often random samples draw a value (default 1): compile is slow on CPU and offload only a refusal here.
WEIGHTS: dict[str, dict[Any, float]] = {
    "compile": {True: 0.12},
    "offload": {True: 0.1},
    "world_size": {4: 0.5},
    "load_world_size": {4: 0.5},
    # Replica groups: in one sample in five (`run_many.py --replicas 2` draws them alone).
    "replicas": {2: 0.25},
}


def conflicts(values: Mapping[str, Any]) -> bool:
    """True when a (partial) assignment cannot be written down as a run. Every rule names two axes, so a
    partial assignment that passes can always be completed."""
    get = values.get
    strategy = get("strategy")
    ws, mesh = get("world_size"), get("mesh")
    if _pipeline_conflicts(values):
        return True
    # Replica groups: at most 3 ranks a group (2 x 4 ranks on the 2 cores is too many), so that every rank's
    # share of the global batch is whole (2 groups x 3 readers divide 12).
    if get("replicas") == 2 and 4 in (ws, get("load_world_size")):
        return True
    if strategy == "single" and ws not in (None, 1):
        return True
    # Meshes: HSDP is fsdp2's, dp x tp is model_parallel's (which always has one), 2x2 is the 4-rank mesh.
    if mesh not in (None, "flat") and strategy not in (None, "fsdp2", "model_parallel", "pipeline"):
        return True
    if strategy == "model_parallel" and (mesh == "flat" or ws in (1, 3)):
        return True
    if ws == 4 and strategy not in (None, "fsdp2", "model_parallel", "pipeline"):
        return True
    if ws is not None and mesh is not None and strategy != "pipeline":
        if (mesh == "2x2") != (ws == 4) or (mesh in ("1x2", "2x1") and ws != 2):
            return True
    # Units and leftovers are FSDP notions; a model under one process or DDP is "no units, no leftovers".
    # model_parallel's units are the user's (fully_shard in parallelize_fn).
    if strategy in ("single", "ddp") and get("units") not in (None, "none"):
        return True
    if strategy == "model_parallel" and get("units") not in (None, "hand"):
        return True
    # pipeline: "hand" = fully_shard on the blocks in parallelize_fn (and on the projections without leftovers),
    # "none" = no unit (plain parameters, whose gradients PipelineStrategy averages over data parallel).
    if strategy == "pipeline" and get("units") not in (None, "hand", "none"):
        return True
    if get("units") == "none" and get("leftovers") is True:
        return True
    if strategy in ("single", "ddp") and get("leftovers") is True:
        return True
    # Sequence parallel needs tensor parallel (model_parallel or pipeline with tp = 2).
    if get("seq_parallel") not in (None, False) and (
        strategy not in (None, "model_parallel", "pipeline") or mesh not in (None, "1x2", "2x2")
    ):
        return True
    if get("offload") is True and strategy not in (None, *SHARDED):
        return True
    # What model_parallel implies, on the axes a partial assignment may fix first.
    for mp_only in (get("seq_parallel") not in (None, False), get("load_tp") == 2):
        if mp_only and (
            ws in (1, 3) or mesh == "flat" or get("units") not in (None, "hand") or get("offload") is True
        ):
            return True
    if get("checkpoint") == "sharded" and strategy in ("single", "ddp"):
        return True
    # Without a checkpoint, when and where it would load means nothing: pin them.
    if get("checkpoint") == "none" and (
        get("save_step") not in (None, 1)
        or get("load_world_size") not in (None, 1)
        or get("ckpt_state") not in (None, "all")
        or get("load_tp") not in (None, 1)
    ):
        return True
    if get("load_tp") == 2 and (
        strategy not in (None, "model_parallel") or get("load_world_size") not in (None, 2, 4)
    ):
        return True
    # Fresh optimizers after the load would meet schedulers that were restored: not one coherent run.
    if get("ckpt_state") == "partial" and get("scheduler") is True:
        return True
    # The user's samplers replace the loop's own sampler (the "subset" loop is a sampler choice of its own).
    if get("sampler") not in (None, "auto") and get("loop") == "subset":
        return True
    return get("batchnorm") is True and _batchnorm_conflicts(values)


def _batchnorm_conflicts(values: Mapping[str, Any]) -> bool:
    """BatchNorm normalises each forward's batch: one process on the global batch is the oracle only where every
    forward sees a whole global batch (data parallel 1 in both phases, one pipeline micro-batch; accumulation's
    micro-batches are forwards of their own in the reference too). torch has no SyncBatchNorm on the CPU."""
    get = values.get
    # What no strategy completes at data parallel 1 (3 ranks, dp 2 x tp 1), named pairwise for the generator.
    if get("microbatches") not in (None, 1) or 3 in (get("world_size"), get("load_world_size")):
        return True
    if get("mesh") == "2x1":
        return True
    if get("replicas") == 2:  # each group's forward sees its share of the global batch
        return True
    for phase in ("train", "resume"):
        dp = _dp(values, phase)
        if dp is not None and dp > 1:
            return True
    return False


def _dp(values: Mapping[str, Any], phase: str) -> int | None:
    """The data-parallel size of a phase of a (partial) assignment, None while it is not known yet."""
    get = values.get
    strategy, mesh = get("strategy"), get("mesh")
    if phase == "train":
        ws, pp = get("world_size"), (get("pp") if strategy == "pipeline" else 1)
        if None in (strategy, ws, mesh, pp):
            return None
        tp = MESHES[mesh][1] if strategy in ("model_parallel", "pipeline") and mesh != "flat" else 1
        return max(ws // (tp * pp), 1)
    if get("checkpoint") == "none":
        return 1
    ws = get("load_world_size")
    if None in (strategy, ws, get("checkpoint")):
        return None
    if strategy == "model_parallel":
        tp = get("load_tp")
        return None if tp is None else max(ws // tp, 1)
    if strategy == "pipeline":
        load_pp = get("load_pp")
        if load_pp is None:
            return None
        return max(ws // (load_pp if isinstance(load_pp, int) else 1), 1)
    return ws


def _pipeline_conflicts(values: Mapping[str, Any]) -> bool:
    """The pipeline's own rules: its axes pinned elsewhere, its meshes, its degrees at save and load."""
    get = values.get
    strategy, ws, mesh, pp = get("strategy"), get("world_size"), get("mesh"), get("pp")
    pinned = {"pp": 1, "schedule": "none", "microbatches": 1, "load_pp": 1, "split": "fn"}
    if strategy not in (None, "pipeline") and any(get(a) not in (None, v) for a, v in pinned.items()):
        return True
    if strategy == "pipeline" and get("schedule") == "none":
        return True
    # pp x tp must divide the world: pp 2 on 2 or 4 ranks; tp 2 ("1x2") on 2 or 4, and on 4 with pp 2.
    if pp == 2 and ws in (1, 3):
        return True
    if strategy == "pipeline" and mesh in ("2x1", "2x2"):
        return True
    if strategy == "pipeline" and mesh == "1x2" and ws in (1, 3):
        return True
    if pp == 2 and mesh == "1x2" and ws == 2:
        return True
    # split_points traces the forward: its stages keep no nn.Linear children for a tensor-parallel plan, so a
    # user with tensor parallel (and sequence parallel) writes a split_fn.
    if get("split") == "points" and mesh not in (None, "flat"):
        return True
    if get("checkpoint") == "none" and get("load_pp") not in (None, 1):
        return True
    if get("load_pp") == 2 and get("load_world_size") in (1, 3):
        return True
    return False


def mesh_of(strategy: str, mesh: str, world_size: int, tp: int | None = None) -> tuple[int, int]:
    """(data-parallel ranks that read different data, tensor-parallel size)."""
    if strategy == "model_parallel":
        tp = MESHES[mesh][1] if tp is None else tp
        return world_size // tp, tp
    return world_size, 1


@dataclass(frozen=True)
class Scenario:
    """One value on each axis (see AXES)."""

    values: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, **values: Any) -> Scenario:
        missing = set(AXES) - set(values)
        unknown = set(values) - set(AXES)
        if missing or unknown:
            raise ValueError(f"scenario axes missing {sorted(missing)}, unknown {sorted(unknown)}")
        for axis, value in values.items():
            if value not in AXES[axis]:
                raise ValueError(f"{axis}={value!r} is not one of {AXES[axis]}")
        if conflicts(values):
            raise ValueError(f"conflicting axis values: {values}")
        return cls(tuple((axis, values[axis]) for axis in AXES))

    def __getattr__(self, name: str) -> Any:
        for axis, value in object.__getattribute__(self, "values"):
            if axis == name:
                return value
        raise AttributeError(name)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    @property
    def saves(self) -> bool:
        return self.checkpoint != "none"

    def tp(self, phase: str = "train") -> int:
        """The tensor-parallel size in a phase ("train" or "resume"); 1 outside model_parallel and pipeline."""
        if self.strategy == "pipeline":
            return MESHES[self.mesh][1] if phase == "train" and self.mesh != "flat" else 1
        if self.strategy != "model_parallel":
            return 1
        return MESHES[self.mesh][1] if phase == "train" else self.load_tp

    def pp_degree(self, phase: str = "train") -> int:
        """The pipeline degree in a phase (1 without a pipeline)."""
        if self.strategy != "pipeline":
            return 1
        if phase == "train":
            return self.pp
        return self.load_pp if isinstance(self.load_pp, int) else 1

    def pipelined(self, phase: str = "train") -> bool:
        """Whether the phase runs under PipelineStrategy (a pipeline checkpoint may resume in ddp or fsdp2)."""
        return self.strategy == "pipeline" and (phase == "train" or isinstance(self.load_pp, int))

    def num_stages(self, phase: str = "train") -> int:
        return self.pp_degree(phase) * (2 if self.schedule in MULTI_STAGE else 1)

    def dp(self, phase: str = "train") -> int:
        """The ranks of one replica group (of the job, without replica groups) that read different data in a
        phase: the strategy's data-parallel size."""
        world = self.world_size if phase == "train" else self.load_world_size
        return world // (self.tp(phase) * self.pp_degree(phase))

    def readers(self, phase: str = "train") -> int:
        """The job's ranks that read different data in a phase: every replica group's."""
        return self.replicas * self.dp(phase)

    def ranks(self, phase: str = "train") -> int:
        """The processes the job of a phase launches: every replica group's."""
        return self.replicas * (self.world_size if phase == "train" else self.load_world_size)

    def load_mesh(self) -> tuple[int, ...] | None:
        """fsdp2's HSDP mesh at load: the saved shape at the same world size, else the flat default (a reshard
        from (replicas, shards) to one dimension)."""
        if self.strategy != "fsdp2" or self.mesh == "flat" or self.load_world_size != self.world_size:
            return None
        return MESHES[self.mesh]

    @property
    def id(self) -> str:
        """A short readable name, unique per scenario (used as the pytest id and in reports)."""
        v = self.as_dict()
        strategy = "mp" if v["strategy"] == "model_parallel" else v["strategy"]
        mesh = "" if v["mesh"] == "flat" else f"[{v['mesh']}]"
        if v["strategy"] == "pipeline":  # pp{degree}.{schedule}.mb{micro-batches}
            strategy = f"pp{v['pp']}.{v['schedule']}.mb{v['microbatches']}"
            strategy += ".points" if v["split"] == "points" else ""
        layout = (
            "" if v["strategy"] in ("single", "ddp") else f"-{v['units']}{'+lo' if v['leftovers'] else ''}"
        )
        extras = "".join(
            f"-{name}"
            for name, on in (
                ({"blocks": "sp", "blocks+norm": "sp+norm"}.get(v["seq_parallel"], ""), v["seq_parallel"]),
                ("ac", v["act_ckpt"]),
                ("compile", v["compile"]),
                ("offload", v["offload"]),
                ("frozen", v["frozen"]),
                ("bn", v["batchnorm"]),
                ("empty", v["empty_init"]),
                ("eval", v["evaluate"]),
            )
            if on
        )
        opt = (
            f"{v['optimizer']}.{v['impl']}"
            + ("x2" if v["n_opt"] == 2 else "")
            + ("g2" if v["groups"] == 2 else "")
        )
        opt += ".sched" if v["scheduler"] else ""
        sampler = "" if v["sampler"] == "auto" else f"+{v['sampler']}"
        ckpt = ""
        if v["checkpoint"] != "none":
            state = "" if v["ckpt_state"] == "all" else f".{v['ckpt_state']}"
            load_tp = f"tp{v['load_tp']}" if v["strategy"] == "model_parallel" else ""
            if v["strategy"] == "pipeline":
                load_tp = f"pp{v['load_pp']}" if isinstance(v["load_pp"], int) else v["load_pp"]
            ckpt = f"-{v['checkpoint']}{state}@{v['save_step']}>w{v['load_world_size']}{load_tp}"
        replicas = "" if v["replicas"] == 1 else f"rg{v['replicas']}."
        return (
            f"{replicas}{strategy}.w{v['world_size']}{mesh}{layout}{'-tied' if v['tied'] else ''}{extras}-{opt}"
            f"-{v['precision']}-acc.{v['accum']}-{'none' if v['set_to_none'] else 'zeros'}-clip.{v['clip']}"
            f"-{v['loop']}{sampler}{ckpt}"
        )
