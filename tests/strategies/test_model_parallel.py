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
CLIP_VALUE = 0.01


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


class Counting(torch.utils.data.IterableDataset):
    """0, 1, 2, ... from `start`, with its position as state (each data-parallel rank starts elsewhere)."""

    def __init__(self, start: int) -> None:
        self.position = start

    def __iter__(self):
        while True:
            self.position += 1
            yield self.position - 1

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def parallelize(model: Net, device_mesh, shard: bool = True, **unit_kwargs) -> Net:
    """Fabric-style: a tensor-parallel plan for attention and MLP, then (with `shard`) fully_shard per block."""
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
        if shard:
            fully_shard(block, **(unit_kwargs or {"mesh": device_mesh["data_parallel"]}))
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (STEPS, ACCUM, GLOBAL, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (STEPS, ACCUM, GLOBAL, SEQ), generator=g)
    return x, y


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1)) / ACCUM


def make_optimizer(params, kind: str = "adam") -> torch.optim.Optimizer:
    # SGD for the low-precision runs: Adam turns rounding noise in tiny gradients into full-size steps.
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def reference(
    autocast: torch.dtype | None = None, clip: str = "norm", scale: bool = False, optimizer: str = "adam"
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process on the whole global batch, with torch's own clip_grad_norm_ / clip_grad_value_ (and, with
    `scale`, torch's GradScaler)."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(model.parameters(), optimizer)
    scaler = torch.amp.GradScaler("cpu") if scale else None
    x, y = data()
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                logits = model(x[step, micro])
            loss = loss_of(logits, y[step, micro])
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norms


def initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Net().named_parameters()}


def full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.module.named_parameters()
    }


def _train(loom: Loom, model, opt, clip: str = "norm") -> list[float]:
    x, y = data()
    split = loom.strategy.distributed_sampler_kwargs
    per = GLOBAL // split["num_replicas"]
    rows = slice(split["rank"] * per, (split["rank"] + 1) * per)
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loom.backward(loss_of(model(x[step, micro, rows]), y[step, micro, rows]))
        if clip == "norm":
            norms.append(float(loom.clip_gradients(model, opt, max_norm=MAX_NORM)))
        else:
            loom.clip_gradients(model, opt, clip_val=CLIP_VALUE)
        opt.step()
        opt.zero_grad()
    return norms


def parallelize_tp_only(model: Net, device_mesh) -> Net:
    """Tensor parallel alone (no fully_shard): every block's layers are DTensors outside every unit."""
    return parallelize(model, device_mesh, shard=False)


def _launch(dp: int, tp: int, fn=parallelize, precision: str = "32-true", **kwargs) -> Loom:
    holder: list = []
    # The blocks' units get torchloom's configuration (mixed-precision policy, the data-parallel mesh).
    strategy = ModelParallelStrategy(
        lambda m, mesh: fn(m, mesh, **holder[0].unit_kwargs()) if fn is parallelize else fn(m, mesh),
        dp,
        tp,
        **kwargs,
    )
    holder.append(strategy)
    loom = Loom(strategy=strategy, accelerator="cpu", devices=4, precision=precision)
    loom.launch()
    return loom


def _inf_into_one_shard(model) -> None:
    from torch.distributed.tensor import DTensor

    for p in model.module.blocks.parameters():
        if isinstance(p.grad, DTensor) and p.grad.to_local().numel():
            p.grad.to_local().view(-1)[0] = float("inf")
            return


