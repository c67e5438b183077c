"""One rank's part in a fault-tolerant job: its replica group in torchft's quorum.

The job is split into replica groups (`torchloom run --replica-groups N`); inside a group the strategy works as
without them (DDP averages the group's gradients in backward), and across groups torchft's `Manager` does the
rest. Each step:

1. its first batch (or its backward, for a script without a set-up loader) asks the lighthouse for a quorum:
   the groups alive now. A group that is behind (restarted) receives the live state from a peer there, through
   torchft's checkpoint transport, before it reads its batch (`use_async_quorum=False`: the healed group then
   reads the batch of the step it joins and contributes a real gradient, never zeros);
2. in the backward that synchronises (under `ddp`, bucket by bucket from DDP's comm hook; after it for the
   other strategies), the gradients are summed over the quorum's groups with `manager.allreduce`, chunk by chunk
   (`_averaging`: torchft's own DDP wrapper's comm hook crashes a survivor when a group dies mid-step), and
   divided by the groups the sums count; a parameter no counted group had a gradient for keeps none;
3. `optimizer.step()` runs only when `manager.should_commit()` agrees (a vote among this group's ranks) that
   the group's collectives of the step succeeded, so its average holds every group of the quorum; a step that
   failed is retried, on the same batch, and a group left behind by a peer that committed heals at the next
   quorum;
4. a process stuck inside a cross-group collective or vote past the timeout ends itself (`_watchdog`).

Every committed step is appended to the job's record (`torchloom.fault_tolerance.record`): which groups took part,
and which batch each used, as the all-reduce that carried the gradients reports it.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import math
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from torchloom import _run_protocol
from torchloom.checkpointing import rng
from torchloom.data.loader import LoomDataLoader
from torchloom.errors import ConfigurationError, MisuseError, TorchloomError
from torchloom.fault_tolerance import _averaging, _start, buffers, exchange
from torchloom.fault_tolerance import record as _record
from torchloom.fault_tolerance._torchft import lighthouse_url, require_torchft

#: Seconds torchft waits for a collective, a commit vote or a checkpoint transfer before the step fails, unless
#: `torchloom run --ft-timeout` says otherwise. A group that dies is noticed at once (its connections close);
#: this bounds a group that hangs instead.
COLLECTIVE_TIMEOUT_S = 30.0
#: Seconds a quorum may take (a group waits this long for the lighthouse, e.g. while it is down), unless
#: `--ft-quorum-timeout` says otherwise.
QUORUM_TIMEOUT_S = 60.0
#: Seconds to connect to the lighthouse and to the managers of the other groups.
CONNECT_TIMEOUT_S = 30.0
#: Seconds past the collective timeout after which a process still inside a cross-group collective or commit
#: vote ends itself (`ReplicaGroup._watchdog`).
WATCHDOG_MARGIN_S = 5.0

_CURRENT: ReplicaGroup | None = None


def current() -> ReplicaGroup | None:
    """This process's replica group, or None outside `torchloom run --replica-groups`."""
    return _CURRENT


