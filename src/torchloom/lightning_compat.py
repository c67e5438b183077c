"""Run a Lightning Fabric program you cannot edit (litgpt, ...) on torchloom: the one switch.

    torchloom run --fabric-compat --devices 2 litgpt -- pretrain ...   # every rank started by torchloom run
    python -m torchloom.lightning_compat litgpt pretrain --devices 2 ...   # the program launches its ranks
    import torchloom.lightning_compat; torchloom.lightning_compat.install()   # in code, before Lightning is used

After the switch, `lightning.Fabric` and `lightning.fabric.Fabric` are `torchloom.Loom`; Lightning's strategy
classes build torchloom's strategies (`FSDPStrategy(...)` an `"fsdp"` one, or an `"fsdp2"` one with `fsdp="fsdp2"`,
`ModelParallelStrategy`, `DDPStrategy`, `SingleDeviceStrategy`; DeepSpeed and XLA refused by name), and
`isinstance(loom.strategy, FSDPStrategy)` answers for them; `ThroughputMonitor`, `Throughput`, `measure_flops`
and `get_available_flops` of `lightning.fabric.utilities(.throughput)` are `torchloom.throughput`'s. The rest of
Lightning (loggers, `LightningDataModule`, utilities) stays Lightning's. Ranks started from a switched process inherit the
switch (`TORCHLOOM_FABRIC_COMPAT` in their environment).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import shutil
import sys
from pathlib import Path
from typing import Any

from torchloom import _fabric_strategies
from torchloom.errors import ConfigurationError

#: Set by the switch for the processes it starts: "fsdp" or "fsdp2" (how Lightning's FSDPStrategy runs).
ENV = "TORCHLOOM_FABRIC_COMPAT"
FSDP_FLAVOURS = ("fsdp", "fsdp2")

_STRATEGY_NAMES = ("FSDPStrategy", "ModelParallelStrategy", "DDPStrategy", "SingleDeviceStrategy")
_THROUGHPUT_NAMES = ("ThroughputMonitor", "Throughput", "measure_flops", "get_available_flops")
_STRATEGY_MODULES = {
    "FSDPStrategy": "fsdp",
    "ModelParallelStrategy": "model_parallel",
    "DDPStrategy": "ddp",
    "SingleDeviceStrategy": "single_device",
    "DeepSpeedStrategy": "deepspeed",
    "DataParallelStrategy": "dp",
}

_installed: str | None = None


def installed() -> str | None:
    """The FSDP flavour the switch runs Lightning's FSDPStrategy as ("fsdp", "fsdp2"), or None before `install`."""
    return _installed


class _LightningStrategy(type):
    """The metaclass of the names put in place of Lightning's strategy classes: calling one builds torchloom's
    strategy from Lightning's arguments, and `isinstance` answers for the torchloom strategies it builds."""

    lightning_name: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _fabric_strategies.build(cls.lightning_name, args, kwargs, fsdp=_installed or "fsdp")

    def __instancecheck__(cls, obj: Any) -> bool:
        from torchloom import strategies

        if cls.lightning_name == "FSDPStrategy":
            # What Lightning's FSDPStrategy(...) builds: FSDP1, or FSDP2 under fsdp="fsdp2" (not model parallel).
            return isinstance(obj, strategies.FSDPStrategy) or (
                type(obj) is strategies.FSDP2Strategy and _installed == "fsdp2"
            )
        targets = {
            "ModelParallelStrategy": strategies.ModelParallelStrategy,
            "DDPStrategy": strategies.DDPStrategy,
            "SingleDeviceStrategy": strategies.SingleDeviceStrategy,
        }
        target = targets.get(cls.lightning_name)
        return target is not None and isinstance(obj, target)


def _stand_in(name: str) -> type:
    return _LightningStrategy(
        name, (), {"lightning_name": name, "__module__": __name__, "__doc__": f"{name} -> torchloom"}
    )


def _throughput(name: str) -> Any:
    try:
        throughput = importlib.import_module("torchloom.throughput")
    except ImportError as error:
        raise ImportError(
            f"Lightning's {name} maps to torchloom.throughput.{name} under torchloom's Fabric switch, but this "
            f"torchloom has no torchloom.throughput ({error})."
        ) from None
    return getattr(throughput, name)


class _LazyClass(type):
    """A stand-in for a class of `torchloom.throughput`, imported on first use rather than at the switch."""

    lightning_name: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _throughput(cls.lightning_name)(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _throughput(cls.lightning_name))


