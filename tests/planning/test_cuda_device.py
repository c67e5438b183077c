"""The planned CUDA device on a machine without one (`torchloom.planning._cuda_device`): torch's device queries
answer as the planned device while installed, the memory figures are the simulated allocator's, streams made
through the CPU device handle (as FSDP2 makes its own) are told apart and named, and everything is undone."""

from __future__ import annotations

import pytest
import torch

from torchloom.planning import _cuda_device
from torchloom.planning.allocator import CachingAllocator

MiB = 1 << 20


def test_device_queries_answer_as_the_planned_device() -> None:
    allocator = CachingAllocator()
    before = (torch.cuda.is_available(), torch.cuda.device_count())
    device = {"name": "h100", "memory": 80 * 1024 * MiB, "capability": [9, 0]}
    streams, undo = _cuda_device.install(device, lambda: allocator, local_rank=3, per_node=8)
    try:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 8
        assert torch.cuda.current_device() == 3
        assert torch.cuda.get_device_capability() == (9, 0)
        properties = torch.cuda.get_device_properties(0)
        assert (properties.major, properties.minor, properties.total_memory) == (9, 0, 80 * 1024 * MiB)
        assert "h100" in torch.cuda.get_device_name() and torch.cuda.is_bf16_supported()
        handle = allocator.malloc(3 * MiB)  # a 20 MiB segment
        assert torch.cuda.memory_allocated() == 3 * MiB and torch.cuda.memory_reserved() == 20 * MiB
        allocator.free(handle)
        assert torch.cuda.max_memory_allocated() == 3 * MiB
        assert torch.cuda.mem_get_info() == (80 * 1024 * MiB - 20 * MiB, 80 * 1024 * MiB)
        torch.cuda.empty_cache()  # the simulated cache released
        assert torch.cuda.memory_reserved() == 0 and torch.cuda.max_memory_reserved() == 20 * MiB
    finally:
        undo()
    assert (torch.cuda.is_available(), torch.cuda.device_count()) == before


def test_a_device_given_by_its_memory_alone_is_planned_as_sm80() -> None:
    streams, undo = _cuda_device.install({"memory": 1 << 30}, lambda: None, local_rank=0, per_node=1)
    try:
        assert torch.cuda.get_device_capability() == _cuda_device.DEFAULT_CAPABILITY == (8, 0)
        assert torch.cuda.memory_reserved() == 0  # no allocator: nothing reserved
    finally:
        undo()


def test_streams_are_told_apart_and_named_as_their_maker_names_them() -> None:
    streams, undo = _cuda_device.install({"memory": 1 << 30}, lambda: None, local_rank=0, per_node=1)
    try:
        handle = torch.cpu  # what FSDP2's `_get_device_handle("cpu")` returns
        self_like = type("Group", (), {})()
        self_like.reduce_scatter_stream = handle.Stream(priority=-1)
        other = handle.Stream()
        assert streams.current() == 0 and handle.current_stream() is handle.current_stream()
        with handle.stream(self_like.reduce_scatter_stream):
            assert streams.current() == 1
            assert handle.current_stream() is self_like.reduce_scatter_stream
            with handle.stream(other):
                assert streams.current() == 2
            assert streams.current() == 1
        assert streams.current() == 0
        assert streams.names[1] == "reduce_scatter_stream" and streams.names[0] == "default stream"
    finally:
        undo()
    assert torch.cpu.Stream.__module__ == "torch.cpu"  # undone


def test_nccls_allowance_follows_its_environment() -> None:
    # one send and one receive buffer of NCCL_BUFFSIZE per channel: 2 x 4 MiB x 32 = 256 MiB per communicator
    assert _cuda_device.nccl_allowance(3, {}) == {
        "communicators": 3,
        "per_communicator": 256 * MiB,
        "bytes": 768 * MiB,
    }
    small = _cuda_device.nccl_allowance(2, {"NCCL_BUFFSIZE": str(MiB), "NCCL_MAX_NCHANNELS": "8"})
    assert small["per_communicator"] == 16 * MiB and small["bytes"] == 32 * MiB


def test_tensors_the_script_puts_on_cuda_are_made_on_the_plans_cpu_device() -> None:
    streams, undo = _cuda_device.install({"memory": 1 << 30}, lambda: None, local_rank=0, per_node=1)
    try:
        made = torch.ones(2, 3, device="cuda")
        moved = torch.zeros(2).cuda()
        cast = made.to("cuda:0", torch.bfloat16)
        module = torch.nn.Linear(3, 1).to(torch.device("cuda", 0))
        assert {t.device.type for t in (made, moved, cast, module.weight)} == {"cpu"}
        assert cast.dtype == torch.bfloat16 and torch.empty(1, device=0).device.type == "cpu"
    finally:
        undo()
    if not torch.cuda.is_available():  # undone: this CPU build refuses CUDA tensors again
        with pytest.raises((RuntimeError, AssertionError)):
            torch.ones(1, device="cuda")


def _adamw_peak(on_cuda: bool, **options: object) -> tuple[int, int]:
    """Two AdamW steps over 4 fp32 parameters of 1 MiB each (P = 4 MiB in all), with their gradients, on the
    plan's fake tensors: the peak of live bytes and its temporaries."""
    from torchloom import _torch_compat
    from torchloom.planning.tracker import MemoryAccount

    undo = _cuda_device.install({"memory": 1 << 34}, lambda: None, 0, 1)[1] if on_cuda else None
    try:
        fake = _torch_compat.fake_tensor_mode()
        account = MemoryAccount(fake=True, fake_mode=fake)
        with fake, account:
            params = [torch.nn.Parameter(torch.zeros(MiB // 4)) for _ in range(4)]
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer = torch.optim.AdamW(params, **options)  # type: ignore[arg-type]
            account.in_optimizer_step = True
            optimizer.step()
            optimizer.step()
            account.in_optimizer_step = False
            account.note([torch.nn.ParameterList(params)], [optimizer])  # what holds parameters and state
    finally:
        if undo is not None:
            undo()
    return account.peak.bytes, account.breakdown()["temporaries"]


def test_the_optimizer_takes_the_path_it_takes_on_the_device() -> None:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim import optimizer

    # On CUDA, AdamW left to choose runs foreach: the parameters (P), gradients (P), two moments (2P) and
    # `_foreach_sqrt` of every second moment at once (P) are live together: 5P = 20 MiB (and 4 step scalars).
    peak, temporaries = _adamw_peak(True)
    assert 20 * MiB <= peak < 20 * MiB + 1024 and 4 * MiB <= temporaries < 4 * MiB + 1024
    # fused=True, asked by the script: the fused kernel updates in place, no list of temporaries: 4P = 16 MiB
    peak, temporaries = _adamw_peak(True, fused=True)
    assert 16 * MiB <= peak < 16 * MiB + 1024 and temporaries < 1024
    # foreach=False asked, and the CPU job (where torch defaults to the loop): one parameter's temporaries at a
    # time, under 5P
    assert _adamw_peak(True, foreach=False)[0] < 20 * MiB
    assert _adamw_peak(False)[0] < 20 * MiB
    assert FakeTensor not in optimizer._foreach_supported_types  # undone
    assert "cpu" not in optimizer._get_foreach_kernels_supported_devices()
