"""The README's comparison table, measured: torchloom, Lightning Fabric, Accelerate and raw PyTorch, side by side.

One model, sharded by hand: FSDP units on its blocks, an input layer (`embed`) and a head left outside every
unit. Every cell of the table is observed by this script, in a job of its own (2 gloo CPU ranks unless the row
says otherwise, forked like `_common.run_ranks` does, but every rank's exit code is read), so a crash (SIGSEGV) in
one cell is reported in that cell, with the innermost Python frame of the crashed rank, and the script goes on. A cell that cannot be observed prints "not measured: <reason>". The rows:

1. units made by hand, then setup: is the root wrapped again? (the type of the root after setup)
2. layers outside every unit stay identical across ranks? (max |rank0 - rank1| of embed and head after
   `--steps` SGD steps on different data per rank)
3. `no_backward_sync` and `clip_gradients` without a wrapped root: one step of 2 micro-batches (the first
   without sync), then clipping by norm; the norm returned is compared with the global norm of a one-process
   reference on the global batch, and the parameters after the step with the reference's.
4. FSDP on CPU (gloo): what setup gives, and whether a training step runs.
5. a full (one-file) checkpoint of the FSDP model: whether the save returns and the file holds the model.
6. a sharded checkpoint written by 2 ranks, loaded by 2 ranks (the same set-up), by 1 plain process and by 3
   ranks (parameters compared with the writer's): the model and its optimizer; where that fails, the model
   alone (ranks) or the framework's own consolidation tool (1 process).

Bypasses, so that rows 1-3, 5, 6 can be observed on CPU at all (the script prints them too):

- Lightning Fabric refuses FSDP on CPU (row 4, observed without any bypass). For the other rows its connector's
  `_check_strategy_and_fallback` runs with the accelerator flag reading "cuda" for the duration of that check
  only; everything else (the CPU accelerator, gloo) is Fabric's own choice.
- Accelerate ignores `fsdp_plugin` on CPU (row 4, observed without any bypass: the model comes back as DDP).
  For the other rows the shared accelerator state is set to `DistributedType.FSDP` and its device to
  `torch.device("cpu")` after `Accelerator(...)` (FSDP1 refuses `device_id=cpu:0` for a module on "cpu"), and
  the plugin gets `use_orig_params=True` (FSDP1 refuses a mix with the hand-made units' setting).

Accelerate is optional: `pip install accelerate==1.15.0` (the versions the README names); without it its column
says "not installed". Lightning is in the `test` extra (without it, the same for Fabric's column).

    python benchmarks/field.py --json benchmarks/results/field.json | tee benchmarks/results/field.txt
    python benchmarks/field.py --tiny        # fewer steps; the same cells (about as long: start-up dominates)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import importlib.metadata
import io
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from torchloom import testing  # noqa: E402

D_IN, DIM, BLOCKS, MICRO, LR, MAX_NORM = 8, 16, 2, 4, 0.05, 0.05
COLUMNS = ("torchloom", "fabric", "accelerate", "raw")
COLUMN_TITLES = {
    "torchloom": "torchloom",
    "fabric": "Lightning Fabric",
    "accelerate": "Accelerate",
    "raw": "raw PyTorch",
}
MISSING = {
    "fabric": "lightning not installed (pip install lightning==2.6.6)",
    "accelerate": "accelerate not installed (pip install accelerate==1.15.0)",
}
ROWS = {
    "root": "units made by hand, then setup: the root is not wrapped again",
    "leftovers": "layers outside every unit stay identical across ranks",
    "sync_clip": "no_backward_sync and clip_gradients without a wrapped root",
    "cpu": "FSDP on CPU (gloo)",
    "full_ckpt": "full (one-file) checkpoint of an FSDP model on CPU",
    "reshard": "sharded checkpoint written by 2 ranks, loaded by 1 process or by 3 ranks",
}

# ---- the model and its data ----------------------------------------------------------------------------------


class Model(nn.Module):
    """An input layer, blocks, a head: the blocks become units by hand, embed and head stay outside."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, DIM)
        self.blocks = nn.ModuleList(_common.Block(DIM) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def new_model() -> Model:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return Model()


def local_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A different batch on every rank (data parallel)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(MICRO, D_IN, generator=g), torch.randn(MICRO, 1, generator=g)


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def reference_accumulated(world_size: int, micros: int = 2) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the global batch (every rank's micro-batches): the global gradient norm before clipping,
    and the parameters after clipping to MAX_NORM and one SGD step. The mean of the ranks' local means is the
    global mean (equal local batches), so a correct data-parallel step gives exactly this."""
    model = new_model()
    for m in range(micros):
        parts = [local_batch(0, m, r) for r in range(world_size)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        (loss_of(model, (x, y)) / micros).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return float(norm), {k: v.detach().clone() for k, v in model.state_dict().items()}


def wrap_blocks_fsdp1(model: Model) -> Model:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, device_id=torch.device("cpu"), use_orig_params=True)
    return model


def wrap_blocks_fsdp2(model: Model) -> Model:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter at full size under its plain name (collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def leftovers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in full_params(model).items() if k.startswith(("embed.", "head."))}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise ValueError(f"different keys: {sorted(set(a) ^ set(b))}")
    diffs = [float((a[k].float() - b[k].float()).abs().max()) for k in a]
    if any(d != d for d in diffs):
        raise ValueError("NaN in the parameters (the training diverged): lower LR")
    return max(diffs)


def short(error: BaseException, limit: int = 110) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def root_type(module: nn.Module) -> str:
    return type(module).__name__


def count_fsdp_units(module: nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return sum(isinstance(m, (FSDP, FSDPModule)) for m in module.modules())


# ---- the frameworks ------------------------------------------------------------------------------------------


def loom_for(flavour: str, world_size: int, **options: Any):
    from torchloom import Loom
    from torchloom.strategies import FSDP2Strategy, FSDPStrategy

    cls = FSDPStrategy if flavour == "fsdp" else FSDP2Strategy
    loom = Loom(accelerator="cpu", devices=world_size, strategy=cls(**options))
    loom.launch()
    return loom


def loom_model(loom, flavour: str):
    model = new_model()
    model = wrap_blocks_fsdp1(model) if flavour == "fsdp" else wrap_blocks_fsdp2(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = loom.setup_module(model)
    return model, loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))


@contextlib.contextmanager
def fabric_fsdp_on_cpu():
    """Fabric's connector refuses FSDP unless the accelerator flag is cuda/gpu; let that one check read "cuda"."""
    from lightning.fabric.connector import _Connector

    original = _Connector._check_strategy_and_fallback

    def check(self) -> None:
        flag = self._accelerator_flag
        self._accelerator_flag = "cuda"
        try:
            original(self)
        finally:
            self._accelerator_flag = flag

    _Connector._check_strategy_and_fallback = check
    try:
        yield
    finally:
        _Connector._check_strategy_and_fallback = original


def fabric_for(world_size: int, **options: Any):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy

    with fabric_fsdp_on_cpu():
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=FSDPStrategy(**options))
    fabric.launch()
    return fabric


def fabric_model(fabric):
    model = wrap_blocks_fsdp1(new_model())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fabric.setup_module(model)
    return model, fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))


