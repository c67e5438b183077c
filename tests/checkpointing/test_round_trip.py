"""Save/load round trips on 2 CPU ranks for every FSDP layout x flavour x format: bit-exact parameters and
optimizer state, and one more training step after load equals one more step without the save/load."""

from __future__ import annotations

import warnings

import pytest
import torch
from fsdp_models import D_IN, Block, D, Net, build_layout, full_state, layout_strategy
from harness import run_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from torchloom import Loom

LAYOUTS = ("wrapped_root", "units_no_root", "units_plus_leftovers")


class Counter:
    """A user object with state_dict()/load_state_dict()."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def _step(loom, model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + loom.global_rank)
    x, y = torch.randn(4, D_IN, generator=g), torch.randn(4, 1, generator=g)
    loom.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()


def _differing(expected: dict, got: dict) -> list[str]:
    """The keys whose tensors are not bit-identical (or missing), so a failure names them."""
    return sorted(k for k in expected if k not in got or not torch.equal(expected[k], got[k]))


def _same_value(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def _optimizer_state(model, opt) -> dict:
    state = get_optimizer_state_dict(
        model.forward_module, opt.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {
        k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
        for k, s in state["state"].items()
    }


def _fresh(loom, flavour, layout, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the one-unit hint
        model = loom.setup_module(build_layout(loom, flavour, layout, seed=seed))
    opt = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _round_trip_body(rank: int, world_size: int, flavour: str, root: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        for fmt in ("sharded", "full"):
            loom = Loom(
                accelerator="cpu",
                devices=world_size,
                strategy=layout_strategy(flavour, layout, state_dict_type=fmt),
            )
            loom.launch()
            model, opt, sched = _fresh(loom, flavour, layout, seed=0)
            counter = Counter()
            for i in range(2):
                _step(loom, model, opt, i)
                sched.step()
                counter.seen += 1
            path = f"{root}/{flavour}-{layout}-{fmt}"
            saved_params, saved_opt = full_state(model), _optimizer_state(model, opt)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loom.save(
                    path,
                    {"model": model, "optimizer": opt, "scheduler": sched, "counter": counter, "step": 2},
                )
            _step(loom, model, opt, 99)
            continued = full_state(model)

            model2, opt2, sched2 = _fresh(
                loom, flavour, layout, seed=1
            )  # another init: load must overwrite it
            before_load = full_state(model2)
            counter2 = Counter()
            state = {"model": model2, "optimizer": opt2, "scheduler": sched2, "counter": counter2}
            with warnings.catch_warnings(record=True) as caught_load:
                warnings.simplefilter("always")
                rest = loom.load(path, state)
            loaded_params, loaded_opt = full_state(model2), _optimizer_state(model2, opt2)
            _step(loom, model2, opt2, 99)
            out[(layout, fmt)] = {
                "init_differed": _differing(saved_params, before_load) == sorted(saved_params),
                "params": _differing(saved_params, loaded_params),
                "optimizer": [
                    f"{k}.{n}"
                    for k in saved_opt
                    for n in saved_opt[k]
                    if not _same_value(saved_opt[k][n], loaded_opt.get(k, {}).get(n))
                ]
                + sorted(set(loaded_opt) ^ set(saved_opt)),
                "next_step": _differing(continued, full_state(model2)),
                "lr": (sched.get_last_lr(), sched2.get_last_lr()),
                "counter": counter2.seen,
                "rest": rest,
                "warnings": [
                    f"{w.category.__name__}: {w.message}"
                    for w in [*caught, *caught_load]
                    if issubclass(w.category, (FutureWarning, DeprecationWarning))
                ],
            }
    return out


@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
def test_round_trip_every_layout_and_format(flavour, tmp_path):
    results = run_ranks(_round_trip_body, 2, flavour, str(tmp_path), timeout=240)
    for rank, result in enumerate(results):
        for (layout, fmt), r in result.items():
            where = f"{flavour} {layout} {fmt} rank {rank}"
            assert r["init_differed"], where  # otherwise the load below would prove nothing
            assert r["params"] == [], where
            assert r["optimizer"] == [], where
            assert r["next_step"] == [], where
            assert r["lr"][0] != [1e-2] and r["lr"][0] == r["lr"][1], where  # the scheduler state came back
            assert r["counter"] == 2, where
            assert r["rest"] == {"step": 2}, where
            assert r["warnings"] == [], where
    assert (tmp_path / f"{flavour}-units_plus_leftovers-sharded").is_dir()
    assert (tmp_path / f"{flavour}-units_plus_leftovers-full").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def _before_setup_body(rank: int, world_size: int, root: str) -> dict:
    """The field's failing case: saving a module whose submodules were wrapped inside init_module, before
    setup_module; and a plain module that is never set up."""
    out = {}
    for fmt in ("sharded", "full"):
        loom = Loom(
            accelerator="cpu",
            devices=world_size,
            strategy=layout_strategy("fsdp", "units_plus_leftovers", state_dict_type=fmt),
        )
        loom.launch()
        torch.manual_seed(0)
        with loom.init_module():
            wrapped = Net(wrap_blocks=True)
        plain = Net()
        loom.save(f"{root}/before-{fmt}", {"wrapped": wrapped, "plain": plain})
        expected_plain = {k: v.clone() for k, v in plain.state_dict().items()}
        torch.manual_seed(5)
        with loom.init_module():
            wrapped2 = Net(wrap_blocks=True)
        plain2 = Net()
        loom.load(f"{root}/before-{fmt}", {"wrapped": wrapped2, "plain": plain2})
        model = loom.setup_module(wrapped2)
        torch.manual_seed(0)
        reference = Net()
        out[fmt] = {
            "plain": _differing(expected_plain, plain2.state_dict()),
            "wrapped": _differing(reference.state_dict(), full_state(model)),
        }
    return out


def test_save_before_setup_and_plain_module(tmp_path):
    for result in run_ranks(_before_setup_body, 2, str(tmp_path), timeout=120):
        for fmt, r in result.items():
            assert r == {"plain": [], "wrapped": []}, fmt


def _dotted_names_body(rank: int, world_size: int, root: str) -> dict:
    """Entry names with dots ("model.ema") in a sharded checkpoint, loaded with strict=True and strict=False; and
    two entries whose tensors would share a stored name, refused before anything is written."""
    from fsdp_models import Block

    from torchloom import CheckpointError
    from torchloom.strategies import FSDP2Strategy

    loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(shard_policy={Block}))
    loom.launch()

    def fresh(seed: int):
        torch.manual_seed(seed)
        model, ema = loom.setup_module(Net()), loom.setup_module(Net())
        return model, ema, loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))

    model, ema, opt = fresh(0)
    _step(loom, model, opt, 0)
    path = f"{root}/dotted"
    loom.save(path, {"model": model, "model.ema": ema, "optimizer": opt, "model.step": 3})
    expected = (full_state(model), full_state(ema), _optimizer_state(model, opt))
    out: dict = {}
    for strict in (True, False):
        model2, ema2, opt2 = fresh(5 + strict)
        before = full_state(ema2)
        state = {"model": model2, "model.ema": ema2, "optimizer": opt2}
        rest = loom.load(path, state, strict=strict)
        got = _optimizer_state(model2, opt2)
        out[strict] = {
            "init_differed": _differing(expected[1], before) == sorted(expected[1]),
            "model": _differing(expected[0], full_state(model2)),
            "ema": _differing(expected[1], full_state(ema2)),
            "optimizer": sorted(
                f"{k}.{n}"
                for k in expected[2]
                for n in expected[2][k]
                if not _same_value(expected[2][k][n], got.get(k, {}).get(n))
            ),
            "rest": rest,
        }
    try:
        loom.save(f"{root}/clash", {"model": model, "model.embed": torch.nn.Linear(D_IN, 16)})
        out["clash"] = None
    except CheckpointError as error:
        out["clash"] = str(error)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_entry_names_with_dots_load_sharded(world_size, tmp_path):
    for rank, result in enumerate(run_ranks(_dotted_names_body, world_size, str(tmp_path), timeout=180)):
        for strict in (True, False):
            r = result[strict]
            where = f"strict={strict} rank {rank}"
            assert r["init_differed"], where
            assert r["model"] == [] and r["ema"] == [] and r["optimizer"] == [], (where, r)
            assert r["rest"] == {"model.step": 3}, where
        assert "Entries 'model' and 'model.embed' both store a tensor named 'model.embed.weight'" in (
            result["clash"] or ""
        ), result["clash"]
    assert not (tmp_path / "clash").exists()


class Calibrated(torch.nn.Module):
    """A layer with plain-data extra state (`get_extra_state`), as quantisation observers and some transformer
    layers keep: stored under "<name>._extra_state", not as a tensor."""

    def __init__(self, dim: int, state: dict) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)
        self.calib = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def get_extra_state(self) -> dict:
        return dict(self.calib)

    def set_extra_state(self, state) -> None:
        self.calib = state


class Uncalibrated(Calibrated):
    """The same layer (the same parameters) without extra state."""

    get_extra_state = torch.nn.Module.get_extra_state
    set_extra_state = torch.nn.Module.set_extra_state


CALIBRATED = {"calls": 7, "scale": [0.5, 2.0], "observer": {"min": -1.5, "max": 3.0}, "mode": "int8"}
EXTRA_KEYS = ("0.0._extra_state", "2._extra_state")


def _calibrated_model(loom, flavour: str, state: dict | None) -> torch.nn.Module:
    """A unit holding a layer with extra state, a block unit, a replicated layer with extra state and a
    replicated head (`state=None`: the same parameters, no extra state). The layer with extra
    state is not a unit's own root: torch's `get_model_state_dict` fails for that under FSDP1."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import wrap

    def layer(dim: int) -> torch.nn.Module:
        return Calibrated(dim, dict(state)) if state is not None else Uncalibrated(dim, {})

    torch.manual_seed(0)
    if flavour == "fsdp":
        with loom.init_module():
            first, block = wrap(torch.nn.Sequential(layer(D_IN), torch.nn.Linear(D_IN, D))), wrap(Block())
    else:
        first, block = torch.nn.Sequential(layer(D_IN), torch.nn.Linear(D_IN, D)), Block()
        fully_shard(first)
        fully_shard(block)
    return loom.setup_module(torch.nn.Sequential(first, block, layer(D), torch.nn.Linear(D, 1)))


