"""Weights tied between an input projection and the output head (GPT-2, small Llamas), on 2 CPU ranks, against one
process on the global batch (fp32, 1e-5): under PipelineStrategy (a copy on each stage that uses the weight, their
gradients summed; the norm counting it once; checkpoints holding it once under the model's names, resumed at pp 1,
under "ddp" and back at pp 2), and under "fsdp" and "fsdp2" with a wrapping policy that would put the two users in
two units (the weight placed in the unit that holds both, and said so in the sharding summary). One group of 2
ranks runs those checks; one of 4 runs pp 2 x dp 2 (copies inside fully_shard units, and plain)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from torchloom import Loom, describe
from torchloom.errors import CheckpointError, MisuseError
from torchloom.strategies import FSDP2Strategy, FSDPStrategy, PipelineStrategy

DIM, LAYERS = 8, 4
STEPS, GLOBAL, MICRO = 3, 8, 2
MAX_NORM = 0.05  # below every step's norm: the clip scales each step, so a norm counting a copy twice shows
TOL = 1e-5


class Block(nn.Module):
    """A residual MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class TiedNet(nn.Module):
    """`head.weight is embed.weight`, tied after both are built (as GPT-2's `tie_weights`): the weight keeps the
    embedding's draw. With `third`, a mixing layer in the middle uses it too (three users on three stages)."""

    def __init__(self, third: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.mix = nn.Linear(DIM, DIM) if third else None
        self.head = nn.Linear(DIM, DIM)
        self.head.weight = self.embed.weight
        if self.mix is not None:
            self.mix.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if i == 2 and self.mix is not None:
                h = h + torch.tanh(self.mix(h))
            h = layer(h)
        return self.head(h)


class Stage(nn.Module):
    """split_fn's stage: the model's own modules of one stage (not copies), at their paths in the model; on two
    stages of one rank, a tied weight is then one parameter object until setup gives each stage a copy."""

    def __init__(self, model: TiedNet, index: int, num_stages: int) -> None:
        super().__init__()
        per = LAYERS // num_stages
        mine = range(index * per, (index + 1) * per)
        self.embed = model.embed if index == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in mine})
        self.head = model.head if index == num_stages - 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for module in (self.embed, *self.layers.values(), self.head):
            h = module(h) if module is not None else h
        return h


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL, DIM, generator=g), torch.randn(STEPS, GLOBAL, DIM, generator=g)


def reference(steps: int = STEPS, third: bool = False, frozen: bool = False, momentum: float = 0.9) -> dict:
    """One process on the global batch: the state after `steps`, the losses and the norms."""
    torch.manual_seed(0)
    model = TiedNet(third)
    model.embed.weight.requires_grad_(not frozen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2, momentum=momentum)
    x, y = data()
    losses, norms = [], []
    for step in range(steps):
        loss = F.mse_loss(model(x[step]), y[step])
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "norms": norms,
    }


