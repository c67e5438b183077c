"""Leftovers under tensor parallelism: which reduction each plain parameter outside every unit needs.

A plain (not DTensor) parameter outside every unit is a full copy on every rank, but what each copy computes
depends on where the module that holds it sits in the tensor-parallel plan:

- after a region whose output is *replicated* (a `RowwiseParallel` with its default `Replicate` output, or
  before any tensor-parallel layer), the ranks of one tensor-parallel group compute the same thing: their local
  gradients are equal, and the right gradient is the mean over the data-parallel replicas, an all-reduce over
  the data-parallel group only;
- after a *sequence-parallel* region (an output placed `Shard(1)`, handed on as the local tensor), each rank of
  the group computes on its own shard of the sequence (or, after a column-wise layer kept local, its own
  heads): its local gradient is one part of a sum, as the tensor-parallel layers' gradients are (DTensor sums
  the parts of a sharded activation's gradient). The right gradient is the sum over the tensor-parallel group
  and the mean over the data-parallel replicas: an all-reduce over every rank, divided by the number of
  replicas. The mean over every rank would give 1/tp of it, silently.

Nothing in a plain tensor says which of the two it is, so the first forward with gradients tells: every module
that holds a leftover records a fingerprint of its inputs, and at the end of the root's forward one all-gather
compares them across each tensor-parallel group. Equal on every rank: replicated; different: parts of a sum.
A parameter used by both kinds of module (a tied embedding and head with the head after a sequence-parallel
region) is refused: its gradient is partly a copy and partly a sum of parts. A parameter judged replicated has
its gradient compared across the tensor-parallel group after its first reduction (one small all-gather): a
difference means it was used on differing data outside its module's forward, or the ranks computed differently
(different batches, different dropout masks), and no reduction can tell what the right gradient is: refused.

Inputs that differ for other reasons than a split of the work (each tensor-parallel rank reading its own batch,
drawing its own dropout masks in a replicated region) look like parts by their values and are summed; there
the tensor-parallel layers already compute from inputs they assume equal, and no reduction of the leftovers
makes the step right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from torchloom.errors import MisuseError
from torchloom.strategies._replicated import PeerBackwardFailedError, ReplicatedGradSync

# Inputs that differ by less than this (relative to their size) are the same input: replicated regions computed
# with non-deterministic kernels (atomics on GPUs) differ in their last bits, sequence shards in everything.
_RTOL = 1e-4
# Rounds in which a replicated parameter's gradient is compared across the tensor-parallel group, at most
# (until each has been seen with a gradient on every rank).
_VERIFY_ROUNDS = 16
_SEEN, _COUNT, _ABS, _SUM, _SQUARES, _WEIGHTED = range(6)
_CHUNK = 1 << 22


def _fingerprint(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[seen, elements, sum |x|, sum x, sum x^2, sum x*w] of `tensors` in float64, w a fixed pseudo-random
    weight per position (so that two inputs with the same values in another order differ)."""
    out = torch.zeros(6, dtype=torch.float64, device=device)
    out[_SEEN] = 1
    for t in tensors:
        flat = t.detach().reshape(-1)
        # In pieces: a whole activation in float64 (and its weights) would double a large model's peak memory.
        for start in range(0, flat.numel(), _CHUNK):
            x = flat[start : start + _CHUNK].to(device=device, dtype=torch.float64)
            w = torch.arange(start, start + x.numel(), dtype=torch.float64, device=device)
            w.mul_(0.6180339887).frac_().sub_(0.5)
            out[_COUNT] += x.numel()
            out[_ABS] += x.abs().sum()
            out[_SUM] += x.sum()
            out[_SQUARES] += x.square().sum()
            out[_WEIGHTED] += (x * w).sum()
    return out


def _differ(rows: torch.Tensor) -> bool:
    """Whether the fingerprints `rows` (one per rank of a tensor-parallel group) are of different inputs."""
    seen = rows[:, _SEEN]
    if not bool((seen == seen[0]).all()):
        return True  # called on some ranks of the group and not on others
    if not bool(seen[0]):
        return False
    if not bool((rows[:, _COUNT] == rows[0, _COUNT]).all()):
        return True
    spread = rows.max(dim=0).values - rows.min(dim=0).values
    scale_abs = rows[:, _ABS].abs().max()
    scale_sq = rows[:, _SQUARES].abs().max()
    return bool(
        spread[_SUM] > _RTOL * scale_abs
        or spread[_WEIGHTED] > _RTOL * scale_abs
        or spread[_ABS] > _RTOL * scale_abs
        or spread[_SQUARES] > _RTOL * scale_sq
    )