def _calibs(model) -> list:
    """The extra state of the model's two layers that have it."""
    return [model.module[0][0].calib, model.module[2].calib]


def _refusal(loom, path: str, model) -> str | None:
    """The CheckpointError of a strict load, or None."""
    from torchloom.errors import CheckpointError

    try:
        loom.load(path, {"model": model})
    except CheckpointError as exc:
        return str(exc)
    return None


def _extra_state_body(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for flavour in ("fsdp", "fsdp2"):
        for fmt in ("sharded", "full"):
            loom = Loom(
                accelerator="cpu",
                devices=world_size,
                strategy=layout_strategy(flavour, "units_plus_leftovers", state_dict_type=fmt),
            )
            loom.launch()
            path = f"{root}/{flavour}-{fmt}"
            loom.save(path, {"model": _calibrated_model(loom, flavour, CALIBRATED)})
            # A fresh layer whose extra state has other values and fewer keys: the load restores what was saved.
            fresh = _calibrated_model(loom, flavour, {"calls": 0})
            loom.load(path, {"model": fresh})
            refused = _refusal(loom, path, _calibrated_model(loom, flavour, None))
            # strict=False: extra state the model lacks is skipped; extra state the checkpoint lacks stays as it is.
            loom.load(path, {"model": _calibrated_model(loom, flavour, None)}, strict=False)
            loom.save(f"{path}-none", {"model": _calibrated_model(loom, flavour, None)})
            refused_missing = _refusal(loom, f"{path}-none", _calibrated_model(loom, flavour, {"calls": 1}))
            kept = _calibrated_model(loom, flavour, {"calls": -1})
            loom.load(f"{path}-none", {"model": kept}, strict=False)
            out[(flavour, fmt)] = {
                "loaded": _calibs(fresh),
                "refused": [refused, refused_missing],
                "kept": _calibs(kept),
            }
    return out


def test_extra_state_round_trips(tmp_path):
    """A module's `get_extra_state()` survives both formats under both flavours on 2 ranks, a sharded checkpoint
    loaded into one plain process, and consolidation. Before, a sharded load left it out of DCP's template
    ("Missing key(s) in state_dict: _extra_state"), and a full load under FSDP handed `set_extra_state` PyTorch's
    internal placeholder object."""
    from torchloom.checkpointing.tools import consolidate

    for rank, result in enumerate(run_ranks(_extra_state_body, 2, str(tmp_path), timeout=240)):
        for (flavour, fmt), r in result.items():
            where = f"{flavour} {fmt} rank {rank}"
            assert r["loaded"] == [CALIBRATED, CALIBRATED], where
            # Strict: a model without the extra state, or a checkpoint without it, is refused naming the keys.
            for refused in r["refused"]:
                assert refused is not None and all(repr(k) in refused for k in EXTRA_KEYS), (where, refused)
            assert r["kept"] == [{"calls": -1}, {"calls": -1}], where

    loom = Loom(accelerator="cpu")  # one process, a plain model
    torch.manual_seed(0)
    model = loom.setup_module(
        torch.nn.Sequential(
            torch.nn.Sequential(Calibrated(D_IN, {}), torch.nn.Linear(D_IN, D)),
            Block(),
            Calibrated(D, {}),
            torch.nn.Linear(D, 1),
        )
    )
    loom.load(tmp_path / "fsdp2-sharded", {"model": model})
    assert _calibs(model) == [CALIBRATED, CALIBRATED]
    consolidated = consolidate(tmp_path / "fsdp2-sharded", tmp_path / "one.pt")["model"]
    assert [consolidated[k] for k in EXTRA_KEYS] == [CALIBRATED, CALIBRATED]
    from_file = torch.load(tmp_path / "one.pt", weights_only=True)["model"]
    assert [from_file[k] for k in EXTRA_KEYS] == [CALIBRATED, CALIBRATED]
    full_file = torch.load(tmp_path / "fsdp-full", weights_only=True)["model"]
    assert [full_file[k] for k in EXTRA_KEYS] == [CALIBRATED, CALIBRATED]
