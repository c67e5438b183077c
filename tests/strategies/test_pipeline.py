"""PipelineStrategy on CPU ranks (gloo): parity with one process on the global batch (fp32, 1e-5) after several
steps with gradient accumulation and a global-norm clip, for GPipe, 1F1B, interleaved 1F1B and ZBV zero bubble at
pp 2, and pp 2 x dp 2 (fully_shard inside each stage) and pp 2 x tp 2 (a tensor-parallel plan on split_fn's
stages) on 4 ranks; checkpoints under the model's own names that load at pp 1, into "ddp" and "fsdp2"; and the
refusals."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from torchloom import Loom
from torchloom.errors import CheckpointError, ConfigurationError, MisuseError
from torchloom.strategies import PipelineStrategy

IN, DIM, OUT, LAYERS = 4, 8, 3, 4
STEPS, ACCUM, GLOBAL, MICRO = 3, 2, 8, 2
MAX_NORM = 0.3
TOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.act = nn.Identity()
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.embed(x))
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Stage(nn.Module):
    """What a split_fn returns: the model's layers of one stage, at their paths in the model."""

    def __init__(self, model: Net, index: int, num_stages: int) -> None:
        super().__init__()
        per = LAYERS // num_stages
        self.embed = copy.deepcopy(model.embed) if index == 0 else None
        self.layers = nn.ModuleDict(
            {str(i): copy.deepcopy(model.layers[i]) for i in range(index * per, (index + 1) * per)}
        )
        self.head = copy.deepcopy(model.head) if index == num_stages - 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.embed(h) if self.embed is not None else h
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


def split_fn(model: Net, index: int, num_stages: int) -> nn.Module:
    return Stage(model, index, num_stages)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, ACCUM, GLOBAL, IN, generator=g), torch.randn(
        STEPS, ACCUM, GLOBAL, OUT, generator=g
    )


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target) / ACCUM


