"""The Checkpointer and what it depends on: the declared interface (and nothing else) of the strategy, the run's
state in one place in both formats (and checkpoints of format version 1 still load), and the async save's life."""

from __future__ import annotations

import ast
import json
import random
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import torchloom
from torchloom import CheckpointError, Loom
from torchloom.checkpointing import Checkpointer, ScalerState, StateAccess, full, rng, sharded, tools
from torchloom.checkpointing.state import META_KEY
from torchloom.strategies import DDPStrategy, FSDP2Strategy, FSDPStrategy, SingleDeviceStrategy

SRC = Path(torchloom.__file__).parent
# A loss scaler state no fresh scaler has: a lowered scale and a growth tracker part-way.
SCALER = {
    "scale": 256.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 3,
}


def _members(protocol: type) -> list[str]:
    return sorted(
        {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))
    )


# ---- the interface, and that imports point one way -------------------------------------------------------------
def _imports(path: Path, module_level_only: bool) -> list[str]:
    """Every module `path` imports (`from torchloom import checkpointing` counts as torchloom.checkpointing)."""
    tree = ast.parse(path.read_text())
    nodes = list(tree.body) if module_level_only else list(ast.walk(tree))
    if module_level_only:  # also the bodies of module-level `if` / `try` (TYPE_CHECKING, optional imports)
        nodes += [n for top in tree.body if isinstance(top, (ast.If, ast.Try)) for n in ast.walk(top)]
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_checkpointing_never_imports_strategies_and_strategies_do_not_import_checkpointing():
    for path in sorted((SRC / "checkpointing").glob("*.py")):
        bad = [n for n in _imports(path, module_level_only=False) if n.startswith("torchloom.strategies")]
        assert not bad, f"{path.name} imports {bad}: checkpointing depends on StateAccess only"
    for path in sorted((SRC / "strategies").glob("*.py")):
        bad = [n for n in _imports(path, module_level_only=True) if n.startswith("torchloom.checkpointing")]
        assert not bad, f"strategies/{path.name} imports {bad} at module level"


@pytest.mark.parametrize("cls", [SingleDeviceStrategy, DDPStrategy, FSDPStrategy, FSDP2Strategy])
def test_every_strategy_declares_what_checkpointing_needs(cls):
    missing = [m for m in _members(StateAccess) if not hasattr(cls, m)]
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_a_looms_strategy_and_precision_satisfy_the_protocols():
    loom = Loom(accelerator="cpu", devices=1, precision="16-mixed")
    assert isinstance(loom.strategy, StateAccess)
    assert isinstance(loom.strategy.precision, ScalerState)


class _OnlyDeclared:
    """The strategy, with every member that `StateAccess` does not declare hidden: checkpointing that reached
    past the interface fails here with AttributeError."""

    def __init__(self, strategy: object) -> None:
        object.__setattr__(self, "_strategy", strategy)

    def __getattr__(self, name: str) -> object:
        if name not in _members(StateAccess):
            raise AttributeError(f"checkpointing used {name!r}, which StateAccess does not declare")
        return getattr(object.__getattribute__(self, "_strategy"), name)


@pytest.mark.parametrize("strategy", ["auto", "fsdp2"])
def test_save_and_load_need_nothing_but_the_declared_interface(tmp_path, strategy):
    loom = Loom(accelerator="cpu", devices=1, strategy=strategy)
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    loom.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    checkpointer = Checkpointer(_OnlyDeclared(loom.strategy), loom.strategy.precision)
    fmt = loom.strategy.checkpoint_format
    checkpointer.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "step": 1}, async_save=True)
    checkpointer.finish_pending_save()
    want = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    fresh = loom.setup_module(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    fresh_opt = loom.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=0.1))
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    assert checkpointer.load(tmp_path / "ckpt", state, strict=True) == {}
    got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in fresh.state_dict().items()}
    assert state["step"] == 1
    assert [k for k in want if not torch.equal(want[k], got[k])] == [], fmt
    checkpointer.close()


