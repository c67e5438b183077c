"""The planner's memory account: every live tensor storage of a (fake) training run, labelled by what it holds,
the peak, when it happened (phase, module, step) and its breakdown.

Runs as a dispatch mode above FakeTensorMode: every operation's new storages are counted (views share one) until
they die, FSDP's storage resizes (its gather and free of units) move the count, and each storage is labelled
when it is made (an all-gather's output: a gathered unit; a collective's: a communication buffer; made in
forward: an activation; in backward or the optimizer step: a temporary) and re-labelled at the end when it turns
out to hold parameters, gradients or optimizer state. The labels at the peak are the breakdown. The peak's place
(phase, module, step) is recorded as memory rises to it, what it held before memory first falls again (a free,
or a storage shrinking in place).

A read of a fake value (`.item()`, `bool()`, `.tolist()`) has no answer: the account answers a guess, or what the
user said (`assume`, `--assume FILE:LINE=VALUE`), and records the user's line that read it, for the plan to warn.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import sysconfig
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from torchloom import _torch_compat
from torchloom.planning.allocator import CachingAllocator, OutOfMemory

#: The kinds of memory a plan reports, in this order.
KINDS = (
    "parameters",
    "gradients",
    "optimizer state",
    "gathered FSDP units",
    "activations",
    "temporaries",
    "communication buffers",
    "other",
)

_GATHER_OPS = {
    "all_gather_copy_in",
    "all_gather_into_tensor",
    "_allgather_base_",
    "allgather_",
    "split_with_sizes_copy",
}
_COMM_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "fsdp"}
_INTEGER_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


_ASSUMED: list[Any] = []  # the values of the `assume` blocks the script is in, innermost last
_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCHLOOM = os.path.dirname(os.path.dirname(__file__)) + os.sep
_PLANNING = os.path.dirname(__file__) + os.sep
_LIBRARY = tuple(
    {sysconfig.get_paths()[name] + os.sep for name in ("stdlib", "platstdlib")} | {_TORCH, "<frozen"}
)


@contextlib.contextmanager
def assume(value: bool | int | float) -> Iterator[None]:
    """In `torchloom plan`, every read of a fake tensor's value inside the block (`.item()`, `bool()`, an `if` on
    a comparison, `.tolist()`) answers `value`: say what a value is, or which way a branch goes, where the fake
    run cannot know it. In a real run it does nothing (the values are real).

        with torchloom.planning.assume(False):
            diverged = bool(h.abs().max() > 1e6)
    """
    _ASSUMED.append(value)
    try:
        yield
    finally:
        _ASSUMED.pop()


def user_frame(frame: FrameType | None) -> tuple[str, int, str, str] | None:
    """The innermost frame, from `frame` outwards, that is the user's code (not torch's, not Python's library and
    not the planner's), as (file, line, function, source line); None when it is torchloom's own code."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_TORCHLOOM) and not path.startswith(_PLANNING):
            return None  # torchloom's own read (before the library test: torchloom may be installed there)
        if not path.startswith(_LIBRARY) and not path.startswith(_PLANNING):
            return path, frame.f_lineno, frame.f_code.co_name, linecache.getline(path, frame.f_lineno).strip()
        frame = frame.f_back
    return None


def user_frames(error: BaseException) -> list[tuple[str, int, str, str]]:
    """The user's frames (not torch's, Python's or torchloom's) of `error`'s traceback, outermost first."""
    found = []
    tb = error.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not path.startswith(_LIBRARY) and not path.startswith(_TORCHLOOM):
            found.append(
                (
                    path,
                    tb.tb_lineno,
                    tb.tb_frame.f_code.co_name,
                    linecache.getline(path, tb.tb_lineno).strip(),
                )
            )
        tb = tb.tb_next
    return found