def reference(
    steps: int = STEPS, autocast: bool = False, precision: str = "32-true"
) -> tuple[dict[str, torch.Tensor], list[float], list[float], list[float]]:
    """One process on the global batch: the state, the losses, the norms, and the eval loss after each step.
    `precision` as `Loom` spells it (autocast: bf16-mixed)."""
    precision = "bf16-mixed" if autocast else precision
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    torch.manual_seed(0)
    model = Net()
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    x, y = data()
    if precision == "bf16-true":
        x = x.to(torch.bfloat16)
    losses, norms, evals = [], [], []

    def forward(i: int, j: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None):
            out = model(x[i, j])
        return loss_fn(out.float() if half is not None else out, y[i, j])

    for step in range(steps):
        for micro in range(ACCUM):
            loss = forward(step, micro)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            losses.append(loss.item())
        if scaler is not None:
            scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        scaler.step(opt) if scaler is not None else opt.step()
        if scaler is not None:
            scaler.update()
        opt.zero_grad()
        with torch.no_grad():
            evals.append(forward(step, 1).item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms, evals


def train(
    loom: Loom, model, opt, steps: range = range(STEPS), evaluate: bool = True
) -> tuple[list[float], list[float], list[float]]:
    """The loop a user writes, the same with and without pipeline parallelism: an evaluation batch after each
    step (through the schedule; it must leave the next training batch as it was)."""
    x, y = data()
    split = loom.strategy.distributed_sampler_kwargs
    per = GLOBAL // split["num_replicas"]
    rows = slice(split["rank"] * per, (split["rank"] + 1) * per)
    losses, norms, evals = [], [], []
    for step in steps:
        for micro in range(ACCUM):
            with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = loom.forward_backward(model, x[step, micro, rows], y[step, micro, rows], loss_fn)
            losses.append(loss.item())
        norms.append(float(loom.clip_gradients(model, opt, max_norm=MAX_NORM)))
        opt.step()
        opt.zero_grad()
        if evaluate:
            evals.append(loom.evaluate(model, x[step, 1, rows], y[step, 1, rows], loss_fn).item())
    return losses, norms, evals


def full_state(model) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def pipeline(world: int, **kwargs) -> Loom:
    kwargs.setdefault("n_microbatches", MICRO)
    if "split_fn" not in kwargs:
        kwargs.setdefault("split_points", ["layers.2"])
        kwargs.setdefault("example_input", torch.zeros(GLOBAL // MICRO, IN))
    precision = kwargs.pop("precision", "32-true")
    loom = Loom(strategy=PipelineStrategy(**kwargs), accelerator="cpu", devices=world, precision=precision)
    loom.launch()
    return loom


def run(
    loom: Loom,
    steps: range = range(STEPS),
    ckpt: str | None = None,
    meta: bool = False,
    evaluate: bool = True,
) -> dict:
    torch.manual_seed(0)
    with loom.init_module(empty_init=True) if meta else contextlib.nullcontext():
        net = Net()
    model = loom.setup_module(net)
    initial = full_state(model)
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    if ckpt is not None:
        loom.load(ckpt, {"model": model, "opt": opt})
    losses, norms, evals = train(loom, model, opt, steps, evaluate)
    return {
        "initial": initial,
        "losses": losses,
        "norms": norms,
        "evals": evals,
        "state": full_state(model),
        "model": model,
        "opt": opt,
        "loom": loom,
    }


def _results(res: dict) -> dict:
    return {k: res[k] for k in ("losses", "norms", "evals", "state")}


class Branchy(Net):
    """A forward whose control flow depends on the data: the tracer cannot follow it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if h.sum() > 0:
            h = -h
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _pp2_body(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    for schedule, extra in [
        ("gpipe", {}),
        ("1f1b", {}),
        ("interleaved_1f1b", {"stages_per_rank": 2, "split_points": ["layers.1", "layers.2", "layers.3"]}),
        ("zbv_zero_bubble", {"stages_per_rank": 2, "split_points": ["layers.1", "layers.2", "layers.3"]}),
        (
            "interleaved_zero_bubble",
            {"stages_per_rank": 2, "split_points": ["layers.1", "layers.2", "layers.3"]},
        ),
        ("looped_bfs", {"stages_per_rank": 2, "split_points": ["layers.1", "layers.2", "layers.3"]}),
    ]:
        # (torch cannot evaluate through the V-shaped schedule: refused below)
        evaluate = schedule != "zbv_zero_bubble"
        out[schedule] = _results(run(pipeline(world, schedule=schedule, **extra), evaluate=evaluate))
    out["split_fn"] = _results(run(pipeline(world, split_fn=split_fn)))
    # bf16-mixed: the stages' forwards under the precision's autocast (judged against one process under autocast)
    loom = pipeline(world, precision="bf16-mixed")
    seen: list = []
    res = run(loom, steps=range(0))
    up = dict(res["model"].module.named_modules()).get("layers.2.up")  # on the second stage only
    if up is not None:
        up.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    train(loom, res["model"], res["opt"])
    out["bf16"] = {"state": full_state(res["model"]), "seen": set(seen)}
    # fp16 with the loss scaler: every stage's gradients unscaled and checked; then an inf on one stage's
    # gradient alone, which every rank must skip alike (weights kept, scale halved on every rank)
    loom = pipeline(world, precision="16-mixed")
    res = run(loom)
    out["fp16"] = {**_results(res), "scale": loom.strategy.precision.scaler.get_scale()}
    x, y = data()
    loom.forward_backward(res["model"], x[0, 0], y[0, 0], loss_fn)
    if rank == 1:
        next(p for p in res["model"].parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    before = full_state(res["model"])
    out["fp16_skip_norm"] = float(loom.clip_gradients(res["model"], res["opt"], max_norm=MAX_NORM))
    res["opt"].step()
    res["opt"].zero_grad()
    out["fp16_skip_moved"] = close(full_state(res["model"]), before)
    out["fp16_skip_scale"] = loom.strategy.precision.scaler.get_scale()
    out["bf16_true"] = _results(run(pipeline(world, precision="bf16-true")))
    # Built on the meta device: each rank's stages get what one process draws for the whole model from the seed
    res = run(pipeline(world), meta=True)
    out["meta_init"], out["meta_init_initial"] = _results(res), res["initial"]
    out["meta_init_split_fn"] = run(
        pipeline(world, split_fn=split_fn, schedule="interleaved_1f1b", stages_per_rank=2),
        steps=range(0),
        meta=True,
    )["initial"]
    # ---- checkpoints: saved at pp 2 after 2 steps (sharded and full), resumed elsewhere for the last step --------
    res = run(pipeline(world, schedule="1f1b"), steps=range(2))
    state = {"model": res["model"], "opt": res["opt"]}
    out["stage_keys"] = sorted(res["model"].state_dict())
    res["loom"].save(f"{tmp}/sharded", state)
    # The whole model in Hugging Face's layout, each stage's files written by its own rank (small files: several)
    from transformers import PretrainedConfig

    res["loom"].save_raw(f"{tmp}/hf", res["model"], max_shard_size=1000, config=PretrainedConfig())
    res["loom"].strategy.save_distributed_checkpoint = False
    res["loom"].save(f"{tmp}/full.pt", state)
    for name, path in [("sharded", f"{tmp}/sharded"), ("full", f"{tmp}/full.pt")]:
        for target in ("ddp", "fsdp2"):
            loom = Loom(strategy=target, accelerator="cpu", devices=world)
            loom.launch()
            out[f"{name}->{target}"] = run(loom, steps=range(2, STEPS), ckpt=path)["state"]
    for name, path in [("sharded", f"{tmp}/sharded"), ("full", f"{tmp}/full.pt")]:
        loom = pipeline(world, schedule="gpipe")  # the same degree: each rank reads its stage only
        out[f"{name}->pp2"] = run(loom, steps=range(2, STEPS), ckpt=path)["state"]
    out["sharded->pp1"] = run(
        pipeline(world, pipeline_parallel_size=1, data_parallel_size=2, split_points=[]),
        steps=range(2, STEPS),
        ckpt=f"{tmp}/sharded",
    )["state"]
    # ---- refusals ------------------------------------------------------------------------------------------------
    loom = pipeline(world)
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    x, y = data()
    # A state that lacks a key of the second stage only: the load fails there, and must fail on every rank
    # (the first stage would otherwise train on and wait for the second in its next collective).
    lacking = {k: v for i, (k, v) in enumerate(model.state_dict().items()) if rank == 0 or i > 0}
    for name, call in [
        ("lacks", lambda: loom.strategy.load_module_state_dict(model.module, lacking)),
        ("call", lambda: model(x[0, 0])),
        ("backward", lambda: loom.backward(torch.zeros((), requires_grad=True))),
        ("indivisible", lambda: loom.forward_backward(model, x[0, 0, :3], y[0, 0, :3], loss_fn)),
        (
            "eval_pending",
            lambda: (
                loom.forward_backward(model, x[0, 0], y[0, 0], loss_fn),
                loom.evaluate(model, x[0, 1], y[0, 1], loss_fn),
            ),
        ),
    ]:
        try:
            call()
            out[name] = None
        except (MisuseError, CheckpointError) as error:
            out[name] = str(error)
    loom = pipeline(
        world,
        schedule="zbv_zero_bubble",
        stages_per_rank=2,
        split_points=["layers.1", "layers.2", "layers.3"],
    )
    model = loom.setup_module(Net())
    try:
        loom.evaluate(model, x[0, 0], y[0, 0], loss_fn)
        out["zbv_eval"] = None
    except MisuseError as error:
        out["zbv_eval"] = str(error)
    for name, kwargs in [
        ("no_module", {"split_points": ["layers.9"]}),
        ("no_params", {"split_fn": lambda m, i, n: split_fn(m, i, n) if i == 0 else nn.Identity()}),
        ("untraceable", {}),
    ]:
        loom = pipeline(world, **kwargs)
        try:
            model_class = Branchy if name == "untraceable" else Net
            loom.setup_module(model_class())
            out[name] = None
        except MisuseError as error:
            out[name] = str(error)
    return out


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def merged(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The whole model from every rank's stage (each key from the first rank that holds it)."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in (
            r[key]["state"].items() if isinstance(r[key], dict) and "state" in r[key] else r[key].items()
        ):
            out.setdefault(k, v)
    return out


def read_hf(path) -> dict[str, torch.Tensor]:
    """A directory save_raw wrote, read with plain safetensors (every file the index names)."""
    from safetensors.torch import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(path / file)))
    assert set(out) == set(index["weight_map"])
    return out


def from_pretrained(path) -> dict[str, torch.Tensor]:
    """The directory loaded by transformers' `from_pretrained` into a model of Net's layers."""
    transformers = pytest.importorskip("transformers")

    class HFNet(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config) -> None:
            super().__init__(config)
            net = Net()
            self.embed, self.act, self.layers, self.head = net.embed, net.act, net.layers, net.head
            self.post_init()

    model = HFNet.from_pretrained(str(path))
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_pp2_schedules_checkpoints_and_refusals(tmp_path) -> None:
    expected, losses, norms, evals = reference()
    initial = reference(steps=0)[0]
    results = run_ranks(_pp2_body, 2, str(tmp_path), timeout=300)
    schedules = (
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "zbv_zero_bubble",
        "interleaved_zero_bubble",
        "looped_bfs",
    )
    for schedule in (*schedules, "split_fn"):
        assert close(merged(results, schedule), expected) <= TOL, schedule
        for r in results:  # the loss and the norm on every rank, as one process computes them
            assert r[schedule]["losses"] == pytest.approx(losses, abs=TOL), schedule
            assert r[schedule]["norms"] == pytest.approx(norms, abs=TOL), schedule
            # evaluation through the schedule between micro-batches: the loss, and training unchanged
            if schedule != "zbv_zero_bubble":
                assert r[schedule]["evals"] == pytest.approx(evals, abs=TOL), schedule
    # Each rank holds only its stage, under the model's own names.
    assert results[0]["stage_keys"] == sorted(
        k for k in expected if k.startswith(("embed", "layers.0", "layers.1"))
    )
    assert results[1]["stage_keys"] == sorted(
        k for k in expected if k.startswith(("layers.2", "layers.3", "head"))
    )
    resumed_in = ("sharded->ddp", "sharded->fsdp2", "full->ddp", "full->fsdp2", "sharded->pp1")
    for resumed in (*resumed_in, "sharded->pp2", "full->pp2"):
        assert close(merged(results, resumed), expected) <= TOL, resumed
    # bf16: the blocks computed in bf16 on the stage, and training went where one process under autocast goes
    # (rounding differs with the micro-batch size: judged against how far training moved the weights).
    bf16_expected = reference(precision="bf16-mixed")[0]
    moved = max((bf16_expected[k] - initial[k]).abs().max().item() for k in initial)
    assert results[1]["bf16"]["seen"] == {torch.bfloat16}
    assert close(merged(results, "bf16"), bf16_expected) <= 0.05 * moved
    # fp16 (scaled, unscaled on every stage, clipped, stepped): one process with torch's GradScaler under fp16
    # autocast. fp16 keeps 11 significant bits; micro-batches round the sums in another order, so judged
    # against how far training moved the weights, as bf16 above (measured: 0.02% of it).
    fp16_expected, fp16_losses, _, _ = reference(precision="16-mixed")
    fp16_moved = max((fp16_expected[k] - initial[k]).abs().max().item() for k in initial)
    assert close(merged(results, "fp16"), fp16_expected) <= 0.005 * fp16_moved
    for r in results:
        assert r["fp16"]["scale"] == 2.0**16  # the parity run overflowed nowhere
        assert r["fp16"]["losses"] == pytest.approx(fp16_losses, rel=1e-2)
        # an inf in one stage's gradient: the step skipped on every rank, the scale halved on every rank
        assert r["fp16_skip_norm"] == float("inf") and r["fp16_skip_moved"] == 0.0
        assert r["fp16_skip_scale"] == 2.0**15
    # bf16-true: the whole model in bf16 (8 significant bits), against one process in bf16 (measured: 2.3% of
    # the movement, one bf16 step of the largest weight)
    bf16_true = reference(precision="bf16-true")[0]
    true_moved = max((bf16_true[k].float() - initial[k]).abs().max().item() for k in initial)
    got = merged(results, "bf16_true")
    assert {v.dtype for v in got.values()} == {torch.bfloat16}
    assert max((got[k].float() - bf16_true[k].float()).abs().max().item() for k in got) <= 0.05 * true_moved
    # Meta-device init: exactly one process's init from the seed (traced 1f1b, and split_fn interleaved), and
    # training from there matches one process
    assert close(merged(results, "meta_init_initial"), initial) == 0.0
    assert close(merged(results, "meta_init_split_fn"), initial) == 0.0
    assert close(merged(results, "meta_init"), expected) <= TOL
    # save_raw at pp 2 after 2 steps: the whole model under its own names, read back by plain safetensors
    after_two = reference(steps=2)[0]
    assert close(read_hf(tmp_path / "hf"), after_two) <= TOL
    assert close(from_pretrained(tmp_path / "hf"), after_two) <= TOL
    for r in results:
        assert "failed on 1 rank of 2" in r["lacks"] and "rank 1: MisuseError" in r["lacks"], r["lacks"]
    r = results[0]
    assert "loom.forward_backward" in r["call"] and "loom.forward_backward" in r["backward"]
    assert "3 samples" in r["indivisible"] and "n_microbatches=2" in r["indivisible"]
    assert "'layers.9' names no module" in r["no_module"]
    assert "cannot run through schedule='zbv_zero_bubble'" in r["zbv_eval"]
    assert "not while gradients are pending" in r["eval_pending"]
    assert "stage 1 holds no parameters" in r["no_params"]
    assert "cannot be split" in r["untraceable"] and "split_fn" in r["untraceable"]


def test_pipeline_degree_must_divide_the_world() -> None:
    strategy = PipelineStrategy(
        pipeline_parallel_size=3, split_points=["layers.1", "layers.2"], example_input=0
    )
    with pytest.raises(ConfigurationError, match="3 x 1 x 1 = 3 ranks, but this job has 2 processes"):
        Loom(strategy=strategy, accelerator="cpu", devices=2)
    with pytest.raises(ConfigurationError, match="exactly one of split_points"):
        PipelineStrategy(split_points=["layers.2"], split_fn=split_fn)
    with pytest.raises(ConfigurationError, match="stages_per_rank=2"):
        PipelineStrategy(split_fn=split_fn, schedule="interleaved_1f1b")


def shard_blocks(strategy: list, root: bool):
    """parallelize_fn for pp x dp: fully_shard each block of the stage (and, with `root`, the stage)."""

    def parallelize(stage: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for name, mod in stage.named_modules():
            if name.startswith("layers.") and name.count(".") == 1:
                fully_shard(mod, **strategy[0].unit_kwargs())
        if root:
            fully_shard(stage, **strategy[0].unit_kwargs())
        return stage

    return parallelize


def tensor_parallel(stage: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in stage.layers.values():
        parallelize_module(
            block, device_mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
    return stage


def _pipeline_with(world: int, make_fn, **kwargs) -> Loom:
    holder: list = []
    kwargs.setdefault("n_microbatches", MICRO)
    if "split_fn" not in kwargs:
        kwargs.setdefault("split_points", ["layers.2"])
        # One micro-batch of one data-parallel rank's batch.
        kwargs.setdefault(
            "example_input", torch.zeros(GLOBAL // kwargs.get("data_parallel_size", 1) // MICRO, IN)
        )
    strategy = PipelineStrategy(make_fn(holder) if make_fn is not None else None, **kwargs)
    holder.append(strategy)
    loom = Loom(strategy=strategy, accelerator="cpu", devices=world)
    loom.launch()
    return loom


def _pp2_4ranks_body(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    # pp 2 x dp 2, each block and the stage a fully_shard unit (torch's pipelining drives FSDP's reductions)
    loom = _pipeline_with(
        world, lambda h: shard_blocks(h, root=True), pipeline_parallel_size=2, data_parallel_size=2
    )
    out["dp_fsdp_1f1b"] = _results(run(loom))
    # interleaved, the blocks units and embed/head plain: torchloom averages their gradients over dp
    loom = _pipeline_with(
        world,
        lambda h: shard_blocks(h, root=False),
        pipeline_parallel_size=2,
        data_parallel_size=2,
        schedule="interleaved_1f1b",
        stages_per_rank=2,
        split_points=["layers.1", "layers.2", "layers.3"],
    )
    out["dp_plain_interleaved"] = _results(run(loom))
    # pp 2 x tp 2: split_fn's stages keep nn.Linear, so a tensor-parallel plan applies
    loom = _pipeline_with(
        world, lambda h: tensor_parallel, pipeline_parallel_size=2, tensor_parallel_size=2, split_fn=split_fn
    )
    out["tp_gpipe"] = _results(run(loom))

    # a plain parameter whose gradient differs between the tensor-parallel ranks (as a norm's under sequence
    # parallelism): refused at the first synchronising batch, not averaged into a wrong value
    def partial_head(stage: nn.Module, device_mesh) -> nn.Module:
        tensor_parallel(stage, device_mesh)
        tp_rank = device_mesh["tensor_parallel"].get_local_rank()
        if stage.head is not None:
            stage.head.weight.register_hook(lambda g: g * (1 + tp_rank))
        return stage

    loom = _pipeline_with(
        world, lambda h: partial_head, pipeline_parallel_size=2, tensor_parallel_size=2, split_fn=split_fn
    )
    try:
        run(loom, steps=range(1))
        out["tp_partial"] = None
    except MisuseError as error:
        out["tp_partial"] = str(error)
    # checkpoint at pp 2 x dp 2 after 2 steps, resumed at pp 1 x dp 4 and in fsdp2 at 4 ranks
    loom = _pipeline_with(
        world, lambda h: shard_blocks(h, root=True), pipeline_parallel_size=2, data_parallel_size=2
    )
    res = run(loom, steps=range(2))
    loom.save(f"{tmp}/pp2dp2", {"model": res["model"], "opt": res["opt"]})
    # save_raw: each stage's fully_shard shards made whole among that stage's ranks only
    loom.save_raw(f"{tmp}/hf4", res["model"], max_shard_size=1000)
    loom = _pipeline_with(
        world,
        lambda h: shard_blocks(h, root=True),
        pipeline_parallel_size=1,
        data_parallel_size=4,
        split_points=[],
    )
    out["pp2dp2->pp1dp4"] = run(loom, steps=range(2, STEPS), ckpt=f"{tmp}/pp2dp2")["state"]
    loom = _pipeline_with(
        world,
        None,
        pipeline_parallel_size=4,
        split_points=["layers.1", "layers.2", "layers.3"],
        schedule="gpipe",
    )
    out["pp2dp2->pp4"] = run(loom, steps=range(2, STEPS), ckpt=f"{tmp}/pp2dp2")["state"]
    loom = Loom(strategy="fsdp2", accelerator="cpu", devices=world)
    loom.launch()
    out["pp2dp2->fsdp2"] = run(loom, steps=range(2, STEPS), ckpt=f"{tmp}/pp2dp2")["state"]
    return out


def test_pp2_with_dp2_and_tp2(tmp_path) -> None:
    expected, losses, norms, evals = reference()
    results = run_ranks(_pp2_4ranks_body, 4, str(tmp_path), timeout=300)
    for key in ("dp_fsdp_1f1b", "dp_plain_interleaved", "tp_gpipe"):
        assert close(merged(results, key), expected) <= TOL, key
        for r in results:
            assert r[key]["norms"] == pytest.approx(norms, abs=TOL), key
    for r in results:  # tensor parallel: every rank reads the whole batch, and sees its loss
        assert r["tp_gpipe"]["losses"] == pytest.approx(losses, abs=TOL)
        assert r["tp_gpipe"]["evals"] == pytest.approx(evals, abs=TOL)
    for key in ("dp_fsdp_1f1b", "dp_plain_interleaved"):  # each pipeline evaluates its half: their mean
        mean = [sum(r[key]["evals"][i] for r in results) / len(results) for i in range(STEPS)]
        assert mean == pytest.approx(evals, abs=TOL), key
    assert all("['head.weight']" in r["tp_partial"] for r in results)  # every rank, together
    assert close(read_hf(tmp_path / "hf4"), reference(steps=2)[0]) <= TOL
    for key in ("pp2dp2->pp1dp4", "pp2dp2->pp4", "pp2dp2->fsdp2"):
        assert close(merged(results, key), expected) <= TOL, key
