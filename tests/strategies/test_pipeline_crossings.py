"""PipelineStrategy where it crosses the older features (issue 44), each against one process on the global batch
(fp32, 1e-5) or the uninterrupted run, in one 4-rank group: a GPT-style model (a position embedding over
`torch.arange(..., device=idx.device)`, LayerNorms) built under `init_module(empty_init=True)` and traced at pp 2 x
dp 2; frozen parameters under AdamW with weight decay at pp 2 x dp 2, resumed from a sharded checkpoint; an
optimizer without state (SGD) resumed from a full-format checkpoint; BatchNorm at pp 4 with one micro-batch, its
running statistics after each step and after each switch between training and evaluation."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.errors import MisuseError
from torchloom.strategies import PipelineStrategy

VOCAB, SEQ, DIM, LAYERS = 11, 6, 8, 4
STEPS, GLOBAL, MICRO = 3, 8, 2
TOL = 1e-5
FROZEN = ("pos.weight", "layers.3.fc.bias")  # one on each stage


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(self.ln(x)))


class GPT(nn.Module):
    """Token and position embeddings, the positions built in the forward (as GPT-2's and nanoGPT's are)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class ConstGPT(GPT):
    """Tensors the checkpoint must not hold: a constant the forward builds (the tracer lifts it into a buffer) and
    a non-persistent buffer in each block (as a rotary cache is)."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.register_buffer("gain", torch.full((DIM,), 0.5), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) * torch.tensor([2.0]) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            h = layer(h) * layer.gain
        return self.head(h)


class BNNet(nn.Module):
    """A BatchNorm in every block: buffers the forward updates, on every stage at pp 4."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Tanh()) for _ in range(LAYERS)]
        )
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class BNStage(nn.Module):
    """split_fn's stage of BNNet: its blocks at their paths in the model (the modules themselves follow eval())."""

    def __init__(self, model: BNNet, index: int, num_stages: int) -> None:
        super().__init__()
        per = LAYERS // num_stages
        self.layers = nn.ModuleDict(
            {str(i): copy.deepcopy(model.layers[i]) for i in range(index * per, (index + 1) * per)}
        )
        self.head = copy.deepcopy(model.head) if index == num_stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def gpt_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(VOCAB, (STEPS, GLOBAL, SEQ), generator=g), torch.randint(
        VOCAB, (STEPS, GLOBAL, SEQ), generator=g
    )


def bn_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return 1 + 2 * torch.randn(STEPS, GLOBAL, DIM, generator=g), torch.randn(STEPS, GLOBAL, 1, generator=g)


def gpt_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.5)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2)  # no momentum: the optimizer holds no state


