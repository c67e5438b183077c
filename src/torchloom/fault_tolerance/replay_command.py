"""`torchloom replay RECORD SPEC.py`: a fault-tolerant job's record replayed in one process, from the command line.

The replay needs what only the user knows: the model as it was before the first step, the optimizer, which
samples a group's batch held, and the loss. `SPEC.py` defines them as four functions:

    def model() -> torch.nn.Module: ...                      # the initial model (same seed as the run)
    def optimizer(model) -> torch.optim.Optimizer: ...
    def batch(group: int, epoch: int, index: int): ...        # the batch group `group` read `index`-th in `epoch`
    def loss(model, batch) -> torch.Tensor: ...               # what the script called `loom.backward` on

and, optionally, what the script did around each step:

    def before_step(model): ...                               # e.g. clip_grad_norm_ (the script's clip_gradients)
    def scheduler(optimizer): ...                             # the LR scheduler, stepped after each step

Every step is checked against the record's fingerprints (see `torchloom.fault_tolerance.replay`); with
`--compare RUN.pt` (a state dict the run saved at its end) the replayed parameters are compared with the run's and
the command fails past `--atol`. `--out` saves the replayed state dict. (The options are parsed by
`torchloom.cli`.)
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path
from typing import Any

import torch

from torchloom.errors import ConfigurationError

_NEEDED = ("model", "optimizer", "batch", "loss")


def main(args: argparse.Namespace) -> int:
    from torchloom.fault_tolerance.replay import replay

    spec = _load_spec(args.spec)
    model = spec["model"]()
    optimizer = spec["optimizer"](model)
    # Optional: what the script did between loom.backward and optimizer.step() (clipping), and its scheduler.
    scheduler = spec["scheduler"](optimizer) if callable(spec.get("scheduler")) else None
    steps = replay(
        args.record,
        model,
        optimizer,
        spec["batch"],
        spec["loss"],
        spec.get("before_step"),
        after_step=None if scheduler is None else (lambda _: scheduler.step()),
        check=not args.no_check,
    )
    print(f"replayed {steps} committed steps of {args.record}" + ("" if args.no_check else ", each checked"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if args.out:
        torch.save(state, args.out)
        print(f"wrote {args.out}")
    if args.compare:
        return _compare(state, torch.load(args.compare, weights_only=True, map_location="cpu"), args.atol)
    return 0


def _load_spec(path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ConfigurationError(
            f"The replay spec {path!r} does not exist: pass the Python file that defines "
            f"{', '.join(_NEEDED)}."
        )
    spec = runpy.run_path(path)
    missing = [name for name in _NEEDED if not callable(spec.get(name))]
    if missing:
        raise ConfigurationError(
            f"The replay spec {path!r} does not define {', '.join(missing)}: it needs model(), optimizer(model), "
            "batch(group, epoch, index) and loss(model, batch) (docs: fault_tolerance.md, 'The record and its "
            "replay')."
        )
    return spec


def _compare(replayed: dict[str, torch.Tensor], run: dict[str, torch.Tensor], atol: float) -> int:
    if set(replayed) != set(run):
        raise ConfigurationError(
            f"--compare: the run's state dict has other entries than the replayed model's (only in the run: "
            f"{sorted(set(run) - set(replayed))[:5]}, only replayed: {sorted(set(replayed) - set(run))[:5]})."
        )
    worst = max(
        (float((run[k].float() - v.float()).abs().max()) if v.numel() else 0.0, k)
        for k, v in replayed.items()
    )
    verdict = "equal within" if worst[0] <= atol else "DIFFERENT beyond"
    print(f"run and replay {verdict} {atol:g}: largest difference {worst[0]:.3e} (in {worst[1]})")
    return 0 if worst[0] <= atol else 1
