"""One simulated rank of a plan: the user's script on fake tensors and torch's fake process group, stopped after
its first training steps; what the memory account saw is written as JSON.

Run as `python -m torchloom.planning._fake_rank CONFIG.json` by `torchloom.planning.plan`, one fresh process per
simulated rank (a script's global state, its process group and imports, must not leak from one rank to the next).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from typing import Any

import torch
import torch.distributed
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torchloom import _torch_compat
from torchloom._run_protocol import publish
from torchloom.planning import _fit_rank
from torchloom.planning.allocator import CachingAllocator
from torchloom.planning.tracker import MemoryAccount, user_frame, user_frames


class _PlanDone(BaseException):
    """The planned steps ran: stop the script (a BaseException, so that the script's `except Exception` lets it
    through)."""


def _world_environment(rank: int, world_size: int, per_node: int) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(rank // per_node),
            "GROUP_WORLD_SIZE": str(world_size // per_node),
            "TORCHELASTIC_RUN_ID": "torchloom-plan",
        }
    )
    # No store to reach: the fake group needs no rendezvous, and the desync report then stays off.
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)


def _fake_swaps() -> Any:
    """`torch.utils.swap_tensors` as `nn.Module._apply` uses it on fake parameters (it always swaps those:
    `module.to(dtype)`, `to_empty`, `module.to(device)`), made to work on them:

    - a fake tensor that came out of the fake mode's conversion (`detach`, `nn.Parameter(fake)`) is in its memo,
      a dictionary of weak references, and torch refuses to swap a tensor that has a weak reference ("Couldn't
      swap Linear.weight"): the memo's entry goes (it only saves converting the same real tensor again, which
      these tensors, made on the fake mode, never are).
    - `module.to(device)` on a fake parameter already there swaps it with an alias of itself, which torch refuses
      too; a swap of two views of the same fake memory changes nothing, so it is skipped."""
    original = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if _torch_compat.is_fake(t1) and _torch_compat.is_fake(t2):
            if t1.untyped_storage()._cdata == t2.untyped_storage()._cdata and (
                t1.shape,
                t1.stride(),
                t1.storage_offset(),
                t1.dtype,
            ) == (t2.shape, t2.stride(), t2.storage_offset(), t2.dtype):
                return
            for t in (t1, t2):
                _forget_conversion(t)
        original(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    return original


def _forget_conversion(tensor: torch.Tensor) -> None:
    """Drop the weak references that fake conversions keep to `tensor`: a fake mode's memo (described tensor ->
    fake tensor) and its describer's ids (tensor -> id), of this tensor's fake mode or of another one (the one
    torch's pipeline tracer converts the model with)."""
    import gc
    import weakref

    refs = weakref.getweakrefs(tensor)
    if not refs:
        return
    for table in gc.get_referrers(*refs):
        if not isinstance(table, dict):
            continue
        for key, value in list(table.items()):
            if any(value is ref or key is ref for ref in refs):
                del table[key]


def _fake_new_groups() -> Any:
    """Every group the script or a strategy makes (gloo for leftovers, checkpoints) is a fake one too: a real one
    would wait for peers that do not exist."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 2:
            args = (*args[:2], "fake", *args[3:])
        else:
            kwargs["backend"] = "fake"
        return original(*args, **kwargs)

    dist.new_group = distributed_c10d.new_group = new_group
    return original


def _object_mailbox(folder: str, timeout: float = 300.0) -> None:
    """Pipeline stages tell the next stage the shapes they send (torch's `PipelineStage` metadata inference,
    `send_object_list`/`recv_object_list`), which the fake group cannot carry: the simulated ranks (one per
    stage, see `_announce_stages`) run side by side and post the objects as files, addressed by the sender's
    and receiver's rank in the group (a pipeline's stage numbers), so that one simulated rank per stage receives
    what its neighbour sent."""
    import pickle
    import time

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    counts: dict[tuple[int, int], int] = {}

    def _address(src: int, dst: int, group: Any) -> str:
        if group is not None:
            src, dst = dist.get_group_rank(group, src), dist.get_group_rank(group, dst)
        n = counts[src, dst] = counts.get((src, dst), -1) + 1
        return os.path.join(folder, f"p2p-{src}-{dst}-{n}.pkl")

    def send_object_list(object_list: list[Any], dst: int | None = None, group: Any = None, **_: Any) -> None:
        path = _address(dist.get_rank(), int(dst if dst is not None else _["group_dst"]), group)
        with open(path + ".tmp" + str(os.getpid()), "wb") as f:
            pickle.dump(list(object_list), f)
        os.replace(path + ".tmp" + str(os.getpid()), path)  # ranks standing for the same stage send the same

    def recv_object_list(object_list: list[Any], src: int | None = None, group: Any = None, **_: Any) -> int:
        source = int(src if src is not None else _["group_src"])
        path = _address(source, dist.get_rank(), group)
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if _a_peer_failed(folder) or time.monotonic() > deadline:
                raise TimeoutError(
                    f"no simulated rank sent rank {dist.get_rank()} the object it waits for from rank {source}"
                )
            time.sleep(0.05)
        with open(path, "rb") as f:
            object_list[:] = pickle.load(f)
        return source

    dist.send_object_list = distributed_c10d.send_object_list = send_object_list  # type: ignore[assignment]
    dist.recv_object_list = distributed_c10d.recv_object_list = recv_object_list  # type: ignore[assignment]


def _announce_stages(folder: str, mesh: Any, dimension: str) -> None:
    """Write `stages.json` into the mailbox: each pipeline stage's global ranks (the planner starts a
    simulated rank for each stage it lacks)."""
    assert mesh.mesh_dim_names is not None
    with _torch_compat.unset_fake_temporarily():
        layout = mesh.mesh.clone().cpu()
    ranks = layout.movedim(mesh.mesh_dim_names.index(dimension), 0).reshape(
        layout.shape[mesh.mesh_dim_names.index(dimension)], -1
    )
    path = os.path.join(folder, "stages.json")
    with open(path + f".tmp{os.getpid()}", "w") as f:
        json.dump(ranks.tolist(), f)
    os.replace(path + f".tmp{os.getpid()}", path)


def _a_peer_failed(folder: str) -> bool:
    """Another simulated rank ended with an error: what this one waits for will not come."""
    for name in os.listdir(folder):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    if json.load(f).get("error"):
                        return True
            except (OSError, ValueError):
                continue
    return False


def _fake_object_collectives() -> None:
    """Object collectives pickle into real byte tensors, which cannot meet the fake ones, and a fake peer sends
    nothing back: every simulated peer answers with this rank's own object (the checks that ranks agree pass, as
    they do in the real run of a correct script) and a broadcast keeps this rank's list."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
        for i in range(len(object_list)):
            object_list[i] = obj

    def broadcast_object_list(object_list: list[Any], *args: Any, **kwargs: Any) -> None:
        return None

    dist.all_gather_object = distributed_c10d.all_gather_object = all_gather_object
    dist.broadcast_object_list = distributed_c10d.broadcast_object_list = broadcast_object_list