class TensorParallelLeftovers:
    """The gradient sync of the leftovers of one model under tensor parallelism (tp > 1): a
    `ReplicatedGradSync` per reduction rule, made at the end of the first root forward with gradients, once the
    rule of every parameter is known. Before that no leftover can have a gradient. It answers what the
    strategy asks of a `ReplicatedGradSync` (`enabled`, `begin`, `end`, `remove`).

    `grid`: the global ranks as (data-parallel replicas, tensor-parallel ranks); `world`: a group of every rank;
    `dp_group`: this rank's data-parallel group (the ranks with its tensor-parallel index)."""

    def __init__(
        self,
        module: nn.Module,
        leftovers: list[tuple[str, nn.Parameter]],
        world: dist.ProcessGroup,
        dp_group: dist.ProcessGroup,
        grid: torch.Tensor,
        device: torch.device,
        unit_params: list[tuple[str, nn.Parameter]] = (),  # type: ignore[assignment]
    ) -> None:
        self.module = module
        self.leftovers = leftovers
        #: Parameters in fully_shard units but not tensor-parallel: fully_shard averages their gradients over the
        #: data-parallel ranks only, right for copies and wrong for parts (checked, refused).
        self.unit_params = list(unit_params)
        self.world = world
        self.dp_group = dp_group
        self.grid = grid
        self.dp_size = grid.shape[0]
        self.device = device
        self.syncs: list[ReplicatedGradSync] = []
        #: name -> "replicated" (mean over data-parallel ranks) or "parts" (sum over tp, mean over dp), once known
        self.rules: dict[str, str] = {}
        self._enabled = True
        ids = {id(p) for _, p in (*leftovers, *self.unit_params)}
        #: The modules holding leftovers as their own parameters, with their paths (the root: "").
        self.holders = [
            (path, mod)
            for path, mod in module.named_modules()
            if any(p is not None and id(p) in ids for p in mod._parameters.values())
        ]
        self._prints: list[torch.Tensor | None] = [None] * len(self.holders)
        self._probe = [
            mod.register_forward_pre_hook(self._recorder(i), with_kwargs=True)
            for i, (_, mod) in enumerate(self.holders)
        ]
        self._probe.append(module.register_forward_hook(self._decide))
        self._unverified: list[tuple[str, nn.Parameter]] = []
        self._verify_rounds = 0

    # ---- what the strategy calls --------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value
        for sync in self.syncs:
            sync.enabled = value

    def begin(self) -> None:
        for sync in self.syncs:
            sync.begin()

    def end(self, error: BaseException | None = None) -> None:
        # Every sync ends its round before anything is raised, so no round is left open on this rank alone.
        failures: list[BaseException] = []
        for sync in self.syncs:
            try:
                sync.end(error)
            except PeerBackwardFailedError as failure:
                failures.append(failure)
        if failures:
            raise failures[0]

    def remove(self) -> None:
        for handle in self._probe:
            handle.remove()
        self._probe = []
        for sync in self.syncs:
            sync.remove()

    # ---- the first forward: which rule each parameter needs ------------------------------------------------------
    def _recorder(self, index: int) -> Callable[..., None]:
        def record(mod: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.is_grad_enabled():
                return
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            fingerprint = _fingerprint(tensors, self.device)
            previous = self._prints[index]
            self._prints[index] = fingerprint if previous is None else previous + fingerprint

        return record

    def _decide(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        empty = torch.zeros(6, dtype=torch.float64, device=self.device)
        local = torch.stack([p if p is not None else empty for p in self._prints])
        # A refusal below leaves the probe in place: a caller that catches it gets it again at the next forward,
        # never a step with unreduced leftovers.
        self._prints = [None] * len(self.holders)
        # One all-gather over every rank, so every rank takes the same decision (a group that happens to see
        # equal inputs in its first batch follows the others).
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(self.world))]
        dist.all_gather(gathered, local, group=self.world)
        prints = torch.stack(gathered).cpu()[self.grid]  # (dp, tp, holders, 6)
        kinds: list[str] = []
        for i in range(len(self.holders)):
            rows = prints[:, :, i]
            if any(_differ(rows[d]) for d in range(rows.shape[0])):
                kinds.append("parts")
            elif bool(rows[:, :, _SEEN].any()):
                kinds.append("replicated")
            else:
                kinds.append("unseen")

        def users(param: nn.Parameter) -> list[tuple[str, str]]:
            return [
                (path, kind)
                for (path, mod), kind in zip(self.holders, kinds, strict=True)
                if any(p is param for p in mod._parameters.values())
            ]

        for name, param in self.unit_params:
            split = next((path for path, kind in users(param) if kind == "parts"), None)
            if split is not None:
                raise MisuseError(
                    f"Parameter {name!r} is in a fully_shard unit but not tensor-parallel, and the input of "
                    f"{split or '<root>'!r} differs across the tensor-parallel ranks (a shard of the sequence after "
                    "a sequence-parallel region, or the rank's own heads): fully_shard averages its gradient over "
                    "the data-parallel ranks only, so each tensor-parallel rank would train its own copy on its "
                    "part, silently. Put it in your plan, e.g. SequenceParallel(sequence_dim=...) for a norm over "
                    "a sequence shard or over the rank's heads (its weight becomes a Replicate DTensor whose "
                    f"gradient sums the ranks' parts), or keep {split or '<root>'!r} out of every unit (torchloom "
                    "then sums its gradient over the tensor-parallel ranks)."
                )
        replicated, parts = [], []
        for name, param in self.leftovers:
            found = {kind for _, kind in users(param)}
            if {"replicated", "parts"} <= found:
                same = next(path for path, kind in users(param) if kind == "replicated")
                split = next(path for path, kind in users(param) if kind == "parts")
                raise MisuseError(
                    f"Leftover parameter {name!r} (outside every FSDP unit, not tensor-parallel) is used by "
                    f"{same or '<root>'!r}, whose input is the same on every tensor-parallel rank, and by "
                    f"{split or '<root>'!r}, whose input differs across them (e.g. a sequence shard after a "
                    "sequence-parallel region): its gradient is partly one copy and partly a sum of the ranks' "
                    "parts, which no reduction of the whole gradient gets right. Make "
                    f"{split or '<root>'!r} tensor-parallel in your plan (e.g. ColwiseParallel("
                    "input_layouts=Shard(1)) for a head after a sequence-parallel region), or untie the weight."
                )
            (parts if "parts" in found else replicated).append((name, param))
        for handle in self._probe:
            handle.remove()
        self._probe = []
        self._prints = []
        self.rules = {name: "parts" for name, _ in parts} | {name: "replicated" for name, _ in replicated}
        # Parts of a sum: summed over every rank (tp x dp), divided by the replicas. Copies: the mean over the
        # data-parallel group alone, the smallest group that gives it.
        if parts:
            self.syncs.append(ReplicatedGradSync([p for _, p in parts], self.world, divisor=self.dp_size))
        if replicated:
            sync = ReplicatedGradSync([p for _, p in replicated], self.dp_group)
            self._unverified = [(n, p) for n, p in replicated if p.requires_grad]
            if self._unverified:
                sync.after_round = self._verify
            self.syncs.append(sync)
        for sync in self.syncs:
            sync.enabled = self._enabled
            sync.watch_outputs(module)
            sync._on_forward(
                module, args, output
            )  # this forward's output: its hooks ran before these existed

    # ---- after the first reductions: a replicated parameter's gradient is the same on every tp rank -------------
    def _verify(self) -> None:
        self._verify_rounds += 1
        rows = torch.zeros(len(self._unverified), 3, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for i, (_, p) in enumerate(self._unverified):
                if p.grad is not None:
                    g = p.grad.detach().to(torch.float64)
                    rows[i, 0] = 1
                    rows[i, 1] = g.abs().sum()
                    rows[i, 2] = g.square().sum()
        gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(self.world))]
        dist.all_gather(gathered, rows, group=self.world)
        table = torch.stack(gathered).cpu()[self.grid]  # (dp, tp, params, 3)
        spread = table.amax(dim=1) - table.amin(dim=1)  # across each tensor-parallel group
        scale = table.abs().amax(dim=1)
        bad = ((spread[..., 0] > 0) | (spread[..., 1:] > _RTOL * scale[..., 1:]).any(-1)).any(0)
        wrong = [name for (name, _), b in zip(self._unverified, bad.tolist(), strict=True) if b]
        if wrong:
            # Checked again after every round: a caller that catches this gets it again, not a wrong step.
            raise MisuseError(
                f"The gradient of the leftover parameter(s) {wrong[:5]}{' ...' if len(wrong) > 5 else ''} "
                "(outside every FSDP unit, not tensor-parallel) differs across the tensor-parallel ranks of one "
                "data-parallel replica, although the input of the module that holds it is the same on all of "
                "them. It is used outside that module's forward on data that differs across those ranks (e.g. "
                "`F.linear(x, self.head.weight)` in a parent's forward after a sequence-parallel region), or the "
                "ranks computed differently (each read its own batch; different dropout masks). torchloom "
                "cannot tell whether its gradient is one copy or the sum of the ranks' parts, so this step must "
                "not be taken. Call the module itself on that data, make it tensor-parallel in your plan, and "
                "give every rank of a tensor-parallel group the same batch (loom.setup_dataloaders does)."
            )
        everywhere = table[..., 0].amin(dim=(0, 1)).bool().tolist()  # had a gradient on every rank
        self._unverified = [item for item, done in zip(self._unverified, everywhere, strict=True) if not done]
        if not self._unverified or self._verify_rounds >= _VERIFY_ROUNDS:
            for sync in self.syncs:
                sync.after_round = None