# ---- the run's state: one place in both formats ------------------------------------------------------------------
def _fp16_loom(strategy: str = "auto") -> Loom:
    loom = Loom(accelerator="cpu", devices=1, strategy=strategy, precision="16-mixed")
    loom.launch()
    return loom


def test_the_scaler_and_generators_live_in_the_record_in_both_formats(tmp_path):
    for strategy, path in (("auto", tmp_path / "full.pt"), ("fsdp2", tmp_path / "sharded")):
        loom = _fp16_loom(strategy)
        loom.strategy.precision.load_state_dict(SCALER)
        model = loom.setup_module(nn.Linear(4, 2))
        loom.save(path, {"model": model, "step": 3})
        if path.is_dir():
            pickled = torch.load(path / sharded.EXTRA_FILE, weights_only=True)
            described = json.loads((path / sharded.META_FILE).read_text())
            assert "grad_scaler" not in described and "rng" not in described
            assert "__grad_scaler__" not in pickled and "__rng__" not in pickled  # version 1's places
        else:
            pickled = torch.load(path, weights_only=True)
        assert pickled[META_KEY]["grad_scaler"] == SCALER, strategy
        assert len(pickled[META_KEY]["rng"]) == 1, strategy
        fresh = _fp16_loom(strategy)
        assert fresh.strategy.precision.state_dict() != SCALER
        state = {"model": fresh.setup_module(nn.Linear(4, 2))}
        assert fresh.load(path, state, restore_run_state=True) == {"step": 3}
        assert fresh.strategy.precision.state_dict() == SCALER, strategy


def _old_generators() -> tuple[list[dict], float]:
    """Every rank's generators as version 1 saved them (one rank), and the number they draw next."""
    random.seed(1234)
    torch.manual_seed(1234)
    saved = [rng.capture()]
    return saved, torch.rand(()).item()


def _scrambled_after_load(loom: Loom, path: Path, state: dict) -> tuple[dict, float]:
    torch.manual_seed(99)  # the load must put back the saved generators
    leftovers = loom.load(path, state, restore_run_state=True)
    return leftovers, torch.rand(()).item()


def test_a_version_1_full_file_loads_its_scaler_and_generators(tmp_path):
    # Version 1's full layout: the run's state inside the `__torchloom__` metadata (as now), version 1.
    model = nn.Linear(4, 2)
    generators, next_draw = _old_generators()
    meta = {
        "version": 1,
        "format": "full",
        "world_size": 1,
        "strategy": "single_device",
        "precision": "16-mixed",
        "grad_scaler": SCALER,
        "kinds": {"model": "module", "step": "value"},
        "rng": generators,
    }
    torch.save({"model": model.state_dict(), "step": 5, META_KEY: meta}, tmp_path / "v1.pt")
    loom = _fp16_loom()
    state = {"model": loom.setup_module(nn.Linear(4, 2)), "step": 0}
    leftovers, draw = _scrambled_after_load(loom, tmp_path / "v1.pt", state)
    assert leftovers == {} and state["step"] == 5
    assert loom.strategy.precision.state_dict() == SCALER
    assert draw == next_draw
    assert torch.equal(state["model"].weight, model.weight)