def _tolerate_grad_of_leaves() -> None:
    """The module tracker that names the module at the peak (torch's `ModTracker`) asks, in its multi-grad hooks,
    whether autograd will run each tensor's node, and torch cannot answer for a leaf inside `torch.autograd.grad`
    (as a pipeline stage computes its input gradients): a leaf's gradient is not accumulated there, so no."""
    original = torch._C._will_engine_execute_node

    def will_engine_execute_node(node: Any) -> bool:
        try:
            return bool(original(node))
        except RuntimeError as error:
            if "autograd.grad" not in str(error):
                raise
            return False

    torch._C._will_engine_execute_node = will_engine_execute_node


def _completed_allreduce(state: object, bucket: Any) -> Any:
    """DDP's gradient all-reduce on the fake group: in place, as gloo's and NCCL's are, so the bucket itself."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP checks the hook's annotations as objects (this module's are strings).
_completed_allreduce.__annotations__ = {
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _patch_ddp(account: MemoryAccount) -> dict[str, Any]:
    """Count what DDP's constructor and its pre-forward make (its gradient buckets, rebuilt before the second
    forward) as communication buffers, and give it an all-reduce the fake group can complete (its own hands DDP's
    reducer an empty result)."""
    from torch.nn.parallel import DistributedDataParallel

    originals = {
        "__init__": DistributedDataParallel.__init__,
        "_pre_forward": DistributedDataParallel._pre_forward,
    }

    def __init__(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        account.context = "communication buffers"
        try:
            originals["__init__"](self, *args, **kwargs)
        finally:
            account.context = None
        self.register_comm_hook(None, _completed_allreduce)

    def _pre_forward(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
        account.context = "communication buffers"
        try:
            return originals["_pre_forward"](self, *args, **kwargs)
        finally:
            account.context = None

    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]
    DistributedDataParallel._pre_forward = _pre_forward  # type: ignore[method-assign]
    return originals


def _note_compiles(found: list[dict[str, Any]]) -> Any:
    """`torch.compile` (and `module.compile()`, which calls it) records where the script compiled: fake tensors
    run torch's eager kernels (Dynamo does not compile under the planner's dispatch modes), so that part is
    planned as eager, which the plan says."""
    original = torch.compile

    def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001  (torch.compile's own name)
        where = user_frame(sys._getframe(1))
        if where is not None and all((where[0], where[1]) != (f["file"], f["line"]) for f in found):
            found.append({"file": where[0], "line": where[1], "code": where[3]})
        return original(*args, **kwargs)

    torch.compile = compile  # type: ignore[assignment]
    return original


def _plan_loom_options(result: dict[str, Any], devices: int, on_cuda: Any) -> Any:
    """`Loom(...)` in the script, as the plan reads it: `accelerator="cuda"` (or "gpu") is planned as the CUDA job
    it is, on the CPU's fake tensors (fake CUDA tensors abort a CPU-only torch once autograd records an op), with
    the caching allocator simulated; options that disagree with the plan's command line are refused with
    `torchloom plan`'s own options, not `torchloom run`'s."""
    from torchloom import loom
    from torchloom.errors import ConfigurationError

    original = loom.command_line_defaults

    def command_line_defaults(**given: Any) -> tuple[Any, ...]:
        accelerator = given.get("accelerator")
        name = accelerator.lower() if isinstance(accelerator, str) else None
        if name in ("cuda", "gpu"):
            result["cuda"] = True
            on_cuda()  # torch's device queries answer as the planned device from here on
            given["accelerator"] = "cpu"  # the plan's own: the CPU's fake tensors
        elif name is not None and name not in ("auto", "cpu"):
            raise ConfigurationError(
                f"Loom(accelerator={accelerator!r}) in the script: `torchloom plan` plans CPU and CUDA jobs "
                "only. Write accelerator='cuda' (or 'cpu') to plan the job as one of them."
            )
        wanted = given.get("devices")
        if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted != devices:
            raise ConfigurationError(
                f"Loom(devices={wanted}) in the script, but the plan simulates {devices} per node (`torchloom plan "
                f"--devices`, 1 when not given): plan it with `torchloom plan --devices {wanted} ...`."
            )
        try:
            return tuple(original(**given))
        except ConfigurationError as error:  # the plan's command line, not `torchloom run`'s
            raise ConfigurationError(str(error).replace("torchloom run", "torchloom plan")) from None

    loom.command_line_defaults = command_line_defaults
    return original


def _offload_accepted() -> Any:
    """A CUDA job's `cpu_offload=True` is planned: torchloom refuses it on CPU ranks (their memory is the CPU's
    already), and the plan's CPU ranks stand for CUDA ones here. Returns a function that undoes it."""
    from torchloom.strategies._sharded import ShardedStrategy

    original = ShardedStrategy.validate

    def validate(self: ShardedStrategy) -> None:
        offload = self.cpu_offload
        if offload and self.flavour != "fsdp2":
            from torchloom.errors import ConfigurationError

            raise ConfigurationError(
                "cpu_offload=True with strategy='fsdp' (FSDP1): `torchloom plan` plans CPU offload of a CUDA job "
                "with strategy='fsdp2' (FSDP2Strategy(cpu_offload=True)) only; plan FSDP1 without cpu_offload."
            )
        self.cpu_offload = False
        try:
            original(self)
        finally:
            self.cpu_offload = offload

    ShardedStrategy.validate = validate  # type: ignore[method-assign]

    def undo() -> None:
        ShardedStrategy.validate = original  # type: ignore[method-assign]

    return undo