def freeze(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if name in FROZEN:
            p.requires_grad_(False)


def reference(kind: str, steps: int = STEPS) -> dict:
    """One process on the global batch: the state after each phase (a step; for BatchNorm also an evaluation) and
    the losses."""
    torch.manual_seed(0)
    model: nn.Module = BNNet() if kind == "bn" else GPT()
    if kind == "frozen":
        freeze(model)
    opt = (adamw if kind == "frozen" else sgd)(model.parameters())
    x, y = bn_data() if kind == "bn" else gpt_data()
    loss_fn = F.mse_loss if kind == "bn" else gpt_loss
    states, losses = [{k: v.clone() for k, v in model.state_dict().items()}], []
    for step in range(steps):
        loss = loss_fn(model(x[step]), y[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        if kind == "bn":
            model.eval()
            with torch.no_grad():
                loss_fn(model(x[step]), y[step])
            model.train()
            states.append({k: v.clone() for k, v in model.state_dict().items()})
    return {"states": states, "losses": losses, "stateful": sorted(id(p) for p in opt.state)}


def _pipeline(world: int, pp: int, dp: int, kind: str, **kwargs) -> Loom:
    if kind.startswith("bn"):
        # one micro-batch: the statistics of one process's batch
        kwargs.update(schedule="gpipe", n_microbatches=1)
        if kind == "bn":
            kwargs["split_fn"] = BNStage
        else:
            kwargs.update(
                split_points=[f"layers.{i}" for i in range(1, pp)], example_input=torch.zeros(GLOBAL, DIM)
            )
    else:
        kwargs.update(
            split_points=["layers.2"], example_input=torch.zeros(GLOBAL // dp // MICRO, SEQ, dtype=torch.long)
        )
        kwargs.setdefault("n_microbatches", MICRO)
    strategy = PipelineStrategy(pipeline_parallel_size=pp, data_parallel_size=dp, **kwargs)
    loom = Loom(strategy=strategy, accelerator="cpu", devices=world)
    loom.launch()
    return loom


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(
    loom: Loom, kind: str, steps: range, meta: bool = False, ckpt: str | None = None, save=None
) -> dict:
    torch.manual_seed(0)
    with loom.init_module(empty_init=True) if meta else contextlib.nullcontext():
        net: nn.Module = BNNet() if kind.startswith("bn") else GPT()
    if kind == "frozen":
        freeze(net)
    model = loom.setup_module(net)
    opt = loom.setup_optimizers((adamw if kind == "frozen" else sgd)(model.parameters()))
    if ckpt is not None:
        loom.load(ckpt, {"model": model, "opt": opt})
    x, y = bn_data() if kind.startswith("bn") else gpt_data()
    split = loom.strategy.distributed_sampler_kwargs
    per = GLOBAL // split["num_replicas"]
    rows = slice(split["rank"] * per, (split["rank"] + 1) * per)
    loss_fn = F.mse_loss if kind.startswith("bn") else gpt_loss
    states, losses = [_state(model)], []
    for step in steps:
        losses.append(loom.forward_backward(model, x[step, rows], y[step, rows], loss_fn).item())
        opt.step()
        opt.zero_grad()
        states.append(_state(model))
        if kind == "bn":
            model.eval()
            loom.evaluate(model, x[step, rows], y[step, rows], loss_fn)
            model.train()
            states.append(_state(model))
        if save is not None and step == save[1]:
            loom.save(save[0], {"model": model, "opt": opt})
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"states": states, "losses": losses, "stateful": sorted(names[id(p)] for p in opt.optimizer.state)}
    if kind == "bn_traced":
        model.eval()
        with pytest.raises(MisuseError) as refused:
            loom.evaluate(model, x[0, rows], y[0, rows], loss_fn)
        out["refused"] = str(refused.value)
    return out


def _crossings_body(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    # 1: empty_init, the positions built in the forward, traced on the meta device at pp 2 x dp 2
    out["meta_gpt"] = _train(_pipeline(world, 2, 2, "gpt"), "gpt", range(STEPS), meta=True)
    # 2: frozen parameters under AdamW's weight decay at pp 2 x dp 2 (plain parameters, averaged over dp); saved
    # (sharded) after 2 steps, resumed for the third
    out["frozen"] = _train(
        _pipeline(world, 2, 2, "frozen"), "frozen", range(STEPS), save=(f"{tmp}/frozen", 1)
    )
    loom = _pipeline(world, 2, 2, "frozen")
    out["frozen_resumed"] = _train(loom, "frozen", range(2, STEPS), ckpt=f"{tmp}/frozen")
    # 5: an optimizer without state, saved in the full format after 2 steps, resumed for the third
    loom = _pipeline(world, 2, 2, "gpt", save_distributed_checkpoint=False)
    out["sgd"] = _train(loom, "gpt", range(STEPS), save=(f"{tmp}/sgd.ckpt", 1))
    loom = _pipeline(world, 2, 2, "gpt", save_distributed_checkpoint=False)
    out["sgd_resumed"] = _train(loom, "gpt", range(2, STEPS), ckpt=f"{tmp}/sgd.ckpt")
    # 4: BatchNorm on every stage at pp 4, one micro-batch: torch's metadata inference (at the first batch and at
    # each switch between training and evaluation) must leave the running statistics alone
    out["bn"] = _train(_pipeline(world, 4, 1, "bn"), "bn", range(STEPS))
    # the same traced (split_points): the training steps; evaluation refused, since the traced graph fixes
    # BatchNorm's training flag (it would go on updating the statistics under model.eval())
    out["bn_traced"] = _train(_pipeline(world, 4, 1, "bn_traced"), "bn_traced", range(STEPS))
    # the state dict keeps the model's names only: no lifted constant, no non-persistent buffer (traced at pp 2
    # with two stages a rank, so blocks of two stages share the "layers" container)
    strategy = PipelineStrategy(
        pipeline_parallel_size=2,
        data_parallel_size=2,
        stages_per_rank=2,
        schedule="interleaved_1f1b",
        split_points=["layers.1", "layers.2", "layers.3"],
        example_input=torch.zeros(GLOBAL // 2 // MICRO, SEQ, dtype=torch.long),
        n_microbatches=MICRO,
        save_distributed_checkpoint=False,
    )
    loom = Loom(strategy=strategy, accelerator="cpu", devices=world)
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(ConstGPT())
    out["const_keys"] = sorted(model.state_dict())
    out["const_full_keys"] = sorted(loom.strategy.module_state_dict(model) or {})
    return out


@pytest.fixture(scope="module")
def crossings(tmp_path_factory) -> list[dict]:
    return run_ranks(_crossings_body, 4, str(tmp_path_factory.mktemp("crossings")), timeout=300)


def _merged(results: list[dict], key: str, index: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r[key]["states"][index])
    return out


def _close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: object, tol: float = TOL
) -> None:
    """The same tensors, each within `tol` of one process's (the worst one named)."""
    assert sorted(got) == sorted(want), what
    off, name = max(((got[k].double() - want[k].double()).abs().max().item(), k) for k in want)
    assert off <= tol, f"{what}: {name} is {off:.3g} off"


def test_empty_init_with_positions_built_in_forward(crossings) -> None:
    want = reference("gpt")
    # each stage starts from exactly what one process draws, and trains as one process does
    _close(_merged(crossings, "meta_gpt", 0), want["states"][0], "initial", tol=0.0)
    for step in range(1, STEPS + 1):
        _close(_merged(crossings, "meta_gpt", step), want["states"][step], step)
    for (
        r
    ) in crossings:  # each data-parallel pipeline sees its half of the batch: their mean is the batch's loss
        assert len(r["meta_gpt"]["losses"]) == STEPS
    mean = [sum(r["meta_gpt"]["losses"][i] for r in crossings) / len(crossings) for i in range(STEPS)]
    assert mean == pytest.approx(want["losses"], abs=TOL)


def test_frozen_parameters_are_left_alone(crossings) -> None:
    want = reference("frozen")
    for step in range(STEPS + 1):
        _close(_merged(crossings, "frozen", step), want["states"][step], step)
    for name in FROZEN:  # unchanged, as under one process: no gradient, no weight decay
        assert torch.equal(_merged(crossings, "frozen", STEPS)[name], want["states"][0][name])
    for r in crossings:  # and the optimizer keeps no state for them
        assert not set(FROZEN) & set(r["frozen"]["stateful"])
        assert r["frozen"]["stateful"] and r["frozen_resumed"]["stateful"] == r["frozen"]["stateful"]
    _close(_merged(crossings, "frozen_resumed", 1), want["states"][STEPS], "resumed")


def test_stateless_optimizer_resumes_from_a_full_checkpoint(crossings) -> None:
    want = reference("gpt")
    _close(_merged(crossings, "sgd", STEPS), want["states"][STEPS], "resumed")
    _close(_merged(crossings, "sgd_resumed", 1), _merged(crossings, "sgd", STEPS), "resumed")
    assert all(r["sgd_resumed"]["stateful"] == [] for r in crossings)


def test_checkpoints_hold_only_the_models_state(crossings) -> None:
    want = sorted(ConstGPT().state_dict())
    assert sorted({k for r in crossings for k in r["const_keys"]}) == want
    assert crossings[0]["const_full_keys"] == want


def test_batchnorm_statistics_match_one_process(crossings) -> None:
    want = reference("bn")
    for step in range(STEPS + 1):  # traced stages: after each training step
        _close(_merged(crossings, "bn_traced", step), want["states"][2 * step], f"traced, step {step}")
    for r in crossings:  # under model.eval(), refused on every rank, naming the modules and the fix
        assert "layers.0.1" in r["bn_traced"]["refused"] and "split_fn" in r["bn_traced"]["refused"]
    # after each step and after each evaluation (torch re-infers the stages' metadata at each switch)
    for phase in range(2 * STEPS + 1):
        got = _merged(crossings, "bn", phase)
        _close(got, want["states"][phase], phase)
        tracked = [k for k in got if k.endswith("num_batches_tracked")]
        assert tracked and all(int(got[k]) == (phase + 1) // 2 for k in tracked), phase