def _version_1_sharded(path: Path, model: nn.Module, generators: list[dict]) -> None:
    """A sharded checkpoint laid out as format version 1 wrote it: the scaler and the generators as the
    top-level entries `__grad_scaler__` and `__rng__` of extra.pt."""
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    meta = {
        "version": 1,
        "format": "sharded",
        "world_size": 1,
        "strategy": "fsdp2",
        "precision": "16-mixed",
        "kinds": {"model": "module", "step": "value"},
    }
    (path / sharded.META_FILE).write_text(json.dumps(meta))
    torch.save({"step": 7, "__grad_scaler__": SCALER, "__rng__": generators}, path / sharded.EXTRA_FILE)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_version_1_sharded_checkpoint_loads_its_scaler_and_generators(tmp_path):
    model = nn.Linear(4, 2)
    generators, next_draw = _old_generators()
    _version_1_sharded(tmp_path / "v1", model, generators)
    loom = _fp16_loom()
    state = {"model": loom.setup_module(nn.Linear(4, 2)), "step": 0}
    leftovers, draw = _scrambled_after_load(loom, tmp_path / "v1", state)
    assert leftovers == {}  # the old records are no user entries
    assert state["step"] == 7
    assert loom.strategy.precision.state_dict() == SCALER
    assert draw == next_draw
    assert torch.equal(state["model"].weight, model.weight)
    # Without a state: every user entry, and still none of the records.
    assert sorted(_fp16_loom().load(tmp_path / "v1")) == ["model", "step"]

    # consolidate turns it into this version's full file, the run's state in the record.
    tools.consolidate(tmp_path / "v1", tmp_path / "one.pt")
    one = full.read(tmp_path / "one.pt")
    assert one[META_KEY]["grad_scaler"] == SCALER and "__grad_scaler__" not in one
    fresh = _fp16_loom()
    _, draw = _scrambled_after_load(
        fresh, tmp_path / "one.pt", {"model": fresh.setup_module(nn.Linear(4, 2))}
    )
    assert fresh.strategy.precision.state_dict() == SCALER and draw == next_draw


def _run_state_after_load(strategy: str, path: Path, entries: str, **kwargs) -> tuple[bool, bool]:
    """Whether a load into a fresh Loom (seeded 99) brought back the saved generators and scaler.
    `entries`: what `state` names, of "model", "optimizer" and "loader"."""
    loom = _fp16_loom(strategy)
    model = loom.setup_module(nn.Linear(4, 2))
    candidates = {
        "model": model,
        "optimizer": loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1)),
        "loader": loom.setup_dataloaders(torch.utils.data.DataLoader(list(range(8)), batch_size=2)),
    }
    torch.manual_seed(99)
    draw_without = torch.rand(()).item()
    torch.manual_seed(99)
    loom.load(path, {k: candidates[k] for k in entries.split("+")}, **kwargs)
    draw = torch.rand(()).item()
    assert draw in (draw_without, _SAVED_DRAW[0]), (draw, draw_without)
    return (
        draw == _SAVED_DRAW[0],
        loom.strategy.precision.state_dict() == SCALER,
    )


_SAVED_DRAW: list[float] = []


@pytest.mark.parametrize("strategy", ["auto", "fsdp2"])
def test_a_weights_only_load_leaves_the_run_state_alone_and_a_resume_restores_it(strategy, tmp_path):
    """Two fine-tuning runs with different seeds loading one pretrained checkpoint must draw different numbers:
    only a load that resumes (an optimizer or a set-up loader in `state`), or one that asks, restores the saved
    generators and loss scaler."""
    loom = _fp16_loom(strategy)
    loom.strategy.precision.load_state_dict(SCALER)
    model = loom.setup_module(nn.Linear(4, 2))
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        loom.setup_dataloaders(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    torch.manual_seed(1234)
    path = tmp_path / ("sharded" if strategy == "fsdp2" else "full.pt")
    loom.save(path, {"model": model, "optimizer": opt, "step": 3})
    _SAVED_DRAW[:] = [torch.rand(()).item()]

    restored = (True, True)
    assert _run_state_after_load(strategy, path, "model") == (False, False)
    assert _run_state_after_load(strategy, path, "model+optimizer") == restored
    assert _run_state_after_load(strategy, path, "model+loader", strict=False) == restored
    assert _run_state_after_load(strategy, path, "model", restore_run_state=True) == restored
    assert _run_state_after_load(strategy, path, "model+optimizer", restore_run_state=False) == (False,) * 2

    # Two fine-tuning runs of different seeds from the same weights draw different streams.
    draws = []
    for seed in (1, 2):
        fresh = _fp16_loom(strategy)
        fresh.seed_everything(seed, verbose=False)
        fresh.load(path, {"model": fresh.setup_module(nn.Linear(4, 2))})
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])