def _options_body(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    out: dict = {}
    # ---- meta-device init at dp 2 x tp 2: rank 0's values, as a real initialisation draws them --------------------
    loom = _launch(2, 2)
    torch.manual_seed(rank)
    with loom.init_module(empty_init=True):
        model = Net()
    out["meta_before"] = all(p.is_meta for p in model.parameters())
    model = loom.setup_module(model)
    out["meta_init"] = full_params(model)
    out["meta_left"] = any(p.is_meta for p in model.parameters())
    # ---- tensor parallel alone (dp 1 x tp 4) with clipping by value; TP layers outside every unit ---------------
    loom = _launch(1, 4, fn=parallelize_tp_only)
    torch.manual_seed(rank)
    with loom.init_module(empty_init=True):
        model = Net()
    model = loom.setup_module(model)
    out["tp_only_init"] = full_params(model)
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    _train(loom, model, opt, clip="value")
    out["tp_only"] = full_params(model)
    # ---- HSDP: replicate 2 x shard 2 (tp 1), the units on the (replicate, shard) sub-mesh ------------------------
    loom = _launch(4, 1, data_parallel_replicate_size=2)
    mesh = loom.strategy.device_mesh
    out["hsdp_mesh"] = (tuple(mesh.mesh_dim_names), tuple(mesh.shape), mesh["data_parallel"].size())
    torch.manual_seed(rank)
    model = loom.setup_module(Net())
    out["hsdp_placements"] = tuple(map(str, model.module.blocks[0].up.weight.placements))
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    out["hsdp_norms"] = _train(loom, model, opt)
    out["hsdp"] = full_params(model)
    # ---- HSDP with tensor parallel: replicate 2 x shard 1 x tp 2 ---------------------------------------------------
    loom = _launch(2, 2, data_parallel_replicate_size=2)
    torch.manual_seed(rank)
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    out["hsdp_tp_split"] = loom.strategy.distributed_sampler_kwargs
    out["hsdp_tp_norms"] = _train(loom, model, opt)
    out["hsdp_tp"] = full_params(model)
    # ---- bf16-mixed through FSDP2's MixedPrecisionPolicy (unit_kwargs) -------------------------------------------
    loom = _launch(2, 2, precision="bf16-mixed")
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    out["bf16_policy"] = str(model.module.blocks[0]._get_fsdp_state()._mp_policy.param_dtype)
    opt = loom.setup_optimizers(make_optimizer(model.parameters(), "sgd"))
    seen: list = []
    model.module.blocks[0].up.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
    out["bf16_norms"] = _train(loom, model, opt)
    out["bf16"] = full_params(model)
    out["bf16_seen"] = set(seen)
    out["bf16_master"] = {p.dtype for p in model.parameters()}

    # ---- a BatchNorm in parallelize_fn's bf16 unit: refused at setup (its first forward failed in torch) ---------
    def shard_all(model: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, **loom.strategy.unit_kwargs())
        return model

    loom = _launch(2, 2, fn=shard_all, precision="bf16-mixed")
    try:
        loom.setup_module(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
        out["bf16_batchnorm"] = "no error"
    except MisuseError as error:
        out["bf16_batchnorm"] = str(error)
    # ---- 16-mixed: torchloom's agreed scaler; parity, then an inf in one rank's shard skips the step everywhere -
    loom = _launch(2, 2, precision="16-mixed")
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(make_optimizer(model.parameters(), "sgd"))
    scaler = loom.strategy.precision.scaler
    out["fp16_scaler"] = type(scaler).__name__
    out["fp16_norms"] = _train(loom, model, opt)
    out["fp16"] = full_params(model)
    out["fp16_scale"] = scaler.get_scale()
    x, y = data()
    before = full_params(model)
    split = loom.strategy.distributed_sampler_kwargs["rank"]
    loom.backward(loss_of(model(x[0, 0, split * 2 : split * 2 + 2]), y[0, 0, split * 2 : split * 2 + 2]))
    if rank == 3:
        _inf_into_one_shard(model)
    opt.step()
    opt.zero_grad()
    out["fp16_after_inf_scale"] = scaler.get_scale()
    out["fp16_after_inf_unchanged"] = all(torch.equal(v, before[k]) for k, v in full_params(model).items())
    out["any_dtensor"] = any(isinstance(p, DTensor) for p in model.parameters())
    return out


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
    # ---- no_backward_sync defers the leftovers' all-reduce to the next synchronising backward ---------------------
    x, y = data()
    rows = slice(out["split"]["rank"] * 2, out["split"]["rank"] * 2 + 2)
    with loom.no_backward_sync(model):
        loom.backward(loss_of(model(x[0, 0, rows]), y[0, 0, rows]))
    out["unsynced_grad"] = model.module.head.weight.grad.clone()
    loom.backward(loss_of(model(x[0, 1, rows]), y[0, 1, rows]))
    out["synced_grad"] = model.module.head.weight.grad.clone()
    opt.zero_grad()
    # ---- the data is split over the data-parallel ranks only ----------------------------------------------------
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    loader = loom.setup_dataloaders(torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=True))
    out["batches"] = [batch[0].tolist() for batch in loader]
    # ---- an iterable dataset's position: one per data-parallel replica, and it loads back --------------------------
    dp_rank = out["split"]["rank"]
    stream = loom.setup_dataloaders(torch.utils.data.DataLoader(Counting(100 * dp_rank), batch_size=2))
    batches = iter(stream)
    out["stream_first"] = [next(batches).tolist() for _ in range(2)]
    state = stream.state_dict()
    out["stream_state"] = state
    again = loom.setup_dataloaders(torch.utils.data.DataLoader(Counting(-1), batch_size=2))
    again.load_state_dict(state)
    out["stream_resumed"] = next(iter(again)).tolist()
    # ---- a parallelize_fn that forgets to return the model --------------------------------------------------------
    try:
        ModelParallelStrategy(lambda m, mesh: None, 2, 2)  # constructing is fine; setup refuses
        bad = Loom(strategy=ModelParallelStrategy(lambda m, mesh: None, 2, 2), accelerator="cpu", devices=4)
        bad.launch()
        bad.setup_module(Net())
    except MisuseError as error:
        out["none_error"] = str(error)

    # ---- a parallelize_fn that shards over a mesh of its own ------------------------------------------------------
    def own_mesh(model, device_mesh):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.blocks[0], mesh=init_device_mesh("cpu", (4,)))
        return model

    try:
        _launch(2, 2, fn=own_mesh).setup_module(Net())
    except MisuseError as error:
        out["own_mesh_error"] = str(error)
    # ---- tensor-parallel layers outside every unit at dp > 1 --------------------------------------------------------
    try:
        _launch(2, 2, fn=parallelize_tp_only).setup_module(Net())
    except MisuseError as error:
        out["tp_outside_units_error"] = str(error)
    # ---- a loader saved at (dp 2, tp 2) resumes at (dp 4, tp 1): the same global batches -------------------------
    numbers = torch.utils.data.TensorDataset(torch.arange(24))
    uninterrupted = loom.setup_dataloaders(torch.utils.data.DataLoader(numbers, batch_size=2, shuffle=True))
    out["uninterrupted"] = [batch[0].tolist() for batch in uninterrupted]
    saved = loom.setup_dataloaders(torch.utils.data.DataLoader(numbers, batch_size=2, shuffle=True))
    batches = iter(saved)
    for _ in range(2):
        next(batches)
    state = saved.state_dict()
    wider = _launch(4, 1)  # twice the data-parallel ranks, half the per-rank batch: the same global batch
    resumed = wider.setup_dataloaders(torch.utils.data.DataLoader(numbers, batch_size=1, shuffle=True))
    resumed.load_state_dict(state)
    out["resumed"] = [batch[0].tolist() for batch in resumed]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 4, timeout=300)


