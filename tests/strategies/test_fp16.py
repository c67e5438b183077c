"""fp16 mixed precision ("16-mixed": autocast plus loss scaling) under "fsdp" and "fsdp2" on 2 CPU ranks.

One launch of 2 ranks per flavour runs every check, layout by layout (a launch costs seconds on 2 cores):
  1. parity: STEPS optimizer steps (gradient accumulation, clipping) against one process training on the
     concatenated global batch with plain torch fp16 autocast and torch's GradScaler;
  2. overflow agreement: an inf written into one rank's local gradient shard makes both ranks skip the step
     (once through `clip_gradients`, once through `optimizer.step()` alone) and halve the scale together;
     a normal step afterwards trains again;
  3. the scaler's state survives a save and a load, in the full format for some layouts and the sharded format
     for the others.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from fsdp_models import (
    ACCUM,
    MICRO,
    STEPS,
    Net,
    build_layout,
    data,
    full_state,
    layout_strategy,
    torch_built_model,
    train,
)
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom._layout import analyze
from torchloom.precision import AgreedGradScaler

LAYOUTS = ("wrapped_root", "units_no_root", "units_plus_leftovers", "leftovers_sharded", "torch_built")
# Half the layouts check the scaler's round trip through each checkpoint format; both formats meet leftovers.
FORMAT = {
    "wrapped_root": "sharded",
    "units_no_root": "full",
    "units_plus_leftovers": "full",
    "leftovers_sharded": "sharded",
    "torch_built": "sharded",
}
LR = 4.0  # SGD with momentum (Adam would turn fp16 noise in near-zero gradients into lr-sized steps)
MAX_NORM = 0.004  # below every step's gradient norm (asserted), so clipping acts on each step
# Each rank's loss is the mean over its own 4 samples, twice the reference's per-sample weight, so its fp16
# gradients are twice as large. Keeping the loss small keeps both far from fp16's overflow at the initial scale
# (2**16): the parity run must take every step, as the reference does. Overflow is tested on purpose below.
LOSS_FACTOR = 1e-2
INIT_SCALE = 2.0**16
TOLERANCE = 1e-3


PROBE = torch.linspace(-2, 2, 12).reshape(2, 6)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return LOSS_FACTOR * nn.functional.mse_loss(out.float(), target) / ACCUM


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _reference(make_model) -> dict:
    """One process on the whole global batch: fp16 autocast, torch's GradScaler, clipping, SGD."""
    torch.manual_seed(0)
    model = make_model()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = _optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    x, y = data()
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[step, micro])
            scaler.scale(_loss(out, y[step, micro])).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"initial": initial, "params": final, "norms": norms, "scale": scaler.get_scale()}


def _local_params(model) -> list[torch.Tensor]:
    """This rank's own pieces of every parameter (a DTensor's shard, an FSDP1 flat slice, a leftover)."""
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def _poison_one_shard(model) -> str:
    """Write an inf into the first non-empty local gradient piece of a parameter inside a unit."""
    leftovers = {id(p) for _, p in analyze(model.forward_module).leftovers}
    for name, p in model.forward_module.named_parameters():
        if id(p) in leftovers or p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if local.numel():
            local.view(-1)[0] = float("inf")
            return name
    raise AssertionError("this rank holds no gradient shard to poison")


def _overflow_steps(loom: Loom, model, opt) -> dict:
    """Two steps in which only one rank's local shard overflows, then one normal step."""
    x, y = data(seed=2)
    rank, per = loom.global_rank, MICRO // loom.world_size
    scaler = loom.strategy.precision.scaler
    out: dict = {"scales": [scaler.get_scale()], "unchanged": [], "poisoned": None}

    def backward(step: int) -> None:
        xs, ys = x[step, 0, rank * per : (rank + 1) * per], y[step, 0, rank * per : (rank + 1) * per]
        loom.backward(_loss(model(xs), ys))

    for step, poisoned_rank, clip in ((0, 1, True), (1, 0, False)):
        before = _local_params(model)
        backward(step)
        if rank == poisoned_rank:
            out["poisoned"] = _poison_one_shard(model)
        if clip:
            # With a scaler active, a non-finite norm is the scaler's business: no error, the step is skipped.
            out["clip_norm"] = float(loom.clip_gradients(model, opt, max_norm=MAX_NORM))
        opt.step()
        opt.zero_grad()
        out["unchanged"].append(
            all(torch.equal(a, b) for a, b in zip(before, _local_params(model), strict=True))
        )
        out["scales"].append(scaler.get_scale())
    before = _local_params(model)
    backward(2)
    loom.clip_gradients(model, opt, max_norm=MAX_NORM)
    opt.step()
    opt.zero_grad()
    out["moved_after"] = max(
        (a - b).abs().max().item() for a, b in zip(before, _local_params(model), strict=True) if a.numel()
    )
    out["scales"].append(scaler.get_scale())
    return out


