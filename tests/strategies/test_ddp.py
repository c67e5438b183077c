"""DDP on 2 CPU ranks trains to the same parameters as one plain-torch process on the concatenated global batch.

Every check here shares one launch of 2 ranks (a launch costs seconds on 2 cores): the rank body trains in
fp32 with SGD+momentum and with Adam, in bf16-mixed, and probes `no_backward_sync` and `clip_val`; the tests
below compare what each rank returns against references computed in this process with plain torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from torchloom import Loom

WORLD = 2
STEPS = 6
MICRO = 2  # micro-batches per optimizer step (gradient accumulation)
MICRO_BATCH = 4  # samples per rank per micro-batch
LOCAL = MICRO * MICRO_BATCH  # samples per rank per step
GLOBAL = WORLD * LOCAL  # samples per step over all ranks
MAX_NORM = 0.1  # below every step's true gradient norm, so clipping acts on each step (asserted below)
CLIP_VAL = 0.02  # below the largest gradient entry (asserted below)
OPTIMIZERS = ("sgd", "adam")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS global batches of GLOBAL samples each."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS, GLOBAL, 6, generator=g)
    w = torch.randn(6, 3, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(STEPS, GLOBAL, 3, generator=g)
    return x, y


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's slice of a global batch."""
    return t[rank * LOCAL : (rank + 1) * LOCAL]


def _micro(t: torch.Tensor, m: int) -> torch.Tensor:
    return t[m * MICRO_BATCH : (m + 1) * MICRO_BATCH]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


