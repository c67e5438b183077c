"""ModelParallelStrategy as a user meets it: the setup summary (each parameter's placement, the units, the
tensor-parallel and the replicated parameters, with this rank's element counts), the errors for the mistakes torch
reports in its own terms inside `parallelize_fn` (fully_shard on the default or the tensor-parallel mesh, a plan
key that matches nothing), and activation checkpointing with torch.compile on a sequence-parallel block. Real gloo
ranks: 2 (tensor parallel 2) for the errors and the compile order, 4 (dp 2 x tp 2) for the 2-D summary."""

from __future__ import annotations

import re
import warnings

import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

import torchloom
from torchloom import Loom
from torchloom.strategies import ModelParallelStrategy

DIM, HEADS, VOCAB, SEQ = 8, 2, 16, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Each tensor-parallel rank holds some of the heads: their count comes from the local width.
        q, k, v = (p(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(DIM), Attention()
        self.mlp_norm, self.up, self.down = (
            nn.LayerNorm(DIM),
            nn.Linear(DIM, 3 * DIM),
            nn.Linear(3 * DIM, DIM),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class Net(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tp_plan(sequence_parallel: bool = False) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {
            **{f"attn.{n}": ColwiseParallel() for n in "qkv"},
            "attn.o": RowwiseParallel(),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(),
        }
    # The sequence-parallel region is the block: it enters and leaves replicated, so the plain embedding and
    # head around it see the whole sequence.
    return {
        "": PrepareModuleInputOutput(
            input_layouts=Replicate(),
            desired_input_layouts=Shard(1),
            use_local_input=True,
            output_layouts=Shard(1),
            desired_output_layouts=Replicate(),
        ),
        "attn_norm": SequenceParallel(),
        "mlp_norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        **{f"attn.{n}": ColwiseParallel() for n in "qkv"},
        "attn.o": RowwiseParallel(output_layouts=Shard(1)),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }


def _parallelize(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], _tp_plan())
        if mesh["data_parallel"].size() > 1:
            fully_shard(block, mesh=mesh["data_parallel"])
    warnings.warn("parallelize_fn's own warning", stacklevel=1)
    return model


# ---- parallelize_fn mistakes ---------------------------------------------------------------------------------------
def _default_mesh(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], _tp_plan())
        fully_shard(block)  # the default mesh: every rank
    return model


def _tensor_parallel_mesh(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], _tp_plan())
        fully_shard(block, mesh=mesh["tensor_parallel"])  # overlaps the dim the plan split
    return model


def _own_mesh(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mine = init_device_mesh("cpu", (mesh.size(),), mesh_dim_names=("dp",))  # not sliced from the strategy's
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], _tp_plan())
        fully_shard(block, mesh=mine)
    return model


def _unresolved_key(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    plan = _tp_plan()
    plan["attn.query"] = plan.pop("attn.q")  # a typo: torch warns and skips the entry
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], plan)
    parallelize_module(model, mesh["tensor_parallel"], {"lm_head": ColwiseParallel()})
    return model


def _checkpoint_then_compile(model: nn.Module, mesh) -> nn.Module:
    return _ac_and_compile(model, mesh, compile_first=False)


def _compile_then_checkpoint(model: nn.Module, mesh) -> nn.Module:
    return _ac_and_compile(model, mesh, compile_first=True)


def _sequence_parallel(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], _tp_plan(sequence_parallel=True))
    return model


def _ac_and_compile(model: nn.Module, mesh, compile_first: bool) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor.parallel import parallelize_module

    for i, block in enumerate(model.blocks):
        parallelize_module(block, mesh["tensor_parallel"], _tp_plan(sequence_parallel=True))
        # aot_eager: the same autograd tracing as inductor's, without compiling kernels (seconds on CPU).
        if compile_first:
            model.blocks[i] = checkpoint_wrapper(torch.compile(block, backend="aot_eager"))
        else:
            model.blocks[i] = torch.compile(checkpoint_wrapper(block), backend="aot_eager")
    return model