# ---- the asynchronous save's life --------------------------------------------------------------------------------
def _slow_writes(monkeypatch, seconds: float = 0.5, fail: bool = False) -> None:
    real = full.write_file

    def slow(obj, path, fsync=True):
        time.sleep(seconds)
        if fail:
            raise OSError(28, "No space left on device")
        real(obj, path, fsync)

    monkeypatch.setattr(full, "write_file", slow)


@pytest.mark.parametrize("then", ["load", "load_raw", "close"])
def test_what_follows_an_async_save_waits_for_it(tmp_path, monkeypatch, then):
    _slow_writes(monkeypatch)
    loom = Loom(accelerator="cpu", devices=1)
    model = loom.setup_module(nn.Linear(4, 2))
    path = tmp_path / "weights.pt"
    loom.save(path, dict(model.state_dict()), async_save=True)  # plain values: the file is the state dict
    assert not path.exists()  # still being written
    target = nn.Linear(4, 2)
    if then == "load":
        target.load_state_dict(loom.load(path))
    elif then == "load_raw":
        loom.load_raw(path, target)
    else:
        loom.close()
        target.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(target.weight, model.weight)


@pytest.mark.parametrize("then", ["save", "load_raw", "close"])
def test_a_failed_async_save_raises_at_the_next_call_with_its_cause(tmp_path, monkeypatch, then):
    _slow_writes(monkeypatch, seconds=0.1, fail=True)
    loom = Loom(accelerator="cpu", devices=1)
    model = loom.setup_module(nn.Linear(4, 2))
    loom.save(tmp_path / "a.pt", {"model": model}, async_save=True)
    with pytest.raises(CheckpointError, match="previous asynchronous save failed") as info:
        if then == "save":
            loom.save(tmp_path / "b.pt", {"model": model})
        elif then == "load_raw":
            loom.load_raw(tmp_path / "a.pt", model)
        else:
            loom.close()
    cause = info.value.__cause__
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__
    assert isinstance(cause, OSError) and cause.errno == 28


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_plain_dcp_checkpoints_values_load_inspect_and_consolidate(tmp_path):
    # A checkpoint written by dcp.save (torchtitan's kind): its non-tensor entries are DCP byte items. They were
    # dropped by consolidate and unknown to load ("no entries ['step']").
    model = nn.Linear(4, 2)
    saved = {
        "model": model.state_dict(),
        "step": 5,
        "app": {"epoch": 3, "name": "run"},
        "ema": {"w": torch.ones(2)},
    }
    dcp.save(saved, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    loom = Loom(accelerator="cpu", devices=1)
    state = {"model": loom.setup_module(nn.Linear(4, 2)), "step": 0}
    leftovers = loom.load(tmp_path / "plain", state)
    assert state["step"] == 5 and torch.equal(state["model"].weight, model.weight)
    assert leftovers["app"] == {"epoch": 3, "name": "run"} and torch.equal(
        leftovers["ema"]["w"], torch.ones(2)
    )
    assert sorted(Loom(accelerator="cpu", devices=1).load(tmp_path / "plain")) == [
        "app",
        "ema",
        "model",
        "step",
    ]

    info = tools.inspect(tmp_path / "plain")
    assert info["extra_entries"] == ["step", "app"] and info["values"]["step"] == 5

    tools.consolidate(tmp_path / "plain", tmp_path / "one.pt")
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    assert one["step"] == 5 and one["app"] == {"epoch": 3, "name": "run"}
    assert torch.equal(one["model"]["weight"], model.weight) and torch.equal(one["ema"]["w"], torch.ones(2))
    assert sorted(tools.consolidate(tmp_path / "plain", tmp_path / "weights.pt", model_only=True)) == [
        "ema",
        "model",
    ]