def _lazy_throughput(name: str) -> Any:
    if name[0].isupper():
        return _LazyClass(name, (), {"lightning_name": name, "__module__": __name__})

    def function(*args: Any, **kwargs: Any) -> Any:
        return _throughput(name)(*args, **kwargs)

    function.__name__ = function.__qualname__ = name
    return function


def install(fsdp: str = "fsdp") -> None:
    """Point Lightning Fabric's public names at torchloom's (see the module's docstring), in this process and in
    the processes it starts. Call it before the program imports them: a name a module already bound with
    `from lightning... import X` keeps Lightning's object. `fsdp="fsdp2"` runs Lightning's `FSDPStrategy` as
    torchloom's `FSDP2Strategy` (`fully_shard`; its FSDP1-only options are refused by name)."""
    global _installed
    if fsdp not in FSDP_FLAVOURS:
        raise ConfigurationError(f"install(fsdp={fsdp!r}): choose 'fsdp' (FSDP1) or 'fsdp2' (fully_shard).")
    if importlib.util.find_spec("lightning") is None:
        raise ConfigurationError(
            "torchloom's Fabric switch points Lightning's names (lightning.Fabric, its strategies, "
            "ThroughputMonitor) at torchloom's, but Lightning is not installed in this environment. Install the "
            "version your program needs (`pip install lightning`): the program imports it itself."
        )
    import lightning  # also imports lightning.pytorch, whose classes subclass Fabric's before they are replaced
    import lightning.fabric
    import lightning.fabric.fabric
    import lightning.fabric.strategies
    import lightning.fabric.utilities
    import lightning.fabric.utilities.throughput

    from torchloom.loom import Loom

    for module in (lightning, lightning.fabric, lightning.fabric.fabric):
        module.Fabric = Loom  # type: ignore[attr-defined]
    for name in (*_STRATEGY_NAMES, *_fabric_strategies.REFUSED):
        stand_in = _stand_in(name)
        if hasattr(lightning.fabric.strategies, name):
            setattr(lightning.fabric.strategies, name, stand_in)
        submodule = sys.modules.get(f"lightning.fabric.strategies.{_STRATEGY_MODULES.get(name, '')}")
        if submodule is not None and hasattr(submodule, name):
            setattr(submodule, name, stand_in)
    for module in (lightning.fabric.utilities, lightning.fabric.utilities.throughput):
        for name in _THROUGHPUT_NAMES:
            setattr(module, name, _lazy_throughput(name))
    _installed = fsdp
    os.environ[ENV] = fsdp


def install_from_environment() -> None:
    """Install the switch in a process started by a switched one (a rank); nothing when it was not switched."""
    flavour = os.environ.get(ENV)
    if flavour and _installed is None:
        install(flavour)


def _program(name: str) -> str:
    """A script path, or a command on PATH (a console script such as `litgpt`)."""
    if Path(name).is_file():
        return name
    # The interpreter's own bin directory first: the program's environment, activated or not.
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise ConfigurationError(
            f"{name!r} is neither a file nor a command on PATH. Give the program's script, or the command its "
            "package installs (e.g. litgpt)."
        )
    with open(found, "rb") as file:
        first = file.readline()
    if not (first.startswith(b"#!") and b"python" in first):
        raise ConfigurationError(f"{found} is not a Python program: the switch runs Python programs only.")
    return found


def main(argv: list[str] | None = None) -> None:
    """`python -m torchloom.lightning_compat [--fsdp fsdp2] PROGRAM ARGS...`: install the switch, then run
    PROGRAM (a script or a console command such as `litgpt`) as `__main__` with ARGS."""
    args = list(sys.argv[1:] if argv is None else argv)
    fsdp = "fsdp"
    if args[:1] == ["--fsdp"] and len(args) >= 2:
        fsdp, args = args[1], args[2:]
    elif args and args[0].startswith("--fsdp="):
        fsdp, args = args[0].split("=", 1)[1], args[1:]
    if not args:
        raise SystemExit("usage: python -m torchloom.lightning_compat [--fsdp fsdp|fsdp2] PROGRAM [ARGS...]")
    install(fsdp)
    path = _program(args[0])
    sys.argv = [path, *args[1:]]
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    # Run through the imported module, so that the switch's state is the one every other import sees.
    from torchloom.lightning_compat import main as _main

    _main()
