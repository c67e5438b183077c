"""ModelParallelStrategy (tensor parallel + FSDP2 on a named 2-D mesh) on 4 CPU ranks (gloo): parity with one
process on the global batch, replicated leftovers, the data split over the data-parallel ranks only, the global
gradient norm, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.errors import ConfigurationError, MisuseError
from torchloom.strategies import ModelParallelStrategy

VOCAB, DIM, HEADS, SEQ = 16, 8, 4, 3
STEPS, ACCUM, GLOBAL = 3, 2, 4  # global micro-batch of 4 sequences: 2 per data-parallel rank at dp=2
MAX_NORM = 0.5


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        # No key bias: it shifts every score of a query equally, so its gradient is rounding noise, which Adam
        # would turn into full-size steps of arbitrary sign.
        self.k = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = DIM // HEADS
        # Under tensor parallelism each rank holds some of the heads: their count comes from the local width.
        q, k, v = (proj(x).view(b, t, -1, hd).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.up, self.gate = nn.Linear(DIM, 2 * DIM), nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(F.gelu(self.up(x)) * self.gate(x))


class Net(nn.Module):
    """Tensor-parallel blocks between plain (replicated) embedding, norm and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parallelize(model: Net, device_mesh, **unit_kwargs) -> Net:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "up": ColwiseParallel(),
        "gate": ColwiseParallel(),
        "down": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, device_mesh["tensor_parallel"], plan)
        fully_shard(block, **(unit_kwargs or {"mesh": device_mesh["data_parallel"]}))
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (STEPS, ACCUM, GLOBAL, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (STEPS, ACCUM, GLOBAL, SEQ), generator=g)
    return x, y


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1)) / ACCUM


def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process on the whole global batch, with torch's own clip_grad_norm_."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = data()
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            loss_of(model(x[step, micro]), y[step, micro]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norms


def full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.module.named_parameters()
    }


def _train(loom: Loom, model, opt) -> list[float]:
    x, y = data()
    split = loom.strategy.distributed_sampler_kwargs
    per = GLOBAL // split["num_replicas"]
    rows = slice(split["rank"] * per, (split["rank"] + 1) * per)
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loom.backward(loss_of(model(x[step, micro, rows]), y[step, micro, rows]))
        norms.append(float(loom.clip_gradients(model, opt, max_norm=MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return norms


def _body(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    out: dict = {}
    # ---- parity at dp 2 x tp 2, with accumulation and clipping --------------------------------------------------
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2)
    loom = Loom(strategy=strategy, accelerator="cpu", devices=world_size)
    loom.launch()
    mesh = strategy.device_mesh
    out["mesh"] = (tuple(mesh.mesh_dim_names), tuple(mesh.shape))
    out["split"] = strategy.distributed_sampler_kwargs
    torch.manual_seed(rank)  # different per rank: setup must start every rank from rank 0's model
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    out["placements"] = {
        n: tuple(map(str, p.placements)) for n, p in model.module.named_parameters() if isinstance(p, DTensor)
    }
    out["norms"] = _train(loom, model, opt)
    out["params"] = full_params(model)
    out["leftovers"] = {
        n: p.detach().clone() for n, p in model.module.named_parameters() if not isinstance(p, DTensor)
    }
    # ---- the data is split over the data-parallel ranks only ----------------------------------------------------
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    loader = loom.setup_dataloaders(torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=True))
    out["batches"] = [batch[0].tolist() for batch in loader]
    # ---- a parallelize_fn that forgets to return the model --------------------------------------------------------
    try:
        ModelParallelStrategy(lambda m, mesh: None, 2, 2)  # constructing is fine; setup refuses
        bad = Loom(strategy=ModelParallelStrategy(lambda m, mesh: None, 2, 2), accelerator="cpu", devices=4)
        bad.launch()
        bad.setup_module(Net())
    except MisuseError as error:
        out["none_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 4, timeout=300)


def test_mesh_has_fabrics_dim_names_and_sizes(results):
    for result in results:
        assert result["mesh"] == (("data_parallel", "tensor_parallel"), (2, 2))
    # Ranks 0, 1 form one tensor-parallel group (data-parallel rank 0), ranks 2, 3 the other.
    assert [r["split"] for r in results] == [{"num_replicas": 2, "rank": r // 2} for r in range(4)]


def test_parity_with_one_process_with_accumulation_and_clipping(results):
    expected, expected_norms = reference()
    assert max(expected_norms) > MAX_NORM  # clipping did act
    for rank, result in enumerate(results):
        assert set(result["params"]) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(
                result["params"][name], value, atol=1e-5, rtol=1e-5, msg=f"{rank} {name}"
            )
        # The norm before clipping is the global one, over 2-D DTensors and plain leftovers alike.
        torch.testing.assert_close(
            torch.tensor(result["norms"]), torch.tensor(expected_norms), atol=1e-5, rtol=1e-5
        )


def test_blocks_are_2d_dtensors_and_leftovers_stay_plain_and_identical(results):
    placements = results[0]["placements"]
    # (data_parallel, tensor_parallel): fully_shard splits dim 0 again over the tensor-parallel rows (strided)
    # or columns; a row-parallel bias is replicated over tensor_parallel.
    assert placements["blocks.0.attn.q.weight"] == ("_S(0, 2)", "S(0)")
    assert placements["blocks.0.down.weight"] == ("S(0)", "S(1)")
    assert placements["blocks.0.down.bias"] == ("S(0)", "R")
    leftovers = results[0]["leftovers"]
    assert set(leftovers) == {"embed.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    for result in results[1:]:
        for name, value in leftovers.items():
            assert torch.equal(result["leftovers"][name], value), name


def test_data_split_over_data_parallel_ranks_only(results):
    batches = [r["batches"] for r in results]
    assert batches[0] == batches[1] and batches[2] == batches[3]  # one tensor-parallel group: the same batch
    seen = sorted(i for b in batches[0] + batches[2] for i in b)
    assert seen == list(range(16))  # the two data-parallel ranks: every sample once


def test_parallelize_fn_returning_nothing_is_refused(results):
    for result in results:
        assert "returned NoneType, not the model" in result["none_error"]
        assert "return model" in result["none_error"]


@pytest.mark.parametrize(
    ("dp", "tp", "expected"),
    [(3, 2, "3 x 2 = 6 ranks, but this job has 4 processes"), (2, 4, "2 x 4 = 8 ranks")],
)
def test_sizes_not_multiplying_to_the_world_size_are_refused(dp, tp, expected):
    with pytest.raises(ConfigurationError, match="must equal the world size") as info:
        Loom(strategy=ModelParallelStrategy(parallelize, dp, tp), accelerator="cpu", devices=4)
    assert expected in str(info.value)


def test_auto_sizes_follow_fabric():
    strategy = ModelParallelStrategy(parallelize)
    Loom(strategy=strategy, accelerator="cpu", devices=4)
    assert (strategy.data_parallel_size, strategy.tensor_parallel_size) == (1, 4)


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigurationError, match="parallelize_fn must be a function"):
        ModelParallelStrategy(None)
    with pytest.raises(ConfigurationError, match="tensor_parallel_size must be a positive int or 'auto'"):
        ModelParallelStrategy(parallelize, 2, 0)
    with pytest.raises(ConfigurationError, match="must divide data_parallel_size=2"):
        Loom(
            strategy=ModelParallelStrategy(parallelize, 2, 2, data_parallel_replicate_size=3),
            accelerator="cpu",
            devices=4,
        )
