"""`torchloom plan --budget`: when a rank is over the budget, the changes that bring every rank under it, fastest
first, each with its predicted peak per rank, its cost per step (recomputed FLOPs, extra communication bytes)
and the arguments or code that apply it; and when nothing fits, the floor: the lowest peak every change
together reaches.

Changes the planner can make to the unchanged script are planned again with the change applied (activation
checkpointing of chosen blocks, full or selective, `precision`, FSDP2's `reshard_after_forward`: see
`_fit_rank`). Those it cannot (the micro-batch is the script's; CPU offload and hybrid sharding need a GPU and
nodes the CPU plan does not have) are derived from the plan's own breakdown and marked so.

"Fastest first" orders by an estimate of the time each change adds to a step: recomputed FLOPs at
`device_flops` and extra bytes at `link_bytes_per_s` (between ranks) or `host_bytes_per_s` (host <-> device),
assumptions the output states and the command line overrides.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchloom.planning._fit_rank import saved_ops
from torchloom.planning.plan import PlanError, human

#: The changes `--fit-changes` chooses from, in the order they are tried.
CHANGES = ("checkpointing", "selective", "precision", "reshard", "micro-batch", "hsdp", "offload")

_SHARDED = ("fsdp", "fsdp2")


@dataclass
class Assumptions:
    """What turns a change's FLOPs and bytes into time (per rank)."""

    device_flops: float = 100e12  # sustained dense FLOP/s of one device
    link_bytes_per_s: float = 25e9  # collective bandwidth between ranks, per rank
    host_bytes_per_s: float = 12e9  # host <-> device copies (PCIe)

    def seconds(self, flops: float, comm_bytes: float, host_bytes: float = 0) -> float:
        return (
            flops / self.device_flops
            + comm_bytes / self.link_bytes_per_s
            + host_bytes / self.host_bytes_per_s
        )

    def describe(self) -> str:
        return (
            f"fastest first: added time per step estimated at {self.device_flops / 1e12:g} TFLOP/s for "
            f"recomputation, {self.link_bytes_per_s / 1e9:g} GB/s between ranks and "
            f"{self.host_bytes_per_s / 1e9:g} GB/s host<->device (--device-flops, --link-bandwidth, "
            "--host-bandwidth)"
        )


Replan = Callable[[dict[str, Any], "str | None"], dict[str, Any]]


_DETAIL = ("ranks", "peak_bytes", "phase", "module", "step", "breakdown")


