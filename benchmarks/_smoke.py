"""The smoke run: every benchmark at its `--tiny` size, one after another, in this one process.

    python benchmarks/_smoke.py OUT_DIR [NAME ...]      # default: SCRIPTS below (tests/test_benchmarks.py tests each)

Each script's `main(["--tiny"])` runs in turn; its output (and that of the ranks it forks) goes to OUT_DIR/NAME.txt
and its exit code to OUT_DIR/NAME.rc (1 with the traceback at the end of NAME.txt when it raised). One process
instead of one per script: the interpreter, torch, torchloom and the torch.distributed modules the ranks use are
imported once, here, and every rank the scripts fork inherits them, so the smoke run costs the scripts' own work,
not a start-up per script and per rank. The numbers at this size mean nothing; full-size runs stay one script per
process (`python benchmarks/NAME.py`).
"""

from __future__ import annotations

import importlib.util
import os
import resource
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = (
    "step_overhead",
    "memory",
    "checkpoint_io",
    "startup",
    "scaling",
    "hf_load",
    "throughput_overhead",
    "pipeline",
)


def _preload() -> None:
    """What the scripts' ranks import, imported before any rank is forked (the ranks then start with it)."""
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import torchloom  # noqa: F401
    import torchloom.checkpointing.hf  # noqa: F401
    import torchloom.loggers  # noqa: F401
    import torchloom.strategies  # noqa: F401
    import torchloom.throughput  # noqa: F401

    # Some scripts run torch ops here before forking their ranks (hf_load writes its checkpoint): with one
    # thread no OpenMP pool exists that a forked rank could inherit half-made.
    torch.set_num_threads(1)


def _run(name: str, out_dir: Path) -> int:
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    log = open(out_dir / f"{name}.txt", "w")  # noqa: SIM115 - closed below, after the descriptors are back
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        code = module.main(["--tiny"])
        rc = 0 if code is None else int(code)
    except SystemExit as exc:  # argparse's refusals
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - recorded for the test, which names the script
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        log.close()
    (out_dir / f"{name}.rc").write_text(str(rc))
    return rc


def _cpu_seconds() -> float:
    """This process's CPU seconds and those of every child it reaped (the ranks, startup.py's commands)."""
    return sum(
        u.ru_utime + u.ru_stime
        for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    sys.argv = [str(HERE / "_smoke.py"), "--tiny"]  # what the scripts' headers print as their command
    _preload()
    failed = []
    for name in argv[1:] or SCRIPTS:
        start, cpu = time.perf_counter(), _cpu_seconds()
        print(f"smoke: {name} ...", file=sys.stderr, flush=True)
        rc = _run(name, out_dir)
        print(
            f"smoke: {name} exit {rc} ({time.perf_counter() - start:.0f} s, {_cpu_seconds() - cpu:.1f} CPU s)",
            file=sys.stderr,
            flush=True,
        )
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
