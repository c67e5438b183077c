"""One owner of gradient norms and clipping (`strategies/_clipping.py`), judged against one process on the same
global batch with torch's own `clip_grad_norm_` / `clip_grad_value_`, in one launched group of 4 CPU ranks:

- the norm (2 and inf) from every strategy: `ddp`, `fsdp`, `fsdp2`, `ModelParallelStrategy` (dp 2 x tp 2, with
  sequence-parallel norms) and `PipelineStrategy` (pp 2 x tp 2, with sequence-parallel norms inside each stage:
  issue 44's item 3, where the pipeline's own norm summed the squared local pieces of `Partial` gradients and
  came out 15% low); one process (`single_device`) in the test process;
- under the pipeline, the gradients after clipping by norm and then by value, gathered whole from the stages;
- the contract for copies of a tied weight on several ranks (`_torchloom_counted_elsewhere`): skipped by the norm,
  scaled and clamped all the same; and a rank holding no gradient still meets the others' collectives.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from test_clipping_tp import VOCAB, Net, sequence_parallel
from torch import nn

from torchloom import Loom
from torchloom.precision import Precision
from torchloom.strategies import ModelParallelStrategy, PipelineStrategy
from torchloom.strategies._clipping import COUNTED_ELSEWHERE, NormGroups, clip_by_norm, clip_by_value

WORLD, GLOBAL, SEQ = 4, 8, 4
MAX_NORM, CLIP_VALUE = 0.05, 0.004  # below the norm and the largest gradient element: both clip
STRATEGIES = ("ddp", "fsdp", "fsdp2", "model_parallel", "pipeline")


class Stage(nn.Module):
    """The split_fn for `Net` at 2 stages: the model's own modules, at their paths in the model."""

    def __init__(self, model: Net, index: int, num_stages: int) -> None:
        super().__init__()
        last = index == num_stages - 1
        self.embed = model.embed if index == 0 else None
        self.blocks = nn.ModuleDict({str(index): model.blocks[index]})
        self.norm, self.head = (model.norm, model.head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g), torch.randint(
        0, VOCAB, (GLOBAL, SEQ), generator=g
    )


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def reference() -> dict:
    """One process on the global batch: the norms (inf, then 2) and the gradients after clipping by norm 2, then
    by value."""
    torch.manual_seed(0)
    model = Net()
    x, y = data()
    loss_fn(model(x), y).backward()
    norm_inf = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, math.inf))
    norm_2 = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"inf": norm_inf, "2": norm_2, "grads": grads}


def _model_parallel(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    sequence_parallel(model, device_mesh)
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _strategy(name: str):
    if name == "model_parallel":
        return ModelParallelStrategy(_model_parallel, data_parallel_size=2, tensor_parallel_size=2)
    if name == "pipeline":
        return PipelineStrategy(
            sequence_parallel,
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
            split_fn=Stage,
            n_microbatches=2,
        )
    return name


def _clip(loom: Loom, gather: bool = False) -> dict:
    """The user's step up to the optimizer: forward and backward of this rank's rows of the global batch, then
    the norms (inf without clipping, then 2, clipping) and the clamp; with `gather`, this rank's clipped
    gradients, as whole tensors."""
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    split = loom.strategy.distributed_sampler_kwargs
    per = GLOBAL // split["num_replicas"]
    rows = slice(split["rank"] * per, (split["rank"] + 1) * per)
    x, y = data()
    loom.forward_backward(model, x[rows], y[rows], loss_fn)
    out = {
        "inf": float(loom.clip_gradients(model, opt, max_norm=1e9, norm_type=math.inf)),
        "2": float(loom.clip_gradients(model, opt, max_norm=MAX_NORM)),
    }
    loom.clip_gradients(model, opt, clip_val=CLIP_VALUE)
    out["grads"] = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for n, p in model.module.named_parameters()
        if gather and p.grad is not None
    }
    return out


