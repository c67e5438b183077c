"""Lightning Fabric's strategy objects turned into torchloom's.

Two ways in: the constructor arguments a program gives Lightning's class (`lightning_compat` maps the class names
onto `build`), or an instance of Lightning's own class handed to `Loom(strategy=...)` (`from_instance` reads what
its constructor stored). Everything torchloom can honour is translated; anything else is refused by name, never
dropped. This module imports nothing of Lightning: it is only given Lightning's objects.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from torchloom.errors import ConfigurationError
from torchloom.strategies.base import Strategy

#: Lightning's strategy classes torchloom has no counterpart for -> what to use instead.
REFUSED = {
    "DeepSpeedStrategy": "torchloom has no DeepSpeed; use FSDPStrategy (or strategy='fsdp'/'fsdp2')",
    "XLAStrategy": "torchloom runs no XLA/TPU devices",
    "XLAFSDPStrategy": "torchloom runs no XLA/TPU devices",
    "SingleDeviceXLAStrategy": "torchloom runs no XLA/TPU devices",
    "DataParallelStrategy": "DataParallel is not supported; use DDPStrategy (strategy='ddp')",
}

#: Lightning's constructor arguments that `Loom(...)` decides in torchloom.
_LOOM_DECIDES = {
    "accelerator": "Loom(accelerator=...)",
    "parallel_devices": "Loom(devices=...)",
    "cluster_environment": "detected (torchrun, SLURM, a local run)",
    "precision": "Loom(precision=...)",
    "checkpoint_io": "torchloom's checkpoint formats (loom.save)",
    "device": "Loom(accelerator=..., devices=...)",
}

#: Lightning's constructors' parameters in their positional order (Lightning 2.x,
#: `lightning/fabric/strategies/{ddp,fsdp,model_parallel,single_device}.py`; tests/test_lightning_compat.py checks
#: them against the installed Lightning). A positional argument is bound to its name here, as Lightning binds it,
#: before anything is translated: torchloom's own constructors order their parameters otherwise.
POSITIONAL = {
    "DDPStrategy": (
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "checkpoint_io",
        "precision",
        "process_group_backend",
        "timeout",
        "start_method",
    ),
    "FSDPStrategy": (
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "precision",
        "process_group_backend",
        "timeout",
        "cpu_offload",
        "mixed_precision",
        "auto_wrap_policy",
        "activation_checkpointing",
        "activation_checkpointing_policy",
        "sharding_strategy",
        "state_dict_type",
        "device_mesh",
    ),
    "ModelParallelStrategy": (
        "parallelize_fn",
        "data_parallel_size",
        "tensor_parallel_size",
        "save_distributed_checkpoint",
        "process_group_backend",
        "timeout",
    ),
    "SingleDeviceStrategy": ("device", "accelerator", "checkpoint_io", "precision"),
}

#: FSDP1 keywords that FSDP2 (`fully_shard`) does by itself: the value FSDP2 always has.
_FSDP2_BUILT_IN = {"use_orig_params": True, "limit_all_gathers": True}

#: FSDP1 sharding strategies as FSDP2 options.
_FSDP2_SHARDING = {
    "FULL_SHARD": {"reshard_after_forward": True},
    "SHARD_GRAD_OP": {"reshard_after_forward": False},
    "HYBRID_SHARD": {"reshard_after_forward": True, "hybrid": True},
    "_HYBRID_SHARD_ZERO2": {"reshard_after_forward": False, "hybrid": True},
}


def _is_instance(classes: tuple[type, ...], module: Any) -> bool:
    return isinstance(module, classes)


def _picklable_policies(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Policies given as classes, as a predicate that pickles (a module-level function over the classes):
    `launch(fn)` pickles the Loom and its strategy for spawned ranks (litgpt passes `{Block}`)."""
    out = dict(kwargs)
    for name in ("activation_checkpointing_policy", "activation_checkpointing", "shard_policy"):
        policy = out.get(name)
        if isinstance(policy, type):
            policy = {policy}
        if isinstance(policy, (set, frozenset, list, tuple)) and all(isinstance(c, type) for c in policy):
            out[name] = functools.partial(_is_instance, tuple(policy))
    if "activation_checkpointing" in out:  # Fabric's deprecated spelling of the same
        out.setdefault("activation_checkpointing_policy", out.pop("activation_checkpointing"))
    return out


def _refuse_loom_options(owner: str, kwargs: dict[str, Any]) -> None:
    for name, instead in _LOOM_DECIDES.items():
        if kwargs.get(name) is not None:
            raise ConfigurationError(
                f"Lightning's {owner}({name}=...) cannot be translated: in torchloom, {name} is {instead}. Leave it "
                "out of the strategy."
            )


