"""cuBLAS's workspaces in a planned CUDA job (`torchloom.planning._cublas`): sized as torch 2.13 sizes them from
the environment and the device's capability, and allocated in the simulated allocator once per thread and stream
that runs a matmul."""

from __future__ import annotations

import torch

from torchloom import _torch_compat
from torchloom.planning._cublas import Workspaces, workspace_sizes
from torchloom.planning.allocator import CachingAllocator
from torchloom.planning.tracker import MemoryAccount

MiB = 1 << 20


def test_the_workspace_size_follows_the_device_and_the_environment() -> None:
    # Hopper and Blackwell: 32 MiB; before them `:4096:2:16:8`: 2 x 4096 KiB + 8 x 16 KiB = 8 MiB + 128 KiB
    assert workspace_sizes((9, 0), {}) == (32 * MiB, 0)
    assert workspace_sizes((10, 0), {}) == (32 * MiB, 0)
    assert workspace_sizes((8, 0), {}) == (8 * MiB + 128 * 1024, 0)
    # CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic runs' setting): 8 x 4096 KiB; :16:8: 8 x 16 KiB
    assert workspace_sizes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == (32 * MiB, 0)
    assert workspace_sizes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == (128 * 1024, 0)
    # cuBLASLt's own workspace only when not unified: CUBLASLT_WORKSPACE_SIZE KiB, 1024 by default
    assert workspace_sizes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == (32 * MiB, MiB)
    separate = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert workspace_sizes((9, 0), separate) == (32 * MiB, 4 * MiB)


def test_one_workspace_per_thread_and_stream_that_runs_a_matmul() -> None:
    allocator = CachingAllocator()
    fake = _torch_compat.fake_tensor_mode()
    account = MemoryAccount(fake=True, fake_mode=fake)
    account.use_allocator(allocator)
    stream = [0]
    account.stream_now = lambda: stream[0]
    workspaces = Workspaces(account, (9, 0), {0: "default stream", 1: "side stream"})
    account.after_op.append(workspaces.seen)
    with fake, account:
        weight = torch.zeros(4, 4, requires_grad=True)
        x = torch.zeros(2, 4)
        for _ in range(2):  # the second step's matmuls reuse the first's workspaces
            (x @ weight).sum().backward()  # the forward's mm, and the backward's on autograd's thread
        stream[0] = 1
        x @ weight  # another stream: a workspace of its own
        torch.add(x, x)  # not a matmul
    threads = sorted((w["thread"], w["stream"]) for w in workspaces.report()["workspaces"])
    assert threads == [
        ("autograd's device thread (backward)", "default stream"),
        ("the script's thread", "default stream"),
        ("the script's thread", "side stream"),
    ]
    # three blocks of 32 MiB (>= 10 MiB: each a segment of its own); the tensors: the small pool's 2 MiB segment
    # on each stream
    assert 3 * 32 * MiB <= allocator.allocated < 3 * 32 * MiB + MiB  # held for good, with the live tensors
    assert allocator.max_reserved == 3 * 32 * MiB + 2 * 2 * MiB
    assert account.peak.bytes < MiB  # the live tensors do not hold them