def _peaks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each simulated rank's peak, when and what (a plan's `ranks` without their timelines)."""
    return [{key: entry[key] for key in _DETAIL if key in entry} for entry in result["ranks"]]


def _largest(peaks: list[dict[str, Any]]) -> int:
    return max(entry["peak_bytes"] for entry in peaks)


class _Fitter:
    def __init__(self, base: dict[str, Any], budget: int, replan: Replan, assumptions: Assumptions) -> None:
        self.base = base
        self.budget = budget
        self.replan = replan
        self.assumptions = assumptions
        self.seen: dict[str, Any] = base["ranks"][0].get("fit") or {}
        self.strategy: dict[str, Any] = self.seen.get("strategy") or {}
        self.world = base["world_size"]
        self.notes: list[str] = []
        self.cache: dict[str, dict[str, Any] | None] = {}

    # ---- the costs of communication ----------------------------------------------------------------------
    def _gather_bytes(self) -> int:
        """Bytes one all-gather of every FSDP unit receives on a rank."""
        return int(self.seen.get("unit_param_bytes", 0) * (self.world - 1) / self.world)

    def _micro_batches(self) -> int:
        return max(1, int(self.seen.get("micro_batches") or 1))

    # ---- one change --------------------------------------------------------------------------------------
    def _entry(
        self,
        change: str,
        apply: str,
        how: str,
        peaks: list[dict[str, Any]],
        flops: int = 0,
        comm: int = 0,
        host: int = 0,
        note: str = "",
    ) -> dict[str, Any]:
        return {
            "change": change,
            "apply": apply,
            "how": how,
            "peak_bytes": _largest(peaks),
            "ranks": peaks,
            "fits": _largest(peaks) <= self.budget,
            "recompute_flops": int(flops),
            "extra_comm_bytes": int(comm + host),
            "host_copy_bytes": int(host),
            "added_seconds": self.assumptions.seconds(flops, comm, host),
            "note": note,
        }

    def plan_with(self, fit: dict[str, Any], precision: str | None = None) -> dict[str, Any] | None:
        """The script planned again with `fit`'s changes (and `precision`); None (with a note) when it fails.
        Each combination is planned once."""
        key = json.dumps([fit, precision], sort_keys=True)
        if key not in self.cache:
            try:
                self.cache[key] = self.replan({**fit, "observe": False}, precision)
            except PlanError as error:
                what = ", ".join([*fit, *([f"precision {precision}"] if precision else [])])
                self.notes.append(f"could not plan {what}: {str(error).splitlines()[0]}")
                self.cache[key] = None
        return self.cache[key]

    def _planned(self, fit: dict[str, Any], precision: str | None = None) -> list[dict[str, Any]] | None:
        result = self.plan_with(fit, precision)
        return None if result is None else _peaks(result)

    def checkpointing(self, selective: bool, count: int | None = None) -> dict[str, Any] | None:
        blocks: list[str] = self.seen.get("blocks") or []
        if not blocks:
            return None
        peaks = self._planned({"checkpointing": {"count": count, "selective": selective}})
        if peaks is None:
            return None
        chosen = len(blocks) if count is None else count
        cls = self.seen["block_class"]
        per_block = self.seen.get("block_forward_flops", 0) / len(blocks)
        kind = "selective" if selective else "full"
        which = (
            f"every {cls} ({chosen} blocks)"
            if chosen == len(blocks)
            else f"{chosen} of {len(blocks)} {cls} blocks"
        )
        pick = f"blocks[:{chosen}]" if chosen < len(blocks) else "blocks"
        wrapper = (
            "partial(checkpoint_wrapper, context_fn=partial(create_selective_checkpoint_contexts, "
            f"[{', '.join(saved_ops())}]))"  # the operations the plan kept, every one
            if selective
            else "checkpoint_wrapper"
        )
        apply = (
            f"before loom.setup(model): blocks = [m for m in model.modules() if isinstance(m, {cls})]; "
            f"chosen = set({pick}); apply_activation_checkpointing(model, checkpoint_wrapper_fn={wrapper}, "
            "check_fn=lambda m: m in chosen)  "
            "# from torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
            + (", and torch.utils.checkpoint" if selective else "")
        )
        if selective:
            flops = 0
            note = "recomputes only what is not a matmul/attention output (not counted in FLOPs)"
        else:
            flops = int(per_block * chosen)
            note = "recomputes each chosen block's forward in backward"
        return self._entry(
            f"activation checkpointing ({kind}) of {which}", apply, "planned", peaks, flops, 0, 0, note
        )

    def fewest_blocks(self, full: dict[str, Any]) -> dict[str, Any] | None:
        """Checkpointing fewer blocks than all, when all of them save more than the budget needs."""
        blocks = self.seen.get("blocks") or []
        saved = self.base["peak_bytes"] - full["peak_bytes"]
        if not full["fits"] or saved <= 0 or len(blocks) < 2:
            return None
        count = math.ceil((self.base["peak_bytes"] - self.budget) / (saved / len(blocks)))
        for _ in range(2):  # the estimate, then one more block if the plan says it falls short
            if count >= len(blocks):
                return None
            entry = self.checkpointing(False, count)
            if entry is None or entry["fits"]:
                return entry
            count += 1
        return None

    def precision(self, name: str) -> dict[str, Any] | None:
        if self.strategy.get("precision") not in (None, "32-true"):
            return None
        peaks = self._planned({}, name)
        if peaks is None:
            return None
        # Collectives move half the bytes: bf16-true all of them; bf16-mixed FSDP's gathers (gradients are
        # still reduced in fp32) and none of DDP's.
        gathers = self._gather_bytes() * 2 * self._micro_batches()
        if self.strategy.get("name") in _SHARDED:
            comm = -gathers // 2 if name == "bf16-mixed" else -(gathers + self._gather_bytes()) // 2
        else:
            all_reduce = int(2 * self.seen.get("param_bytes", 0) * (self.world - 1) / self.world)
            comm = 0 if name == "bf16-mixed" else -all_reduce // 2
        note = "computes in bfloat16 (check the loss curve); usually faster on GPUs, not counted"
        if name == "bf16-true":
            note = "parameters, gradients and optimizer state in bfloat16 too: less exact updates"
        return self._entry(
            f"precision {name}",
            f"torchloom run --precision {name} (or Loom(precision={name!r}))",
            "planned",
            peaks,
            0,
            comm,
            0,
            note,
        )

    def reshard(self) -> dict[str, Any] | None:
        if self.strategy.get("name") != "fsdp2" or self.strategy.get("reshard_after_forward") is not False:
            return None
        peaks = self._planned({"reshard_after_forward": True})
        if peaks is None:
            return None
        return self._entry(
            "reshard_after_forward=True",
            "FSDP2Strategy(reshard_after_forward=True), and fully_shard(block, reshard_after_forward=True) "
            "for units made by hand",
            "planned",
            peaks,
            0,
            self._gather_bytes() * self._micro_batches(),
            0,
            "every unit is gathered again for backward",
        )

    def micro_batch(self, plan: dict[str, Any], label: str = "") -> dict[str, Any] | None:
        batch = self.seen.get("micro_batch")
        if not batch or batch < 2:
            return None
        for size in sorted((d for d in range(1, batch) if batch % d == 0), reverse=True):
            peaks = self._smaller_batch(plan, size / batch)
            if _largest(peaks) <= self.budget or size == 1:
                break
        factor = batch // size
        comm = 0
        if self.strategy.get("name") in _SHARDED:  # every extra micro-batch gathers every unit again
            comm = self._gather_bytes() * 2 * (factor - 1) * self._micro_batches()
        return self._entry(
            f"micro-batch {size} (from {batch}) with {factor}x the accumulation{label}",
            f"read {size} samples per micro-batch and accumulate {factor}x as many micro-batches per "
            f"optimizer step (the same global batch: loss / accumulation, loom.no_backward_sync(model, "
            f"enabled=not last) on all but the last)",
            "derived",
            peaks,
            0,
            comm,
            0,
            "derived: activations (and forward/backward temporaries) scaled by the micro-batch, gradients "
            "held across micro-batches; smaller kernels run less efficiently, not counted",
        )

    def _smaller_batch(self, plan: dict[str, Any], ratio: float) -> list[dict[str, Any]]:
        """The peaks with a micro-batch `ratio` of today's and the accumulation to match: activations (and the
        temporaries of a forward or backward peak) scale with the micro-batch, and from the second micro-batch
        on every gradient is held (a peak before the gradients exist holds them then)."""
        out = []
        for entry in plan["ranks"]:
            kinds = entry["breakdown"]
            scaled = kinds.get("activations", 0)
            if entry.get("phase") in ("forward", "backward"):
                scaled += kinds.get("temporaries", 0)
            held = max(0, kinds.get("parameters", 0) - kinds.get("gradients", 0)) if ratio < 1 else 0
            peak = int(entry["peak_bytes"] - scaled * (1 - ratio) + held)
            out.append({"ranks": entry["ranks"], "peak_bytes": peak})
        return out

    def _moved(self, plan: dict[str, Any], fraction: float) -> list[dict[str, Any]]:
        """The peaks with `fraction` of the sharded state (parameters, gradients, optimizer state) gone."""
        share = self.seen.get("unit_param_bytes", 0) / max(1, self.seen.get("param_bytes", 1))
        out = []
        for entry in plan["ranks"]:
            kinds = entry["breakdown"]
            state = kinds.get("parameters", 0) + kinds.get("gradients", 0) + kinds.get("optimizer state", 0)
            out.append(
                {"ranks": entry["ranks"], "peak_bytes": int(entry["peak_bytes"] - state * share * fraction)}
            )
        return out

    def offload(self, plan: dict[str, Any], label: str = "") -> dict[str, Any] | None:
        if self.strategy.get("name") not in _SHARDED or self.strategy.get("cpu_offload"):
            return None
        shard = self.seen.get("unit_param_bytes", 0) // self.world
        gathers = 2 if self.strategy.get("reshard_after_forward") is not False else 1
        host = shard * gathers * self._micro_batches() + shard  # parameters in, gradients out
        return self._entry(
            f"CPU offload{label}",
            f"Loom(strategy={'FSDP2Strategy' if self.strategy['name'] == 'fsdp2' else 'FSDPStrategy'}"
            "(cpu_offload=True)) (CUDA only)",
            "derived",
            self._moved(plan, 1.0),
            0,
            0,
            host,
            "derived: the units' parameters, gradients and optimizer state live in host memory; the "
            "optimizer steps on the CPU, not counted",
        )

    def full_shard(self, plan: dict[str, Any], label: str = "") -> dict[str, Any] | None:
        nodes = self.base["num_nodes"]
        if self.strategy.get("name") not in _SHARDED or not self.strategy.get("hybrid") or nodes < 2:
            return None
        per_node = self.world // nodes
        # Hybrid shards over a node's ranks; full sharding over all: each rank keeps 1/world, not 1/per_node.
        fraction = 1 - per_node / self.world
        unit = self.seen.get("unit_param_bytes", 0)
        comm = int(unit * (1 / per_node - 1 / self.world)) * 3 * self._micro_batches()
        return self._entry(
            f"full sharding instead of HSDP{label}",
            f"{'FSDP2Strategy' if self.strategy['name'] == 'fsdp2' else 'FSDPStrategy'}(hybrid=False)",
            "derived",
            self._moved(plan, fraction),
            0,
            comm,
            0,
            "derived: gathers and reduce-scatters cross nodes",
        )


def fit_budget(
    base: dict[str, Any],
    budget: int,
    replan: Replan,
    *,
    assumptions: Assumptions | None = None,
    changes: tuple[str, ...] = CHANGES,
) -> dict[str, Any]:
    """The fits of `base` (a plan made with `fit={"observe": True}`) to `budget`: `replan(fit, precision)` plans
    the script again with a change applied. Returns `{"fits": [...], "tried": [...], "floor": {...}}`."""
    unknown = set(changes) - set(CHANGES)
    if unknown:
        from torchloom.errors import ConfigurationError

        raise ConfigurationError(
            f"--fit-changes {', '.join(sorted(unknown))}: not a change the planner knows. Choose from "
            f"{', '.join(CHANGES)}."
        )
    fitter = _Fitter(base, budget, replan, assumptions or Assumptions())
    tried: list[dict[str, Any]] = []

    def add(entry: dict[str, Any] | None) -> None:
        if entry is not None:
            tried.append(entry)

    full = fitter.checkpointing(False) if "checkpointing" in changes else None
    add(full)
    if full is not None:
        add(fitter.fewest_blocks(full))
    if "selective" in changes:
        add(fitter.checkpointing(True))
    if "precision" in changes:
        for name in ("bf16-mixed", "bf16-true"):
            add(fitter.precision(name))
    if "reshard" in changes:
        add(fitter.reshard())
    if "micro-batch" in changes:
        add(fitter.micro_batch(base))
    if "hsdp" in changes:
        add(fitter.full_shard(base))
    if "offload" in changes:
        add(fitter.offload(base))
    floor = _floor(fitter, changes, tried)
    # Ties (changes that add no counted time) go planned first, then by the headroom they leave.
    fits = sorted(
        (e for e in tried if e["fits"]),
        key=lambda e: (e["added_seconds"], e["how"] != "planned", e["peak_bytes"]),
    )
    if not fits and floor["peak_bytes"] <= budget:
        fits = [floor["entry"]]
    return {
        "budget_bytes": budget,
        "assumptions": vars(fitter.assumptions),
        "fits": fits,
        "tried": tried,
        "floor": {k: v for k, v in floor.items() if k != "entry"},
        "notes": fitter.notes,
    }


def _floor(fitter: _Fitter, changes: tuple[str, ...], tried: list[dict[str, Any]]) -> dict[str, Any]:
    """Every change that lowers the peak, together: the planned ones in one re-plan, the derived ones on its
    breakdown."""
    fit: dict[str, Any] = {}
    took: list[str] = []
    derived = False  # a derived change is part of the floor: the floor is derived too
    planned = [e for e in tried if e["how"] == "planned"]
    checkpointing = [e for e in planned if e["change"].startswith("activation checkpointing")]
    best_ac = min(checkpointing, key=lambda e: e["peak_bytes"], default=None)
    if best_ac is not None and best_ac["peak_bytes"] < fitter.base["peak_bytes"]:
        fit["checkpointing"] = {"count": None, "selective": "selective" in best_ac["change"]}
        took.append(best_ac["change"])
    precisions = [e for e in planned if e["change"].startswith("precision")]
    best_precision = min(precisions, key=lambda e: e["peak_bytes"], default=None)
    precision = None
    if best_precision is not None and best_precision["peak_bytes"] < fitter.base["peak_bytes"]:
        precision = best_precision["change"].split()[-1]
        took.append(best_precision["change"])
    reshard = next((e for e in planned if e["change"].startswith("reshard_after_forward")), None)
    if reshard is not None:
        fit["reshard_after_forward"] = True
        took.append(reshard["change"])
    same = [e for e in planned if e["change"] in took]
    combined: dict[str, Any] | None = fitter.base
    if took:
        combined = fitter.plan_with(fit, precision)
        if combined is None:  # the combination failed (noted): the floor from the derived changes alone
            took, same, combined = [], [], fitter.base
    assert combined is not None
    peaks = _peaks(combined)
    flops = sum(e["recompute_flops"] for e in same)
    comm = sum(e["extra_comm_bytes"] - e["host_copy_bytes"] for e in same)
    host = 0
    applies = [e["apply"] for e in tried if e["change"] in took]
    for name, derive in (
        ("micro-batch", fitter.micro_batch),
        ("hsdp", fitter.full_shard),
        ("offload", fitter.offload),
    ):
        if name not in changes:
            continue
        if name == "micro-batch":
            saved_budget, fitter.budget = fitter.budget, -1  # the smallest micro-batch: the floor
            entry = derive(combined)
            fitter.budget = saved_budget
        else:
            entry = derive(combined)
        if entry is None or entry["peak_bytes"] >= _largest(peaks):
            continue
        took.append(entry["change"])
        applies.append(entry["apply"])
        derived = derived or entry["how"] == "derived"
        cut = {
            tuple(p["ranks"]): _largest([p]) - q["peak_bytes"]
            for p, q in zip(peaks, entry["ranks"], strict=True)
        }
        combined = {
            **combined,
            "ranks": [
                {**r, "peak_bytes": r["peak_bytes"] - cut[tuple(r["ranks"])]} for r in combined["ranks"]
            ],
        }
        peaks = _peaks(combined)
        comm += entry["extra_comm_bytes"] - entry["host_copy_bytes"]
        host += entry["host_copy_bytes"]
    entry = fitter._entry(
        "all of: " + "; ".join(took) if took else "no change",
        " and ".join(applies) or "-",
        "derived" if derived else "planned",
        peaks,
        flops,
        comm,
        host,
        "every change that lowers the peak, together",
    )
    return {"peak_bytes": _largest(peaks), "changes": took, "how": entry["how"], "entry": entry}


def format_fits(fit: dict[str, Any]) -> str:
    budget = fit["budget_bytes"]
    lines = []
    if fit["fits"]:
        lines.append(f"changes that fit the budget of {human(budget)} per rank, fastest first:")
        for number, entry in enumerate(fit["fits"], 1):
            peaks = ", ".join(
                (
                    f"ranks {p['ranks'][0]}-{p['ranks'][-1]}"
                    if len(p["ranks"]) > 1
                    else f"rank {p['ranks'][0]}"
                )
                + f" {human(p['peak_bytes'])}"
                for p in entry["ranks"]
            )
            lines.append(f"{number}. {entry['change']} ({entry['how']}): peak {peaks}")
            lines.append(
                f"    cost per step: recompute {_flops(entry['recompute_flops'])}, extra communication "
                f"{_signed(entry['extra_comm_bytes'])}"
                + (f" (host<->device {human(entry['host_copy_bytes'])})" if entry["host_copy_bytes"] else "")
                + f", about {_seconds(entry['added_seconds'])}; {entry['note']}"
            )
            lines.append(f"    apply: {entry['apply']}")
    floor = fit["floor"]
    if not fit["fits"]:
        lines.append(
            f"no change the planner knows fits the budget of {human(budget)} per rank: the floor is "
            f"{human(floor['peak_bytes'])} ({floor['how']}), with "
            + ("; ".join(floor["changes"]) if floor["changes"] else "no change that lowers the peak")
            + ". Add devices, shard more of the model, or raise the budget."
        )
    else:
        lines.append(f"floor (every change together): {human(floor['peak_bytes'])} ({floor['how']})")
    lines.extend(f"note: {note}" for note in fit["notes"])
    lines.append(Assumptions(**fit["assumptions"]).describe())
    return "\n".join(lines)


def _flops(flops: float) -> str:
    return "0 FLOPs" if not flops else f"{flops / 1e9:.2f} GFLOPs"


def _signed(nbytes: int) -> str:
    return ("-" if nbytes < 0 else "+") + human(abs(nbytes)) if nbytes else "+0 B"


def _seconds(seconds: float) -> str:
    return f"{'-' if seconds < 0 else '+'}{abs(seconds) * 1e3:.3g} ms"


def add_fit_options(parser: Any) -> None:
    """`torchloom plan`'s options for fitting a budget."""
    parser.add_argument(
        "--fit-changes",
        default=",".join(CHANGES),
        help=f"with --budget: the changes to try, comma-separated (default all: {','.join(CHANGES)})",
    )
    parser.add_argument(
        "--device-flops", type=float, default=Assumptions.device_flops, help="FLOP/s that cost recomputation"
    )
    parser.add_argument(
        "--link-bandwidth",
        type=float,
        default=Assumptions.link_bytes_per_s,
        help="bytes/s between ranks that cost extra communication",
    )
    parser.add_argument(
        "--host-bandwidth",
        type=float,
        default=Assumptions.host_bytes_per_s,
        help="bytes/s host<->device that cost CPU offload",
    )


def fit_for_command(args: Any, result: dict[str, Any], budget: int, replan: Replan) -> str:
    """`torchloom plan --budget` over the budget: the fits added to `result` (its `fits` list and `fitting`),
    and their text."""
    changes = tuple(c.strip() for c in args.fit_changes.split(",") if c.strip())
    assumptions = Assumptions(args.device_flops, args.link_bandwidth, args.host_bandwidth)
    fit = fit_budget(result, budget, replan, assumptions=assumptions, changes=changes)
    result["fits"] = fit["fits"]
    result["fitting"] = {k: v for k, v in fit.items() if k != "fits"}
    return format_fits(fit)