def _error_report(error: BaseException, account: MemoryAccount) -> dict[str, Any]:
    """The script's error, where in the user's code it happened (the innermost of the user's frames: torch's
    own frames do not say which line of the script to change) and its traceback from the user's frames on."""
    frames = user_frames(error)
    lines = traceback.format_exception(error)
    report: dict[str, Any] = {
        "fake_tensor_error": type(error).__module__.startswith("torch._subclasses")
        or ("fake" in str(error).lower()),
        "user_line": None,
    }
    message = str(error).strip()
    cause = error.__cause__ or error.__context__
    while cause is not None:  # what torch wrapped ("Failed to run stage backward"): the error itself
        message += f" (from {type(cause).__name__}: {str(cause).strip()[:1000]})"
        cause = cause.__cause__ or cause.__context__
    if frames:
        path, line, function, code = frames[-1]
        report["user_line"] = {"file": path, "line": line, "function": function, "code": code}
        summary = traceback.StackSummary.from_list(
            [traceback.FrameSummary(p, n, f, line=c) for p, n, f, c in frames]
        )
        lines = ["Traceback, the script's frames:\n", *summary.format()]
    else:  # torch's last frames (the message is the first line already)
        lines = lines[-8:-1]
    report["error"] = (
        f"{type(error).__name__} in operation {account.last_op or '(none)'}: {message}".strip()
        + "\n"
        + "".join(lines)
    )
    return report