def build(lightning_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], fsdp: str = "fsdp") -> Strategy:
    """The torchloom strategy for `lightning_name(*args, **kwargs)` (Lightning's class and arguments).
    `fsdp="fsdp2"` runs Lightning's `FSDPStrategy` as torchloom's `FSDP2Strategy` (`fully_shard`)."""
    from torchloom import strategies

    if lightning_name in REFUSED:
        raise ConfigurationError(
            f"Lightning's {lightning_name} has no torchloom counterpart: {REFUSED[lightning_name]}."
        )
    kwargs = _by_name(lightning_name, args, kwargs)
    if lightning_name == "FSDPStrategy":
        _refuse_loom_options(lightning_name, kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in _LOOM_DECIDES}
        if fsdp == "fsdp2":
            return _as_fsdp2(kwargs)
        return strategies.FSDPStrategy(**_picklable_policies(kwargs))
    if lightning_name == "DDPStrategy":
        _refuse_loom_options(lightning_name, kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in _LOOM_DECIDES}
        start = kwargs.pop("start_method", "popen")
        if start not in ("popen", "spawn", "fork"):
            raise ConfigurationError(
                f"Lightning's DDPStrategy(start_method={start!r}) cannot be translated: torchloom starts ranks "
                "with 'spawn' (launch(fn)), 'fork', or by running the script again ('popen')."
            )
        if start == "fork":
            kwargs["start_method"] = "fork"
        return strategies.DDPStrategy(**kwargs)
    if lightning_name == "SingleDeviceStrategy":
        device = kwargs.pop("device", None)
        _refuse_loom_options(lightning_name, kwargs)
        if device is not None and str(device) != "cpu":
            raise ConfigurationError(
                f"Lightning's SingleDeviceStrategy(device={device!r}) cannot be translated: torchloom picks the "
                "device from Loom(accelerator=..., devices=...). Leave device out."
            )
        return strategies.SingleDeviceStrategy()
    if lightning_name == "ModelParallelStrategy":
        return strategies.ModelParallelStrategy(**kwargs)
    raise ConfigurationError(f"Lightning's {lightning_name} has no torchloom counterpart.")