def _new_loom(fn, world_size: int, dp: int = 1) -> Loom:
    strategy = ModelParallelStrategy(fn, data_parallel_size=dp, tensor_parallel_size=world_size // dp)
    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    return loom


def _failure(fn, world_size: int) -> dict | None:
    loom = _new_loom(fn, world_size)
    try:
        torch.manual_seed(0)
        loom.setup_module(Net(blocks=1))
    except Exception as error:
        cause = error.__cause__
        return {
            "types": [c.__name__ for c in type(error).__mro__],
            "message": str(error),
            "cause": f"{type(cause).__name__}: {cause}" if cause is not None else None,
        }
    finally:
        loom.close()
    return None


def _losses(fn, world_size: int) -> list[float]:
    """Two SGD steps on the same batch for every rank (one data-parallel replica)."""
    loom = _new_loom(fn, world_size)
    torch.manual_seed(0)
    model = loom.setup_module(Net(blocks=1))
    optimizer = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loom.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    loom.close()
    return losses


def _placements(model: nn.Module) -> dict[str, tuple]:
    """What each parameter is, read from the model itself: (DTensor, placement per mesh dim, global and local
    element counts)."""
    from torch.distributed.tensor import DTensor

    found = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            dims = p.device_mesh.mesh_dim_names
            kinds = [f"Shard({pl.dim})" if hasattr(pl, "dim") else type(pl).__name__ for pl in p.placements]
            found[name] = (True, tuple(zip(dims, kinds, strict=True)), p.numel(), p.to_local().numel())
        else:
            found[name] = (False, (), p.numel(), p.numel())
    return found


def _summary_case(rank: int, world_size: int, dp: int) -> dict:
    loom = _new_loom(_parallelize, world_size, dp)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = loom.setup_module(Net())
    out = {"summary": torchloom.describe(model), "params": _placements(model.module)}
    # torchloom records the warnings of parallelize_fn to find skipped plan keys; the others reach the caller.
    out["warnings"] = [str(w.message) for w in caught]
    loom.close()
    return out


def _tp2_body(rank: int, world_size: int) -> dict:
    out = {"summary": _summary_case(rank, world_size, dp=1)}
    for name, fn in {
        "default mesh": _default_mesh,
        "tensor-parallel mesh": _tensor_parallel_mesh,
        "own mesh": _own_mesh,
        "unresolved key": _unresolved_key,
    }.items():
        out[name] = _failure(fn, world_size)
    # Activation checkpointing and compile on a sequence-parallel attention block: the order that torch 2.13
    # cannot run is explained; the order the docs recommend trains as the eager block does.
    loom = _new_loom(_checkpoint_then_compile, world_size)
    torch.manual_seed(0)
    model = loom.setup_module(Net(blocks=1))
    try:
        model(torch.zeros(2, SEQ, dtype=torch.long)).sum().backward()
        out["checkpoint then compile"] = None
    except Exception as error:
        out["checkpoint then compile"] = {
            "types": [c.__name__ for c in type(error).__mro__],
            "message": str(error),
            "cause": type(error.__cause__).__name__,
        }
    loom.close()
    out["eager losses"] = _losses(_sequence_parallel, world_size)
    out["compile then checkpoint losses"] = _losses(_compile_then_checkpoint, world_size)
    return out


def _section(summary: str, title: str) -> list[str]:
    """The indented lines under the summary line that starts with `title`."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(title))
    body = []
    for line in lines[start + 1 :]:
        if len(line) - len(line.lstrip()) <= 2:
            break
        body.append(line.strip())
    return body


def _check_summary(out: dict, mesh_text: str) -> None:
    summary, params = out["summary"], out["params"]
    assert f"mesh {mesh_text}" in summary, summary
    placed = _section(summary, "placements")
    distributed = {name: v for name, v in params.items() if v[0]}
    assert distributed, params
    for name, (_, placement, _, _) in distributed.items():
        generic = re.sub(r"\.\d+\.", ".*.", name)
        line = next((line for line in placed if line.startswith(generic + " ")), None)
        assert line is not None, (name, summary)
        for dim, kind in placement:
            assert f"{dim} {kind}" in line, (name, placement, line)
    # Tensor-parallel weights are never reported as replicated; the plain ones are, each by name.
    replicated = " ".join(_section(summary, "replicated on every rank"))
    for name, (is_dtensor, *_rest) in params.items():
        assert (name + " ") in replicated + " " or is_dtensor, (name, summary)
        assert not (is_dtensor and (name + " ") in replicated + " "), (name, summary)
    assert "parallelize_fn's own warning" in out["warnings"], out["warnings"]
    total = sum(v[2] for v in params.values())
    local = sum(v[3] for v in params.values())
    assert f"per rank: {local:,} of {total:,} parameter elements" in summary, (local, total, summary)


def test_tensor_parallel_summary_errors_and_compile_order():
    results = run_ranks(_tp2_body, 2, timeout=240)
    for rank, out in enumerate(results):
        # The summary at dp 1 x tp 2: the blocks' weights are placed on the tensor-parallel dim, outside every
        # unit, and counted per rank; embedding and head are the replicated ones.
        _check_summary(out["summary"], "tensor_parallel 2")
        assert "tensor-parallel outside all units" in out["summary"]["summary"]
        assert f"rank {rank}'s" in out["summary"]["summary"]

        # fully_shard(block) with its default mesh on a tensor-parallel block: torch's TypeError, explained.
        failure = out["default mesh"]
        assert failure is not None and {"MisuseError", "TypeError"} <= set(failure["types"]), failure
        assert "Invariant encountered" in failure["cause"], failure
        assert "fully_shard(blocks.0)" in failure["message"] and "default mesh" in failure["message"], failure
        assert "mesh=device_mesh['data_parallel']" in failure["message"], failure

        # fully_shard over the tensor-parallel dim the plan already split: torch's RuntimeError, explained.
        failure = out["tensor-parallel mesh"]
        assert failure is not None and {"MisuseError", "RuntimeError"} <= set(failure["types"]), failure
        assert "overlapping meshes" in failure["cause"], failure
        assert "fully_shard(blocks.0)" in failure["message"] and "overlap" in failure["message"], failure

        # A mesh made in parallelize_fn instead of sliced from the one it receives.
        failure = out["own mesh"]
        assert failure is not None and "MisuseError" in failure["types"], failure
        assert "fully_shard(blocks.0)" in failure["message"], failure
        assert "not sliced from the strategy's" in failure["message"], failure

        # Plan keys that resolve to nothing: torch only warns and skips them.
        failure = out["unresolved key"]
        assert failure is not None and {"MisuseError", "ValueError"} <= set(failure["types"]), failure
        for needle in (
            "'query'",
            "'blocks.0.attn'",
            "'lm_head'",
            "'<root>'",
            "children: embed, blocks, head",
        ):
            assert needle in failure["message"], (needle, failure["message"])

        failure = out["checkpoint then compile"]
        assert failure is not None and {"MisuseError", "AssertionError"} <= set(failure["types"]), failure
        assert failure["cause"] == "AssertionError", failure
        assert "'blocks.0'" in failure["message"], failure
        assert "checkpoint_wrapper(torch.compile(block))" in failure["message"], failure

        eager, compiled = out["eager losses"], out["compile then checkpoint losses"]
        assert eager[1] < eager[0], eager
        assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-5, (eager, compiled)


def test_two_dimensional_summary():
    results = run_ranks(_summary_case, 4, 2, timeout=180)
    for rank, out in enumerate(results):
        _check_summary(out, "data_parallel 2 x tensor_parallel 2")
        summary = out["summary"]
        assert "2 fully_shard unit(s)" in summary and "tensor-parallel outside" not in summary, summary
        for i in range(2):
            unit = {n: v for n, v in out["params"].items() if n.startswith(f"blocks.{i}.")}
            expected = (
                f"blocks.{i}: {len(unit)} parameters, {sum(v[2] for v in unit.values()):,} elements, "
                f"{sum(v[3] for v in unit.values()):,} per rank"
            )
            assert expected in summary, (expected, summary)
        assert f"rank {rank}'s" in summary
