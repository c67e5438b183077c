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
from torchloom.errors import CheckpointError, MisuseError
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


class UnitNet(nn.Module):
    """A frozen input layer, then a layer whose output is transposed where stage 0 ends (non-contiguous)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(SEQ, SEQ)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.emb.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(torch.tanh(self.emb(x)) * self.gain).transpose(1, 2))


class TiedNet(nn.Module):
    """The output layer's weight tied to the input layer's, both on one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.emb(x)))))


class Half(nn.Module):
    """split_fn's stage of TiedNet at two stages: its layers at their paths in the model."""

    def __init__(self, model: TiedNet, index: int, num_stages: int) -> None:
        super().__init__()
        names = [("emb", "mid", "head")] if num_stages == 1 else [("emb",), ("mid", "head")]
        for name in names[index]:
            setattr(self, name, getattr(model, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in ("emb", "mid", "head"):
            if hasattr(self, name):
                x = getattr(self, name)(x)
                x = torch.tanh(x) if name != "head" else x
        return x


def unit_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, GLOBAL, SEQ, DIM, generator=g), torch.randn(
        STEPS, GLOBAL, DIM, SEQ, generator=g
    )


def tied_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(STEPS, GLOBAL, DIM, generator=g), torch.randn(STEPS, GLOBAL, DIM, generator=g)


def momentum(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


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
    out.update(_units_and_stage_ends(world, tmp))
    return out


def _one_process(make, data, steps: int) -> dict:
    """One process on the global batch (SGD with momentum): the states after each step, and the evaluation loss
    of each state on the next batch."""
    torch.manual_seed(0)
    model = make()
    opt = momentum(model.parameters())
    x, y = data()
    states, evals = [_state(model)], []
    for step in range(steps):
        F.mse_loss(model(x[step]), y[step]).backward()
        opt.step()
        opt.zero_grad()
        states.append(_state(model))
        with torch.no_grad():
            evals.append(F.mse_loss(model(x[step + 1]), y[step + 1]).item())
    return {"states": states, "evals": evals}


def _full_state(model) -> dict[str, torch.Tensor]:
    """The state with every shard gathered (a collective over each unit's data-parallel ranks)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _stateless_full_resume(name: str, world: int, path: str) -> dict:
    from torchloom.strategies import FSDP2Strategy, ModelParallelStrategy

    states = []
    for load in (False, True):
        if name == "fsdp2":
            strategy = FSDP2Strategy(state_dict_type="full")
        else:
            strategy = ModelParallelStrategy(lambda m, mesh: m, save_distributed_checkpoint=False)
        loom = Loom(strategy=strategy, accelerator="cpu", devices=world)
        loom.launch()
        torch.manual_seed(1 if load else 0)  # the loaded run starts elsewhere
        model = loom.setup_module(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)))
        opt = loom.setup_optimizers(sgd(model.parameters()))
        if load:
            loom.load(path, {"model": model, "opt": opt})
        else:
            loss = F.mse_loss(model(torch.ones(2, DIM)), torch.zeros(2, DIM))
            loom.backward(loss)
            opt.step()
            opt.zero_grad()
            loom.save(path, {"model": model, "opt": opt})
        states.append(_full_state(model))
    return {"states": states, "state": len(opt.optimizer.state)}


def _rows(loom: Loom) -> slice:
    split = loom.strategy.distributed_sampler_kwargs
    per = GLOBAL // split["num_replicas"]
    return slice(split["rank"] * per, (split["rank"] + 1) * per)


def _units_and_stage_ends(world: int, tmp: str) -> dict:
    """The crossings the scenario engine found beyond issue 44's list, each against one process."""
    out: dict = {}
    # A frozen layer in a fully_shard unit of its own on stage 0 (stage 1 plain), stage 0's output transposed
    # (non-contiguous), at pp 2 x dp 2: trained, evaluated, saved (full format).
    holder: list[PipelineStrategy] = []

    def shard_emb(stage: nn.Module, mesh) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        if hasattr(stage, "emb"):  # `gain` stays plain
            fully_shard(stage.emb, **holder[0].unit_kwargs())
            fully_shard(stage.a, **holder[0].unit_kwargs())
        return stage

    holder.append(
        PipelineStrategy(
            shard_emb,
            pipeline_parallel_size=2,
            data_parallel_size=2,
            split_points=["b"],
            example_input=torch.zeros(GLOBAL // 2 // MICRO, SEQ, DIM),
            n_microbatches=MICRO,
            save_distributed_checkpoint=False,
        )
    )
    loom = Loom(strategy=holder[0], accelerator="cpu", devices=world)
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(UnitNet())
    opt = loom.setup_optimizers(momentum(model.parameters()))
    x, y = unit_data()
    rows = _rows(loom)
    states, evals, kinds = [_full_state(model)], [], set()
    for step in range(2):
        loom.forward_backward(model, x[step, rows], y[step, rows], F.mse_loss)
        opt.step()
        opt.zero_grad()
        kinds |= {type(p).__name__ for n, p in model.named_parameters() if n.startswith("emb.")}
        states.append(_full_state(model))
        evals.append(loom.evaluate(model, x[step + 1, rows], y[step + 1, rows], F.mse_loss).item())
        kinds |= {type(p).__name__ for n, p in model.named_parameters() if n.startswith("emb.")}
    loom.save(f"{tmp}/unit.ckpt", {"model": model, "opt": opt})
    # An optimizer no module owns, over sharded parameters on stage 0's ranks only: refused on every rank
    # together (stage 1's ranks would otherwise wait in the save's collectives).
    stray = momentum([*model.parameters(), nn.Parameter(torch.zeros(1))])
    with pytest.raises(CheckpointError) as refused:
        loom.save(f"{tmp}/stray.ckpt", {"model": model, "opt": stray})
    out["unit"] = {"states": states, "evals": evals, "kinds": sorted(kinds), "refused": str(refused.value)}
    # A stateless foreach SGD over plain and DTensor parameters (stage 0), saved in the full format (torch makes
    # state for it with a step) and loaded back.
    sgd_foreach = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, foreach=True))
    loom.save(f"{tmp}/foreach.ckpt", {"model": model, "opt": sgd_foreach})
    loom.load(f"{tmp}/foreach.ckpt", {"model": model, "opt": sgd_foreach})
    out["foreach"] = {"state": len(sgd_foreach.optimizer.state), "after": _full_state(model)}
    # The same optimizer without state, a full checkpoint loaded under the sharded strategies (as under ddp)
    for name in ("fsdp2", "model_parallel"):
        out[name] = _stateless_full_resume(name, world, f"{tmp}/{name}.ckpt")
    # A weight tied inside one stage (pp 1 x dp 4), the model built with empty_init; then at two adjacent
    # stages on each rank (interleaved_1f1b at pp 1), evaluated between the steps.
    for key, kwargs in (
        ("tied_meta", {"schedule": "gpipe", "n_microbatches": 1}),
        ("adjacent", {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "n_microbatches": MICRO}),
    ):
        strategy = PipelineStrategy(
            pipeline_parallel_size=1, data_parallel_size=world, split_fn=Half, **kwargs
        )
        loom = Loom(strategy=strategy, accelerator="cpu", devices=world)
        loom.launch()
        torch.manual_seed(0)
        with loom.init_module(empty_init=True) if key == "tied_meta" else contextlib.nullcontext():
            net = TiedNet()
        model = loom.setup_module(net)
        params = dict(model.named_parameters(remove_duplicate=False))
        opt = loom.setup_optimizers(momentum(model.parameters()))
        x, y = tied_data()
        rows = _rows(loom)
        states, evals = [_state(model)], []
        for step in range(2):
            loom.forward_backward(model, x[step, rows], y[step, rows], F.mse_loss)
            opt.step()
            opt.zero_grad()
            states.append(_state(model))
            evals.append(loom.evaluate(model, x[step + 1, rows], y[step + 1, rows], F.mse_loss).item())
        out[key] = {"states": states, "evals": evals, "tied": params["emb.weight"] is params["head.weight"]}
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


def _mean_evals(results: list[dict], key: str) -> list[float]:
    """Each data-parallel rank evaluates its share of the batch: their mean is the batch's loss."""
    return [
        sum(r[key]["evals"][i] for r in results) / len(results) for i in range(len(results[0][key]["evals"]))
    ]


def test_frozen_unit_and_non_contiguous_stage_output(crossings) -> None:
    want = _one_process(UnitNet, unit_data, 2)
    for step in range(3):
        _close(_merged(crossings, "unit", step), want["states"][step], step)
    assert _mean_evals(crossings, "unit") == pytest.approx(want["evals"], abs=TOL)
    # the frozen unit stays sharded after a training batch and an evaluation (the optimizer's parameters)
    assert {k for r in crossings for k in r["unit"]["kinds"]} == {"DTensor"}
    for r in crossings:  # refused on every rank (none left waiting), naming the problem
        assert "belong to no one module" in r["unit"]["refused"]


@pytest.mark.parametrize("key", ["tied_meta", "adjacent"])
def test_tie_inside_a_stage_and_adjacent_stages_evaluated(crossings, key: str) -> None:
    want = _one_process(TiedNet, tied_data, 2)
    for step in range(3):
        _close(_merged(crossings, key, step), want["states"][step], (key, step))
    assert _mean_evals(crossings, key) == pytest.approx(want["evals"], abs=TOL)
    # one tensor where the stage holds both ends (at two stages each holds a copy, kept equal: the states above)
    assert key != "tied_meta" or all(r[key]["tied"] for r in crossings)


def test_stateless_optimizers_full_checkpoints(crossings) -> None:
    for r in crossings:
        assert r["foreach"]["state"] == 0  # saved without the state torch made, and loaded so
        for name in ("fsdp2", "model_parallel"):
            saved, loaded = r[name]["states"]
            _close(loaded, saved, name, tol=0.0)
            assert r[name]["state"] == 0
    _close(
        _merged(crossings, "unit", 2), {k: v for r in crossings for k, v in r["foreach"]["after"].items()}, ""
    )
