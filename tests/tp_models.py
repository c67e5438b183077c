"""A tiny Hugging Face Llama, its tensor-parallel plan (torchtitan's style) and the training runs compared, shared
by the CPU test (tests/strategies/test_model_parallel_llama.py) and the CUDA one (tests/gpu/).

`parallelize_llama(model, device_mesh)` is the user's `parallelize_fn` for `ModelParallelStrategy`: per decoder
layer, Megatron-style tensor parallelism over the mesh's "tensor_parallel" dimension (q/k/v and the MLP's
gate/up split by output features, o and down by input features, so each layer needs one all-reduce in its
attention and one in its MLP), then `fully_shard` of the layer over "data_parallel". The token embedding, the
final norm and the head stay plain: leftovers, which the strategy keeps identical on every rank.
"""

from __future__ import annotations

import torch
from test_hf_models import ACCUM, GLOBAL_BATCH, MAX_NORM, PROBE, STEPS, data, optimizer
from test_hf_models import llama as tiny_llama
from test_hf_models import reference as _hf_reference
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# The model, data, optimizer and hyper-parameters are those of the Hugging Face tests (tests/test_hf_models.py):
# a Llama with 4 query heads and 2 key/value heads (grouped-query attention), so a tensor-parallel size of 2 gives
# each rank 2 query heads and their 1 key/value head; SGD with momentum, STEPS steps of ACCUM micro-batches, each
# step clipped.


def parallelize_llama(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """The `parallelize_fn` (the same as in docs, model-parallel page): tensor parallel inside every decoder layer,
    then each layer one FSDP2 unit over the data-parallel ranks. Embedding, final norm and head are left plain.

    LlamaAttention (transformers >= 4.48) reshapes its projections with `view(..., -1, head_dim)`: a rank's
    local q/k/v hold its own heads, so no head count needs adjusting; `num_key_value_groups` (query heads per
    key/value head) is the same locally. The split must not cut a head, nor separate a query head from its
    key/value head: both head counts must divide by the tensor-parallel size."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_mesh = device_mesh["tensor_parallel"]
    tp, config = tp_mesh.size(), model.config
    if config.num_attention_heads % tp or config.num_key_value_heads % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide the attention and key/value head counts")
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    return model


# ------------------------------------------------------------------------------- training, shared by CPU and CUDA
def _logits(model: nn.Module, device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE.to(device), use_cache=False).logits.detach().cpu()


def reference() -> dict:
    """One process on the CPU, plain torch and transformers, on the whole global batch of every micro-batch
    (test_hf_models.reference), with the initial weights."""
    return {**_hf_reference("llama"), "initial": tiny_llama().state_dict()}


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole, under the model's own names, by PyTorch's state-dict API."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _layout(model: nn.Module) -> dict[str, tuple]:
    """Each parameter's mesh dims and, per dim, the tensor dim it is split along (FSDP2's strided shard of a
    tensor-parallel weight included): a plain tensor gives ()."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.device_mesh.mesh_dim_names, tuple(getattr(s, "dim", repr(s)) for s in p.placements))
        if isinstance(p, DTensor)
        else ()
        for name, p in model.named_parameters()
    }


def _result(model: nn.Module, losses: list[float], norms: list[float], device: torch.device) -> dict:
    from torch.distributed.tensor import DTensor

    return {
        "losses": losses,
        "norms": norms,
        "layout": _layout(
            model
        ),  # before the probe's forward, after which the layers keep their whole weights
        "leftovers": {
            n: p.detach().cpu().clone() for n, p in model.named_parameters() if not isinstance(p, DTensor)
        },
        "params": _full_params(model),
        "logits": _logits(model, device),
    }