def _rank_body(rank: int, world_size: int, flavour: str, tmp: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        fmt = FORMAT[layout]
        strategy = layout_strategy(flavour, layout, state_dict_type=fmt)
        loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy, precision="16-mixed")
        loom.launch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-unit warning of "wrapped_root" is tested elsewhere
            model = loom.setup_module(build_layout(loom, flavour, layout))
        opt = loom.setup_optimizers(_optimizer(model.parameters()))
        scaler = loom.strategy.precision.scaler
        result: dict = {"scaler_type": type(scaler).__name__}
        result["norms"] = train(loom, model, opt, loss=_loss, max_norm=MAX_NORM)
        result["scale_after_parity"] = scaler.get_scale()
        result["params"] = full_state(model)
        with torch.no_grad():
            result["probe_out"] = model(PROBE)  # compared with plain autocast and fp32 at these parameters
        result["overflow"] = _overflow_steps(loom, model, opt)
        result["leftovers"] = {n: p.detach().clone() for n, p in analyze(model.forward_module).leftovers}

        # The scaler's state (a lowered scale, a growth tracker of 1) round-trips through this format.
        path = f"{tmp}/{flavour}-{layout}.ckpt"
        saved_scaler = scaler.state_dict()
        loom.save(path, {"model": model, "optimizer": opt})
        loom2 = Loom(
            accelerator="cpu",
            devices=world_size,
            strategy=layout_strategy(flavour, layout, state_dict_type=fmt),
            precision="16-mixed",
        )
        loom2.launch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model2 = loom2.setup_module(build_layout(loom2, flavour, layout))
        opt2 = loom2.setup_optimizers(_optimizer(model2.parameters()))
        fresh_scaler = loom2.strategy.precision.scaler
        result["fresh_scale"] = fresh_scaler.get_scale()
        loom2.load(path, {"model": model2, "optimizer": opt2})
        result["saved_scaler"] = saved_scaler
        result["loaded_scaler"] = fresh_scaler.state_dict()
        result["loaded_equal_params"] = all(
            torch.equal(a, b) for a, b in zip(_local_params(model), _local_params(model2), strict=True)
        )
        result["format"] = loom.strategy.checkpoint_format
        out[layout] = result
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
def test_fp16_mixed_every_layout(flavour, tmp_path):
    results = run_ranks(_rank_body, 2, flavour, str(tmp_path), timeout=400)
    for layout in LAYOUTS:
        make = torch_built_model if layout == "torch_built" else Net
        ref = _reference(make)
        r0, r1 = (r[layout] for r in results)
        for rank, got in enumerate((r0, r1)):
            where = f"{flavour} {layout} rank {rank}"
            assert got["scaler_type"] == AgreedGradScaler.__name__, where

            # ---- 1. parity with one process under torch's own fp16 autocast and GradScaler ----------------
            # Neither run skipped a step (the scale never moved), so both took the same STEPS updates.
            assert ref["scale"] == got["scale_after_parity"] == INIT_SCALE, where
            assert min(ref["norms"]) > MAX_NORM, "MAX_NORM must be below every norm so clipping is exercised"
            # Tolerance, as in the bf16 DDP test: fp16 rounds every matmul output (10-bit mantissa, relative
            # error up to 2**-11); the reference multiplies the whole batch of 8 while each rank multiplies 4
            # and sums in fp32 over micro-batches and ranks, so roundings happen at different points. Each
            # update is then off by a small fraction of its size, and the final parameters by a small fraction
            # of how far training moved them: we allow TOLERANCE of it. fp32 FSDP parity is 1e-5 in test_fsdp.py.
            movement = _max_diff(ref["params"], ref["initial"])
            diff = _max_diff(got["params"], ref["params"])
            assert diff < TOLERANCE * movement, (where, diff, movement)
            assert got["norms"] == pytest.approx(ref["norms"], rel=TOLERANCE), where
            assert movement > 0.04, (
                where,
                movement,
            )  # training moved the weights far more than the tolerance
            # fp16 really ran: the forward at the final parameters is plain torch's fp16 autocast forward (as
            # close as its own rounding), and far from the fp32 forward.
            plain = make()
            plain.load_state_dict(got["params"])
            with torch.no_grad():
                fp32_out = plain(PROBE)
                with torch.autocast("cpu", dtype=torch.float16):
                    fp16_out = plain(PROBE)
            assert got["probe_out"].dtype == torch.float32, where  # outputs come back in fp32 for the loss
            off_fp16 = (got["probe_out"] - fp16_out.float()).abs().max().item()
            off_fp32 = (got["probe_out"] - fp32_out).abs().max().item()
            assert off_fp32 > 1e-5 and off_fp16 < off_fp32 / 4, (where, off_fp16, off_fp32)

            # ---- 2. an inf in one rank's shard: both ranks skip, and lower the scale together --------------
            overflow = got["overflow"]
            assert overflow["unchanged"] == [True, True], (where, overflow)
            assert overflow["scales"] == [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 4, INIT_SCALE / 4], where
            assert not math.isfinite(overflow["clip_norm"]), (where, overflow["clip_norm"])
            assert overflow["moved_after"] > 1e-4, (where, overflow["moved_after"])

            # ---- 3. the scaler's state through a checkpoint -------------------------------------------------
            assert got["format"] == FORMAT[layout], where
            assert got["fresh_scale"] == INIT_SCALE, where
            assert got["saved_scaler"]["scale"] == INIT_SCALE / 4, where
            assert got["saved_scaler"]["_growth_tracker"] == 1, where
            assert got["loaded_scaler"] == got["saved_scaler"], where
            assert got["loaded_equal_params"], where
        # The poison went into one rank only, once each; replicated leftovers stayed identical everywhere.
        assert r1["overflow"]["poisoned"] and r0["overflow"]["poisoned"], layout
        assert r0["leftovers"].keys() == r1["leftovers"].keys()
        for name, value in r0["leftovers"].items():
            assert torch.equal(value, r1["leftovers"][name]), (flavour, layout, name)
        assert (len(r0["leftovers"]) > 0) == (layout in ("units_plus_leftovers", "torch_built")), layout
        torch.testing.assert_close(r0["params"], r1["params"], rtol=0, atol=0)
