"""The planned CUDA device, on a machine without one: while a CUDA job is planned, torch's device queries answer
as the planned device would (`torch.cuda.is_available()`, the device count, the capability that picks kernels,
the properties, the memory figures, which come from the simulated caching allocator), and the streams the job
makes are told apart, so that the allocator keeps each stream's blocks for that stream as c10's does.

The plan's tensors stay fake CPU tensors (a CPU-only torch aborts once autograd records an op on a fake CUDA
tensor): only the queries and the streams are the device's, and what the script itself puts on `"cuda"` is made
on the CPU's fake device with the same bytes. NCCL's buffers, outside the allocator, get a stated allowance.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from torchloom.planning.allocator import CachingAllocator

#: The capability a device given by its memory alone is planned with (an Ampere or later data-centre GPU: the
#: flash-attention kernels run there).
DEFAULT_CAPABILITY = (8, 0)


def multiprocessors(capability: tuple[int, int]) -> int:
    """The SM count the planned device reports (what kernels size their splits by): an H100 SXM's 132 from
    Hopper on, an A100's 108 before."""
    return 132 if capability >= (9, 0) else 108


class Streams:
    """The job's CUDA streams as the plan sees them: `torch.cpu.Stream` objects (what FSDP2 and others make through
    their device handle on the plan's CPU tensors), numbered as they are made, the current one changed by
    `torch.cpu.stream(s)` as `torch.cuda.stream(s)` changes it. Stream 0 is the default stream."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}
        self._keep: list[Any] = []  # the stream objects, alive so their ids stay theirs
        self.names: dict[int, str] = {0: "default stream"}
        self._current: list[int] = [0]

    def current(self) -> int:
        return self._current[-1]

    def number(self, stream: Any, made_at: str | None = None) -> int:
        key = id(stream)
        if key not in self._ids:
            self._ids[key] = len(self._ids) + 1
            self._keep.append(stream)
            self.names[self._ids[key]] = made_at or f"stream {self._ids[key]}"
        return self._ids[key]

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        self._current.append(0 if stream is None or stream is _DEFAULT else self.number(stream))
        try:
            yield
        finally:
            self._current.pop()


_DEFAULT: Any = None  # the default stream's object, made by `install`


def _stream_name(frame: Any) -> str | None:
    """`self.reduce_scatter_stream = self.device_handle.Stream(...)` -> 'reduce_scatter_stream': the name the
    code that made a stream gives it (FSDP2's streams are named so)."""
    import linecache

    while frame is not None:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        match = re.search(r"(\w*stream\w*)\s*=", line)
        if match:
            return match.group(1).lstrip("_")
        if "torch/cpu" not in frame.f_code.co_filename.replace("\\", "/"):
            return None
        frame = frame.f_back
    return None


def _as_cpu(device: Any) -> Any:
    """A CUDA device (`"cuda"`, `"cuda:1"`, `torch.device("cuda", 0)`, or an index, which torch reads as a CUDA
    device) as the plan's: the CPU's fake device."""
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    return device


class _CudaTensorsOnTheCpu(torch.overrides.TorchFunctionMode):
    """Tensors the script itself puts on `"cuda"` (`device="cuda"`, `.cuda()`, `.to("cuda")`, `module.to(device)`),
    made on the plan's CPU fake device: a CPU-only torch aborts once autograd records an op on a fake CUDA tensor.
    Their bytes are the same; `tensor.device` then reads `cpu`."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _as_cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _as_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def install(
    device: dict[str, Any], allocator: Callable[[], CachingAllocator | None], local_rank: int, per_node: int
) -> tuple[Streams, Callable[[], None]]:
    """Make torch's CUDA queries answer as `device` (`plan.planned_device`'s dict) and tell the job's streams
    apart. `allocator()`: the simulated allocator whose figures `torch.cuda.memory_*` report. Returns the streams
    and a function that undoes it all."""
    global _DEFAULT
    streams = Streams()
    capability = tuple(device.get("capability") or DEFAULT_CAPABILITY)
    memory = int(device.get("memory") or 0)
    name = f"{device.get('name') or 'CUDA device'} (planned)"
    properties = SimpleNamespace(
        name=name,
        major=capability[0],
        minor=capability[1],
        total_memory=memory,
        multi_processor_count=multiprocessors(capability),  # type: ignore[arg-type]
        is_integrated=False,
        is_multi_gpu_board=False,
    )
    current = [local_rank]

    def stat(field: str) -> Callable[..., int]:
        def read(*_: Any, **__: Any) -> int:
            simulated = allocator()
            return int(getattr(simulated, field)) if simulated is not None else 0

        return read

    def mem_get_info(*_: Any, **__: Any) -> tuple[int, int]:
        simulated = allocator()
        used = simulated.reserved if simulated is not None else 0
        return (max(memory - used, 0), memory)

    def empty_cache() -> None:
        simulated = allocator()
        if simulated is not None:
            simulated.empty_cache()

    def set_device(index: Any) -> None:
        current[0] = (
            index.index if isinstance(index, torch.device) and index.index is not None else int(index)
        )

    cuda_queries: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: per_node,
        "current_device": lambda: current[0],
        "set_device": set_device,
        "get_device_capability": lambda *_: capability,
        "get_device_properties": lambda *_: properties,
        "get_device_name": lambda *_: name,
        "is_bf16_supported": lambda *_, **__: capability >= (8, 0),
        "synchronize": lambda *_: None,
        "empty_cache": empty_cache,
        "memory_allocated": stat("allocated"),
        "memory_reserved": stat("reserved"),
        "max_memory_allocated": stat("max_allocated"),
        "max_memory_reserved": stat("max_reserved"),
        "mem_get_info": mem_get_info,
        # The plan's peak covers the whole of the planned steps; a reset in the script does not cut it.
        "reset_peak_memory_stats": lambda *_: None,
    }
    _DEFAULT = torch.cpu.current_stream()
    original_stream_class = torch.cpu.Stream

    class Stream(original_stream_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            streams.number(self, _stream_name(sys._getframe(1)))

    def stream(s: Any) -> Any:
        return streams.use(s)

    def current_stream(*_: Any) -> Any:
        number = streams.current()
        if number == 0:
            return _DEFAULT
        return streams._keep[number - 1]

    cpu_names = {"Stream": Stream, "stream": stream, "current_stream": current_stream}
    saved = {("cuda", k): getattr(torch.cuda, k) for k in cuda_queries}
    saved.update({("cpu", k): getattr(torch.cpu, k) for k in cpu_names})
    for key, value in cuda_queries.items():
        setattr(torch.cuda, key, value)
    for key, value in cpu_names.items():
        setattr(torch.cpu, key, value)
    on_the_cpu = _CudaTensorsOnTheCpu()
    on_the_cpu.__enter__()
    undo_optimizers = _optimizers_as_on_the_device()

    def undo() -> None:
        undo_optimizers()
        on_the_cpu.__exit__(None, None, None)
        for (module, key), value in saved.items():
            setattr(torch.cuda if module == "cuda" else torch.cpu, key, value)

    return streams, undo


def _optimizers_as_on_the_device() -> Callable[[], None]:
    """torch's optimizers choose their implementation from the parameters when the script leaves it to them
    (`torch.optim.optimizer._default_to_fused_or_foreach`: foreach where every parameter is a plain tensor, a
    parameter or a DTensor, on a device with foreach kernels, which CUDA has and the CPU has not). The plan's
    parameters are fake CPU tensors standing for CUDA ones, so for that choice the CPU counts as such a device and
    a fake tensor as the tensor it stands for; the plan then runs the foreach path the device runs, with its
    intermediate tensor lists (AdamW's `exp_avg_sq.sqrt()` of every parameter at once), not the per-parameter
    loop. Gradient clipping (`torch.nn.utils.clip_grad_norm_`) chooses by the same types. What the script asks
    itself (`foreach=`, `fused=True`) runs as asked: the fused kernel updates in place, as CUDA's does. Returns a
    function that undoes it."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    original = optimizer._get_foreach_kernels_supported_devices
    added = [
        types
        for types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
        if FakeTensor not in types
    ]

    def foreach_devices() -> list[str]:
        return [*original(), "cpu"]

    optimizer._get_foreach_kernels_supported_devices = foreach_devices  # type: ignore[attr-defined]
    for types in added:
        types.append(FakeTensor)

    def undo() -> None:
        optimizer._get_foreach_kernels_supported_devices = original  # type: ignore[attr-defined]
        for types in added:
            types.remove(FakeTensor)

    return undo


#: NCCL's defaults behind `nccl_allowance`: the buffer of one protocol of one channel to one peer
#: (`NCCL_BUFFSIZE`, 4 MiB) and the channels an NVLink/InfiniBand communicator may open (`NCCL_MAX_NCHANNELS`, 32).
NCCL_BUFFSIZE = 4 << 20
NCCL_CHANNELS = 32


def nccl_allowance(communicators: int, environ: dict[str, str] | None = None) -> dict[str, int]:
    """NCCL's own device buffers, which it allocates outside the caching allocator (so `max_memory_reserved()`
    never shows them): an allowance, not a simulation, of one send and one receive buffer of `NCCL_BUFFSIZE` per
    channel, `NCCL_MAX_NCHANNELS` channels, per communicator (a process group of more than one rank), read from
    the environment as NCCL reads them."""
    import os

    env = os.environ if environ is None else environ
    buffsize = int(env.get("NCCL_BUFFSIZE", NCCL_BUFFSIZE))
    channels = int(env.get("NCCL_MAX_NCHANNELS", NCCL_CHANNELS))
    per = 2 * buffsize * channels
    return {"communicators": communicators, "per_communicator": per, "bytes": communicators * per}


def communicators() -> int:
    """The process groups of more than one rank the job made (each an NCCL communicator on the GPUs)."""
    from torch.distributed import distributed_c10d

    return sum(1 for group in list(distributed_c10d._world.pg_map) if group.size() > 1)
