"""What every multi-process strategy shares: the process group and the collectives."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import time
import uuid
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from torchloom import _run_protocol, _torch_compat, diagnostics
from torchloom.environments import restore_environment
from torchloom.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigurationError, MisuseError
from torchloom.launcher import _is_peer_failure
from torchloom.strategies._gather import all_gather_with_grads
from torchloom.strategies.base import Strategy, _reduce_op

# Fabric's strategies take these as arguments; in torchloom `Loom(...)` decides them and completes the strategy.
_SET_BY_LOOM = {
    "accelerator": "Loom(accelerator=...)",
    "parallel_devices": "Loom(devices=...)",
    "cluster_environment": "the environment torchloom detects (torchrun, SLURM, `torchloom run`)",
    "precision": "Loom(precision=...)",
}


def refuse_options(owner: str, given: dict[str, Any], owned: dict[str, str]) -> None:
    """Refuse keywords meant for the wrapper (DDP, FSDP) that torchloom sets itself, saying where each comes from."""
    for name, instead in {**_SET_BY_LOOM, **owned}.items():
        if name in given:
            raise ConfigurationError(f"{owner}({name}=...) is not an option: {name} is {instead}.")


# The store namespace of the process group this process is in now (see `agree_on_namespace`); None before the
# first group and after it is destroyed.
_NAMESPACE: str | None = None

# The store of the last process group made here, kept after the group is destroyed. torch's env:// store is
# shared by every store of this process on the same port while one of them lives (multi-tenant), so a Loom
# launched after another one closed gets the same store server on rank 0. Without it, rank 0 destroys its
# server some time after the ranks agreed to end the group: a faster peer that launches its next Loom at once
# can connect to the server that is about to go and fail with "Connection was likely closed" (1 launch in 10).
_STORE: dist.Store | None = None


@atexit.register  # registered first, so it runs after every group's own teardown at exit
def _release_store() -> None:
    """Free the kept store while the interpreter is whole (its server thread is joined in the destructor)."""
    global _STORE
    _STORE = None


# Where ranks other than 0 leave the random ids rank 0 answers (see `agree_on_namespace`).
_JOINS = "torchloom/joins"
_POLL_SECONDS = 0.01


def agree_on_namespace(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """Return a store namespace that every rank of this group gets and no other group ever gets,
    `torchloom/<random id of rank 0>`, once all `world_size` ranks have called this (at most `timeout`).

    An elastic agent keeps its store from one attempt to the next (torchrun's c10d and static rendezvous alike),
    so a restarted job finds its failed attempt's keys: gloo's addresses of dead sockets, counters already at the
    world size. Nothing the agent tells a worker names the attempt for every node (TORCHELASTIC_RESTART_COUNT is
    each agent's own count, which a membership change does not raise), and a per-process counter restarts with
    the process. So each rank draws a random id and rank 0 answers every id it finds with its own: a rank waits
    only for the answer to its own id, which no earlier attempt can have written."""
    nonce = uuid.uuid4().hex
    namespace = f"torchloom/{nonce}"
    if world_size == 1:
        return namespace
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        if rank == 0:
            _answer_joins(store, namespace, world_size, deadline, timeout)
        else:
            store.append(_JOINS, nonce + " ")  # type: ignore[attr-defined]  # in torch, not in its stubs
            answer = f"torchloom/answer/{nonce}"
            store.wait([answer], timeout)
            namespace = store.get(answer).decode()
            store.delete_key(answer)
            if store.add(f"{namespace}/arrived", 1) == world_size - 1:
                store.set(f"{namespace}/all", "1")
            store.wait([f"{namespace}/all"], _left(deadline))
    except dist.DistStoreError as error:
        if "timeout" not in str(error).lower():
            raise
        raise _start_timeout(rank, world_size, timeout) from error
    return namespace


def _answer_joins(
    store: dist.Store, namespace: str, world_size: int, deadline: float, timeout: timedelta
) -> None:
    while not store.check([f"{namespace}/all"]):
        joins = store.get(_JOINS).decode() if store.check([_JOINS]) else ""
        if joins:
            # Ids of failed attempts get answered too, harmlessly: nobody waits for those answers.
            for nonce in joins.split():
                store.set(f"torchloom/answer/{nonce}", namespace)
            # Empty the list unless a rank added to it meanwhile (then its ids are answered again next time), so
            # that neither the list nor the next attempt's first read grow with every restart.
            store.compare_set(_JOINS, joins, "")
        if time.monotonic() > deadline:
            raise _start_timeout(0, world_size, timeout)
        time.sleep(_POLL_SECONDS)


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _start_timeout(rank: int, world_size: int, timeout: timedelta) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        f"Rank {rank} waited {timeout} for the other ranks of {world_size} to start and join the process group, "
        "in vain. Check that every rank was started (a node that did not come up, a rank that failed before "
        "Loom(...)) and that all of them use the same MASTER_ADDR and MASTER_PORT."
    )


class ParallelStrategy(Strategy):
    """A strategy whose ranks talk over a `torch.distributed` process group.

    Args:
        timeout: see `Strategy`.
        process_group_backend: "gloo", "nccl", ...; default: the accelerator's ("nccl" on CUDA, "gloo" on CPU).
    """

    #: `no_backward_sync` contexts open now: a backward inside synchronises nothing, across replica groups neither.
    _accumulating: int = 0
    replica_groups_refusal: str | None = (
        "no data-parallel dimension of it is averaged across groups in this version; a replica group runs "
        "strategy 'ddp' (the default), 'fsdp2' or ModelParallelStrategy"
    )

    def __init__(self, timeout: timedelta | None = None, process_group_backend: str | None = None) -> None:
        super().__init__(timeout=timeout)
        self.process_group_backend = process_group_backend

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size()

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank()

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank()

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank()

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def backend(self) -> str:
        return self.process_group_backend or self.accelerator.backend

    def setup_environment(self) -> None:
        super().setup_environment()
        global _NAMESPACE
        if dist.is_initialized():
            # A group made outside torchloom: its store may hold an earlier attempt's keys too.
            if _NAMESPACE is None:
                _NAMESPACE = agree_on_namespace(
                    _torch_compat.default_store(), dist.get_rank(), dist.get_world_size(), default_pg_timeout
                )
            self._join_replica_group()
            return
        env = self.cluster_environment
        self._exported_environment = env.export()
        kwargs: dict[str, Any] = {}
        if self.root_device.type == "cuda":
            # Binding the group to this rank's GPU lets NCCL connect eagerly and avoids device guessing.
            kwargs["device_id"] = self.root_device
        timeout = self.timeout
        if self.backend == "nccl":
            # NCCL's own watchdog aborts the process when a collective times out; torchloom's reports first.
            timeout += diagnostics.NCCL_REPORT_GRACE
        # Peers start seconds apart (importing torch took 10 s on a loaded 2-core machine), and gloo's and NCCL's
        # connection set-up waits for them only as long as the group's timeout: a short Loom(timeout=...), meant
        # for collectives, made start-up fail. So ranks first meet in the store, waiting as long as torch's
        # default group timeout (or the user's, if longer); the group is then made with the user's timeout.
        start_timeout = max(timeout, default_pg_timeout)
        global _STORE
        store, _, _ = next(
            dist.rendezvous(
                "env://", rank=env.global_rank(), world_size=env.world_size(), timeout=start_timeout
            )
        )
        _STORE = store
        # The group's keys (gloo's addresses, the end-of-job marks) go under a namespace of this group's own:
        # the store may hold an earlier group's (a restarted attempt, or a script that closed a Loom and
        # started another), and a new group reading those would connect to closed sockets.
        _NAMESPACE = agree_on_namespace(store, env.global_rank(), env.world_size(), start_timeout)
        store.set_timeout(timeout)
        dist.init_process_group(
            self.backend,
            rank=env.global_rank(),
            world_size=env.world_size(),
            timeout=timeout,
            store=dist.PrefixStore(f"{_NAMESPACE}/group", store),
            **kwargs,
        )
        atexit.register(self._teardown_at_exit)
        self._join_replica_group()

    # ---- replica groups (`torchloom run --replica-groups`, torchloom.fault_tolerance) ---------------------------
    # Under fault tolerance this rank's group is one replica group of the job: its `ReplicaGroup` averages the
    # gradients across the groups (each strategy calls it after the backward that synchronised them inside the
    # group), heals the group from a peer, and lets the optimizer step only when the step commits.

    def _join_replica_group(self) -> None:
        spec = _run_protocol.replica_groups()
        if spec is None or self.replicas is not None or self.replica_groups_refusal is not None:
            return  # refused by name before (`connector`), for a strategy that cannot run in a group
        from torchloom.fault_tolerance.replica import ReplicaGroup

        self.replicas = ReplicaGroup(
            *spec,
            group_rank=self.global_rank,
            group_size=self.world_size,
            all_gather_object=self.all_gather_object,
            device=self.root_device,
        )
        # The loss scaler heals with the model, and the record's fingerprints are of the unscaled gradients.
        self.replicas.add_stateful("precision", self.precision)
        self.replicas.loss_scale = self.precision.loss_scale

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.replicas is not None:
            self.replicas.add_optimizer(optimizer)
        return super().setup_optimizer(optimizer)

    def start_diagnostics(self) -> None:
        """Record the collectives entered through Loom and answer desync-report requests (see `diagnostics`)."""
        if self.backend == "nccl":
            # NCCL collectives return once queued: follow each with an event, and report from the watchdog
            # thread when one is still pending after the timeout (no Python exception would come before the
            # abort).
            diagnostics.RECORD.device_event = _recorded_cuda_event
            diagnostics.start(
                self.global_rank,
                self.world_size,
                _NAMESPACE,
                report_after=self.timeout,
                device=self.root_device,
            )
        else:
            diagnostics.start(self.global_rank, self.world_size, _NAMESPACE)

    #: What `setup_environment` found in the variables it set, restored by `teardown`.
    _exported_environment: dict[str, str | None] | None = None

    #: Set when this rank's work ended in an exception: its exit then does not wait for the other ranks.
    failed: bool = False

    def teardown(self) -> None:
        """Wait until every rank is done (at most `exit_timeout()`), then destroy the process group."""
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None
        diagnostics.stop()
        shutdown_process_group(self.world_size, min(self.timeout, exit_timeout()))
        if self._exported_environment is not None:
            restore_environment(self._exported_environment)
            self._exported_environment = None

    def _teardown_at_exit(self) -> None:
        # A rank dying of an exception skips this: the launcher stops the job anyway, and its peers may be stuck
        # in a collective that will never complete, so waiting for them would only delay the failure.
        if self.failed or getattr(sys, "last_value", None) is not None:
            return
        self.teardown()

    def _require_group(self, what: str) -> None:
        if not dist.is_initialized():
            raise MisuseError(
                f"{what} needs the process group, which does not exist yet. Call `loom.launch()` first "
                "(or run your function with `loom.launch(fn)`)."
            )

    # ---- collectives -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _collective(self, name: str) -> Generator[None, None, None]:
        """Turn a collective's timeout into an error that names it and says what to do. A timeout, or a peer that
        died in the collective, first gets the ranks' desync report, whose culprit line the error repeats."""
        try:
            yield
        except RuntimeError as error:
            text = str(error).lower()
            timed_out = "timed out" in text or "timeout" in text
            if not timed_out and not _is_peer_failure(text):
                raise
            what = f"loom.{name}() on rank {self.global_rank}"
            failed = f"{what} timed out after {self.timeout}" if timed_out else f"{what} lost a peer"
            culprit = diagnostics.explain(failed, timed_out)
            if not timed_out:
                if culprit is None:
                    raise  # the peer died for reasons of its own; the launcher reports that rank
                mismatch_error = CollectiveMismatchError(
                    f"{failed}: the ranks called mismatched collectives (gloo aborts a rank that receives more "
                    f"data than it expects). {culprit}. Make every rank call the same collectives, with the same "
                    f"shapes, in the same order. PyTorch said: {error}"
                )
                mismatch_error.culprit = culprit
                raise mismatch_error from error
            found = f" {culprit}." if culprit else ""
            timeout_error = CollectiveTimeoutError(
                f"{failed}: another rank did not reach the same {name} in time (stuck in a loop, much slower, or "
                f"it called a different collective).{found} Make every rank call {name} at the same point; if one "
                f"rank legitimately needs longer (e.g. a long evaluation on rank 0), raise Loom(timeout=...). "
                f"PyTorch said: {error}"
            )
            # For a Loom call that ran this collective itself (loom.save), to say what parted the ranks.
            timeout_error.culprit = culprit
            raise timeout_error from error

    def all_reduce(self, data: Any, reduce_op: str = "mean", group: Any = None) -> Any:
        op = _reduce_op(reduce_op)
        self._require_group("all_reduce")

        def reduce(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            out = t.detach().clone()
            if out.device != self.root_device:
                out = out.to(self.root_device)
            with self._collective("all_reduce"):
                dist.all_reduce(out, op=op, group=group)
            if reduce_op.lower() in ("mean", "avg"):
                size = self.world_size if group is None else dist.get_world_size(group)
                out = out / size if out.is_floating_point() else out // size
            return out

        return torch.utils._pytree.tree_map(reduce, data)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        self._require_group("all_gather")

        def gather(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            t = t.contiguous().to(self.root_device)
            if sync_grads:
                with self._collective("all_gather"):
                    return all_gather_with_grads(t, group)
            t = t.detach()
            size = self.world_size if group is None else dist.get_world_size(group)
            out = [torch.empty_like(t) for _ in range(size)]
            with self._collective("all_gather"):
                dist.all_gather(out, t, group=group)
            return torch.stack(out)

        return torch.utils._pytree.tree_map(gather, data)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._require_group("broadcast")
        box = [obj]
        with self._collective("broadcast"):
            dist.broadcast_object_list(
                box, src=src, device=self.root_device if self.backend == "nccl" else None
            )
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._require_group("all_gather_object")
        out: list[Any] = [None] * self.world_size
        with self._collective("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out

    @property
    def checkpoint_group(self) -> Any:
        # A gloo group of its own: DCP coordinates on CPU, and an async save's collectives run in a background
        # thread, where sharing the training group could interleave with training collectives.
        if getattr(self, "_checkpoint_group", None) is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group

    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        with self._collective("barrier"):
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()


def exit_timeout() -> timedelta:
    """How long a finished rank waits for the others at the end of the job: TORCHLOOM_EXIT_TIMEOUT seconds,
    default 60 (never more than `Loom(timeout=...)`). A rank that exits with an error does not wait."""
    return timedelta(seconds=float(os.environ.get("TORCHLOOM_EXIT_TIMEOUT", "60")))


def _exit_store() -> Any:
    """The job's key-value store, which every launcher (torchrun, torchloom's agent, SLURM with env://) sets up
    before the process group and which needs no collective to use; None where there is none."""
    try:
        return _torch_compat.default_store()
    except (RuntimeError, ValueError):
        return None


def agree_to_exit(world_size: int, timeout: timedelta) -> list[int]:
    """Wait, through the store, until every rank has arrived here or `timeout` has passed; return the ranks
    known to have arrived (all of them, unless the wait timed out or the store is gone).

    Destroying the process group while a peer is still inside a collective breaks that peer's connections,
    and gloo aborts it ("terminate called without an active exception"). Once every rank is here, every
    collective of the job is over, so the group can go. The store keeps working when a process group is
    wedged, and a bounded wait means a peer that is already gone cannot hang this rank's exit."""
    store = _exit_store()
    if store is None or world_size == 1:
        return list(range(world_size))
    rank = dist.get_rank()
    try:
        namespace = _NAMESPACE or agree_on_namespace(store, rank, world_size, timeout)
    except (CollectiveTimeoutError, RuntimeError, dist.DistError):
        return [rank]  # a group made outside torchloom, and a peer that never came to the end
    prefix = f"{namespace}/exit"
    try:
        store.set(f"{prefix}/rank{rank}", "1")
        if store.add(f"{prefix}/arrived", 1) == world_size:
            store.set(f"{prefix}/done", "1")
        store.wait([f"{prefix}/done"], timeout)
        return list(range(world_size))
    except (RuntimeError, dist.DistError):
        # Timed out, or the store's host (rank 0 or the agent) is already gone: report who made it.
        arrived = []
        for other in range(world_size):
            try:
                if store.check([f"{prefix}/rank{other}"]):
                    arrived.append(other)
            except (RuntimeError, dist.DistError):
                return [rank]
        return arrived


def shutdown_process_group(world_size: int, timeout: timedelta) -> None:
    """End this rank's part of the job: agree with the other ranks that all are done (bounded by `timeout`),
    then destroy the process group while the interpreter is still whole.

    Left to interpreter teardown, gloo's worker threads can still be releasing the last collective's tensors
    when Python finalises; a thread that then needs the GIL is ended inside a C++ destructor and the rank dies of
    SIGABRT after finishing its work (pytorch/pytorch#190489)."""
    if not dist.is_initialized():
        return
    arrived = agree_to_exit(world_size, timeout)
    if len(arrived) < world_size:
        missing = sorted(set(range(world_size)) - set(arrived))
        print(
            f"torchloom: rank {dist.get_rank()} finished, but rank(s) {missing} did not reach the end of the job "
            f"within {timeout}; destroying the process group without them.",
            file=sys.stderr,
            flush=True,
        )
    global _NAMESPACE
    # No GC pass until gloo's workers have settled: one could free what the program dropped in a reference cycle
    # (a model, a script's globals run by runpy) and with it the destroyed group's last reference, whose
    # destructor then waits for a worker that waits for the GIL (a rank hung so in a GC pass started by the
    # cache clear's imports, running a docs script on a forked rank in tests/test_docs.py).
    collecting = gc.isenabled()
    gc.disable()
    try:
        dist.destroy_process_group()
        _NAMESPACE = None
        _let_gloo_workers_settle()
        # Cached DTensor decisions name the destroyed groups: a later process group (another Loom) must not get
        # them.
        _torch_compat.clear_dtensor_caches()
    finally:
        if collecting:
            gc.enable()


# gloo's worker threads (named so by PyTorch) and how long to wait for them at most.
_GLOO_WORKER = "pt_gloo_runloop"
_SETTLE_SECONDS = 1.0


def _let_gloo_workers_settle() -> None:
    """Give gloo's worker threads the GIL until none of them is running or waiting to run.

    A worker frees the last collective's work after `wait()` has returned; freeing tensors that Python also
    holds takes the GIL, and a thread that asks for it once the interpreter is finalising is ended inside a
    C++ destructor (SIGABRT). So before returning to a possibly finalising interpreter, sleep (the GIL is free
    then) until every worker thread has been seen asleep twice in a row: a worker that still had work to free
    was woken by the released GIL and shows as running. Linux (/proc); elsewhere one short sleep."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        time.sleep(0.01)
        return
    deadline = time.monotonic() + _SETTLE_SECONDS
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = quiet + 1 if _gloo_workers_asleep(tasks) else 0


def _gloo_workers_asleep(tasks: str) -> bool:
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name, _, rest = stat.partition("(")[2].rpartition(")")
        if name.startswith(_GLOO_WORKER) and rest.split()[0] not in ("S", "D"):
            return False
    return True


def _recorded_cuda_event() -> torch.cuda.Event:
    # Recorded on the current stream, which NCCL made wait for the collective: it completes when the collective
    # does (and the work queued before it, which the collective waited for anyway).
    event = torch.cuda.Event()
    event.record()
    return event