def _by_name(lightning_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Lightning's arguments all by name: each positional one takes the name Lightning's constructor gives its
    position (`POSITIONAL`), so that `DDPStrategy(accelerator)` is refused as an accelerator instead of landing
    in torchloom's first parameter. Too many, or one given twice, is refused as Python refuses it."""
    kwargs = dict(kwargs)
    if not args:
        return kwargs
    names = POSITIONAL.get(lightning_name, ())
    if len(args) > len(names):
        raise ConfigurationError(
            f"Lightning's {lightning_name} takes at most {len(names)} positional arguments ({', '.join(names)}); "
            f"got {len(args)}. Pass the others by keyword."
        )
    for name, value in zip(names, args, strict=False):
        if name in kwargs:
            raise ConfigurationError(
                f"Lightning's {lightning_name} got two values for {name!r}: the positional argument {value!r} "
                f"(Lightning's position {names.index(name) + 1} is {name}) and {name}={kwargs[name]!r}."
            )
        kwargs[name] = value
    return kwargs


def _as_fsdp2(kwargs: dict[str, Any]) -> Strategy:
    """Lightning's FSDP1 options as `FSDP2Strategy`'s (`fully_shard`): the policies, checkpointing, offload,
    mesh and checkpoint format carry over; FSDP1 knobs FSDP2 has no counterpart for are refused by name."""
    from torchloom.strategies import FSDP2Strategy

    options: dict[str, Any] = {}
    for name, value in _FSDP2_BUILT_IN.items():
        given = kwargs.pop(name, value)
        if given != value:
            raise ConfigurationError(
                f"FSDPStrategy({name}={given!r}) cannot run as 'fsdp2': fully_shard always behaves as {name}={value}. "
                "Run it as 'fsdp' (without the fsdp2 switch), or drop the argument."
            )
    sharding = kwargs.pop("sharding_strategy", "FULL_SHARD")
    key = str(getattr(sharding, "name", sharding)).upper()
    if key not in _FSDP2_SHARDING:
        raise ConfigurationError(
            f"FSDPStrategy(sharding_strategy={sharding!r}) cannot run as 'fsdp2', which shards (FULL_SHARD, "
            "SHARD_GRAD_OP, HYBRID_SHARD). Use DDPStrategy for NO_SHARD, or run it as 'fsdp'."
        )
    options.update(_FSDP2_SHARDING[key])
    if "auto_wrap_policy" in kwargs:
        options["shard_policy"] = kwargs.pop("auto_wrap_policy")
    offload = kwargs.pop("cpu_offload", False)
    options["cpu_offload"] = bool(getattr(offload, "offload_params", offload))
    if kwargs.get("mixed_precision") is not None:
        raise ConfigurationError(
            "FSDPStrategy(mixed_precision=MixedPrecision(...)) cannot run as 'fsdp2', whose policy is "
            "MixedPrecisionPolicy: choose the precision with Loom(precision=...), or run it as 'fsdp'."
        )
    kwargs.pop("mixed_precision", None)
    passed = {
        "activation_checkpointing",
        "activation_checkpointing_policy",
        "state_dict_type",
        "device_mesh",
        "timeout",
        "process_group_backend",
    }
    unknown = sorted(set(kwargs) - passed)
    if unknown:
        raise ConfigurationError(
            f"FSDPStrategy({', '.join(f'{k}=...' for k in unknown)}) cannot run as 'fsdp2': fully_shard has no such "
            "option. Run it as 'fsdp' (without the fsdp2 switch), or drop the argument."
        )
    if kwargs.get("device_mesh") is not None:
        options.pop("hybrid", None)  # the mesh's shape decides, as FSDPStrategy's device_mesh does
    return FSDP2Strategy(**_picklable_policies({**options, **kwargs}))


def is_lightning_strategy(obj: Any) -> bool:
    """Whether `obj` is an instance of one of Lightning Fabric's strategy classes."""
    return any(is_lightning_strategy_class(cls) for cls in type(obj).__mro__)


def from_instance(obj: Any) -> Strategy:
    """The torchloom strategy for an instance of Lightning's own strategy class, from what its constructor stored
    (Lightning 2.x). Subclasses are refused: their overrides are Lightning internals torchloom cannot run."""
    name = type(obj).__name__
    lightning = [c for c in type(obj).__mro__ if is_lightning_strategy_class(c)]
    own_class: type = type(obj)
    if own_class is not lightning[0] or name in REFUSED:
        if name in REFUSED:
            raise ConfigurationError(f"Lightning's {name} has no torchloom counterpart: {REFUSED[name]}.")
        raise ConfigurationError(
            f"{name} subclasses Lightning's {lightning[0].__name__}: its overrides are Lightning internals that "
            "torchloom cannot run. Pass Lightning's class itself, or torchloom's strategy."
        )
    if getattr(obj, "_accelerator", None) is not None or getattr(obj, "_precision", None) is not None:
        raise ConfigurationError(
            f"Lightning's {name} was given an accelerator or precision plugin: in torchloom these are "
            "Loom(accelerator=...) and Loom(precision=...). Leave them out of the strategy."
        )
    if getattr(obj, "_cluster_environment", None) is not None:
        raise ConfigurationError(
            f"Lightning's {name} was given a cluster_environment: torchloom detects torchrun, SLURM or a local run."
        )
    common: dict[str, Any] = {}
    timeout = getattr(obj, "_timeout", None)
    if timeout is not None and timeout != timedelta(minutes=30):  # Lightning's default_pg_timeout
        common["timeout"] = timeout
    if getattr(obj, "_process_group_backend", None) is not None:
        common["process_group_backend"] = obj._process_group_backend
    if name == "FSDPStrategy":
        kwargs = dict(obj._fsdp_kwargs)
        checkpointing = dict(obj._activation_checkpointing_kwargs)
        if "auto_wrap_policy" in checkpointing:
            kwargs["activation_checkpointing_policy"] = checkpointing["auto_wrap_policy"]
        elif "check_fn" in checkpointing:  # Fabric's deprecated activation_checkpointing=: a predicate
            kwargs["activation_checkpointing_policy"] = checkpointing["check_fn"]
        kwargs.update(
            sharding_strategy=obj.sharding_strategy,
            cpu_offload=obj.cpu_offload,
            state_dict_type=obj._state_dict_type,
        )
        if obj.mixed_precision is not None:
            kwargs["mixed_precision"] = obj.mixed_precision
        return build(name, (), {**kwargs, **common})
    if name == "DDPStrategy":
        return build(name, (), {**obj._ddp_kwargs, "start_method": obj._start_method, **common})
    if name == "SingleDeviceStrategy":
        return build(name, (), {"device": obj.root_device})
    if name == "ModelParallelStrategy":
        return build(
            name,
            (obj._parallelize_fn,),
            {
                "data_parallel_size": obj._data_parallel_size,
                "tensor_parallel_size": obj._tensor_parallel_size,
                "save_distributed_checkpoint": obj._save_distributed_checkpoint,
                **common,
            },
        )
    raise ConfigurationError(
        f"Lightning's {name} has no torchloom counterpart. torchloom translates FSDPStrategy, "
        "ModelParallelStrategy, DDPStrategy and SingleDeviceStrategy."
    )


def is_lightning_strategy_class(cls: type) -> bool:
    return cls.__module__.startswith(("lightning.fabric.strategies", "lightning_fabric.strategies"))
