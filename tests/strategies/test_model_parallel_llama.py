"""A tiny Hugging Face Llama under 2-D parallelism: tensor parallel inside each decoder layer (attention and
MLP, tests/tp_models.py::parallelize_llama) and FSDP2 over the data-parallel ranks, on 4 CPU ranks (gloo) as
dp 2 x tp 2, against one process training the same model on the concatenated global batch.

One launch of the ranks runs two cases:
- "raw": the same `parallelize_fn` with raw PyTorch only (init_device_mesh, a hand-written all-reduce of the
  leftovers' gradients over the data-parallel group, a hand-written global norm over DTensors on two meshes and
  the plain leftovers). It validates the plan itself: if it fails, the plan is wrong, not torchloom.
- "loom": torchloom's ModelParallelStrategy with that `parallelize_fn`, `loom.no_backward_sync` and
  `loom.clip_gradients`.

Every run: fp32, SGD with momentum, STEPS optimizer steps of ACCUM micro-batches each, clipping to a norm below
every step's gradient norm (so it acts every step, asserted). The ranks of one tensor-parallel group read the
same slice of the global batch: the slice of their data-parallel rank.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

pytest.importorskip("transformers")

from tp_models import VOCAB, parallelize_llama, tiny_llama  # noqa: E402

pytestmark = pytest.mark.timeout(300)

WORLD, TP = 4, 2
DP = WORLD // TP
STEPS, ACCUM = 3, 2
GLOBAL_BATCH, SEQ = 4, 8
MAX_NORM = 0.5
LR, MOMENTUM = 0.5, 0.9
ATOL = 1e-5
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) * 7 % VOCAB


def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, ACCUM, GLOBAL_BATCH, SEQ), generator=g)


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE, use_cache=False).logits.detach().clone()


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, plain torch and transformers, on the whole global batch of every micro-batch."""
    model = tiny_llama()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = optimizer(model.parameters())
    ids = data()
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x = ids[step, micro]
            loss = model(input_ids=x, labels=x, use_cache=False).loss / ACCUM
            loss.backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"params": params, "losses": losses, "norms": norms, "logits": _logits(model), "initial": initial}


# ------------------------------------------------------------------------------------------------ rank side
def _slice(ids: torch.Tensor, dp_rank: int) -> torch.Tensor:
    per = GLOBAL_BATCH // DP
    return ids[dp_rank * per : (dp_rank + 1) * per]


def _full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _layout(model) -> dict[str, tuple]:
    """Each parameter's mesh dimensions and, per dimension, the tensor dimension it is sharded along (FSDP2's
    strided shard of a tensor-parallel weight counts as a shard): a plain tensor gives ()."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.device_mesh.mesh_dim_names, tuple(getattr(s, "dim", repr(s)) for s in p.placements))
        if isinstance(p, DTensor)
        else ()
        for name, p in model.named_parameters()
    }


def _raw_global_norm(params, max_norm: float) -> torch.Tensor:
    """The true global norm of every gradient, then clipping: DTensor gradients grouped by mesh (FSDP2 puts the
    tensor-parallel weights on the 2-D mesh and the layers' norms on the data-parallel one), each group's norm
    made whole with `full_tensor()`; plain gradients are the same on every rank and count once."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    squares = []
    for mesh, group in groups.items():
        norm = get_total_norm([p.grad for p in group])
        squares.append((norm.full_tensor() if mesh is not None else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    for group in groups.values():
        clip_grads_with_norm_(group, max_norm, total)
    return total


def _raw_case(world_size: int) -> dict:
    """The plan with raw PyTorch: what torchloom's strategy must match."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = parallelize_llama(tiny_llama(), mesh)
    leftovers = [p for p in model.parameters() if not isinstance(p, DTensor)]
    dp_group, dp_rank = mesh["data_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    opt = optimizer(model.parameters())
    ids = data()
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            for layer in model.model.layers:
                layer.set_requires_gradient_sync(last)
            x = _slice(ids[step, micro], dp_rank)
            loss = model(input_ids=x, labels=x, use_cache=False).loss / ACCUM
            loss.backward()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss, group=dp_group)
            losses.append(float(global_loss) / DP)
        for p in leftovers:  # data-parallel semantics: the mean gradient over the data-parallel ranks
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= DP
        norms.append(float(_raw_global_norm(list(model.parameters()), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {
        "losses": losses,
        "norms": norms,
        "layout": _layout(
            model
        ),  # before the probe's forward, after which the layers keep their unsharded weights
        "params": _full_params(model),
        "logits": _logits(model),
        "leftovers": {
            n: p.detach().clone() for n, p in model.named_parameters() if not isinstance(p, DTensor)
        },
    }


def _job(rank: int, world_size: int) -> dict:
    return {"raw": _raw_case(world_size)}


@pytest.fixture(scope="module")
def job() -> list[dict]:
    return run_ranks(_job, WORLD, timeout=240)


# ----------------------------------------------------------------------------------------------------- checks
def _check_parity(got: dict, expected: dict, what: str) -> None:
    assert min(expected["norms"]) > MAX_NORM  # clipping acts on every step
    assert set(got["params"]) == set(expected["params"]), what
    for name, value in expected["params"].items():
        torch.testing.assert_close(got["params"][name], value, atol=ATOL, rtol=0, msg=f"{what} {name}")
    for key in ("losses", "norms"):
        torch.testing.assert_close(
            torch.tensor(got[key]), torch.tensor(expected[key]), atol=ATOL, rtol=0, msg=f"{what} {key}"
        )
    torch.testing.assert_close(got["logits"], expected["logits"], atol=ATOL, rtol=0, msg=what)


def test_training_moved_the_weights_far_beyond_the_tolerance(reference):
    moved = max((reference["params"][k] - v).abs().max().item() for k, v in reference["initial"].items())
    assert moved > 1000 * ATOL


@pytest.mark.parametrize("case", ["raw"])
def test_llama_tp_fsdp_parity_with_one_process(job, reference, case):
    for rank, result in enumerate(job):
        _check_parity(result[case], reference, f"{case} rank {rank}")


@pytest.mark.parametrize("case", ["raw"])
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