def _raw_global_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The true global norm of every gradient, then clipping. DTensor gradients grouped by mesh (FSDP2 puts the
    tensor-parallel weights on the 2-D mesh, the layers' norms on the data-parallel one), each group's norm made
    whole with `full_tensor()`; plain gradients are the same on every rank and count once."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for mesh, group in groups.items():
        norm = get_total_norm([p.grad for p in group])
        squares.append((norm.full_tensor() if mesh is not None else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    for group in groups.values():
        clip_grads_with_norm_(group, max_norm, total)
    return total


def raw_case(accelerator: str, world_size: int, tp: int) -> dict:
    """The plan with raw PyTorch: init_device_mesh, `parallelize_llama`, the leftovers' gradients averaged over
    the data-parallel group by hand, `_raw_global_norm`. What torchloom's strategy must match."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    device = (
        torch.device("cuda", int(os.environ["LOCAL_RANK"])) if accelerator == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dp = world_size // tp
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = parallelize_llama(tiny_llama().to(device), mesh)
    leftovers = [p for p in model.parameters() if not isinstance(p, DTensor)]
    dp_group, dp_rank = mesh["data_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    opt = optimizer(model.parameters())
    ids = data().to(device)
    per = GLOBAL_BATCH // dp
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            for layer in model.model.layers:
                layer.set_requires_gradient_sync(last)
            x = ids[step, micro, dp_rank * per : (dp_rank + 1) * per]
            loss = model(input_ids=x, labels=x, use_cache=False).loss / ACCUM
            loss.backward()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss, group=dp_group)
            losses.append(float(global_loss) / dp)
        for p in leftovers:  # data-parallel semantics: the mean gradient over the data-parallel ranks
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp
        norms.append(float(_raw_global_norm(list(model.parameters()), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return _result(model, losses, norms, device)


def loom_case(accelerator: str, world_size: int, tp: int) -> dict:
    """torchloom's ModelParallelStrategy with `parallelize_llama`: the data split over the data-parallel ranks
    by `loom.setup_dataloaders`, `loom.no_backward_sync`, `loom.clip_gradients`."""
    from torch.utils.data import DataLoader

    from torchloom import Loom
    from torchloom.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize_llama, data_parallel_size=world_size // tp, tensor_parallel_size=tp
    )
    loom = Loom(accelerator=accelerator, devices=world_size, strategy=strategy)
    loom.launch()
    # Built on the CPU and moved, as the reference is: under loom.init_module() a GPU run would draw the initial
    # weights from the GPU's random generator.
    model = loom.setup_module(tiny_llama().to(loom.device))
    opt = loom.setup_optimizers(optimizer(model.parameters()))
    # The global micro-batches in order; each data-parallel rank reads its share of every one.
    sequences = data().flatten(0, 2)  # (sequences, tokens)
    loader = loom.setup_dataloaders(DataLoader(sequences, batch_size=GLOBAL_BATCH // (world_size // tp)))
    batches = iter(loader)
    losses, norms = [], []
    for _ in range(STEPS):
        for micro in range(ACCUM):
            x = next(batches)
            with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = model(input_ids=x, labels=x, use_cache=False).loss / ACCUM
                loom.backward(loss)
            losses.append(
                float(loom.all_reduce(loss.detach()))
            )  # the mean over ranks: over data-parallel ones
        norms.append(float(loom.clip_gradients(model, opt, max_norm=MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return _result(model.module, losses, norms, loom.device)


def check_parity(got: dict, expected: dict, what: str, atol: float) -> None:
    assert min(expected["norms"]) > MAX_NORM  # clipping acts on every step
    assert set(got["params"]) == set(expected["params"]), what
    for name, value in expected["params"].items():
        torch.testing.assert_close(got["params"][name], value, atol=atol, rtol=0, msg=f"{what} {name}")
    for key in ("losses", "norms"):
        torch.testing.assert_close(
            torch.tensor(got[key]), torch.tensor(expected[key]), atol=atol, rtol=0, msg=f"{what} {key}"
        )
    torch.testing.assert_close(got["logits"], expected["logits"], atol=atol, rtol=0, msg=what)


def max_deviation(got: dict, expected: dict) -> float:
    """The largest absolute difference over parameters, losses, norms and logits (for reports)."""
    diffs = [(got["params"][k] - v).abs().max().item() for k, v in expected["params"].items()]
    for key in ("losses", "norms"):
        diffs.append((torch.tensor(got[key]) - torch.tensor(expected[key])).abs().max().item())
    diffs.append((got["logits"] - expected["logits"]).abs().max().item())
    return max(diffs)