def simulate(config: dict[str, Any]) -> dict[str, Any]:
    rank, world_size, per_node = config["rank"], config["world_size"], config["devices"]
    _world_environment(rank, world_size, per_node)
    publish(config["options"])
    _torch_compat.init_fake_process_group(rank, world_size)
    _fake_new_groups()
    _fake_object_collectives()
    _object_mailbox(config["mailbox"])
    _tolerate_grad_of_leaves()
    from torchloom.strategies import _tp_leftovers

    # torchloom's check that a replicated leftover's gradient agrees across tensor-parallel ranks compares
    # values, which fake tensors do not have (and it allocates nothing that stays).
    _tp_leftovers.TensorParallelLeftovers._verify = lambda self: None  # type: ignore[method-assign]
    from torchloom.strategies import parallel

    # The group exists already, so the strategy only agrees on a store namespace, which needs the other ranks.
    parallel._NAMESPACE = "torchloom/plan"

    from torchloom.planning import measure

    measure._PLANNING = True
    fake = _torch_compat.fake_tensor_mode()
    account = MemoryAccount(fake=True, assumed=config.get("assume"), fake_mode=fake)
    device = config.get("device") or {}
    allocator = CachingAllocator(bool(device.get("expandable_segments")), device.get("memory"))
    account.use_allocator(allocator)
    fitting = _fit_rank.install(config.get("fit"), account)  # `plan --budget`: its changes and observations
    optimizers: list[Any] = []
    modules: dict[int, torch.nn.Module] = {}

    def before_step(optimizer: Any, *_: Any) -> None:
        if all(optimizer is not seen for seen in optimizers):
            optimizers.append(optimizer)
        account.note(list(modules.values()), optimizers)
        account.in_optimizer_step = True

    def after_step(optimizer: Any, *_: Any) -> None:
        account.in_optimizer_step = False
        account.note(list(modules.values()), optimizers)
        account.step += 1
        if account.step >= config["steps"]:
            raise _PlanDone

    def root_forward(module: torch.nn.Module, *_: Any) -> None:
        if len(account._modules.parents) <= 1:  # a root module: its parameters are the model's
            modules.setdefault(id(module), module)

    hooks = [
        register_optimizer_step_pre_hook(before_step),
        register_optimizer_step_post_hook(after_step),
        torch.nn.modules.module.register_module_forward_pre_hook(root_forward),
    ]
    result: dict[str, Any] = {
        "rank": rank,
        "error": None,
        "stage": None,
        "compiled": [],
        "user_line": None,
        "cuda": bool(device.get("name") or device.get("memory")),
    }
    cuda_undo: list[Any] = []
    attention: dict[str, dict[str, Any]] = {}
    streams: list[Any] = []
    workspaces: list[Any] = []

    def on_cuda() -> None:
        """The job is a CUDA one (`--device`, or `Loom(accelerator="cuda")`): the device's queries, streams
        and attention kernels, once."""
        if cuda_undo:
            return
        from torchloom.planning import _cublas, _cuda_attention, _cuda_device, _offload

        found, undo = _cuda_device.install(device, lambda: account.allocator, rank % per_node, per_node)
        account.stream_now = found.current
        streams.append(found)
        cuda_undo.append(undo)
        capability = tuple(device.get("capability") or _cuda_device.DEFAULT_CAPABILITY)
        cuda_undo.append(_cuda_attention.install(capability, attention))  # type: ignore[arg-type]
        workspaces.append(_cublas.Workspaces(account, capability, found.names))  # type: ignore[arg-type]
        account.after_op.append(workspaces[0].seen)
        account.after_op.append(_cuda_attention.backward_scratch(account, capability))  # type: ignore[arg-type]
        cuda_undo.append(account.after_op.clear)
        cuda_undo.append(_offload.install(account))
        cuda_undo.append(_offload_accepted())

    if result["cuda"]:
        on_cuda()
    original_defaults = _plan_loom_options(result, per_node, on_cuda)
    from torchloom.strategies import pipeline

    setup_stage = pipeline.PipelineStrategy.setup_module

    def setup_module(self: pipeline.PipelineStrategy, *args: Any, **kwargs: Any) -> Any:
        # Each pipeline stage is a role of its own: the plan names the stage a simulated rank runs, and tells
        # the planner every stage's ranks, so that it simulates a rank of each stage the others wait for.
        mesh = self.device_mesh
        result["stage"] = mesh[pipeline.PIPELINE_PARALLEL].get_local_rank()
        _announce_stages(config["mailbox"], mesh, pipeline.PIPELINE_PARALLEL)
        return setup_stage(self, *args, **kwargs)

    pipeline.PipelineStrategy.setup_module = setup_module  # type: ignore[method-assign]
    sys.argv = [config["script"], *config["script_args"]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(config["script"])))
    original_swap = _fake_swaps()
    original_compile = _note_compiles(result["compiled"])
    ddp_originals = _patch_ddp(account)
    try:
        with fake, account:
            runpy.run_path(config["script"], run_name="__main__")
    except _PlanDone:
        pass
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            result["error"] = f"the script exited with status {exit_.code} before {config['steps']} steps"
    except BaseException as error:  # noqa: BLE001  (reported with what was planned until then)
        result.update(_error_report(error, account))
    finally:
        torch.compile = original_compile  # type: ignore[assignment]
        from torchloom import loom

        loom.command_line_defaults = original_defaults
        for undo in reversed(cuda_undo):
            undo()
        for hook in hooks:
            hook.remove()
        account.note(list(modules.values()), optimizers)
        torch.utils.swap_tensors = original_swap
        from torch.nn.parallel import DistributedDataParallel

        for name, original in ddp_originals.items():
            setattr(DistributedDataParallel, name, original)
    result.update(
        steps=account.step,
        peak_bytes=account.peak.bytes,
        phase=account.peak.phase,
        module=account.peak.module,
        step=account.peak.step + (1 if account.peak.phase != "setup" else 0),
        breakdown=account.breakdown(),
        timeline=account.timeline,
        fake_reads=list(account.fake_reads.values()),
    )
    if result["cuda"]:
        result["allocator"] = {
            "allocated_peak": allocator.max_allocated,
            "reserved_peak": allocator.max_reserved,
            "retries": allocator.retries,
            "out_of_memory": account.out_of_memory,
            "allocated_at_reserved_peak": allocator.allocated_at_reserved_peak,
            "reserved_peak_at": account.reserved_peak_at,
            "reserved_at_peak": [
                {
                    "stream": streams[0].names.get(stream, f"stream {stream}")
                    if streams
                    else "default stream",
                    "pool": "small" if small else "large",
                    "bytes": nbytes,
                }
                for (stream, small), nbytes in sorted(allocator.reserved_by_pool_at_peak.items())
                if nbytes
            ],
        }
        result["attention"] = attention
        if account.host_peak.bytes:
            result["host"] = {
                "peak_bytes": account.host_peak.bytes,
                "phase": account.host_peak.phase,
                "step": account.host_peak.step + (1 if account.host_peak.phase != "setup" else 0),
                "breakdown": account.host_breakdown(),
            }
        if workspaces:
            result["cublas"] = workspaces[0].report()
        from torchloom.planning._cuda_device import communicators, nccl_allowance

        result["nccl"] = nccl_allowance(communicators())
    if fitting is not None:
        result["fit"] = fitting.report()
    return result


def main() -> int:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    stdout = sys.stdout
    if config.get("quiet", True):
        sys.stdout = open(os.devnull, "w")  # the script's prints would be its fake values
    try:
        result = simulate(config)
    finally:
        sys.stdout = stdout
    with open(config["out"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
