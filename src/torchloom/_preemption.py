"""Preemption: `loom.on_preempt` catches the signals a cluster sends before it stops a job, `loom.should_stop`
tells every rank once any rank caught one, and `loom.exit_for_restart` ends the attempt so that it is restarted
(requeued under SLURM)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from torchloom.diagnostics import RECORD as _record
from torchloom.errors import ConfigurationError
from torchloom.strategies.base import Strategy

#: The exit status of `loom.exit_for_restart()`: EX_TEMPFAIL, "try again later".
PREEMPTED_EXIT_CODE = 75


def catch(signals: tuple[int, ...], handler: Callable[[int, Any], None], requeue: bool) -> None:
    """`on_preempt`: refuse `requeue` outside a SLURM job, then let `handler` take these signals."""
    if requeue and not os.environ.get("SLURM_JOB_ID"):
        # Refused at the call, where every rank sees the same environment: at exit_for_restart only rank 0
        # would fail, after the preemption checkpoint, with the job already ending.
        raise ConfigurationError(
            "on_preempt(requeue=True) requeues a SLURM job, but SLURM_JOB_ID is not set: this is not a SLURM "
            "job. Leave requeue out (under torchrun, --max-restarts restarts the ranks after "
            "exit_for_restart())."
        )
    for sig in signals:
        signal.signal(sig, handler)


def any_rank_caught(strategy: Strategy, caught: bool) -> bool:
    """Whether any rank caught a preemption signal: one scalar all-reduce (max) over the ranks."""
    flag = torch.tensor(1.0 if caught else 0.0, device=strategy.root_device)
    if strategy.is_distributed:
        with _record("should_stop"):
            flag = strategy.all_reduce(flag, reduce_op="max")
    return bool(flag.item() > 0)


def requeue_slurm_job() -> None:
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise ConfigurationError(
            "on_preempt(requeue=True) requeues a SLURM job, but SLURM_JOB_ID is not set: this is not a SLURM job. "
            "Leave requeue out; under torchrun, --max-restarts restarts the ranks."
        )
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        raise ConfigurationError(
            f"`scontrol requeue {job}` failed: {detail}. The job must be requeueable (sbatch --requeue)."
        ) from None