def accelerate_available() -> str | None:
    try:
        return importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        return None


def accelerator_for(bypass: bool, **plugin_options: Any):
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(use_orig_params=True, **plugin_options)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    if bypass:  # what Accelerator(...) decides on GPUs, set by hand (see the module docstring)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        PartialState._shared_state["device"] = torch.device("cpu")
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.device = torch.device("cpu")
        acc.state.fsdp_plugin = plugin
    return acc


def accelerate_model(acc):
    model = wrap_blocks_fsdp1(new_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = acc.prepare(model, opt)
    return model, opt


def raw_group(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def train(model, opt, backward: Callable[[torch.Tensor], None], rank: int, steps: int) -> None:
    for step in range(steps):
        backward(loss_of(model, local_batch(step, 0, rank)))
        opt.step()
        opt.zero_grad()


# ---- row 1: units by hand, then setup ------------------------------------------------------------------------


def root_torchloom(rank: int, world_size: int, args) -> dict:
    out = {}
    for flavour in ("fsdp", "fsdp2"):
        loom = loom_for(flavour, world_size)
        model, _ = loom_model(loom, flavour)
        out[flavour] = (root_type(model.forward_module), count_fsdp_units(model.forward_module))
    return out


def root_fabric(rank: int, world_size: int, args) -> dict:
    fabric = fabric_for(world_size)
    model, _ = fabric_model(fabric)
    return {"fsdp": (root_type(model._forward_module), count_fsdp_units(model._forward_module))}


def root_accelerate(rank: int, world_size: int, args) -> dict:
    model, _ = accelerate_model(accelerator_for(bypass=True))
    return {"fsdp": (root_type(model), count_fsdp_units(model))}


def judge_root(results: list[dict]) -> str:
    parts = []
    for flavour, (root, units) in results[0].items():
        verdict = "root wrapped again" if units > BLOCKS else "root not wrapped"
        parts.append(f"{flavour}: {verdict} (root {root}, {units} units for {BLOCKS} hand-made)")
    return "; ".join(parts)


# ---- row 2: leftovers identical across ranks -----------------------------------------------------------------


def leftovers_torchloom(rank: int, world_size: int, args) -> dict:
    out = {}
    for flavour in ("fsdp", "fsdp2"):
        loom = loom_for(flavour, world_size)
        model, opt = loom_model(loom, flavour)
        train(model, opt, loom.backward, rank, args.steps)
        out[flavour] = leftovers(model.forward_module)
    return out


def leftovers_fabric(rank: int, world_size: int, args) -> dict:
    fabric = fabric_for(world_size)
    model, opt = fabric_model(fabric)
    train(model, opt, fabric.backward, rank, args.steps)
    return {"fsdp": leftovers(model._forward_module)}


def leftovers_accelerate(rank: int, world_size: int, args) -> dict:
    acc = accelerator_for(bypass=True)
    model, opt = accelerate_model(acc)
    train(model, opt, acc.backward, rank, args.steps)
    return {"fsdp": leftovers(model)}


def leftovers_raw(rank: int, world_size: int, args) -> dict:
    raw_group(rank, world_size)
    out = {}
    for flavour, wrap in (("FSDP1", wrap_blocks_fsdp1), ("FSDP2", wrap_blocks_fsdp2)):
        model = wrap(new_model())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        train(model, opt, lambda loss: loss.backward(), rank, args.steps)
        out[flavour] = leftovers(model)
    return out


def judge_leftovers(args) -> Callable[[list[dict]], str]:
    def judge(results: list[dict]) -> str:
        parts = []
        for flavour in results[0]:
            diff = max_diff(results[0][flavour], results[1][flavour])
            verdict = "identical" if diff == 0 else "diverged"
            parts.append(
                f"{flavour}: {verdict}, max abs(rank0 - rank1) = {diff:.1e} after {args.steps} steps"
            )
        return "; ".join(parts)

    return judge


# ---- row 3: no_backward_sync + clip_gradients ----------------------------------------------------------------


def _accumulate_and_clip(model, no_sync, backward, clip, rank: int) -> dict:
    """Micro-batch 0 inside no_sync, micro-batch 1 outside, clip, step: each call's error is recorded."""
    out: dict[str, Any] = {}
    try:
        with no_sync():
            backward(loss_of(model, local_batch(0, 0, rank)) / 2)
        out["no_sync"] = "ok"
    except Exception as error:  # noqa: BLE001 - the observation
        out["no_sync"] = short(error)
        backward(loss_of(model, local_batch(0, 0, rank)) / 2)  # synchronised instead, to go on
    backward(loss_of(model, local_batch(0, 1, rank)) / 2)
    try:
        out["norm"] = float(clip())
    except Exception as error:  # noqa: BLE001 - the observation
        out["clip"] = short(error)
    return out


def sync_clip_torchloom(rank: int, world_size: int, args) -> dict:
    out = {}
    for flavour in ("fsdp", "fsdp2"):
        loom = loom_for(flavour, world_size)
        model, opt = loom_model(loom, flavour)
        out[flavour] = _accumulate_and_clip(
            model,
            lambda loom=loom, model=model: loom.no_backward_sync(model),
            loom.backward,
            lambda loom=loom, model=model, opt=opt: loom.clip_gradients(model, opt, max_norm=MAX_NORM),
            rank,
        )
        opt.step()
        out[flavour]["params"] = full_params(model.forward_module)
    return with_reference(out, rank, world_size)


def sync_clip_fabric(rank: int, world_size: int, args) -> dict:
    fabric = fabric_for(world_size)
    model, opt = fabric_model(fabric)
    out = _accumulate_and_clip(
        model,
        lambda: fabric.no_backward_sync(model),
        fabric.backward,
        lambda: fabric.clip_gradients(model, opt, max_norm=MAX_NORM),
        rank,
    )
    opt.step()
    out["params"] = full_params(model._forward_module)
    return with_reference({"fsdp": out}, rank, world_size)


def sync_clip_accelerate(rank: int, world_size: int, args) -> dict:
    acc = accelerator_for(bypass=True)
    model, opt = accelerate_model(acc)
    out = _accumulate_and_clip(
        model,
        lambda: acc.no_sync(model),
        acc.backward,
        lambda: acc.clip_grad_norm_(model.parameters(), MAX_NORM),
        rank,
    )
    opt.step()
    out["params"] = full_params(model)
    return with_reference({"fsdp": out}, rank, world_size)


def sync_clip_raw(rank: int, world_size: int, args) -> dict:
    """What raw PyTorch offers without a root unit: FSDP1's `no_sync()` and `clip_grad_norm_()` on a unit, FSDP2's
    `set_requires_gradient_sync(False)` on each unit and `torch.nn.utils.clip_grad_norm_` over all parameters."""
    raw_group(rank, world_size)
    model = wrap_blocks_fsdp1(new_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    units = list(model.blocks)

    @contextlib.contextmanager
    def fsdp1_no_sync():
        with contextlib.ExitStack() as stack:
            for unit in units:
                stack.enter_context(unit.no_sync())
            yield

    def fsdp1_clip():
        return sum(float(unit.clip_grad_norm_(MAX_NORM)) ** 2 for unit in units) ** 0.5

    fsdp1 = "FSDP1 (unit.no_sync, unit.clip_grad_norm_)"
    out = {fsdp1: _accumulate_and_clip(model, fsdp1_no_sync, lambda loss: loss.backward(), fsdp1_clip, rank)}
    opt.step()
    out[fsdp1]["params"] = full_params(model)

    model = wrap_blocks_fsdp2(new_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    @contextlib.contextmanager
    def fsdp2_no_sync():
        for block in model.blocks:
            block.set_requires_gradient_sync(False)
        yield
        for block in model.blocks:
            block.set_requires_gradient_sync(True)

    fsdp2 = "FSDP2 (unit.set_requires_gradient_sync, nn.utils.clip_grad_norm_)"
    out[fsdp2] = _accumulate_and_clip(
        model,
        fsdp2_no_sync,
        lambda loss: loss.backward(),
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
        rank,
    )
    opt.step()
    out[fsdp2]["params"] = full_params(model)
    return with_reference(out, rank, world_size)


def with_reference(out: dict, rank: int, world_size: int) -> dict:
    """Rank 0 adds the one-process reference (computed in a rank: the parent runs no torch op before a fork)."""
    if rank == 0:
        out["reference"] = reference_accumulated(world_size)
    return out


def judge_sync_clip(results: list[dict]) -> str:
    norm, params = results[0].pop("reference")
    parts = []
    for flavour in results[0]:
        seen = [r[flavour] for r in results]
        bits = []
        if seen[0]["no_sync"] != "ok":
            bits.append(f"no_sync: {seen[0]['no_sync']}")
        if "clip" in seen[0]:
            bits.append(f"clip: {seen[0]['clip']}")
        else:
            norms = [s["norm"] for s in seen]
            same = all(abs(n - norm) <= 1e-5 * max(1.0, norm) for n in norms)
            where = "the global norm" if same else "not the global norm"
            bits.append(f"norm {'/'.join(f'{n:.4g}' for n in norms)} ({where} {norm:.4g})")
        diff = max(max_diff(s["params"], params) for s in seen)
        bits.append(
            f"params after the step {'match' if diff <= 1e-5 else 'differ from'} the reference "
            f"(max {diff:.1e})"
        )
        parts.append(f"{flavour}: " + ", ".join(bits))
    return "; ".join(parts)


# ---- row 4: FSDP on CPU --------------------------------------------------------------------------------------


def cpu_torchloom(rank: int, world_size: int, args) -> dict:
    out = {}
    for flavour in ("fsdp", "fsdp2"):
        loom = loom_for(flavour, world_size)
        model, opt = loom_model(loom, flavour)
        train(model, opt, loom.backward, rank, 1)
        out[flavour] = f"a step ran ({count_fsdp_units(model.forward_module)} units)"
    return out


def cpu_fabric(rank: int, world_size: int, args) -> dict:
    from lightning.fabric import Fabric

    try:  # no bypass here: this is the observation
        Fabric(accelerator="cpu", devices=world_size, strategy="fsdp")
    except Exception as error:  # noqa: BLE001 - the observation
        return {"fsdp": f"refused: {short(error, 90)}"}
    return {"fsdp": "accepted"}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def cpu_accelerate(rank: int, world_size: int, args) -> dict:
    records = _Records()
    logging.getLogger().addHandler(records)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = accelerator_for(bypass=False)  # no bypass here: this is the observation
        model = new_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt = acc.prepare(model, opt)
        train(model, opt, acc.backward, rank, 1)
    said = [m for m in records.messages + [str(w.message) for w in caught] if "fsdp" in m.lower()]
    units = count_fsdp_units(model)
    if units:
        return {"fsdp": f"a step ran ({units} units)"}
    told = f"warned: {said[0][:80]}" if said else "no warning or log record mentions FSDP"
    return {"fsdp": f"fsdp_plugin ignored: {acc.distributed_type}, model is {root_type(model)} (DDP); {told}"}


def cpu_raw(rank: int, world_size: int, args) -> dict:
    raw_group(rank, world_size)
    out = {}
    for flavour, wrap in (("FSDP1", wrap_blocks_fsdp1), ("FSDP2", wrap_blocks_fsdp2)):
        model = wrap(new_model())
        train(model, torch.optim.SGD(model.parameters(), lr=LR), lambda loss: loss.backward(), rank, 1)
        out[flavour] = "a step ran"
    return out


def judge_strings(results: list[dict]) -> str:
    return "; ".join(f"{k}: {v}" for k, v in results[0].items())


# ---- row 5: full checkpoint ----------------------------------------------------------------------------------


def _check_full_file(path: Path, model: nn.Module, key: str | None) -> str:
    """On rank 0 after the save: does the file hold the model's full parameters? (`full` is collective, so
    every rank computes it before.)"""
    expected = full_params(model)
    if dist.get_rank() != 0:
        return ""
    if not path.is_file():
        return f"no file at {path.name}"
    state = torch.load(path, weights_only=False)
    state = state[key] if key else state
    state = {
        k.removeprefix("_forward_module.").replace("_fsdp_wrapped_module.", ""): v for k, v in state.items()
    }
    expected = {k: v for k, v in expected.items()}
    try:
        diff = max_diff({k: state[k] for k in expected}, expected)
    except KeyError as error:
        return f"saved, but the file lacks {error}"
    return f"one file, {path.stat().st_size // 1024} KiB, matches the model (max {diff:.0e})"


def full_ckpt_torchloom(rank: int, world_size: int, args) -> dict:
    out = {}
    for flavour in ("fsdp", "fsdp2"):
        loom = loom_for(flavour, world_size, state_dict_type="full")
        model, opt = loom_model(loom, flavour)
        train(model, opt, loom.backward, rank, 1)
        path = Path(args.dir) / f"torchloom-{flavour}.pt"
        loom.save(path, {"model": model, "optimizer": opt})
        out[flavour] = _check_full_file(path, model.forward_module, "model")
    return out


def full_ckpt_fabric(rank: int, world_size: int, args) -> dict:
    fabric = fabric_for(world_size, state_dict_type="full")
    model, opt = fabric_model(fabric)
    train(model, opt, fabric.backward, rank, 1)
    path = Path(args.dir) / "fabric.pt"
    fabric.save(path, {"model": model, "optimizer": opt})
    return {"fsdp": _check_full_file(path, model._forward_module, "model")}


def full_ckpt_accelerate(rank: int, world_size: int, args) -> dict:
    acc = accelerator_for(bypass=True, state_dict_type="FULL_STATE_DICT")
    model, opt = accelerate_model(acc)
    train(model, opt, acc.backward, rank, 1)
    path = Path(args.dir) / "accelerate"
    acc.save_model(model, path, safe_serialization=False)
    files = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    file = path / "pytorch_model.bin"
    return {"fsdp": _check_full_file(file, model, None) if file.is_file() or rank else f"wrote {files}"}


def full_ckpt_raw(rank: int, world_size: int, args, variant: str) -> dict:
    """FSDP1's full state dict with `offload_to_cpu=True, rank0_only=True` (what a one-file save of a large
    model needs), the same without offloading, and FSDP2's `get_model_state_dict(full_state_dict=True,
    cpu_offload=True)`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    raw_group(rank, world_size)
    wrap = wrap_blocks_fsdp2 if variant == "FSDP2" else wrap_blocks_fsdp1
    model = wrap(new_model())
    train(model, torch.optim.SGD(model.parameters(), lr=LR), lambda loss: loss.backward(), rank, 1)
    path = Path(args.dir) / f"raw-{variant}.pt"
    if variant == "FSDP2":
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        offload = variant == "FSDP1 offload"
        config = FullStateDictConfig(offload_to_cpu=offload, rank0_only=offload)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    if rank == 0:
        torch.save(state, path)
    dist.barrier()
    return {variant: _check_full_file(path, model, None)}


# ---- row 6: sharded checkpoint, 2 ranks -> 1 process, 3 ranks ------------------------------------------------


def reshard_write_torchloom(rank: int, world_size: int, args) -> dict:
    loom = loom_for("fsdp2", world_size)
    model, opt = loom_model(loom, "fsdp2")
    train(model, opt, loom.backward, rank, 1)
    loom.save(Path(args.dir) / "torchloom-sharded", {"model": model, "optimizer": opt})
    return full_params(model.forward_module)


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reshard_read_torchloom(rank: int, world_size: int, args, mode: str) -> dict:
    """`loom.load` into a plain model (1 process, strategy "auto") or into the writer's set-up (2, 3 ranks)."""
    from torchloom import Loom

    path = Path(args.dir) / "torchloom-sharded"
    if world_size == 1:
        loom = Loom(accelerator="cpu")
        model = loom.setup_module(Model())
    else:
        loom = loom_for("fsdp2", world_size)
        model, _ = loom_model(loom, "fsdp2")
    state: dict[str, Any] = {"model": model}
    if mode == "model+optimizer":
        state["optimizer"] = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    elif mode == "tool":
        raise NotImplementedError("no other way tried")
    loom.load(path, state)
    return plain_state(model) if world_size == 1 else full_params(model.forward_module)


def reshard_write_fabric(rank: int, world_size: int, args) -> dict:
    fabric = fabric_for(world_size, state_dict_type="sharded")
    model, opt = fabric_model(fabric)
    train(model, opt, fabric.backward, rank, 1)
    fabric.save(Path(args.dir) / "fabric-sharded", {"model": model, "optimizer": opt})
    return full_params(model._forward_module)


def reshard_read_fabric(rank: int, world_size: int, args, mode: str) -> dict:
    """`fabric.load` into a plain model (1 process, `Fabric(accelerator="cpu", devices=1)`) or into the writer's
    set-up (2, 3 ranks); "tool": Fabric's `python -m lightning.fabric.utilities.consolidate_checkpoint`, then
    `torch.load` and `load_state_dict`."""
    from lightning.fabric import Fabric

    path = Path(args.dir) / "fabric-sharded"
    if mode == "tool":
        out = Path(args.dir) / "fabric-consolidated.pt"
        command = [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint", str(path)]
        done = subprocess.run(
            [*command, "--output_file", str(out)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise RuntimeError(f"consolidate_checkpoint exit {done.returncode}: {done.stderr.strip()[-200:]}")
        model = Model()
        model.load_state_dict(torch.load(out, weights_only=False)["model"])
        return plain_state(model)
    if world_size == 1:
        fabric = Fabric(accelerator="cpu", devices=1)
        model = fabric.setup_module(Model())
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    else:
        fabric = fabric_for(world_size, state_dict_type="sharded")
        model, opt = fabric_model(fabric)
    state: dict[str, Any] = {"model": model}
    if mode == "model+optimizer":
        state["optimizer"] = opt
    fabric.load(path, state)
    return plain_state(model.module) if world_size == 1 else full_params(model._forward_module)


def reshard_write_accelerate(rank: int, world_size: int, args) -> dict:
    acc = accelerator_for(bypass=True, state_dict_type="SHARDED_STATE_DICT")
    model, opt = accelerate_model(acc)
    train(model, opt, acc.backward, rank, 1)
    acc.save_state(str(Path(args.dir) / "accelerate-sharded"))
    return full_params(model)


def reshard_read_accelerate(rank: int, world_size: int, args, mode: str) -> dict:
    """`load_state` with a plain `Accelerator(cpu=True)` (1 process) or the writer's set-up (2, 3 ranks);
    "tool": Accelerate's `merge_fsdp_weights`, then `torch.load` and `load_state_dict`. `load_state` restores
    every prepared object: "model" prepares no optimizer."""
    from accelerate import Accelerator

    path = Path(args.dir) / "accelerate-sharded"
    if mode == "tool":
        from accelerate.utils import merge_fsdp_weights

        out = Path(args.dir) / "accelerate-merged"
        merge_fsdp_weights(str(path / "pytorch_model_fsdp_0"), str(out), safe_serialization=False)
        model = Model()
        model.load_state_dict(torch.load(out / "pytorch_model.bin", weights_only=False))
        return plain_state(model)
    if world_size == 1:
        acc = Accelerator(cpu=True)
        model = Model()
    else:
        acc = accelerator_for(bypass=True, state_dict_type="SHARDED_STATE_DICT")
        model = wrap_blocks_fsdp1(new_model())
    objects = [model]
    if mode == "model+optimizer":
        objects.append(torch.optim.SGD(model.parameters(), lr=LR))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = acc.prepare(*objects)
    model = prepared[0] if isinstance(prepared, (tuple, list)) else prepared
    acc.load_state(str(path))
    return plain_state(model) if world_size == 1 else full_params(model)


def reshard_write_raw(rank: int, world_size: int, args) -> dict:
    """By hand with DCP: `get_state_dict` of FSDP2 units on the blocks and on the root, `dcp.save`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    raw_group(rank, world_size)
    model = fully_shard(wrap_blocks_fsdp2(new_model()))  # the root too: else embed and head diverge (row 2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    train(model, opt, lambda loss: loss.backward(), rank, 1)
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optimizer": opt_state}, checkpoint_id=str(Path(args.dir) / "raw-dcp"))
    return full_params(model)


def reshard_read_raw(rank: int, world_size: int, args, mode: str) -> dict:
    """By hand with DCP: one process without a process group reads into a plain model's state dict; 2 or 3
    ranks read into their own FSDP2 model through `get/set_state_dict`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    if mode == "tool":
        raise NotImplementedError("no other way tried")
    path = str(Path(args.dir) / "raw-dcp")
    if world_size == 1:  # the model only: a plain optimizer's state dict has no names to match
        model = Model()
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)  # no process group: DCP reads everything locally
        model.load_state_dict(state["model"])
        return plain_state(model)
    raw_group(rank, world_size)
    model = fully_shard(wrap_blocks_fsdp2(Model()))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model_state, opt_state = get_state_dict(model, opt)
    state = {"model": model_state}
    if mode == "model+optimizer":
        state["optimizer"] = opt_state
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))
    return full_params(model)


# ---- running the cells ---------------------------------------------------------------------------------------


def _cell_rank(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, extra: tuple, results, crash_log: str
) -> None:
    os.environ.update(testing.rank_environment(rank, world_size, port))
    torch.set_num_threads(1)
    # A crash (SIGSEGV) leaves no traceback to send back: Python's own stack goes to a file instead.
    faulthandler.enable(open(crash_log, "w"))  # noqa: SIM115 - open until the process ends
    failed = True
    try:
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *extra), buffer)
        results.put((rank, True, buffer.getvalue()))
        failed = False
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        testing.end_rank(world_size, failed)


def run_cell(fn: Callable[..., Any], args, world_size: int = 2, *extra: Any) -> tuple[Any, str | None]:
    """Run `fn(rank, world_size, args, *extra)` on `world_size` forked ranks; (their results, None) or (None,
    what went wrong). Unlike `_common.run_ranks`, every rank's exit code is read: when one rank crashes, its
    peer usually fails first with a gloo "connection reset", and the crash is the observation."""
    ctx = mp.get_context("fork")  # the parent never ran a torch op: see _common.run_ranks
    results = ctx.Queue()
    port = testing.free_port()
    logs = [os.path.join(args.dir, f".crash-{port}-{r}.txt") for r in range(world_size)]
    procs = [
        ctx.Process(target=_cell_rank, args=(fn, r, world_size, port, (args, *extra), results, logs[r]))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + args.timeout
    died_at = None
    while len(done) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.2)
            done[rank] = (ok, payload)
            continue
        except queue.Empty:
            pass
        if any(p.exitcode is not None and p.exitcode != 0 for p in procs):
            died_at = died_at or time.monotonic()
            if time.monotonic() - died_at > 10:  # its peers had time to report; do not wait for a hang
                break
    for p in procs:
        p.join(timeout=10 if len(done) == world_size else 1)
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    crashed = [r for r, c in enumerate(codes) if c is not None and c < 0 and c != -signal.SIGKILL]
    where = crash_site(logs[crashed[0]]) if crashed else ""
    for log in logs:
        with contextlib.suppress(OSError):
            os.remove(log)
    if crashed:
        code = codes[crashed[0]]
        ranks = ",".join(map(str, crashed))
        return None, f"crashed: {signal.Signals(-code).name} (exit {code}) on rank {ranks}{where}"
    failures = sorted((r, payload) for r, (ok, payload) in done.items() if not ok)
    if failures:
        return None, describe_failure(failures[0][1]).replace(args.dir, "<dir>")
    if len(done) < world_size:
        missing = sorted(set(range(world_size)) - set(done))
        return None, f"hung: ranks {missing} did not finish within {args.timeout:.0f} s (killed)"
    return [torch.load(io.BytesIO(done[r][1]), weights_only=False) for r in range(world_size)], None


def crash_site(log: str) -> str:
    """', in FUNCTION (FILE:LINE)' for the innermost Python frame of a crashed rank's faulthandler dump."""
    try:
        text = Path(log).read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("File "):  # File "PATH", line N in FUNCTION
            path, rest = line[len('File "') :].split('", line ', 1)
            number, _, function = rest.partition(" in ")
            path = path.split("site-packages/", 1)[-1]
            return f", in {function} ({path}:{number})"
    return ""


def describe_failure(trace: str) -> str:
    """The exception line of a traceback."""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    return f"failed: {lines[-1][:140]}"


def observe(fn: Callable[..., Any], judge: Callable[[list], str], args, world_size: int = 2) -> str:
    results, failure = run_cell(fn, args, world_size)
    if failure:
        return failure
    try:
        return judge(results)
    except Exception as error:  # noqa: BLE001 - a judge that cannot read the results says so
        return f"not measured: {short(error)}"


def observe_full_ckpt_raw(args) -> str:
    parts = []
    for variant in ("FSDP1 offload", "FSDP1 no offload", "FSDP2"):
        results, failure = run_cell(full_ckpt_raw, args, 2, variant)
        parts.append(f"{variant}: {failure or results[0][variant]}")
    return "; ".join(parts)


def compare_loaded(results: list[dict], written: list[dict], initial: dict) -> str:
    """Every reader's parameters against the writers' (rank 0's, or where the writers' copies of a replicated
    layer differ (row 2), any writer's): equal, or which tensors come from which writer, or how far off."""
    if max(max_diff(r, written[0]) for r in results) == 0:
        return "loaded, equal"
    origin: dict[str, str] = {}
    for key in written[0]:
        if all(torch.equal(r[key], written[0][key]) for r in results):
            continue
        match = [
            w for w, state in enumerate(written) if all(torch.equal(r[key], state[key]) for r in results)
        ]
        if match:
            origin[key] = f"writer rank {match[0]}'s"
        elif all(torch.equal(r[key], initial[key]) for r in results):
            origin[key] = "the initial value (not loaded)"
        else:
            diff = max(float((r[key] - written[0][key]).abs().max()) for r in results)
            origin[key] = f"off by {diff:.1e}"
    listed = ", ".join(f"{k} = {v}" for k, v in list(origin.items())[:4])
    return f"loaded a mix of the writers' differing copies: {listed}, the rest = rank 0's"


def observe_reshard(write: Callable, read: Callable, args) -> str:
    """Write with 2 ranks; read with 2 ranks (the same set-up), 1 process, 3 ranks: the model and its
    optimizer; where that fails, the model alone (ranks) or the framework's consolidation tool (1 process)."""

    def write_and_initial(rank: int, world_size: int, args) -> dict:
        return {"params": write(rank, world_size, args), "initial": plain_state(new_model())}

    cell, failure = run_cell(write_and_initial, args, 2)
    if failure:
        return f"write by 2 ranks {failure}"
    written, initial = [c["params"] for c in cell], cell[0]["initial"]
    parts = []
    for world_size, name in ((2, "2 ranks"), (1, "1 process"), (3, "3 ranks")):
        modes = ["model+optimizer", "model" if world_size > 1 else "tool"]
        seen = []
        for mode in modes:
            results, failure = run_cell(read, args, world_size, mode)
            label = "" if mode == modes[0] else {"model": "model alone: ", "tool": "consolidated: "}[mode]
            if failure:
                seen.append(label + failure)
                continue
            try:
                seen.append(label + compare_loaded(results, written, initial))
            except ValueError as error:
                seen.append(f"{label}loaded, but {error}")
            break
        parts.append(f"{name}: {'; '.join(seen)}")
    return " / ".join(parts)


def measure(args, columns: list[str]) -> dict[str, dict[str, str]]:
    cells: dict[str, dict[str, Callable[[], str]]] = {
        "root": {
            "torchloom": lambda: observe(root_torchloom, judge_root, args),
            "fabric": lambda: observe(root_fabric, judge_root, args),
            "accelerate": lambda: observe(root_accelerate, judge_root, args),
            "raw": lambda: "not measured: raw PyTorch has no setup call",
        },
        "leftovers": {
            "torchloom": lambda: observe(leftovers_torchloom, judge_leftovers(args), args),
            "fabric": lambda: observe(leftovers_fabric, judge_leftovers(args), args),
            "accelerate": lambda: observe(leftovers_accelerate, judge_leftovers(args), args),
            "raw": lambda: observe(leftovers_raw, judge_leftovers(args), args),
        },
        "sync_clip": {
            "torchloom": lambda: observe(sync_clip_torchloom, judge_sync_clip, args),
            "fabric": lambda: observe(sync_clip_fabric, judge_sync_clip, args),
            "accelerate": lambda: observe(sync_clip_accelerate, judge_sync_clip, args),
            "raw": lambda: observe(sync_clip_raw, judge_sync_clip, args),
        },
        "cpu": {
            "torchloom": lambda: observe(cpu_torchloom, judge_strings, args),
            "fabric": lambda: observe(cpu_fabric, judge_strings, args),
            "accelerate": lambda: observe(cpu_accelerate, judge_strings, args),
            "raw": lambda: observe(cpu_raw, judge_strings, args),
        },
        "full_ckpt": {
            "torchloom": lambda: observe(full_ckpt_torchloom, judge_strings, args),
            "fabric": lambda: observe(full_ckpt_fabric, judge_strings, args),
            "accelerate": lambda: observe(full_ckpt_accelerate, judge_strings, args),
            "raw": lambda: observe_full_ckpt_raw(args),
        },
        "reshard": {
            "torchloom": lambda: observe_reshard(reshard_write_torchloom, reshard_read_torchloom, args),
            "fabric": lambda: observe_reshard(reshard_write_fabric, reshard_read_fabric, args),
            "accelerate": lambda: observe_reshard(reshard_write_accelerate, reshard_read_accelerate, args),
            "raw": lambda: observe_reshard(reshard_write_raw, reshard_read_raw, args),
        },
    }
    out: dict[str, dict[str, str]] = {}
    for row in [r for r in ROWS if r in args.rows]:
        out[row] = {}
        for column in COLUMNS:
            if column not in columns:
                out[row][column] = f"not measured: {MISSING[column]}"
                continue
            started = time.monotonic()
            out[row][column] = cells[row][column]()
            print(f"# {row} / {column}: {out[row][column]}  ({time.monotonic() - started:.0f} s)", flush=True)
    return out


def versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("torchloom", "lightning", "accelerate"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps of row 2")
    parser.add_argument("--tiny", action="store_true", help="2 steps in row 2 (the cells are the same)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument(
        "--timeout", type=float, default=180, help="seconds per cell before it counts as hung"
    )
    parser.add_argument("--dir", default=None, help="where checkpoints go (a temporary directory by default)")
    parser.add_argument("--json", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    if args.tiny:
        args.steps = 2
    found = versions()
    package = {"fabric": "lightning", "accelerate": "accelerate"}
    columns = [c for c in COLUMNS if found.get(package.get(c, ""), "") != "not installed"]
    # Imported once here, so the forked ranks of every cell start with them loaded.
    if "fabric" in columns:
        import lightning.fabric  # noqa: F401
    if "accelerate" in columns:
        import accelerate  # noqa: F401
    logging.getLogger("torchloom").setLevel(logging.WARNING)  # no sharding summary from every setup
    torch.set_num_threads(1)  # the parent compares small tensors; no thread pool for the forks to inherit

    _common.header("field: the README's comparison table, measured", args)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# date: {stamp}", flush=True)
    print(f"# versions: {', '.join(f'{k} {v}' for k, v in found.items())}", flush=True)
    print(
        "# bypasses: Fabric's FSDP-needs-GPU check and Accelerate's CPU handling of fsdp_plugin are bypassed in"
        " every row but 'FSDP on CPU' (see the docstring)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="field-") as tmp:
        if args.dir is None:
            args.dir = tmp
        os.makedirs(args.dir, exist_ok=True)
        table = measure(args, columns)
    print()
    titles = {**COLUMN_TITLES}
    titles["fabric"] += f" {found['lightning']}"
    if found["accelerate"] != "not installed":
        titles["accelerate"] += f" {found['accelerate']}"
    titles["torchloom"] += f" {found['torchloom']}"
    titles["raw"] += f" (torch {torch.__version__})"
    print("| | " + " | ".join(titles[c] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for row, cells in table.items():
        print(f"| {ROWS[row]} | " + " | ".join(cells[c].replace("|", "/") for c in COLUMNS) + " |")
    _common.write_json(
        args.json,
        {"date": stamp, "versions": found, "rows": ROWS, "columns": titles, "table": table},
    )


if __name__ == "__main__":
    main()
