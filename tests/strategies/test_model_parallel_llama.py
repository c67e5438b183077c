"""A tiny Hugging Face Llama under 2-D parallelism: tensor parallel inside each decoder layer (attention and
MLP) and FSDP2 over the data-parallel ranks (tests/tp_models.py::parallelize_llama), on 4 CPU ranks (gloo) as
dp 2 x tp 2, against one process training the same model on the concatenated global batch (fp32, <= 1e-5).

One launch of the ranks runs two cases with the same `parallelize_fn`:
- "loom": torchloom's ModelParallelStrategy, the data split by `loom.setup_dataloaders`, accumulation with
  `loom.no_backward_sync`, `loom.clip_gradients`;
- "raw": raw PyTorch only (init_device_mesh, the leftovers' gradients averaged over the data-parallel group by
  hand, a hand-written global norm over DTensors on two meshes and the plain leftovers). It validates the plan
  itself: where "raw" passes and "loom" fails, the fault is torchloom's.
The same cases run on GPUs over NCCL in tests/gpu/test_model_parallel_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

pytest.importorskip("transformers")

import tp_models  # noqa: E402

pytestmark = pytest.mark.timeout(300)

WORLD, TP = 4, 2
ATOL = 1e-5
CASES = ("loom", "raw")


def _job(rank: int, world_size: int) -> dict:
    # Loom's launch makes the process group the raw case then uses.
    return {
        "loom": tp_models.loom_case("cpu", world_size, TP),
        "raw": tp_models.raw_case("cpu", world_size, TP),
    }


@pytest.fixture(scope="module")
def job() -> list[dict]:
    return run_ranks(_job, WORLD, timeout=240)


@pytest.fixture(scope="module")
def reference() -> dict:
    return tp_models.reference()


def test_training_moved_the_weights_far_beyond_the_tolerance(reference):
    moved = max((reference["params"][k] - v).abs().max().item() for k, v in reference["initial"].items())
    assert moved > 1000 * ATOL


@pytest.mark.parametrize("case", CASES)
def test_llama_tp_fsdp_parity_with_one_process(job, reference, case):
    for rank, result in enumerate(job):
        tp_models.check_parity(result[case], reference, f"{case} rank {rank}", ATOL)


@pytest.mark.parametrize("case", CASES)
def test_llama_plan_layout(job, case):
    """The plan did what it says: attention and MLP weights are 2-D DTensors (sharded over data-parallel and
    split over tensor-parallel: by rows for q/k/v/gate/up, by columns for o/down), the layers' norms are sharded
    over data-parallel only, and the embedding, final norm and head are plain, identical on every rank."""
    layout = job[0][case]["layout"]
    dims = ("data_parallel", "tensor_parallel")
    for i in range(2):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            assert layout[f"model.layers.{i}.{name}.weight"] == (dims, (0, 0)), name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert layout[f"model.layers.{i}.{name}.weight"] == (dims, (0, 1)), name
        for name in ("input_layernorm", "post_attention_layernorm"):
            assert layout[f"model.layers.{i}.{name}.weight"] == (("data_parallel",), (0,)), name
    plain = {name for name, spec in layout.items() if spec == ()}
    assert plain == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for rank in range(1, WORLD):
        for name, value in job[0][case]["leftovers"].items():
            assert torch.equal(job[rank][case]["leftovers"][name], value), (case, rank, name)