# ---- what runs on each rank ----------------------------------------------------------------------------------
def _train_on_rank(loom: Loom, opt_name: str) -> dict:
    """The training loop a user writes: accumulate MICRO micro-batches per step, clip, step."""
    x, y = _data()
    model = _mlp()
    model, opt = loom.setup(model, _optimizer(opt_name, model.parameters()))
    norms = []
    for step in range(STEPS):
        xs, ys = _local(x[step], loom.global_rank), _local(y[step], loom.global_rank)
        for m in range(MICRO):
            is_accumulating = m < MICRO - 1
            with loom.no_backward_sync(model, enabled=is_accumulating):
                # The local mean over this rank's samples; DDP's average over ranks makes it the global mean.
                loss = F.mse_loss(model(_micro(xs, m)), _micro(ys, m)) / MICRO
                loom.backward(loss)
        norms.append(float(loom.clip_gradients(model, opt, max_norm=MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {"params": _params(model), "norms": norms}


def _probe_sync(loom: Loom) -> dict:
    """Gradients inside and outside `no_backward_sync`, and clipping by value."""
    x, y = _data()
    xs, ys = _local(x[0], loom.global_rank), _local(y[0], loom.global_rank)
    torch.manual_seed(100 + loom.global_rank)  # a different init on each rank: DDP must start from rank 0's
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    model = loom.setup_module(model)
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    out = {"init": _params(model)}
    with loom.no_backward_sync(model):
        loom.backward(F.mse_loss(model(_micro(xs, 0)), _micro(ys, 0)))
    out["inside"] = _grads(model)
    loom.backward(F.mse_loss(model(_micro(xs, 1)), _micro(ys, 1)))
    out["after"] = _grads(model)
    assert loom.clip_gradients(model, opt, clip_val=CLIP_VAL) is None
    out["clipped"] = _grads(model)
    opt.zero_grad()
    with loom.no_backward_sync(model, enabled=False):
        loom.backward(F.mse_loss(model(_micro(xs, 0)), _micro(ys, 0)))
    out["disabled"] = _grads(model)
    return out


def _rank_body(rank: int, world_size: int) -> dict:
    loom = Loom(accelerator="cpu", devices=world_size, strategy="ddp")
    loom.launch()
    assert (loom.global_rank, loom.world_size) == (rank, world_size)
    out = {opt_name: _train_on_rank(loom, opt_name) for opt_name in OPTIMIZERS}
    out["probe"] = _probe_sync(loom)
    # A second Loom in the same process joins the existing process group; only the precision differs.
    bf16 = Loom(accelerator="cpu", devices=world_size, strategy="ddp", precision="bf16-mixed")
    bf16.launch()
    out["bf16-mixed"] = _train_on_rank(bf16, "sgd")
    model = bf16.setup_module(_mlp())
    x = _local(_data()[0][0], rank)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_out = model.module(x)
        out["bf16-forward"] = {"loom": model(x), "autocast": autocast_out, "fp32": model.module(x)}
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_rank_body, WORLD, timeout=150)


# ---- the plain-torch reference: one process, the whole global batch, one backward per step -------------------
def _reference(opt_name: str, autocast: bool = False) -> dict:
    x, y = _data()
    model = _mlp()
    opt = _optimizer(opt_name, model.parameters())
    norms = []
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x[step])
        F.mse_loss(out.float(), y[step]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {"params": _params(model), "norms": norms}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _assert_ranks_identical(ranks: list[dict], key: str) -> None:
    for name, tensor in ranks[0][key]["params"].items():
        for r in range(1, WORLD):
            assert torch.equal(tensor, ranks[r][key]["params"][name]), (
                f"rank {r} differs from rank 0 in {name}"
            )


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_fp32_parity_with_single_process(ranks, opt_name):
    ref = _reference(opt_name)
    assert all(n > MAX_NORM for n in ref["norms"]), (
        "MAX_NORM must be below every norm so clipping is exercised"
    )
    _assert_ranks_identical(ranks, opt_name)
    for r in range(WORLD):
        assert ranks[r][opt_name]["norms"] == pytest.approx(ref["norms"], rel=1e-5, abs=1e-6)
        assert _max_diff(ranks[r][opt_name]["params"], ref["params"]) < 1e-5
    # The comparison has teeth: training moved the parameters far more than the tolerance.
    assert _max_diff(ref["params"], _params(_mlp())) > 1e-2


def test_bf16_mixed_parity_with_autocast_reference(ranks):
    ref = _reference("sgd", autocast=True)
    ref_fp32 = _reference("sgd")
    got = ranks[0]["bf16-mixed"]
    _assert_ranks_identical(ranks, "bf16-mixed")
    # Tolerance: under autocast the matmuls round their outputs to bf16 (8-bit mantissa, relative error up to
    # 2**-9 per rounding). The reference multiplies the whole batch of 16 at once while each rank multiplies
    # micro-batches of 4 and sums gradients in fp32 across micro-batches and ranks, so values are rounded at
    # different points. Each step's update is then off by about that relative error, and the errors of
    # different steps do not add up coherently, so the final parameters may differ by a small fraction of how far
    # training moved them. We allow 1% of that movement (about 2.5 * 2**-8); fp32 parity is held to 1e-5 above.
    movement = _max_diff(ref["params"], _params(_mlp()))
    diff = _max_diff(got["params"], ref["params"])
    assert diff < 0.01 * movement, (diff, movement)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-2)
    # That tolerance alone cannot tell bf16 from fp32 training (they differ by ~1e-4 here), so check that
    # autocast really ran: training left fp32 parity, and the forward equals plain torch autocast exactly.
    assert _max_diff(got["params"], ref_fp32["params"]) > 1e-5
    for r in range(WORLD):
        fwd = ranks[r]["bf16-forward"]
        assert fwd["loom"].dtype == torch.float32  # outputs come back in fp32 for the loss
        assert fwd["autocast"].dtype == torch.bfloat16
        assert torch.equal(fwd["loom"], fwd["autocast"].float())
        assert (fwd["loom"] - fwd["fp32"]).abs().max() > 1e-4


def _local_grads(rank: int, micro: int) -> dict[str, torch.Tensor]:
    """Plain-torch gradient of one rank's micro-batch, starting from rank 0's initial weights."""
    x, y = _data()
    torch.manual_seed(100)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    xs, ys = _local(x[0], rank), _local(y[0], rank)
    F.mse_loss(model(_micro(xs, micro)), _micro(ys, micro)).backward()
    return _grads(model)


def _mean(dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}


def _add(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: a[k] + b[k] for k in a}


def test_no_backward_sync_skips_then_syncs(ranks):
    probes = [ranks[r]["probe"] for r in range(WORLD)]
    micro0 = [_local_grads(r, 0) for r in range(WORLD)]
    micro1 = [_local_grads(r, 1) for r in range(WORLD)]
    # setup_module started every rank from rank 0's weights, although each rank built its own.
    torch.manual_seed(100)
    rank0_init = _params(
        nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    )
    for r in range(WORLD):
        assert _max_diff(probes[r]["init"], rank0_init) == 0
    # Inside no_backward_sync: each rank holds only its own gradient, and the ranks differ.
    for r in range(WORLD):
        assert _max_diff(probes[r]["inside"], micro0[r]) < 1e-6
    assert _max_diff(probes[0]["inside"], probes[1]["inside"]) > 1e-3
    # The next backward outside syncs everything accumulated: the average over ranks of both micro-batches.
    expected = _mean([_add(micro0[r], micro1[r]) for r in range(WORLD)])
    for r in range(WORLD):
        assert _max_diff(probes[r]["after"], expected) < 1e-6
    # enabled=False syncs as usual.
    for r in range(WORLD):
        assert _max_diff(probes[r]["disabled"], _mean(micro0)) < 1e-6


def test_clip_val_clamps_synced_gradients(ranks):
    probes = [ranks[r]["probe"] for r in range(WORLD)]
    largest = max(g.abs().max().item() for g in probes[0]["after"].values())
    assert largest > CLIP_VAL, "CLIP_VAL must be below the largest gradient so clipping is exercised"
    expected = {k: g.clamp(-CLIP_VAL, CLIP_VAL) for k, g in probes[0]["after"].items()}
    for r in range(WORLD):
        assert _max_diff(probes[r]["clipped"], expected) == 0