class ReplicaGroup:
    """This rank's replica group (see the module docstring). The strategy creates it when the process group is
    joined and hands it the set-up modules, optimizer and loaders, which it keeps in step with the other groups.

    Read-only for users: `group`, `groups`, `step` (committed steps of the job), `participants` (the groups whose
    gradients the last committed step averaged)."""

    def __init__(
        self,
        groups: int,
        group: int,
        lighthouse: str,
        record_path: str | None,
        *,
        group_rank: int,
        group_size: int,
        all_gather_object: Any,
        device: torch.device,
    ) -> None:
        global _CURRENT
        require_torchft()
        if not 0 <= group < groups:
            raise ConfigurationError(
                f"--replica-group {group} must be in 0..{groups - 1} for {groups} groups."
            )
        self.group, self.groups = group, groups
        self.participants: list[int] = []
        self._lighthouse = lighthouse_url(lighthouse)
        self._record_path = record_path
        self._group_rank, self._group_size = group_rank, group_size
        self._all_gather_object = all_gather_object
        self._device = device
        self._manager: Any = None
        # torchft's reconfigurable process group across the groups (this rank's, with the same rank of the others).
        self._process_group: Any = None
        self._timeout_s, self._quorum_timeout_s = _run_protocol.ft_timeouts(
            COLLECTIVE_TIMEOUT_S, QUORUM_TIMEOUT_S
        )
        self._store: Any = None
        self._modules: list[nn.Module] = []
        self._optimizers: list[Optimizer] = []
        self._loaders: list[ReplicaLoader] = []
        self._in_step = False
        # The step's vote, once asked (by its first optimizer's `step()`): the answer for the step's other optimizers.
        self._decision: bool | None = None
        self._voted: list[Optimizer | None] = []  # the optimizers that stepped (or not) on it
        # Whether this step's gradients went through `average_gradients` (a step without it is refused).
        self._averaged = False
        #: The last step did not commit: the survivors retry it on the same batches.
        self.retrying = False
        # (epoch, batch) of the batch this step reads, (-1, -1) when no set-up loader hands it out.
        self._source = (-1, -1)
        self._sources: torch.Tensor | None = None
        self._averager: _averaging.Averager | None = None
        self._applied = 0.0
        self._loss_scale = 1.0
        self._whole = True
        #: Heals so far (`average_gradients` tells a heal inside its own quorum).
        self._heals = 0
        # What heals with the model besides it: the loss scaler, the LR schedulers (`add_stateful`).
        self._stateful: dict[str, Any] = {}
        # The persistent buffers at the step's first forward: what a step that does not commit goes back to.
        self._buffers_at_start: list[torch.Tensor] | None = None
        # The loss scale the gradients carry (16-mixed): the record's fingerprints are of the true gradients.
        self.loss_scale: Any = lambda: 1.0
        # torchft's step count from a checkpoint `loom.load` read, for the manager once it starts.
        self._resumed: dict[str, int] | None = None
        # The record's hash chain of the history this group's state holds (taken from the peer when healing).
        self._chain = ""
        _CURRENT = self

    # ---- what the strategy hands over ------------------------------------------------------------------------
    def add_module(self, module: nn.Module) -> None:
        self._modules.append(module)
        module.register_forward_pre_hook(self._before_forward)

    def add_stateful(self, name: str, obj: Any) -> None:
        """Heal `obj` (with `state_dict`/`load_state_dict`) from the peer along with the model."""
        self._stateful[name] = obj

    def add_scheduler(self, scheduler: Any) -> None:
        """An LR scheduler of the job's optimizer (`loom.setup(..., scheduler=...)`): it heals with the model, and
        its `step()` after an optimizer step that did not commit does nothing (the retried step steps it), so
        that the learning rates follow the committed steps as in the replay."""
        self.add_stateful(f"scheduler{len(self._stateful)}", scheduler)
        replicas = self
        base = type(scheduler)

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if replicas.retrying:
                return None
            return base.step(self, *args, **kwargs)

        scheduler.__class__ = type(base.__name__, (base,), {"step": step, "__module__": base.__module__})

    def _before_forward(self, *_: Any) -> None:
        if self._buffers_at_start is None:
            self._buffers_at_start = buffers.snapshot(buffers.persistent(self._modules))

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """A set-up optimizer: it heals with the model, and its `step()` runs only when the step commits. With
        several (Muon for the matrices and AdamW for the rest, say), the first `step()` after a backward asks the
        groups' vote and the others of that step follow its answer."""
        self._optimizers.append(optimizer)

    def add_loader(self, loader: ReplicaLoader) -> None:
        loader._replicas = self
        self._loaders.append(loader)

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints (`loom.save`): every group that committed the last step
        holds the same state, so one of them writes it, the lowest-numbered (group 0 before the first commit).
        Several groups writing one path at once would remove each other's temporary files."""
        return self.group == min(self.participants or [0])

    @property
    def step(self) -> int:
        """Committed steps of the job (torchft's step count, carried to a group that heals)."""
        return 0 if self._manager is None else int(self._manager.current_step())

    # ---- the step --------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Join this step's quorum (once a step); a group behind the others heals here."""
        if self._in_step:
            return
        self._decision = None
        if self._manager is None:
            self._manager = self._start_manager()
            if self._resumed is not None:
                self._manager.load_state_dict(self._resumed)
            # After the manager is up: its heartbeats tell the lighthouse to wait for this group's quorum request.
            _start.wait_for_groups(self.groups, self._group_rank)
        self._in_step = True
        try:
            self._manager.start_quorum()
        except Exception as error:
            raise MisuseError(
                f"Replica group {self.group} got no quorum from the lighthouse at {self._lighthouse} within "
                f"{self._quorum_timeout_s:g} s ({type(error).__name__}: {error}). The lighthouse may have died: "
                "restart it (`torchft_lighthouse`, or the whole `torchloom run`); the job resumes from its last "
                "checkpoint."
            ) from error

    def note_batch(self, epoch: int, batch: int) -> None:
        self._source = (epoch, batch)

    def ddp_comm_hook(self, process_group: Any, bucket: Any) -> Any:
        """DDP's comm hook in a replica group: the bucket averaged inside the group (DDP's own all-reduce), and,
        inside a step's quorum, its pieces handed to the cross-group sums, which then overlap the rest of the
        backward (`_averaging`). Never raises for a cross-group failure: torchft records it and the step does not
        commit. Outside a quorum (a script without a set-up loader joins it after its backward, and may heal
        there) the pieces wait for `average_gradients`."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if process_group.size() == 1:  # a group of one process: its gradient is the group's (no pass over it)
            ready: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            ready.set_result(bucket.buffer())
        else:
            ready = allreduce_hook(process_group, bucket)
        if self._in_step:
            self._averaging().deliver(zip(bucket.parameters(), bucket.gradients(), strict=True), ready)
        return ready

    def average_gradients(self) -> None:
        """After a backward that synchronised the group's gradients (the strategy's own, inside the group): average
        the set-up modules' gradients over the quorum's groups (and learn which groups and batches the average
        holds). Each rank averages its local pieces with the same rank of the other groups (see `exchange`), so
        a sharded strategy's clipping, after this, clips the average over every group. A failure (a group
        died) is recorded by torchft; the step will not commit.

        A parameter that no counted group had a gradient for keeps none (`p.grad = None`: the optimizer leaves
        it alone, as in one process); one that some had is averaged over every counted group, zeros for the
        others."""
        from torch.distributed import ReduceOp

        heals = self._heals
        self.begin_step()
        # Healed just now (a script without a set-up loader joins the step's quorum in backward): this rank's
        # gradients were computed on the weights from before the heal. The group sends zeros and is not counted;
        # it steps with the others' average, from the peer's weights.
        stale = self._heals != heals
        self._averaged = True
        averaging = self._averaging()
        params = averaging.params
        scale = float(
            self.loss_scale()
        )  # (16-mixed: the record's fingerprints are of the unscaled gradients)
        own_buffers = buffers.persistent(self._modules)
        gathered = buffers.slots(own_buffers, self.groups, self.group, send=not stale)
        weights = _record.weights_fingerprint([exchange.local(p) for p in params])
        with self._watchdog():
            works, (value, size) = averaging.finish(zeros=stale)
            views = averaging.views
            had = [not stale and p.grad is not None for p in params]
            # Slots per group: 1 from each group in the average, the epoch and batch it read, the fingerprint of
            # the gradient it sent (the record's proof that the average is whole), the group's optimizer
            # hyperparameters (`_check_hyperparameters`); then per parameter whether the group had a gradient.
            sources = _record.sources(
                self.groups,
                self.group,
                *self._source,
                views,
                had,
                (value / scale, size / scale),
                self._hyperparameters(),
                weights,
            ).to(self._device)
            if stale:
                sources.zero_()
            # Summed, then divided by the groups the sums count (torchft's average divides by its quorum's size,
            # which counts a stale group).
            works.append(self._manager.allreduce(sources, reduce_op=ReduceOp.SUM))
            works.extend(self._manager.allreduce(rows, reduce_op=ReduceOp.SUM) for rows in gathered)
            for work in works:
                work.wait()
        if self._manager.errored() is not None:
            # The step will not commit; the gradients may be partial, and are not used.
            self._close_failed_process_group()
            return
        participants = _record.participants_of(sources, self.groups)
        counted = len(participants)
        if counted == 0:
            self._manager.report_error(RuntimeError("no group of the quorum sent a current gradient"))
            return
        self._check_hyperparameters(_record.hyperparameters_of(sources, self.groups), participants)
        if not self._weights_agree(_record.weights_of(sources, self.groups), participants):
            return
        buffers.write_mean(own_buffers, gathered, participants)
        applied = []
        with torch.no_grad():
            for p, view, count in zip(
                params, views, _record.gradient_counts(sources, self.groups), strict=True
            ):
                if count == 0:
                    p.grad = None  # no group had one: the sums hold zeros only
                    applied.append(view)
                    continue
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                grad = exchange.local(p.grad)
                torch.div(view, counted, out=grad)
                applied.append(grad)
        self._applied = _record.fingerprint(applied)[0] / scale
        self._loss_scale = scale
        if scale != 1.0 and not all(bool(torch.isfinite(grad).all()) for grad in applied):
            # The loss scaler will skip this step (an overflow in some group): the record says so.
            self._applied = math.inf
        self._whole = exchange.whole(self._modules)
        self._sources = sources.cpu()

    def _close_failed_process_group(self) -> None:
        """After a failed cross-group collective: destroy this rank's cross-group process group now, which closes
        its connections, rather than at the next quorum's reconfigure. torchft turns this rank's remaining
        collectives of the step into no-ops, so a survivor whose part of a sum waits on data from this rank (gloo's
        ring reads from one neighbour: the dead group's other neighbour fails at once, the survivor downstream of it
        does not) would wait until this rank's next quorum, and the lighthouse forms none for one group of three
        while the stuck one still heartbeats: it waited for the dead group to come back (4-5 s). gloo's own
        `abort()` leaves the connections open; only the process group's destruction closes them (torchft's
        wrapper drops it here, and reconfigures a new one at the next quorum, whose id changes after a failed
        commit)."""
        self._process_group.abort()

    def _hyperparameters(self) -> float:
        """A number that differs between groups whose optimizers would step differently: the sum of every param
        group's numeric hyperparameters (learning rate, weight decay, betas, momentum)."""
        total = 0.0
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                for key, value in group.items():
                    if key == "params":
                        continue
                    for number in value if isinstance(value, tuple | list) else (value,):
                        if isinstance(number, bool) or not isinstance(number, int | float | torch.Tensor):
                            continue
                        if isinstance(number, torch.Tensor) and number.numel() != 1:
                            continue
                        total += float(number) * (1 + len(key))  # keyed, so that two swapped values differ
        return total

    def _check_hyperparameters(self, hyper: list[float], participants: list[int]) -> None:
        """Refuse a step whose groups' optimizers hold different hyperparameters (every group sees the same sums,
        so every group raises): the groups would apply one average with different learning rates and part
        silently. An LR scheduler that was not handed to `loom.setup` does not heal, and restarts from its
        beginning in a group that healed."""
        values = {g: float(hyper[g]) for g in participants}
        if len(set(values.values())) > 1:
            raise MisuseError(
                f"The replica groups' optimizers hold different hyperparameters at step {self.step} (a sum of "
                f"each group's learning rates, weight decays, ...: {values}), so their steps would part. An LR "
                "scheduler must heal with the model: pass it to loom.setup(model, optimizer, scheduler=scheduler) "
                "(as with Fabric), and change hyperparameters only through it or identically in every group."
            )

    def _weights_agree(self, weights: list[float], participants: list[int]) -> bool:
        """Whether every group of the step computed its gradient on the same weights (their fingerprints, which
        each group sent with its gradient, are equal). Groups that hold the same state are bit-identical, so a
        difference means a group's state parted from the others' (a defect, in torchloom or in the script, e.g.
        an update outside `optimizer.step()`), and its average would mix gradients of different models.
        Then the step commits nowhere: a group in the minority raises (its agent restarts it, and it heals from
        a peer); the majority warns and retries the step without it. Without a majority (two groups, or every
        group different) every group raises, and the job goes on from its last checkpoint, as after losing
        every group."""
        values = {g: weights[g] for g in participants}
        if len(set(values.values())) <= 1:
            return True
        majority: float | None
        ((majority, held),) = collections.Counter(values.values()).most_common(1)
        if held * 2 <= len(values):
            majority = None  # no state that most groups hold
        message = (
            f"The replica groups' weights differ at step {self.step}: the fingerprints of the weights each group "
            f"computed its gradient on are {values}; groups holding one state are bit-identical, so a group's "
            "state parted from the others' (a change to the parameters outside optimizer.step(), in one group "
            "only, does it). The step is not committed."
        )
        if values[self.group] != majority:
            raise TorchloomError(
                message + f" Replica group {self.group} "
                + ("is not in the majority: it restarts and heals from a peer." if majority is not None
                   else "restarts; with no majority every group does, and the job goes on from its last "
                   "checkpoint.")
            )  # fmt: skip
        self._manager.report_error(TorchloomError(message))
        print(
            f"torchloom: {message} Groups {sorted(g for g, v in values.items() if v != majority)} restart and "
            "heal from a peer; the others retry the step.",
            file=sys.stderr,
            flush=True,
        )
        return False

    def _averaging(self) -> _averaging.Averager:
        """The cross-group sums' layout for the set-up modules' trainable parameters as they are now."""
        from torch.distributed import ReduceOp

        if self._averager is None:
            self._averager = _averaging.Averager(
                lambda flat: self._manager.allreduce(flat, reduce_op=ReduceOp.SUM)
            )
        if not self._averager.in_progress:  # between two backwards: the parameters may have been replaced
            self._averager.lay_out(exchange.trainable(self._modules))
        return self._averager

    def should_commit(self, optimizer: Optimizer | None = None) -> bool:
        """At `optimizer.step()`: whether this group's step succeeded (torchft's vote among the group's ranks: every
        cross-group collective completed, so the average is whole); then the step runs. The step's other
        optimizers (each asks once) get the same answer without a vote of their own."""
        if self._decision is not None and optimizer is not None and optimizer not in self._voted:
            self._voted.append(optimizer)
            return self._decision  # a later optimizer of this step: the vote has answered for the step
        self.begin_step()
        if not self._averaged:
            raise MisuseError(
                f"optimizer.step() in replica group {self.group} without a backward that averaged the gradients "
                "over the groups: with replica groups, call loom.backward(loss) (outside loom.no_backward_sync for "
                "the last micro-batch), so that every group steps with the same gradients."
            )
        self._averaged = False
        with self._watchdog():
            committed = bool(self._manager.should_commit())
        self._in_step = False
        self._decision, self._voted = committed, [optimizer]
        self.retrying = not committed
        if not committed and self._buffers_at_start is not None:
            # The step's forwards never happened (for the record and the replay): buffers as at its start.
            buffers.restore(buffers.persistent(self._modules), self._buffers_at_start)
        self._buffers_at_start = None
        sources, self._sources = self._sources, None
        if committed:
            step = int(self._manager.current_step()) - 1
            self.participants = _record.participants_of(sources, self.groups)
            if sources is not None:
                if self._group_rank == 0 and self._record_path:
                    self._chain = _record.append(
                        self._record_path,
                        step,
                        sources,
                        self.groups,
                        self._chain,
                        self._applied,
                        self._whole,
                        self._loss_scale,
                    )
                else:
                    self._chain = _record.chained(
                        self._chain, step, _record.participants_with_batches(sources, self.groups)
                    )
        return committed

    @contextlib.contextmanager
    def _watchdog(self) -> Iterator[None]:
        """End this process if a cross-group collective or commit vote outlives the timeout by
        `WATCHDOG_MARGIN_S`: torchft fails the step at the timeout, so a process still inside is stuck. Its
        heartbeats to the lighthouse go on while it is stuck, and the lighthouse forms no quorum without it
        while it is half of the groups or more (two groups: the survivor would wait for it forever); ended, its
        agent restarts it and it heals. faulthandler's timer runs without the GIL, and prints the stacks."""
        faulthandler.dump_traceback_later(self._timeout_s + WATCHDOG_MARGIN_S, exit=True)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()

    # ---- checkpoints ---------------------------------------------------------------------------------------
    # A job that loses every group at once restarts from its last checkpoint. The checkpoint carries the job's
    # committed steps and the record's chain (as counters of the run's state), so the restarted job goes on
    # numbering steps from there and its record lines follow the checkpoint's step: the record's history is
    # then the whole run (the lines of the steps lost since the checkpoint are off it), and the replay from
    # the initial model equals the resumed run.

    #: The run's counters (`loom.save`'s record) that hold this place.
    COUNTERS = ("replica_step", "replica_batches", "replica_chain")

    def before_save(self, counters: dict[str, int]) -> bool:
        """Before `loom.save`: whether this group writes the checkpoint (`writes_checkpoints`); the job's place
        written into the run's counters."""
        batches = 0 if self._manager is None else int(self._manager.batches_committed())
        chain = int(self._chain, 16) if self._chain else 0
        counters.update(zip(self.COUNTERS, (self.step, batches, chain), strict=True))
        return self.writes_checkpoints

    @contextlib.contextmanager
    def loading(self, counters: dict[str, int]) -> Iterator[None]:
        """Around `loom.load`: ask for the job's place (-1 where the checkpoint holds none: written without
        replica groups, or its run's state not restored), then go on from it."""
        counters.update(dict.fromkeys(self.COUNTERS, -1))
        yield
        step, batches, chain = (int(counters[key]) for key in self.COUNTERS)
        if step < 0:
            return  # a checkpoint of a job without replica groups: the record starts here
        self._resumed = {"step": step, "batches_committed": batches}
        self._chain = f"{chain:016x}" if chain else ""
        if self._manager is not None:
            self._manager.load_state_dict(self._resumed)

    # ---- healing ---------------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """What a peer that heals receives (called by torchft while this group sends it): this rank's local
        pieces, which the peer's same rank holds too (see `exchange`)."""
        return {
            "modules": [exchange.module_state(m) for m in self._modules],
            "optimizers": [exchange.optimizer_state(o) for o in self._optimizers],
            "loaders": [loader.position_at_step_start() for loader in self._loaders],
            "rng": rng.capture(self._device),  # Python's, NumPy's, torch's and the rank's GPU's
            "stateful": {name: obj.state_dict() for name, obj in self._stateful.items()},
            "chain": self._chain,
            "participants": self.participants,
        }

    def _load(self, state: dict[str, Any]) -> None:
        for module, module_state in zip(self._modules, state["modules"], strict=True):
            exchange.load_module_state(module, module_state)
        for optimizer, optimizer_state in zip(self._optimizers, state["optimizers"], strict=True):
            exchange.load_optimizer_state(optimizer, optimizer_state)
        for loader, position in zip(self._loaders, state["loaders"], strict=True):
            loader.heal_to(position)
        rng.restore(state["rng"], self._device)
        for name, obj in self._stateful.items():
            obj.load_state_dict(state["stateful"][name])
        self._buffers_at_start = None  # the peer's are this step's start
        self._chain = state["chain"]
        self.participants = list(state["participants"])
        self.retrying = False
        self._heals += 1

    def _start_manager(self) -> Any:
        """torchft's `Manager` for this rank, on a store of the group's own (rank 0 serves it)."""
        from torch.distributed import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if self._group_rank == 0:
            # A fresh store each start: the job's own store may hold a dead attempt's manager address.
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = self._store.port
        else:
            port = 0
        port = max(self._all_gather_object(port))
        if self._device.type == "cuda":
            from torchft.process_group import ProcessGroupNCCL

            pg: Any = ProcessGroupNCCL(timeout=timedelta(seconds=self._timeout_s))
        else:
            pg = ProcessGroupGloo(timeout=timedelta(seconds=self._timeout_s))
        self._process_group = pg
        return Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=1,
            use_async_quorum=False,
            timeout=timedelta(seconds=self._timeout_s),
            quorum_timeout=timedelta(seconds=self._quorum_timeout_s),
            connect_timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
            rank=self._group_rank,
            world_size=self._group_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=self._lighthouse,
            replica_id=f"torchloom_group_{self.group}",
            init_sync=True,
        )

    def close(self) -> None:
        global _CURRENT
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        if _CURRENT is self:
            _CURRENT = None