def test_mesh_has_fabrics_dim_names_and_sizes(results):
    for result in results:
        assert result["mesh"] == (("data_parallel", "tensor_parallel"), (2, 2))
    # Ranks 0, 1 form one tensor-parallel group (data-parallel rank 0), ranks 2, 3 the other.
    assert [r["split"] for r in results] == [{"num_replicas": 2, "rank": r // 2} for r in range(4)]


def _assert_fp32_parity(params: dict, norms: list, expected: dict, expected_norms: list, rank: int) -> None:
    assert set(params) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), atol=1e-5, rtol=1e-5)


def test_parity_with_one_process_with_accumulation_and_clipping(results):
    expected, expected_norms = reference()
    assert max(expected_norms) > MAX_NORM  # clipping did act
    for rank, result in enumerate(results):
        # The norm before clipping is the global one, over 2-D DTensors and plain leftovers alike.
        _assert_fp32_parity(result["params"], result["norms"], expected, expected_norms, rank)


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


def test_a_loader_resumes_at_another_data_parallel_degree(results):
    # Saved after 2 global batches of 4 at (dp 2, tp 2); resumed at (dp 4, tp 1) with a per-rank batch of 1.
    steps = len(results[0]["uninterrupted"])
    assert (
        steps == 6 and results[1]["uninterrupted"] == results[0]["uninterrupted"]
    )  # one tp group, one batch
    expected = [
        sorted(results[0]["uninterrupted"][s] + results[2]["uninterrupted"][s]) for s in range(2, steps)
    ]
    got = [sorted(sum((results[r]["resumed"][s] for r in range(4)), [])) for s in range(steps - 2)]
    assert got == expected


