"""The tiny Llama under 2-D parallelism (tensor parallel 2 inside every decoder layer, FSDP2 over the
data-parallel ranks; tests/strategies/test_model_parallel_llama.py runs the same on 4 CPU ranks) on GPUs over
NCCL: torchloom's ModelParallelStrategy and raw PyTorch with the same `parallelize_fn`, each against one process
(on the CPU) training the same model on the whole global batch.

Tensor parallelism needs 2 GPUs at least: `cuda(min_devices=2)` skips the test with the reason on fewer
(tests/conftest.py). With 4 GPUs or more it runs dp 2 x tp 2, with 2 or 3 dp 1 x tp 2.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

pytest.importorskip("transformers")

import tp_models  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TP = 2
# fp32 without TF32, but NCCL and the GPU kernels sum in other orders than the CPU reference.
ATOL = 1e-4


def _world() -> int:
    return 4 if torch.cuda.device_count() >= 4 else 2


def _job(rank: int, world_size: int) -> dict:
    # Loom's launch makes the NCCL process group the raw case then uses.
    return {
        "loom": tp_models.loom_case("cuda", world_size, TP),
        "raw": tp_models.raw_case("cuda", world_size, TP),
    }


@pytest.fixture(scope="module")
def job() -> list[dict]:
    return run_ranks(_job, _world(), timeout=240)


@pytest.mark.cuda(min_devices=2)
@pytest.mark.parametrize("case", ["loom", "raw"])
def test_llama_tp_fsdp_parity_on_gpus(job, case):
    expected = tp_models.reference()  # one process on the CPU
    for rank, result in enumerate(job):
        tp_models.check_parity(result[case], expected, f"{case} rank {rank}", ATOL)
