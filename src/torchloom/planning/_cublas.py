"""cuBLAS's workspaces in a planned CUDA job: blocks of the caching allocator that no tensor owns.

As torch 2.13 sets cuBLAS up (aten/src/ATen/cuda/CublasHandlePool.cpp): the first cuBLAS call (a matmul) with a
handle on a stream allocates that (handle, stream)'s workspace from the caching allocator, on that stream, and
keeps it for the process (`setWorkspaceForHandle`: a map keyed by handle and stream). Handles are per thread
(each thread reserves its own from the pool), and on CUDA autograd runs the backward on a device thread of its
own, so the forward's (and the optimizer's) matmuls and the backward's each have their workspace on a stream.
The size is `getChosenWorkspaceSize()`: `CUBLAS_WORKSPACE_CONFIG` (`:SIZE:COUNT` pairs, SIZE KiB each, summed),
else 32 MiB on Hopper and Blackwell (capability 9.x, 10.x, 11.x, 12.x) and `:4096:2:16:8` (8 MiB + 128 KiB)
before them. cuBLASLt's workspace (the matmul with a bias epilogue) is the same block unless
`TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`, when it is one of `CUBLASLT_WORKSPACE_SIZE` KiB (1024) of its own per
(handle, stream). Which matmuls take cuBLASLt's path depends on shapes and dtypes that torch checks at run time;
the plan takes it for `addmm` (a linear layer with a bias), so with separate workspaces it may count one that the
run does not make.
"""

from __future__ import annotations

import os
import re
from typing import Any

from torchloom import _torch_compat

#: The aten ops that call cuBLAS on CUDA (what `nn.Linear`, `matmul`, `einsum` and math attention come to)
MATMULS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation", "_int_mm"}
)
#: ... and the ones that take cuBLASLt's path (the bias epilogue), with a workspace of their own when not unified
LT_MATMULS = frozenset({"addmm", "_addmm_activation"})


def workspace_sizes(capability: tuple[int, int], environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(cuBLAS's workspace, cuBLASLt's own workspace: 0 when it shares cuBLAS's) in bytes, as torch reads them
    from the environment for a device of `capability`."""
    env = os.environ if environ is None else environ
    default = 32 << 20 if capability[0] in (9, 10, 11, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    chosen = sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").strip().lower() not in (
        "0",
        "false",
        "off",
        "n",
    )
    if unified:
        return chosen, 0
    lt = int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    return chosen, lt


class Workspaces:
    """Allocates each (thread, stream)'s workspace in the account's simulated allocator at its first matmul, as
    cuBLAS does; the account calls `seen` after every op (`account.after_op`)."""

    def __init__(self, account: Any, capability: tuple[int, int], stream_names: Any) -> None:
        self.account = account
        self.cublas, self.lt = workspace_sizes(capability)
        self.stream_names = stream_names  # stream number -> name
        self.made: dict[tuple[str, int, str], int] = {}  # (thread, stream, library) -> bytes

    def seen(self, namespace: str, op: str, args: Any = ()) -> None:
        if namespace != "aten" or op not in MATMULS or self.account.allocator is None:
            return
        # the backward runs on autograd's device thread, with a cuBLAS handle of its own
        thread = "backward" if _torch_compat.current_graph_task_id() != -1 else "forward"
        stream = self.account.stream_now()
        wanted = [("cuBLAS", self.cublas)]
        if self.lt and op in LT_MATMULS:
            wanted.append(("cuBLASLt", self.lt))
        for library, nbytes in wanted:
            key = (thread, stream, library)
            if key not in self.made and nbytes:
                self.made[key] = nbytes
                self.account.hold_on_device(nbytes)

    def report(self) -> dict[str, Any]:
        return {
            "workspace_bytes": self.cublas,
            "lt_workspace_bytes": self.lt,
            "bytes": sum(self.made.values()),
            "workspaces": [
                {
                    "library": library,
                    "thread": "autograd's device thread (backward)"
                    if thread == "backward"
                    else "the script's thread",
                    "stream": self.stream_names.get(stream, f"stream {stream}"),
                    "bytes": nbytes,
                }
                for (thread, stream, library), nbytes in self.made.items()
            ],
        }