def test_iterable_dataset_position_is_one_per_data_parallel_replica(results):
    for rank, result in enumerate(results):
        dp_rank = rank // 2
        assert result["stream_first"] == [[100 * dp_rank + i, 100 * dp_rank + i + 1] for i in (0, 2)]
        state = result["stream_state"]
        assert state["world_size"] == 2  # the replicas, not the 4 ranks
        assert [p["position"] for p in state["iterable_dataset_ranks"]] == [4, 104]
        # Loaded back at the same layout, each rank continues its own replica's stream.
        assert result["stream_resumed"] == [100 * dp_rank + 4, 100 * dp_rank + 5]


def test_parallelize_fn_returning_nothing_is_refused(results):
    for result in results:
        assert "returned NoneType, not the model" in result["none_error"]
        assert "return model" in result["none_error"]


def test_no_backward_sync_defers_the_leftovers_all_reduce(results):
    unsynced = [r["unsynced_grad"] for r in results]
    # Inside: each data-parallel rank keeps its own gradient (the tensor-parallel pair computes the same one)...
    assert torch.allclose(unsynced[0], unsynced[1]) and torch.allclose(unsynced[2], unsynced[3])
    assert not torch.allclose(unsynced[0], unsynced[2])
    # ...and the next synchronising backward averages the accumulated sum over every rank.
    for result in results[1:]:
        assert torch.equal(result["synced_grad"], results[0]["synced_grad"])


def test_meshes_other_than_the_strategys_are_refused(results):
    for result in results:
        assert "not the strategy's" in result["own_mesh_error"]
        assert "device_mesh['data_parallel'] for fully_shard" in result["own_mesh_error"]
        error = result["tp_outside_units_error"]
        assert "blocks.0.attn.q.weight" in error and "outside every fully_shard unit" in error
        assert "data_parallel_size=2" in error


def test_desync_report_places_ranks_on_the_mesh(monkeypatch):
    from torchloom.diagnostics import RECORD
    from torchloom.diagnostics.report import _report

    monkeypatch.setattr(RECORD, "mesh", (("data_parallel", "tensor_parallel"), (2, 2)))
    answer = {
        "pid": 1,
        "inside": True,
        "name": "all_reduce",
        "seq": 3,
        "shapes": "",
        "detail": "",
        "stack": [],
    }
    answer.update(file="/x/train.py", line=10, function="main")
    report = _report({r: dict(answer) for r in range(4)}, {}, 4, 0, "timeout", "culprit: ?")
    assert "device mesh: data_parallel 2 x tensor_parallel 2" in report
    assert "rank 2 [data_parallel 1, tensor_parallel 0] (pid 1): in" in report
    assert "rank 1 [data_parallel 0, tensor_parallel 1]" in report


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


