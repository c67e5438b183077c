"""Oracle (a): one process training on each global batch with plain torch (no torchloom anywhere)."""

from __future__ import annotations

import contextlib

import torch

from .model import (
    EVALUATE_AFTER,
    STEPS,
    Net,
    accumulation,
    clip_arguments,
    dataset,
    eval_batch,
    eval_loss,
    global_batches,
    kept_by_filter,
    make_optimizers,
    make_schedulers,
    micro_loss,
    net_options,
)

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def named_optimizer_state(named, optimizers) -> dict[str, dict[str, torch.Tensor]]:
    """Every optimizer's per-parameter state keyed by parameter name (tensors as fp32 copies)."""
    names = {id(p): n for n, p in named}
    out = {}
    for opt in optimizers:
        for p, state in opt.state.items():
            out[names[id(p)]] = {k: torch.as_tensor(v).detach().float().clone() for k, v in state.items()}
    return out


def train_reference(
    scenario,
    initial: dict[str, torch.Tensor],
    restart: bool = False,
    reverse_batches: bool = False,
    float64: bool = False,
) -> dict:
    """Train the scenario's model, optimizers, precision, accumulation, clipping and loop on the global batch.

    Tensor parallel, sequence parallel, activation checkpointing, compile and offload do not change the math:
    the reference is the same dense model. `restart`: what the resumed run of a checkpoint scenario must end
    with: at the save step, what the checkpoint does not restore restarts (ckpt_state "filter": the
    parameters the filter dropped take their initial values again; "partial": fresh optimizers).
    `reverse_batches`: each global batch's samples in the reverse order (the same math, other roundings);
    `float64` (fp32 scenarios): in double precision (the same math, nearly without roundings)."""
    model = Net(**net_options(scenario))
    if scenario.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    if float64:
        model = model.double()
    model.load_state_dict(initial)
    named = list(model.named_parameters())
    optimizers = make_optimizers(scenario, named)
    schedulers = make_schedulers(scenario, optimizers)
    scaler = torch.amp.GradScaler("cpu") if scenario.precision == "16-mixed" else None
    accum = accumulation(scenario)
    batches = global_batches(scenario, STEPS * accum)
    xa, ya, _ = dataset("a")
    xb, yb, _ = dataset("b")
    x_all, y_all = torch.cat([xa, xb]), torch.cat([ya, yb])
    clip = clip_arguments(scenario)
    norms, clipped, evals = [], 0, []
    dtype = AUTOCAST.get(scenario.precision)
    for step in range(STEPS):
        if restart and step == scenario.save_step:
            if scenario.ckpt_state == "filter":
                with torch.no_grad():  # parameters and buffers (BatchNorm's statistics) alike
                    for name, t in model.state_dict().items():
                        if not kept_by_filter(name):
                            t.copy_(initial[name])
            elif scenario.ckpt_state == "partial":
                optimizers = make_optimizers(scenario, named)
        for micro in range(accum):
            idx = batches[step * accum + micro]
            if reverse_batches:  # within each loader's part (the loss tells them apart by position)
                idx = [i for i in idx if i < 1000][::-1] + [i for i in idx if i >= 1000][::-1]
            rows = torch.tensor([i if i < 1000 else len(xa) + i - 1000 for i in idx])
            n_a = sum(i < 1000 for i in idx)
            x, y = x_all[rows], y_all[rows]
            if scenario.precision == "bf16-true":
                x = x.to(torch.bfloat16)
            if float64:
                x, y = x.double(), y.double()
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                out = model(x)
            loss = micro_loss(scenario, out, y, n_a)
            (scaler.scale(loss) if scaler else loss).backward()
        for opt in optimizers:
            if scaler and clip:
                scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            if "max_norm" in clip:
                norm = torch.nn.utils.clip_grad_norm_(params, clip["max_norm"])
                norms.append(float(norm))
                clipped += float(norm) > clip["max_norm"]
            elif "clip_val" in clip:
                grads = [p.grad for p in params if p.grad is not None]
                clipped += any(bool((g.abs() > clip["clip_val"]).any()) for g in grads)
                torch.nn.utils.clip_grad_value_(params, clip["clip_val"])
        for opt in optimizers:
            scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        for sched in schedulers:
            sched.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=scenario.set_to_none)
        if scenario.evaluate and step + 1 == EVALUATE_AFTER:
            evals.append((step + 1, _evaluate(scenario, model, dtype, float64)))
    return {
        "params": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
        "optim": named_optimizer_state(named, optimizers),
        "batches": batches,
        "norms": norms,
        "clipped": clipped,
        "scale": scaler.get_scale() if scaler else None,
        "evals": evals,
    }


def _evaluate(scenario, model: torch.nn.Module, dtype, float64: bool) -> float:
    """The script's validation between steps: eval mode (BatchNorm's running statistics), no gradients."""
    x, y = eval_batch()
    if scenario.precision == "bf16-true":
        x = x.to(torch.bfloat16)
    if float64:
        x, y = x.double(), y.double()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
        loss = eval_loss(model(x), y)
    model.train()
    return float(loss)