def full_state(loom: Loom, model) -> dict[str, torch.Tensor]:
    """This rank's parameters, whole, under the model's names (torch's state-dict API gathers the shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if isinstance(loom.strategy, PipelineStrategy):
        state = model.state_dict()  # only this rank's stages: no collective
    else:
        state = get_model_state_dict(model.forward_module, options=StateDictOptions(full_state_dict=True))
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()
    }


def _half_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * F.mse_loss(output, target)


def train(loom: Loom, model, opt, steps: range, accumulate: bool = False) -> tuple[list[float], list[float]]:
    """The user's loop, the same under every strategy (`forward_backward` is the plain forward elsewhere); with
    `accumulate`, each step's batch in two halves, each backward synchronising (no `no_backward_sync`)."""
    x, y = data()
    split = loom.strategy.distributed_sampler_kwargs
    per = GLOBAL // split["num_replicas"]
    first = split["rank"] * per
    halves = [slice(first, first + per // 2), slice(first + per // 2, first + per)]
    losses, norms = [], []
    for step in steps:
        if accumulate:
            loss = sum(loom.forward_backward(model, x[step, h], y[step, h], _half_mse) for h in halves)
        else:
            loss = loom.forward_backward(
                model, x[step, first : first + per], y[step, first : first + per], F.mse_loss
            )
        losses.append(float(loom.all_reduce(loss.detach(), reduce_op="mean")))
        norms.append(float(loom.clip_gradients(model, opt, max_norm=MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return losses, norms


def pipeline(world: int, **kwargs) -> Loom:
    """A launched Loom under PipelineStrategy: 2 micro-batches, traced and cut before layers.2 unless told."""
    traced = (
        {} if "split_fn" in kwargs else {"split_points": ["layers.2"], "example_input": torch.zeros(4, DIM)}
    )
    options = {"n_microbatches": MICRO, **traced, **kwargs}
    loom = Loom(strategy=PipelineStrategy(**options), accelerator="cpu", devices=world)
    loom.launch()
    return loom


def build(loom: Loom, third: bool = False, frozen: bool = False, meta: bool = False):
    """The set-up model: seed 0 (the reference's draw), on the meta device with `meta`."""
    torch.manual_seed(0)
    with loom.init_module(empty_init=True) if meta else contextlib.nullcontext():
        net = TiedNet(third)
    net.embed.weight.requires_grad_(not frozen)
    return loom.setup_module(net)


def run(
    loom: Loom,
    steps: range = range(STEPS),
    ckpt: str | None = None,
    initial: bool = True,
    momentum: float = 0.9,
    accumulate: bool = False,
    **options,
) -> dict:
    """`build`'s model trained for `steps` (from the checkpoint `ckpt`): initial and final states, losses, norms."""
    model = build(loom, **options)
    # (FSDP1's state_dict before the first forward leaves its nested units marked as roots)
    first = full_state(loom, model) if initial else {}
    opt = loom.setup_optimizers(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2, momentum=momentum)
    )
    if ckpt is not None:
        loom.load(ckpt, {"model": model, "opt": opt})
    losses, norms = train(loom, model, opt, steps, accumulate)
    return {
        "initial": first,
        "losses": losses,
        "norms": norms,
        "state": full_state(loom, model),
        "model": model,
        "opt": opt,
        "loom": loom,
    }


def _results(res: dict) -> dict:
    return {k: res[k] for k in ("initial", "losses", "norms", "state")}


def _pipeline_checks(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    # split_fn with the model's own modules, 1F1B; the traced cut on a meta-device model; three users on four
    # stages (interleaved: rank 0 holds two copies); a frozen tied weight
    out["split_fn"] = _results(run(pipeline(world, split_fn=Stage)))
    out["traced_meta"] = _results(run(pipeline(world), meta=True))
    res = run(
        pipeline(
            world,
            schedule="interleaved_1f1b",
            stages_per_rank=2,
            split_points=["layers.1", "layers.2", "layers.3"],
        ),
        third=True,
    )
    out["three_users"] = _results(res)
    res["loom"].save_raw(f"{tmp}/raw_three", res["model"])  # rank 0 holds two of the three copies
    out["frozen"] = _results(run(pipeline(world, split_fn=Stage), frozen=True))
    # accumulation over two halves, each backward synchronising: the copies' sum counts each batch once
    out["accumulate"] = _results(run(pipeline(world, split_fn=Stage), accumulate=True))
    # ---- checkpoints: saved at pp 2 after 2 steps, resumed at pp 1, under ddp, and at pp 2 from ddp's --------------
    res = run(pipeline(world, split_fn=Stage), steps=range(2))
    state = {"model": res["model"], "opt": res["opt"]}
    res["loom"].save_raw(f"{tmp}/raw", res["model"])
    # read back at pp 2 by another cut: the head's copy from the one tensor the file holds (embed.weight)
    loom = pipeline(world)
    model = build(loom)
    loom.load_raw(f"{tmp}/raw", model)
    out["load_raw"] = full_state(loom, model)
    # a file that lacks a tensor of stage 1 only: every rank raises the same error, none trains on alone
    if rank == 0:
        from safetensors.torch import load_file, save_file

        whole = {}
        for file in sorted(Path(f"{tmp}/raw").glob("*.safetensors")):
            whole.update(load_file(str(file)))
        del whole["head.bias"]
        Path(f"{tmp}/lacking").mkdir()
        save_file(whole, f"{tmp}/lacking/model.safetensors", metadata={"format": "pt"})
    loom.barrier()
    try:
        loom.load_raw(f"{tmp}/lacking", model)
        out["load_raw_lacking"] = None
    except CheckpointError as error:
        out["load_raw_lacking"] = str(error)
    res["loom"].save(f"{tmp}/sharded", state)
    res["loom"].strategy.save_distributed_checkpoint = False
    res["loom"].save(f"{tmp}/full.pt", state)
    for name, path in [("sharded", f"{tmp}/sharded"), ("full", f"{tmp}/full.pt")]:
        ddp = Loom(strategy="ddp", accelerator="cpu", devices=world)
        ddp.launch()
        out[f"{name}->ddp"] = run(ddp, steps=range(2, STEPS), ckpt=path)["state"]
        pp1 = pipeline(world, pipeline_parallel_size=1, data_parallel_size=2, split_points=[])
        out[f"{name}->pp1"] = run(pp1, steps=range(2, STEPS), ckpt=path)["state"]
        out[f"{name}->pp2"] = run(pipeline(world), steps=range(2, STEPS), ckpt=path)["state"]
    # An optimizer without state (SGD without momentum) saves the tied weight in its param group only: the head's
    # copy on stage 1 must still be listed in its group at the load (it was left out, and only that rank raised)
    res = run(pipeline(world, split_fn=Stage), steps=range(2), momentum=0.0)
    res["loom"].strategy.save_distributed_checkpoint = False
    res["loom"].save(f"{tmp}/stateless.pt", {"model": res["model"], "opt": res["opt"]})
    out["stateless->pp2"] = run(
        pipeline(world), steps=range(2, STEPS), ckpt=f"{tmp}/stateless.pt", momentum=0.0
    )["state"]
    # An optimizer state that does not fit one stage only (the head's bias left out of its group): every rank
    # raises, none trains on into a collective that the failed rank never joins
    if rank == 0:
        broken = torch.load(f"{tmp}/stateless.pt", weights_only=False)
        broken["opt"]["param_groups"][0]["params"].remove("head.bias")
        torch.save(broken, f"{tmp}/broken.pt")
    loom = pipeline(world)
    loom.barrier()
    try:
        run(loom, steps=range(0), ckpt=f"{tmp}/broken.pt", momentum=0.0)
        out["broken"] = None
    except CheckpointError as error:
        out["broken"] = str(error)
    ddp = Loom(strategy="ddp", accelerator="cpu", devices=world)
    ddp.launch()
    res = run(ddp, steps=range(2))
    ddp.save(f"{tmp}/ddp.pt", {"model": res["model"], "opt": res["opt"]})
    out["ddp->pp2"] = run(pipeline(world, split_fn=Stage), steps=range(2, STEPS), ckpt=f"{tmp}/ddp.pt")[
        "state"
    ]
    # ---- a copy sharded by fully_shard on one stage and plain on the other: refused on every rank -------------------
    strategy: list = []

    def shard_embed_only(stage: nn.Module, mesh) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        if stage.embed is not None:
            fully_shard(stage.embed, **strategy[0].unit_kwargs())
        return stage

    loom = pipeline(world, split_fn=Stage, parallelize_fn=shard_embed_only)
    strategy.append(loom.strategy)
    try:
        loom.setup_module(TiedNet())
        out["unlike_copies"] = None
    except MisuseError as error:
        out["unlike_copies"] = str(error)
    return out


def _sharded_checks(rank: int, world: int) -> dict:
    """A policy of every nn.Linear would make the embedding and the head two units, each sharding its own copy of
    the tied weight: the two are left out, so the root shards it once (the blocks' Linears are units)."""
    out: dict = {}
    for name, strategy in [
        ("fsdp", lambda: FSDPStrategy(auto_wrap_policy={nn.Linear})),
        ("fsdp_legacy", lambda: FSDPStrategy(auto_wrap_policy=_legacy_linear_policy)),
        ("fsdp2", lambda: FSDP2Strategy(shard_policy={nn.Linear})),
    ]:
        loom = Loom(strategy=strategy(), accelerator="cpu", devices=world)
        loom.launch()
        res = run(loom, initial=False)
        res["summary"] = describe(res["model"])
        res["skipped"] = list(loom.strategy._tie_skipped)
        out[name] = {k: res[k] for k in ("initial", "losses", "norms", "state", "summary", "skipped")}
    # Built on the meta device: each user's reset_parameters draws into the one tied weight, which must keep the
    # first user's draw (the embedding's, as the model built for real keeps it), the later draws still made.
    loom = Loom(strategy=FSDP2Strategy(shard_policy={nn.Linear}), accelerator="cpu", devices=world)
    loom.launch()
    out["fsdp2_meta"] = _results(run(loom, meta=True))
    return out


def _legacy_linear_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return True if recurse else isinstance(module, nn.Linear)


def _body(rank: int, world: int, tmp: str) -> dict:
    return {"pipeline": _pipeline_checks(rank, world, tmp), "sharded": _sharded_checks(rank, world)}


def _pp2_dp2_body(rank: int, world: int, tmp: str) -> dict:
    """pp 2 x dp 2: the copies inside fully_shard units (their gradients summed shard by shard, after FSDP's
    reduce-scatter) and left plain (after the dp average); each saved after 2 steps, resumed at pp 2 x dp 2 and
    under "ddp" on 4 ranks."""
    out: dict = {}
    strategy: list = []

    def shard(stage: nn.Module, mesh) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for module in (stage.embed, *stage.layers.values(), stage.head):
            if module is not None:
                fully_shard(module, **strategy[0].unit_kwargs())
        return stage

    for name, parallelize in (("units", shard), ("plain", None)):
        for resume in (False, True):
            loom = pipeline(world, split_fn=Stage, data_parallel_size=2, parallelize_fn=parallelize)
            strategy[:] = [loom.strategy]
            res = run(
                loom, steps=range(2, STEPS) if resume else range(2), ckpt=f"{tmp}/{name}" if resume else None
            )
            if not resume:
                loom.save(f"{tmp}/{name}", {"model": res["model"], "opt": res["opt"]})
            out[f"{name}_resumed" if resume else name] = _results(res)
        ddp = Loom(strategy="ddp", accelerator="cpu", devices=world)
        ddp.launch()
        out[f"{name}_ddp"] = run(ddp, steps=range(2, STEPS), ckpt=f"{tmp}/{name}")["state"]
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("ties")


@pytest.fixture(scope="module")
def results(folder) -> list[dict]:
    return run_ranks(_body, 2, str(folder), timeout=300)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def merged(results: list[dict], *keys: str) -> dict[str, torch.Tensor]:
    """The whole model from every rank's stages (each key from the first rank that holds it), and each copy of
    the tied weight checked equal to the others."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        value = r
        for key in keys:
            value = value[key]
        for k, v in value.items():
            if k in out:
                assert torch.equal(out[k], v), k  # a copy of the tied weight, or a replica
            out.setdefault(k, v)
    return out


@pytest.mark.parametrize("case", ["split_fn", "traced_meta", "three_users", "frozen", "accumulate"])
def test_pipeline_trains_a_tied_weight_as_one_process(results, case) -> None:
    expected = reference(third=case == "three_users", frozen=case == "frozen")
    got = merged(results, "pipeline", case, "state")
    # both names of the tied weight, on the two stages, hold the value one process's one tensor holds
    assert close(got, expected["state"]) <= TOL, case
    assert (
        close(
            merged(results, "pipeline", case, "initial"), reference(0, third=case == "three_users")["state"]
        )
        == 0
    )
    for r in results:  # the norm counts the tied weight once
        assert r["pipeline"][case]["norms"] == pytest.approx(expected["norms"], abs=TOL), case
        assert r["pipeline"][case]["losses"] == pytest.approx(expected["losses"], abs=TOL), case


def test_pipeline_checkpoints_resume_at_other_degrees(results, folder) -> None:
    expected = reference()["state"]
    # The weight once, under the model's names, as one process saves it: one tensor under both model names, the
    # optimizer's state under the first name only (the copies' equal states merged)
    full = torch.load(folder / "full.pt", weights_only=False)
    assert full["model"]["embed.weight"] is full["model"]["head.weight"]
    assert "head.weight" not in full["opt"]["state"] and "embed.weight" in full["opt"]["state"]
    assert full["opt"]["param_groups"][0]["params"].count("embed.weight") == 1
    assert (
        full["opt"]["param_groups"][0]["params"]
        == torch.load(folder / "ddp.pt", weights_only=False)["opt"]["param_groups"][0]["params"]
    )
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(folder / "sharded")).read_metadata().state_dict_metadata)
    assert not any(k.startswith("opt.state.head.weight") for k in keys), sorted(keys)
    assert any(k.startswith("opt.state.embed.weight") for k in keys), sorted(keys)
    for case in (
        "sharded->ddp",
        "full->ddp",
        "sharded->pp1",
        "full->pp1",
        "sharded->pp2",
        "full->pp2",
        "ddp->pp2",
    ):
        assert close(merged(results, "pipeline", case), expected) <= TOL, case


def _raw(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a save_raw directory, read with plain safetensors."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("case", ["raw", "raw_three"])
def test_pipeline_save_raw_writes_a_tied_weight_once_as_one_process(results, folder, case) -> None:
    """The oracle: one process's save_raw of the model trained alike (the weight under its first name only)."""
    pytest.importorskip("safetensors")
    third = case == "raw_three"
    expected = reference(steps=2 if case == "raw" else STEPS, third=third)["state"]
    one = Loom(accelerator="cpu", devices=1)
    net = TiedNet(third)
    net.load_state_dict(expected)
    one.save_raw(folder / f"{case}_one", one.setup_module(net))
    want, got = _raw(folder / f"{case}_one"), _raw(folder / case)
    assert "head.weight" not in want and "embed.weight" in want  # what the check below rests on
    assert close(got, want) <= TOL, case


def test_pipeline_load_raw_fills_every_copy_and_refuses_a_lacking_file_on_every_rank(results, folder) -> None:
    pytest.importorskip("safetensors")
    written = _raw(folder / "raw")
    assert "head.weight" not in written
    assert (
        close(merged(results, "pipeline", "load_raw"), {**written, "head.weight": written["embed.weight"]})
        == 0
    )
    for r in results:
        message = r["pipeline"]["load_raw_lacking"]
        assert (
            message is not None and "no tensor for 1 of the model's" in message and "'head.bias'" in message
        )


def test_pipeline_resumes_a_tied_weight_of_an_optimizer_without_state(results) -> None:
    expected = reference(momentum=0.0)["state"]
    assert close(merged(results, "pipeline", "stateless->pp2"), expected) <= TOL


def test_pipeline_load_that_fails_on_one_stage_raises_on_every_rank(results) -> None:
    for r in results:
        message = r["pipeline"]["broken"]
        assert message is not None and "failed on 1 rank of 2" in message, message
        assert "rank 1: ValueError" in message and "param groups" in message, message


def test_pipeline_refuses_copies_laid_out_unlike(results) -> None:
    for r in results:
        message = r["pipeline"]["unlike_copies"]
        assert message is not None and "'embed.weight' and 'head.weight'" in message, message
        assert "stage 0: a DTensor" in message and "stage 1: a plain tensor" in message, message
        assert "fully_shard each of them (or none)" in message, message


@pytest.mark.parametrize("flavour", ["fsdp", "fsdp_legacy", "fsdp2"])
def test_sharded_policy_places_a_tied_weight_in_the_unit_of_both_users(results, flavour) -> None:
    expected = reference()
    for r in results:
        got = r["sharded"][flavour]
        assert close(got["state"], expected["state"]) <= TOL, flavour
        assert got["norms"] == pytest.approx(expected["norms"], abs=TOL), flavour
        assert got["losses"] == pytest.approx(expected["losses"], abs=TOL), flavour
        # where the tied weight went and what it costs, in the sharding summary
        assert (
            "tied weight 'embed.weight' = 'head.weight' (64 elements): sharded once by unit '<root>'"
            in (got["summary"])
        ), got["summary"]
        assert "0.00 MiB per rank at rest" in got["summary"], got["summary"]
        assert {"embed", "head"} <= set(got["skipped"]), got["skipped"]


def test_sharded_meta_init_keeps_the_first_users_draw_of_a_tied_weight(results) -> None:
    for r in results:
        got = r["sharded"]["fsdp2_meta"]
        assert close(got["initial"], reference(0)["state"]) == 0
        assert close(got["state"], reference()["state"]) <= TOL


@pytest.fixture(scope="module")
def results_dp2(tmp_path_factory) -> list[dict]:
    return run_ranks(_pp2_dp2_body, 4, str(tmp_path_factory.mktemp("ties_dp2")), timeout=300)


@pytest.mark.parametrize("layout", ["units", "plain"])
def test_pipeline_sums_tied_copies_with_data_parallel(results_dp2, layout) -> None:
    after_two, expected = reference(2), reference()
    assert close(merged(results_dp2, layout, "state"), after_two["state"]) <= TOL, layout
    for r in results_dp2:
        assert r[layout]["norms"] == pytest.approx(after_two["norms"], abs=TOL), layout
    assert close(merged(results_dp2, f"{layout}_resumed", "state"), expected["state"]) <= TOL, layout
    assert close(merged(results_dp2, f"{layout}_ddp"), expected["state"]) <= TOL, layout