@pytest.fixture(scope="module")
def options():
    return run_ranks(_options_body, 4, timeout=400)


def _largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_meta_init_gives_rank_0s_values_as_a_real_init(options):
    expected = initial()
    for rank, result in enumerate(options):
        assert result["meta_before"] and not result["meta_left"]
        for key in ("meta_init", "tp_only_init"):
            for name, value in expected.items():
                torch.testing.assert_close(
                    result[key][name], value, atol=0, rtol=0, msg=f"{key} {rank} {name}"
                )


def test_tensor_parallel_alone_with_clipping_by_value(options):
    expected, _ = reference(clip="value")
    moved = _largest_gap(expected, initial())
    assert moved > 0.01, moved
    for rank, result in enumerate(options):
        _assert_fp32_parity(result["tp_only"], [], expected, [], rank)


def test_hsdp_replicate_times_shard_parity(options):
    expected, norms = reference()
    for rank, result in enumerate(options):
        assert result["hsdp_mesh"] == (
            ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel"),
            (2, 2, 1),
            4,
        )
        # (replicate, shard, tensor_parallel): replicated over the first dim, sharded over the others.
        assert result["hsdp_placements"] == ("R", "S(0)", "S(0)")
        _assert_fp32_parity(result["hsdp"], result["hsdp_norms"], expected, norms, rank)


def test_hsdp_with_tensor_parallel_parity(options):
    expected, norms = reference()
    for rank, result in enumerate(options):
        assert result["hsdp_tp_split"] == {"num_replicas": 2, "rank": rank // 2}
        _assert_fp32_parity(result["hsdp_tp"], result["hsdp_tp_norms"], expected, norms, rank)


def test_bf16_mixed_through_fsdp2_mixed_precision_policy(options):
    expected, norms = reference(autocast=torch.bfloat16, optimizer="sgd")
    moved = _largest_gap(expected, initial())
    assert moved > 0.1, moved
    for rank, result in enumerate(options):
        assert result["bf16_policy"] == "torch.bfloat16"
        # The units computed with bf16 weights (the policy's cast, not just autocast) over fp32 master weights.
        assert result["bf16_seen"] == {(torch.bfloat16, torch.bfloat16)}
        assert result["bf16_master"] == {torch.float32}
        # bf16 rounds differently in the units (whole parameters cast) than autocast does (matmul inputs): the
        # gap is judged against how far training moved the weights (measured: 0.5% of it).
        gap = _largest_gap(result["bf16"], expected)
        assert gap < 0.02 * moved, (rank, gap, moved)
        assert result["bf16_norms"] == pytest.approx(norms, rel=0.01)


def test_batchnorm_in_a_bf16_unit_of_parallelize_fn_is_refused(options):
    for result in options:
        message = result["bf16_batchnorm"]
        assert message.startswith("The BatchNorm '1' sits in the FSDP unit '<root>'"), message
        assert (
            "fully_shard(bn, **{**loom.strategy.unit_kwargs(), 'mp_policy': MixedPrecisionPolicy()})"
            in message
        )


def test_fp16_mixed_with_the_agreed_scaler(options):
    expected, norms = reference(autocast=torch.float16, scale=True, optimizer="sgd")
    moved = _largest_gap(expected, initial())
    for rank, result in enumerate(options):
        assert result["fp16_scaler"] == "AgreedGradScaler"
        assert result["fp16_scale"] == 2.0**16  # no step skipped in the parity run
        gap = _largest_gap(result["fp16"], expected)
        assert gap < 1e-2 * moved, (rank, gap, moved)
        assert result["fp16_norms"] == pytest.approx(norms, rel=1e-2)
        # An inf in rank 3's shard alone: every rank skips the step and halves the scale.
        assert result["fp16_after_inf_scale"] == 2.0**15, rank
        assert result["fp16_after_inf_unchanged"], rank