class ReplicaLoader(LoomDataLoader):
    """`LoomDataLoader` in a replica group: each batch starts the step (the quorum, and the heal of a group that
    is behind, which moves this loader to the peer's position first), and a step that did not commit is
    retried on the batches it used (every micro-batch of an accumulated step, in order)."""

    _replicas: ReplicaGroup

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The step's batches as read, (batch, epoch, index) each, and how many of them a retry has handed out.
        self._step_batches: list[tuple[Any, int, int]] = []
        self._replayed = 0
        self._step_start: dict[str, Any] | None = None
        self._healed: dict[str, Any] | None = None

    def __iter__(self) -> Any:
        return _ReplicaPass(self, super().__iter__())

    def position_at_step_start(self) -> dict[str, Any] | None:
        return self._step_start

    def heal_to(self, position: dict[str, Any] | None) -> None:
        self._healed = position
        self._step_batches = []

    def _next(self, live: Any) -> tuple[Any, Any]:
        """The live pass's next batch for this step, and the pass to read from afterwards."""
        replicas = self._replicas
        starting = not replicas._in_step
        if starting and not (replicas.retrying and self._step_batches):
            # Before this step's first batch: what a peer heals to.
            self._step_start = LoomDataLoader.state_dict(self)
            self._step_batches = []
        if starting:
            self._replayed = 0
        replicas.begin_step()
        if self._healed is not None:
            # Healed from a peer: read from its position (its epoch, its batch count) in this group's shard.
            live.close()
            LoomDataLoader.load_state_dict(self, self._healed)
            self._step_start, self._healed = self._healed, None
            live = LoomDataLoader.__iter__(self)
        if replicas.retrying and self._replayed < len(self._step_batches):
            batch, epoch, index = self._step_batches[self._replayed]
            self._replayed += 1
            replicas.note_batch(epoch, index)
            return batch, live
        position = self._position
        per_batch = (self._loader.batch_size or 1) * position.world_size
        epoch, index = -1 if position.current is None else position.current, position.consumed // per_batch
        batch = next(live)
        replicas.note_batch(epoch, index)
        self._step_batches.append((batch, epoch, index))
        self._replayed += 1
        return batch, live


class _ReplicaPass:
    """One pass over a `ReplicaLoader`: the loader decides each batch (see `ReplicaLoader._next`)."""

    def __init__(self, loader: ReplicaLoader, live: Any) -> None:
        self._loader, self._live = loader, live

    def __iter__(self) -> _ReplicaPass:
        return self

    def __next__(self) -> Any:
        batch, self._live = self._loader._next(self._live)
        return batch

    def close(self) -> None:
        self._live.close()