def _answer(value: Any, dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    if dtype.is_complex:
        return complex(value)
    return int(value)


def _tensors_in(value: Any, into: list[torch.Tensor]) -> None:
    """The tensors in an op's arguments or results (tensors, in lists, tuples and dicts, as aten passes them),
    flattened as `_flat_tensors` flattens each: what `torch.utils._pytree.tree_flatten` finds there, without
    building its tree (a tenth of a plan's time went to it)."""
    if isinstance(value, torch.Tensor):
        _flat_tensors(value, into)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors_in(item, into)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors_in(item, into)


def _flat_tensors(value: Any, into: list[torch.Tensor]) -> None:
    if not isinstance(value, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(value) and not _torch_compat.is_fake(value):
        names, _ = value.__tensor_flatten__()
        for name in names:
            _flat_tensors(getattr(value, name), into)
        return
    into.append(value)


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


@dataclass
class Peak:
    """The largest total, where it happened and what it held."""

    bytes: int = 0
    phase: str = "setup"
    module: str = ""
    step: int = 0
    held: dict[int, tuple[int, str]] = field(default_factory=dict)  # serial -> (bytes, label when made)


def same_spot(spot: str, path: str, line: int) -> bool:
    """`--assume`'s `FILE:LINE` names this line: FILE is the path or its last components (`train.py`)."""
    file, _, number = spot.rpartition(":")
    return number == str(line) and (path == file or path.endswith(os.sep + file.lstrip("./" + os.sep)))


class MemoryAccount(TorchDispatchMode):
    """Live storage bytes by kind, with the peak. `fake=True`: the run is on fake tensors; scalar reads of fake
    values (`loss.item()`) answer 0 (True for booleans) unless told (`assume`), each recorded where the
    script made it, and integer work without fake inputs (samplers, seeds)
    runs for real so that data pipelines keep their order."""

    def __init__(
        self, fake: bool = True, assumed: dict[str, Any] | None = None, fake_mode: Any = None
    ) -> None:
        super().__init__()
        self.fake = fake
        # The run's own fake mode: only its tensors' integer work runs for real. Another fake mode's (the one
        # torch.export traces a pipeline's model with) must stay fake: a real tensor in its graph breaks it.
        self.fake_mode = fake_mode
        # `torchloom plan --assume FILE:LINE=VALUE`: what the script's reads of fake values at a line answer
        self.assumed = dict(assumed or {})
        # (file, line) -> where the script read a fake value, how often and what the plan answered
        self.fake_reads: dict[tuple[str, int], dict[str, Any]] = {}
        self.live: dict[int, tuple[int, int, str]] = {}  # storage key -> (serial, bytes, label)
        self.current = 0
        self.peak = Peak()
        self.step = 0
        self.in_optimizer_step = False
        self.known: dict[int, str] = {}  # serial -> parameters, gradients or optimizer state
        self.context: str | None = None  # a label for everything made now (DDP's constructor: its buckets)
        self.last_op = ""
        # (total bytes, step, phase, bytes by kind) at every local high: what `--plot` draws
        self.timeline: list[tuple[int, int, str, dict[str, int]]] = []
        self.by_label: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._up = False  # memory rose since it last fell
        self._serial = 0
        self._rising = False
        self._in_step = (
            False  # a forward of this step began (the loss, the script's code after it: forward too)
        )
        self._where: tuple[str, str, int] = ("setup", "", 0)  # (phase, module, step) of the peak as it rose
        self._modules = _torch_compat.module_tracker()
        self._original_resize: Any = None
        # The CUDA caching allocator, simulated on this account's own allocations and frees (`use_allocator`).
        self.allocator: CachingAllocator | None = None
        self.out_of_memory: dict[str, Any] | None = None  # where the simulated device ran out, if it did
        self._handles: dict[int, int] = {}  # storage key -> the allocator's handle
        # the CUDA stream an allocation is made on now (`_cuda_device.Streams.current`): 0, the default stream
        self.stream_now: Any = lambda: 0
        self.reserved_peak_at: dict[str, Any] | None = None  # the phase, module and step of the reserved peak
        # each called with (namespace, op, args) after every op of the job's device: what a kernel or its library
        # allocates besides the op's tensors (`_cublas.Workspaces.seen`, `_cuda_attention.backward_scratch`)
        self.after_op: list[Any] = []
        self._held = 0  # allocations of the simulated allocator that no tensor owns (`hold_on_device`)
        # A CUDA job's host memory, apart from the device's (`track_host`): the storages that live in CPU memory
        # (what CPU offload keeps there, `_offload`), their total and peak; a new storage is the host's when
        # `placement` says so, or, left to the op, when every tensor the op read is the host's (the optimizer's
        # step over offloaded parameters runs on the CPU).
        self.track_host = False
        self.placement: str | None = (
            None  # "host" or "device": where the storages made now are, whatever the op
        )
        self.host: dict[int, tuple[int, int, str]] = {}  # storage key -> (serial, bytes, label)
        self.host_current = 0
        self.host_peak = Peak()
        self._host_rising = False

    def use_allocator(self, allocator: CachingAllocator) -> None:
        """Feed every storage made, resized and freed from now on into `allocator` (a CUDA job's reserved
        memory). A storage grows as CUDA's `resize_` does: the new block is allocated before the old is freed."""
        self.allocator = allocator

    def _device_malloc(self, key: int, nbytes: int) -> None:
        allocator = self.allocator
        if allocator is None:
            return
        old = self._handles.pop(key, 0)
        try:
            if nbytes:
                before = allocator.max_reserved
                self._handles[key] = allocator.malloc(nbytes, self.stream_now())
                if allocator.max_reserved > before:  # where the reserved peak is, as it rises
                    self.reserved_peak_at = {
                        "phase": self._phase_now(),
                        "module": self._module_now(),
                        "step": self.step,
                    }
        except OutOfMemory as error:
            # The device's memory is spent: the real run stops here with CUDA's out-of-memory error; the plan
            # says where, and goes on without the simulation (its peaks are those up to here).
            self.out_of_memory = {
                "bytes": error.nbytes,
                "allocated": error.allocated,
                "reserved": error.reserved,
                "phase": self._phase_now(),
                "module": self._module_now(),
                "step": self.step,
            }
            self.allocator = None
            return
        allocator.free(old)

    def hold_on_device(self, nbytes: int) -> None:
        """Allocate `nbytes` on the current stream of the simulated allocator for the rest of the run: memory a
        library keeps outside any tensor (cuBLAS's workspaces), in the allocator's figures, not among the live
        tensors."""
        self._held += 1
        self._device_malloc(-self._held, nbytes)

    def scratch(self, sizes: list[int], label: str = "temporaries") -> None:
        """Buffers a kernel allocates for itself and frees before it returns (flash attention's fp32
        accumulator in its backward), made now in this order and freed in the reverse: counted among the live
        tensors and in the simulated allocator while the op runs."""
        made = []
        for nbytes in sizes:
            self._held += 1
            key, serial = -self._held, self._serial + 1
            self._serial = serial
            self.live[key] = (serial, nbytes, label)
            self.current += nbytes
            self.by_label[label] += nbytes
            self._device_malloc(key, nbytes)
            self._up = self._up or nbytes > 0
            if self.current > self.peak.bytes:
                self._rising = True
                self.peak.bytes = self.current
                self._where = (self._phase_now(), self._module_now(), self.step)
            made.append((key, serial))
        for key, serial in reversed(made):
            self._free(key, serial)

    def _device_free(self, key: int) -> None:
        handle = self._handles.pop(key, 0)
        if self.allocator is not None:
            self.allocator.free(handle)

    # ---- counting ----------------------------------------------------------------------------------------
    def _label(self, op: str, namespace: str) -> str:
        if op in _GATHER_OPS and namespace != "aten" or op == "resize":
            return "gathered FSDP units"
        if namespace in _COMM_NAMESPACES:
            return "communication buffers"
        if self.context is not None:
            return self.context
        phase = self._phase_now()
        if phase == "optimizer step":
            return (
                "temporaries"  # the optimizer's state is recognised by `note_state` (made in its first step)
            )
        if phase == "forward":
            return "activations"
        if phase == "backward":
            return "temporaries"
        return "other"

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory is the host's (a CUDA job's CPU memory, `track_host`)."""
        storage = _storage(tensor)
        return storage is not None and storage._cdata in self.host

    def _add_host(self, storage: torch.UntypedStorage, label: str) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self.host:
            serial, before, old_label = self.host[key]
            if nbytes < before:
                self._settle_host()
            self.host[key] = (serial, nbytes, old_label)
        else:
            before = 0
            self._serial += 1
            self.host[key] = (self._serial, nbytes, label)
            weakref.finalize(storage, self._free_host, key, self._serial)
        self.host_current += nbytes - before
        if self.host_current > self.host_peak.bytes:
            self._host_rising = True
            self.host_peak.bytes = self.host_current
            self.host_peak.phase, self.host_peak.module, self.host_peak.step = (
                self._phase_now(),
                self._module_now(),
                self.step,
            )

    def _free_host(self, key: int, serial: int) -> None:
        entry = self.host.get(key)
        if entry is None or entry[0] != serial:
            return
        self._settle_host()
        del self.host[key]
        self.host_current -= entry[1]

    def _settle_host(self) -> None:
        if self._host_rising:
            self._host_rising = False
            self.host_peak.held = {serial: (nbytes, label) for serial, nbytes, label in self.host.values()}

    def host_breakdown(self) -> dict[str, int]:
        """The host peak's bytes by kind."""
        self._settle_host()
        kinds = dict.fromkeys(KINDS, 0)
        for serial, (nbytes, label) in self.host_peak.held.items():
            kinds[self.known.get(serial, label)] += nbytes
        return kinds

    def _add(self, storage: torch.UntypedStorage, label: str, host: bool = False) -> None:
        key = storage._cdata
        if self.track_host and (key in self.host or (host and key not in self.live)):
            self._add_host(storage, label)
            return
        nbytes = storage.nbytes()
        if key in self.live:
            serial, before, old_label = self.live[key]
            if nbytes == before:
                return
            if nbytes < before:  # a storage shrinking in place (FSDP's reshard, `resize_(0)`) ends a peak too
                self._settle()
                self._sample()
            new_label = label if nbytes > before else old_label
            self._device_malloc(key, nbytes)
            self.by_label[old_label] -= before
            self.by_label[new_label] += nbytes
            self.current += nbytes - before
            self.live[key] = (serial, nbytes, new_label)
        else:
            self._serial += 1
            self.live[key] = (self._serial, nbytes, label)
            self.current += nbytes
            self.by_label[label] += nbytes
            self._device_malloc(key, nbytes)
            weakref.finalize(storage, self._free, key, self._serial)
        self._up = self._up or nbytes > 0
        if self.current > self.peak.bytes:
            # Where the peak is, recorded as it rises: by the time memory falls (or an error unwinds the
            # script's frames) the phase and module may be others.
            self._rising = True
            self.peak.bytes = self.current
            self._where = (self._phase_now(), self._module_now(), self.step)

    def _free(self, key: int, serial: int) -> None:
        entry = self.live.get(key)
        if entry is None or entry[0] != serial:
            return
        self._settle()
        self._sample()
        del self.live[key]
        self._device_free(key)
        self.current -= entry[1]
        self.by_label[entry[2]] -= entry[1]

    def _sample(self) -> None:
        """Memory is about to fall: keep this local high for the picture of the step."""
        if not self._up:
            return
        self._up = False
        self.timeline.append(
            (self.current, self.step, self._phase_now(), {k: v for k, v in self.by_label.items() if v})
        )

    def _settle(self) -> None:
        """Memory is about to fall (a free, a storage shrinking) after rising to a new peak: keep what the peak
        held, which is what is live now."""
        if not self._rising:
            return
        self._rising = False
        self.peak = Peak(
            self.peak.bytes,
            *self._where,
            {serial: (nbytes, label) for serial, nbytes, label in self.live.values()},
        )

    def _phase_now(self) -> str:
        if self.in_optimizer_step:
            self._in_step = False
            return "optimizer step"
        if _torch_compat.current_graph_task_id() != -1:
            return "backward"
        if len(self._modules.parents) > 1:
            self._in_step = True
            return "forward"
        if self._in_step:  # between the model's forward and the backward: the loss, the script's own code
            return "forward"
        return "between steps" if self.step else "setup"

    # ---- reads of fake values ----------------------------------------------------------------------------
    def _read(self, tensor: torch.Tensor) -> Any:
        """A read of a fake tensor's value: it has none, so the answer is a guess (0; True for a boolean), or
        what the user said it is (`assume`, `--assume`). Every read of the user's code is recorded where it
        happened: the branch it decides may go another way than on real data."""
        where = user_frame(sys._getframe(1))
        if where is None:  # torchloom's own code (its checks that compare values across ranks are off)
            return _answer(
                _ASSUMED[-1] if _ASSUMED else 0 if tensor.dtype != torch.bool else True, tensor.dtype
            )
        path, line, function, code = where
        how = None
        if _ASSUMED:
            value, how = _ASSUMED[-1], "assume()"
        else:
            value = next(
                (v for spot, v in self.assumed.items() if same_spot(spot, path, line)),
                None,
            )
            how = None if value is None else "--assume"
            if value is None:
                value = True if tensor.dtype == torch.bool else 0
        answer = _answer(value, tensor.dtype)
        entry = self.fake_reads.setdefault(
            (path, line),
            {"file": path, "line": line, "function": function, "code": code, "count": 0, "answers": []},
        )
        entry["count"] += 1
        entry["assumed"] = how
        if answer not in entry["answers"] and len(entry["answers"]) < 4:
            entry["answers"].append(answer)
        return answer

    def _module_now(self) -> str:
        parents = [name for name in self._modules.parents if name != "Global"]
        return max(parents, key=lambda name: (name.count("."), len(name))) if parents else ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        namespace = func.namespace
        op = func._overloadpacket.__name__
        self.last_op = f"{namespace}.{op}"
        if self.fake and op == "_local_scalar_dense" and _torch_compat.is_fake(args[0]):
            return self._read(args[0])
        inputs: list[torch.Tensor] = []
        _tensors_in(args, inputs)
        _tensors_in(kwargs, inputs)
        real = bool(self.fake and inputs) and not any(_torch_compat.is_fake(t) for t in inputs)
        if real:
            with (
                _torch_compat.unset_fake_temporarily()
            ):  # real inputs only (a sampler's indices): run for real
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
            if self.fake and not inputs:
                outputs: list[torch.Tensor] = []
                _tensors_in(out, outputs)
                if outputs and all(
                    t.dtype in _INTEGER_DTYPES
                    and t.numel() <= 1 << 24
                    and (self.fake_mode is None or getattr(t, "fake_mode", None) is self.fake_mode)
                    for t in outputs
                ):
                    # Index and seed work (a sampler's permutation, a worker seed): real, so it can be read.
                    with _torch_compat.unset_fake_temporarily():
                        out = func(*args, **kwargs)
        label = self._label(op, namespace)
        host = self.placement == "host"
        if self.track_host and self.placement is None and inputs and self.host:
            placed = [self.is_host(t) for t in inputs if _storage(t) is not None]
            host = bool(placed) and all(placed)
        results: list[torch.Tensor] = []
        _tensors_in(out, results)
        if op.endswith("_"):
            for t in inputs:
                results.append(t)
        for t in results:
            if t.device.type == "meta":  # the model's device: no memory (a pipeline stage's shape inference)
                continue
            storage = _storage(t)
            if storage is not None:
                self._add(storage, label, host)
        if not real:  # an op of the job's device (not the data's integer work)
            for call in self.after_op:
                call(namespace, op, args)
        return out

    # ---- entering and leaving -----------------------------------------------------------------------------
    def __enter__(self) -> MemoryAccount:
        self._hold_no_gradients(True)
        self._original_resize = _torch_compat.storage_resize()
        original, account = self._original_resize, self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            account._add(storage, "gathered FSDP units")
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        self._modules.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._modules.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        self._hold_no_gradients(False)
        self._settle()

    def _hold_no_gradients(self, on: bool) -> None:
        """The module tracker's backward hooks fire at a module's first gradient instead of its last: its
        hooks that wait for all of them (torch's `register_multi_grad_hook(mode="all")`) hold each gradient that
        came until the last one does, or for good where one never comes (a pipeline stage's input under
        `torch.autograd.grad`). The real run holds none of them: counted, they were 0.38 MiB of a 6 MiB
        pipeline stage's peak. The tracker only names the module where memory peaks; entering a module's
        backward at its first gradient names it as well."""
        from torch.autograd import graph
        from torch.distributed._tools import mod_tracker

        if not on:
            mod_tracker.register_multi_grad_hook = graph.register_multi_grad_hook  # type: ignore[attr-defined]
            return

        def first_gradient(tensors: Any, fn: Any, *, mode: str = "all") -> Any:
            return graph.register_multi_grad_hook(tensors, fn, mode="any")

        mod_tracker.register_multi_grad_hook = first_gradient  # type: ignore[attr-defined]

    # ---- the report --------------------------------------------------------------------------------------
    def serial_of(self, tensor: torch.Tensor) -> list[int]:
        found: list[torch.Tensor] = []
        _flat_tensors(tensor, found)
        serials = []
        for t in found:
            storage = _storage(t)
            if storage is not None and storage._cdata in self.live:
                serials.append(self.live[storage._cdata][0])
            elif storage is not None and storage._cdata in self.host:
                serials.append(self.host[storage._cdata][0])
        return serials

    def note(self, modules: list[torch.nn.Module], optimizers: list[Any]) -> None:
        """Remember which storages hold parameters, gradients and optimizer state now (called at every optimizer
        step and at the end): a gradient freed by `zero_grad` is still a gradient at the peak it was part of."""
        for optimizer in optimizers:
            for state in optimizer.state.values():
                for value in state.values() if isinstance(state, dict) else ():
                    if isinstance(value, torch.Tensor):
                        for serial in self.serial_of(value):
                            self.known[serial] = "optimizer state"
        for module in modules:
            for param in module.parameters():
                if param.grad is not None:
                    for serial in self.serial_of(param.grad):
                        self.known[serial] = "gradients"
                for serial in self.serial_of(param):
                    self.known[serial] = "parameters"
        for key, (serial, nbytes, label) in list(self.live.items()):  # live memory from now on under its kind
            kind = self.known.get(serial, label)
            if kind != label:
                self.live[key] = (serial, nbytes, kind)
                self.by_label[label] -= nbytes
                self.by_label[kind] += nbytes

    def breakdown(self) -> dict[str, int]:
        """The peak's bytes by kind."""
        kinds = dict.fromkeys(KINDS, 0)
        for serial, (nbytes, label) in self.peak.held.items():
            kinds[self.known.get(serial, label)] += nbytes
        return kinds