def _counted_elsewhere(rank: int, precision: Precision) -> dict:
    """Megatron's tied weight across 4 ranks (standing for pipeline stages): every rank holds a copy `tied` whose
    gradient is the same everywhere (already summed), counted on rank 0 only; each rank also holds a weight of
    its own, whose gradient rank 3 does not have. The norm counts the copy once; every copy is scaled and
    clamped, so the copies stay equal."""
    tied = nn.Parameter(torch.zeros(3))
    tied.grad = torch.tensor([0.3, -0.4, 0.0])
    own = nn.Parameter(torch.zeros(2))
    own.grad = None if rank == 3 else torch.full((2,), 0.1 * (rank + 1))
    if rank:
        setattr(tied, COUNTED_ELSEWHERE, True)
    opt = torch.optim.SGD([tied, own], lr=1.0)
    groups = NormGroups(across=(dist.group.WORLD,))
    out = {
        "inf": float(clip_by_norm(precision, opt, 1e9, math.inf, True, torch.device("cpu"), groups)),
        "2": float(clip_by_norm(precision, opt, 0.25, 2.0, True, torch.device("cpu"), groups)),
        "tied_scaled": tied.grad.clone(),
    }
    clip_by_value(precision, opt, 0.1)
    out["tied_clamped"] = tied.grad.clone()
    return out


def _body(rank: int, world: int) -> dict:
    out: dict = {}
    for name in STRATEGIES:
        loom = Loom(strategy=_strategy(name), accelerator="cpu", devices=world)
        loom.launch()
        out[name] = _clip(loom, gather=name == "pipeline")
    out["counted_elsewhere"] = _counted_elsewhere(rank, loom.strategy.precision)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_body, WORLD, timeout=300)


@pytest.fixture(scope="module")
def expected() -> dict:
    return reference()


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_gives_one_process_norm(results, expected, name) -> None:
    assert expected["2"] > MAX_NORM
    for rank, r in enumerate(results):
        for norm_type in ("inf", "2"):
            assert r[name][norm_type] == pytest.approx(expected[norm_type], abs=1e-5, rel=1e-5), (
                rank,
                norm_type,
            )


def test_single_device_gives_one_process_norm(expected) -> None:
    loom = Loom(accelerator="cpu", devices=1)
    got = _clip(loom)
    for norm_type in ("inf", "2"):
        assert got[norm_type] == pytest.approx(expected[norm_type], abs=1e-5, rel=1e-5)


def test_pipeline_with_sequence_parallel_norms_clips_like_one_process(results, expected) -> None:
    """Issue 44, item 3: pp 2 x tp 2, `SequenceParallel` norms inside the stages, whose gradients reach the clip
    as `Partial` sums. The old pipeline norm read 0.066760 against one process's 0.078210; the clamp then cut
    each addend instead of their sum."""
    for rank, r in enumerate(results):
        assert r["pipeline"]["2"] == pytest.approx(expected["2"], abs=1e-5, rel=1e-5), rank
        assert r["pipeline"]["2"] == pytest.approx(r["model_parallel"]["2"], abs=1e-5, rel=1e-5), rank
    merged: dict = {}
    for r in results:
        merged.update(r["pipeline"]["grads"])
    assert merged.keys() == expected["grads"].keys()
    assert any(bool((g.abs() == CLIP_VALUE).any()) for g in expected["grads"].values())  # the clamp acts
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(merged[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_copy_counted_elsewhere_is_skipped_by_the_norm_and_scaled_like_the_others(results) -> None:
    tied, own = [0.3, -0.4, 0.0], [0.1, 0.2, 0.3]  # rank 3 holds no gradient of its own
    norm_2 = math.sqrt(sum(v * v for v in tied) + sum(2 * v * v for v in own))
    coef = 0.25 / (norm_2 + 1e-6)
    for rank, r in enumerate(results):
        got = r["counted_elsewhere"]
        assert got["inf"] == pytest.approx(0.4, abs=1e-6), rank  # the copy's largest element, counted once
        assert got["2"] == pytest.approx(norm_2, abs=1e-6), rank
        scaled = torch.tensor(tied) * coef
        torch.testing.assert_close(got["tied_scaled"], scaled, msg=f"rank {rank}")
        torch.testing.assert_close(got["tied_clamped"], scaled.clamp(-0.1, 0.1), msg=f"rank {rank}")


def test_counted_elsewhere_on_one_process() -> None:
    """Without any group (one process), the flag still takes the copy out of the norm, not out of the clip."""
    precision = Precision("32-true", "cpu")
    copy, other = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    copy.grad, other.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])
    setattr(copy, COUNTED_ELSEWHERE, True)
    opt = torch.optim.SGD([copy, other], lr=1.0)
    assert float(clip_by_norm(precision, opt, 2.5, 2.0, True, torch.device("cpu"), NormGroups())) == 5.0
    torch.testing.assert_close(copy.grad, torch.tensor([1.5, 2.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(other.grad, torch.tensor([0.0, 2.5]), atol=1e-6, rtol=0)
