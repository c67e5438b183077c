"""Lightning's tests_fabric/test_fabric.py as a checklist: each public behaviour it checks, run side by side.

Every test here makes the same public calls on `lightning.fabric.Fabric(accelerator="cpu")` and on
`torchloom.Loom` and compares what a user sees: return values and their types, which built-in exception types a
misuse raises, warnings, and the state afterwards. Lightning's tests are not copied: they mock Fabric's internals
(`_strategy`, `_launched`, `_FabricModule`), which torchloom does not have; these compare behaviour only.

Items covered elsewhere are not repeated: tests/test_fabric_compat.py (error types of setup twice, empty/invalid
setup_dataloaders, save filters, missing checkpoints; `launch(None)`; `call()` keyword filtering and
non-callable hooks; `on_after_setup`, `on_after_optimizer_step`; `log_metrics` by keyword; `seed_everything`'s
environment variables; `sharded_model`; `rank_zero_first`; `loader.device`; clipping's third positional
argument). Deliberate differences are in docs/fabric.md ("Where torchloom differs from Fabric on purpose"); the
tests below that meet one assert the difference, so that it stays what the page says.
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_ranks
from test_fabric_compat import _KeywordLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from torchloom import Loom

pytest.importorskip("lightning.fabric")
from lightning.fabric import Fabric  # noqa: E402


def _outcome(call: Any) -> Any:
    """What a user sees of `call()`: its value and the warnings it gave, or which built-in types its exception
    is an instance of (what `except` clauses written for Fabric catch)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = call()
        except Exception as error:  # noqa: BLE001 - the exception is the outcome
            # torchloom's errors are RuntimeErrors that are also the type Fabric raises: the most specific wins
            kinds = (ValueError, TypeError, FileNotFoundError, KeyError, RuntimeError)
            return ("raises", next((k.__name__ for k in kinds if isinstance(error, k)), type(error).__name__))
    relevant = [type(w.message).__name__ for w in caught if not issubclass(w.category, DeprecationWarning)]
    return (value, relevant) if relevant else value


def _both(script: Any) -> tuple[Any, Any]:
    """`script(cls)` once with Fabric and once with Loom; each outcome as `_outcome` reports it."""
    return _outcome(lambda: script(Fabric)), _outcome(lambda: script(Loom))


def _one(cls: type, **kwargs: Any) -> Any:
    runner = cls(accelerator="cpu", devices=1, **kwargs)
    runner.launch()
    return runner


# ---- the subclass entry point ----------------------------------------------------------------------------------
def _run_override(cls: type) -> tuple:
    class Job(cls):  # type: ignore[misc, valid-type]
        def run(self, *args: Any, **kwargs: Any) -> str:
            self.seen = (args, kwargs)
            return "result"

    job = Job(accelerator="cpu", devices=1)
    return job.run(1, 2, three=3), job.seen


def test_run_receives_the_arguments_and_returns_the_result():
    fabric, loom = _both(_run_override)
    assert fabric == ("result", ((1, 2), {"three": 3}))
    assert loom == fabric


# ---- setup -----------------------------------------------------------------------------------------------------
def _setup_shapes(cls: type) -> dict:
    runner = _one(cls)
    model = nn.Linear(1, 2)
    sgd, adam = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())
    alone = runner.setup(model)
    pair = runner.setup(model, sgd)
    triple = runner.setup(model, sgd, adam)
    single_opt = runner.setup_optimizers(sgd)
    opts = runner.setup_optimizers(sgd, adam)
    return {
        "setup(model)": (alone.module is model, alone.weight is model.weight, alone.forward != model.forward),
        "setup(model, opt)": (
            type(pair).__name__,
            len(pair),
            pair[0].module is model,
            pair[1].optimizer is sgd,
        ),
        "setup(model, opt, opt)": (type(triple).__name__, len(triple), triple[2].optimizer is adam),
        "setup_optimizers(opt)": single_opt.optimizer is sgd,
        "setup_optimizers(opt, opt)": (type(opts).__name__, [o.optimizer for o in opts] == [sgd, adam]),
    }


def test_setup_returns_what_fabric_returns():
    fabric, loom = _both(_setup_shapes)
    assert fabric["setup(model)"] == (True, True, True) and fabric["setup(model, opt)"] == (
        "tuple",
        2,
        True,
        True,
    )
    assert loom == fabric


def _devices_after_setup(cls: type) -> list:
    seen = []
    for move in (True, False):
        runner = _one(cls)
        model = nn.Linear(1, 2)
        wrapped = runner.setup_module(model, move_to_device=move)
        empty = runner.setup_module(nn.Sequential(), move_to_device=move)
        seen.append(
            (move, str(wrapped.device), str(empty.device), str(runner.device), str(model.weight.device))
        )
    return seen


def test_setup_module_device_attributes_with_and_without_moving():
    fabric, loom = _both(_devices_after_setup)
    assert loom == fabric


def _compiled(cls: type) -> tuple:
    runner = _one(cls)
    model = nn.Linear(1, 2)
    wrapped = runner.setup(torch.compile(model))
    return wrapped.weight is model.weight, [
        p is q for p, q in zip(wrapped.parameters(), model.parameters(), strict=True)
    ]


def test_setup_accepts_a_compiled_module_and_reaches_its_parameters():
    fabric, loom = _both(_compiled)
    assert fabric == (True, [True, True])
    assert loom == fabric


def _passed_twice(cls: type) -> dict:
    runner = _one(cls)
    model = nn.Linear(1, 2)
    optimizer = torch.optim.Adam(model.parameters())
    wrapped_model, wrapped_optimizer = runner.setup(model, optimizer)
    loader = runner.setup_dataloaders(DataLoader(range(2)))
    cases = {
        "setup(set-up model, optimizer)": lambda: runner.setup(wrapped_model, optimizer),
        "setup(model, set-up optimizer)": lambda: runner.setup(model, wrapped_optimizer),
        "setup_optimizers(set-up optimizer)": lambda: runner.setup_optimizers(wrapped_optimizer),
        "setup_dataloaders(set-up loader)": lambda: runner.setup_dataloaders(loader),
    }
    return {name: _outcome(call) for name, call in cases.items()}


def test_passing_a_set_up_object_again_raises_fabrics_value_error():
    """Fabric raises ValueError for each; torchloom raised TypeError for a loader it had returned."""
    fabric, loom = _both(_passed_twice)
    assert set(map(str, fabric.values())) == {str(("raises", "ValueError"))}
    assert loom == fabric


# ---- setup_dataloaders -----------------------------------------------------------------------------------------
def _loaders(cls: type) -> tuple:
    runner = _one(cls)
    first, second = list(range(3)), list(range(5))
    one = runner.setup_dataloaders(DataLoader(first))
    several = runner.setup_dataloaders(DataLoader(first), DataLoader(second, batch_size=2))
    return (
        type(several).__name__,
        [loader.dataset is data for loader, data in zip(several, (first, second), strict=True)],
        [len(loader) for loader in several],
        [batch.tolist() for batch in one],
        len(one),
    )


def test_setup_dataloaders_returns_a_list_for_several_as_fabric():
    """Fabric returns several loaders as a list; torchloom returned a tuple (`loaders + [x]` failed)."""
    fabric, loom = _both(_loaders)
    assert fabric[0] == "list"
    assert loom == fabric


# ---- moving, backward, precision -------------------------------------------------------------------------------
def _to_device(cls: type) -> tuple:
    runner = _one(cls)
    moved = runner.to_device({"data": torch.rand(2), "int": 1, "text": "x", "nested": [torch.ones(1)]})
    module = runner.to_device(nn.Linear(2, 3))
    return (
        str(moved["data"].device),
        moved["int"],
        moved["text"],
        str(moved["nested"][0].device),
        type(module).__name__,
        str(module.weight.device),
    )


def test_to_device_moves_modules_tensors_and_collections():
    fabric, loom = _both(_to_device)
    assert loom == fabric


def _backward_with_arguments(cls: type) -> list:
    runner = _one(cls)
    model = runner.setup(nn.Linear(2, 2))
    loss = model(torch.ones(1, 2)).sum()
    runner.backward(loss, retain_graph=True)  # passed on to torch: the graph survives for a second backward
    runner.backward(loss)
    return model.weight.grad.tolist()


def test_backward_passes_arguments_to_torch():
    fabric, loom = _both(_backward_with_arguments)
    assert fabric == [[2.0, 2.0], [2.0, 2.0]]
    assert loom == fabric


def _plain_backward(precision: str) -> Any:
    def script(cls: type) -> str:
        runner = _one(cls, precision=precision)
        first, second = runner.setup(nn.Linear(2, 2)), runner.setup(nn.Linear(2, 2))
        second(first(torch.rand(2, 2))).sum().backward()  # two models chained, plain torch backward
        return str(first.weight.grad.dtype)

    return script


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_plain_loss_backward_where_fabric_allows_it(precision):
    fabric, loom = _both(_plain_backward(precision))
    assert loom == fabric and not isinstance(fabric, tuple)


def test_plain_loss_backward_under_bf16_mixed_is_a_deliberate_difference():
    """docs/fabric.md, deliberate differences: Fabric refuses `loss.backward()` under bf16-mixed; torchloom
    refuses it only where it would be wrong (16-mixed: the loss is not scaled), and bf16 needs no scaling."""
    fabric, loom = _both(_plain_backward("bf16-mixed"))
    assert fabric == ("raises", "RuntimeError")
    assert loom == "torch.float32"


def _autocast(cls: type) -> tuple:
    runner = _one(cls, precision="bf16-mixed")
    with runner.autocast():
        inside = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    return str(inside), str((torch.ones(2, 2) @ torch.ones(2, 2)).dtype)


def test_autocast_context():
    fabric, loom = _both(_autocast)
    assert fabric == ("torch.bfloat16", "torch.float32")
    assert loom == fabric


def _init_contexts(cls: type) -> tuple:
    runner = _one(cls, precision="bf16-true")
    with runner.init_tensor():
        tensor = torch.empty(2)
    with runner.init_module():
        module = nn.Linear(2, 2)
    with runner.init_module(empty_init=True):
        empty = nn.Linear(2, 2)
    return str(tensor.dtype), str(module.weight.dtype), str(empty.weight.dtype), str(empty.weight.device)


def test_init_tensor_and_init_module_contexts():
    fabric, loom = _both(_init_contexts)
    assert loom == fabric


def _no_sync_one_process(cls: type) -> tuple:
    runner = _one(cls)
    model = runner.setup(nn.Linear(2, 2))
    with runner.no_backward_sync(model):
        runner.backward(model(torch.ones(1, 2)).sum())
    with runner.no_backward_sync(model, enabled=False):
        runner.backward(model(torch.ones(1, 2)).sum())
    return model.weight.grad.tolist()


def test_no_backward_sync_in_one_process_is_a_silent_no_op():
    fabric, loom = _both(_no_sync_one_process)
    assert fabric == [[2.0, 2.0], [2.0, 2.0]]  # no warning either (a warning would make it a tuple)
    assert loom == fabric


def _clip_once(cls: type, kwargs: dict) -> tuple:
    runner = _one(cls)
    raw = nn.Linear(3, 1)
    with torch.no_grad():
        raw.weight.fill_(0.5)
    model, optimizer = runner.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    runner.backward(model(torch.full((1, 3), 5.0)).sum())
    norm = runner.clip_gradients(model, optimizer, **kwargs)
    return (None if norm is None else round(float(norm), 5)), [
        round(g, 5) for g in raw.weight.grad[0].tolist()
    ]


def _clipping(cls: type) -> list:
    cases = ({"clip_val": 1e-3}, {"max_norm": 1.0}, {}, {"clip_val": 1.0, "max_norm": 1.0})
    return [_outcome(functools.partial(_clip_once, cls, kwargs)) for kwargs in cases]


def test_clip_gradients_results_and_refusals():
    fabric, loom = _both(_clipping)
    assert fabric[0][0] is None and fabric[2] == ("raises", "ValueError") == fabric[3]
    assert loom == fabric


# ---- launch ----------------------------------------------------------------------------------------------------
def _launch_function(cls: type) -> tuple:
    runner = cls(accelerator="cpu", devices=1)
    result = runner.launch(lambda given, extra: (given is runner, extra), 7)
    without = _outcome(lambda: cls(accelerator="cpu", devices=1).launch(lambda: 3))
    return result, without


def test_launch_runs_the_function_with_the_instance_and_refuses_one_without_parameters():
    """Fabric checks that the function takes the instance before it starts anything; torchloom called it and
    failed with Python's own TypeError (in every rank, after starting them)."""
    fabric, loom = _both(_launch_function)
    assert fabric == ((True, 7), ("raises", "TypeError"))
    assert loom == fabric


def test_launch_of_a_function_without_parameters_names_the_fix():
    with pytest.raises(TypeError, match=r"takes at least one argument.*def train\(loom\)"):
        Loom(accelerator="cpu", devices=2).launch(lambda: 3)  # before any rank starts


def _launch_without_function(cls: type, strategy: str, devices: int) -> Any:
    return _outcome(lambda: cls(accelerator="cpu", devices=devices, strategy=strategy).launch())


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_notebook"])
def test_launch_without_a_function_where_ranks_are_forked_is_a_type_error(strategy, devices):
    """A forked rank runs a function: torchloom refused launch() without one with a RuntimeError on several
    devices, and accepted it on one."""
    fabric, loom = _both(lambda cls: _launch_without_function(cls, strategy, devices))
    assert fabric == ("raises", "TypeError")
    assert loom == fabric
    with pytest.raises(TypeError, match=r"forks ranks that run a function: call loom.launch\(train\)"):
        Loom(accelerator="cpu", devices=devices, strategy=strategy).launch()


def test_launch_without_a_function_and_without_a_script_is_a_type_error(monkeypatch):
    """`python -c` (or an interactive session): no script to run again per rank. Fabric's "ddp_spawn" refuses
    launch() without a function with a TypeError; torchloom raised a RuntimeError."""
    monkeypatch.setattr("sys.argv", ["-c"])
    fabric, loom = _both(lambda cls: _launch_without_function(cls, "ddp_spawn", 2))
    assert fabric == ("raises", "TypeError")
    assert loom == fabric
    with pytest.raises(TypeError, match=r"not started from a script.*loom.launch\(fn\)"):
        Loom(accelerator="cpu", devices=2, strategy="ddp").launch()


def _before_launch(cls: type) -> dict:
    runner = cls(accelerator="cpu", devices=2, strategy="ddp")  # no launch()
    cases = {
        "setup": lambda: runner.setup(nn.Linear(1, 1)),
        "setup_module": lambda: runner.setup_module(nn.Linear(1, 1)),
        "setup_dataloaders": lambda: runner.setup_dataloaders(DataLoader(range(4))),
        "barrier": lambda: runner.barrier(),
        "broadcast": lambda: runner.broadcast(1),
        "all_reduce": lambda: runner.all_reduce(torch.ones(1)),
        "all_gather": lambda: runner.all_gather(torch.ones(1)),
    }
    return {name: _outcome(call) for name, call in cases.items()}


def test_calls_before_launch_are_refused_as_in_fabric():
    """setup_dataloaders before launch() split the data as rank 0 of a job that did not exist yet (with
    launch(fn), every rank would then iterate rank 0's half); Fabric refuses it with the others."""
    fabric, loom = _both(_before_launch)
    assert set(map(str, fabric.values())) == {str(("raises", "RuntimeError"))}
    assert loom == fabric


def test_init_module_before_launch_under_ddp_is_a_deliberate_difference():
    """docs/fabric.md: Fabric refuses init_module() before launch() under DDP; torchloom allows it where nothing
    needs the process group (DDP) and refuses it where something does (fsdp, tests/test_misuse.py)."""
    fabric, loom = _both(
        lambda cls: cls(accelerator="cpu", devices=2, strategy="ddp").init_module().__enter__()
    )
    assert fabric == ("raises", "RuntimeError") and loom is None


# ---- callbacks and loggers -------------------------------------------------------------------------------------
class _Hook:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def on_event(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


def _callbacks(cls: type) -> list:
    single, first, second = _Hook(), _Hook(), _Hook()
    cls(accelerator="cpu", devices=1, callbacks=single).call("on_event", "positional", keyword="keyword")
    both = cls(accelerator="cpu", devices=1, callbacks=[first, second, object()])
    both.call("on_event")
    both.call("on_hook_nobody_has", 1)
    return [single.calls, first.calls, second.calls]


def test_callbacks_given_alone_or_in_a_list_and_hooks_they_lack():
    fabric, loom = _both(_callbacks)
    assert fabric == [[(("positional",), {"keyword": "keyword"})], [((), {})], [((), {})]]
    assert loom == fabric


class _SpecialCallback:
    """Lightning's test_special_callbacks: hooks for Fabric's own events, written for Fabric."""

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        pass

    def on_after_setup(self, fabric: Any, module: Any) -> None:
        pass


def _special_callbacks(cls: type) -> list:
    from unittest.mock import Mock

    callback = Mock(wraps=_SpecialCallback())  # a Mock takes **kwargs, and hands them on to the real hook
    runner = _one(cls, callbacks=[callback])
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, wrapped_optimizer = runner.setup(model, optimizer)
    model(torch.randn(2, 2)).sum().backward()
    wrapped_optimizer.step()
    identity = {"fabric": runner, "module": wrapped, "strategy": runner.strategy, "optimizer": optimizer}
    return [
        (name, sorted(kwargs), all(v is identity[k] for k, v in kwargs.items()))
        for name, _, kwargs in callback.mock_calls
    ]


def test_hooks_fabric_calls_reach_a_callback_written_for_fabric():
    """A `Mock(wraps=...)` of a callback written for Fabric (Lightning's own test) gets exactly Fabric's keywords;
    torchloom passed `loom=` too, which the Mock handed on, and `on_after_setup(self, fabric, module)` raised
    TypeError."""
    fabric, loom = _both(_special_callbacks)
    assert fabric == [
        ("on_after_setup", ["fabric", "module"], True),
        ("on_after_optimizer_step", ["optimizer", "strategy"], True),
    ]
    assert loom == fabric


class _LoomSpelling:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_after_setup(self, loom: Any, module: Any) -> None:
        self.seen.append(("loom, module", loom, module))


class _KeywordsAndLoom:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_after_setup(self, loom: Any, **kwargs: Any) -> None:
        self.seen.append(("loom, **kwargs", loom, sorted(kwargs)))


def test_hooks_in_torchloom_spelling_keep_working():
    """`loom=` goes to a hook that names it, beside Fabric's keywords."""
    spelled, mixed = _LoomSpelling(), _KeywordsAndLoom()
    loom = _one(Loom, callbacks=[spelled, mixed])
    model = loom.setup(nn.Linear(2, 2))
    assert spelled.seen == [("loom, module", loom, model)]
    assert mixed.seen == [("loom, **kwargs", loom, ["fabric", "module"])]


def _lightning_module_hooks(cls: type) -> list:
    import lightning

    class Lit(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)
            self.events: list[str] = []

        def on_train_start(self) -> None:
            self.events.append("on_train_start")

    runner = _one(cls)
    lit = Lit()
    runner.setup_module(lit)
    runner.call("on_train_start")
    return lit.events


def test_a_set_up_lightning_module_is_a_callback():
    fabric, loom = _both(_lightning_module_hooks)
    assert fabric == ["on_train_start"]
    assert loom == fabric


class _Logger(_KeywordLogger):
    """Records the type of each value too: Fabric hands loggers Python numbers, not tensors."""

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:  # type: ignore[override]
        self.logged.append(({k: (type(v).__name__, v) for k, v in metrics.items()}, step))


def _loggers(cls: type) -> dict:
    first, second = _Logger(), _Logger()
    out: dict[str, Any] = {
        "None": len(cls(accelerator="cpu", devices=1, loggers=None).loggers),
        "[]": len(cls(accelerator="cpu", devices=1, loggers=[]).loggers),
    }
    alone = cls(accelerator="cpu", devices=1, loggers=first)
    out["single"] = (len(alone.loggers), alone.logger is first)
    runner = cls(accelerator="cpu", devices=1, loggers=[first, second])
    out["list"] = (len(runner.loggers), runner.logger is first, runner.loggers[1] is second)
    first.logged.clear()
    runner.log("zero-dim", torch.tensor(1))
    runner.log_dict({"one-element": torch.tensor([2]), "float": 2.5}, step=15)
    runner.log("number", 3, step=None)
    out["multi-element log"] = _outcome(lambda: runner.log("bad", torch.tensor([3, 4])))
    out["multi-element log_dict"] = _outcome(lambda: runner.log_dict({"bad": torch.tensor([3, 4])}))
    out["received"] = first.logged
    out["same for both loggers"] = first.logged == second.logged
    return out


def test_loggers_given_in_every_form_and_values_converted_to_python_numbers():
    fabric, loom = _both(_loggers)
    assert fabric["received"][0] == ({"zero-dim": ("int", 1)}, None)
    assert fabric["multi-element log"] == ("raises", "ValueError")
    assert loom == fabric


# ---- checkpoints -----------------------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2, bias=False)


def _fixed_net() -> _Net:
    net = _Net()
    with torch.no_grad():
        net.layer.weight.copy_(torch.arange(8.0).view(2, 4))
    return net


def _saved_content(tmp: Path, set_up: bool) -> Any:
    def script(cls: type) -> Any:
        runner = _one(cls)
        raw = _fixed_net()
        optimizer = torch.optim.Adam(raw.parameters())
        model, opt = runner.setup(raw, optimizer) if set_up else (raw, optimizer)
        path = tmp / f"{cls.__name__}-{set_up}.ckpt"
        runner.save(path, {"model": model, "optimizer": opt, "anything": {"cocofruit": 1}})
        loaded = torch.load(path, weights_only=True)
        return {
            "keys": sorted(loaded),
            "model": {k: v.tolist() for k, v in loaded["model"].items()},
            "optimizer keys": sorted(loaded["optimizer"]),
            "anything": loaded["anything"],
        }

    return script


@pytest.mark.parametrize("set_up", [True, False])
def test_save_writes_the_state_dicts_of_wrapped_and_plain_objects(tmp_path, set_up):
    """One deliberate difference (docs/fabric.md): torchloom adds its `__torchloom__` entry (format version and
    what a resume needs); the user's entries are Fabric's."""
    fabric, loom = _both(_saved_content(tmp_path, set_up))
    assert fabric["model"] == {"layer.weight": [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]}
    assert loom.pop("keys") == ["__torchloom__", *fabric.pop("keys")]
    assert loom == fabric


def test_save_filter_values_must_be_callable(tmp_path):
    def script(cls: type) -> Any:
        runner = _one(cls)
        return runner.save(tmp_path / "x.ckpt", {"model": _fixed_net()}, filter={"model": "foo"})

    fabric, loom = _both(script)
    assert fabric == ("raises", "TypeError")
    assert loom == fabric


def _load_in_place(tmp: Path, set_up: bool) -> Any:
    source = tmp / "fabric-written.ckpt"
    if not source.exists():
        runner = _one(Fabric)
        saved = runner.setup(_fixed_net())
        runner.save(source, {"model": saved, "int": 5, "dict": {"x": 1}, "extra": "data"})

    def script(cls: type) -> Any:
        runner = _one(cls)
        raw = _Net()
        model = runner.setup(raw) if set_up else raw
        state = {"model": model, "int": 0, "dict": {"x": 0}}
        remainder = runner.load(source, state)
        return {
            "model is kept": state["model"] is model,
            "weights": raw.layer.weight.tolist(),
            "int": state["int"],
            "dict": state["dict"],
            "remainder": remainder,
        }

    return script


@pytest.mark.parametrize("set_up", [True, False])
def test_load_restores_in_place_and_returns_the_rest(tmp_path, set_up):
    fabric, loom = _both(_load_in_place(tmp_path, set_up))
    assert fabric["remainder"] == {"extra": "data"} and fabric["int"] == 5
    assert loom == fabric


def _load_raw(tmp: Path) -> Any:
    weights = tmp / "weights.pt"
    torch.save(_fixed_net().state_dict(), weights)
    partial = tmp / "partial.pt"
    torch.save({}, partial)

    def script(cls: type) -> Any:
        runner = _one(cls)
        raw = _Net()
        optimizer = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9)
        model, opt = runner.setup(raw, optimizer)
        runner.load_raw(weights, raw)
        into_raw = raw.layer.weight.sum().item()
        with torch.no_grad():
            raw.layer.weight.zero_()
        runner.load_raw(weights, model)
        into_wrapped = raw.layer.weight.sum().item()
        strict = _outcome(lambda: runner.load_raw(partial, model))
        lenient = _outcome(lambda: runner.load_raw(partial, model, strict=False))
        opt_path = tmp / f"{cls.__name__}-opt.pt"
        torch.save(optimizer.state_dict(), opt_path)
        optimizer.param_groups[0]["lr"] = 5.0
        runner.load_raw(opt_path, opt)
        return into_raw, into_wrapped, strict, lenient, optimizer.param_groups[0]["lr"]

    return script


def test_load_raw_into_plain_and_wrapped_objects(tmp_path):
    fabric, loom = _both(_load_raw(tmp_path))
    assert fabric[:2] == (28.0, 28.0) and fabric[2] == ("raises", "RuntimeError") and fabric[4] == 0.1
    assert loom == fabric


def test_load_of_a_plain_file_with_every_weights_only(tmp_path):
    torch.save({"foo": 123}, tmp_path / "plain.pt")

    def script(cls: type) -> list:
        runner = cls(accelerator="cpu", devices=1)
        return [runner.load(tmp_path / "plain.pt", weights_only=w) for w in (None, False, True)]

    fabric, loom = _both(script)
    assert fabric == [{"foo": 123}] * 3
    assert loom == fabric


def test_seed_everything_is_static_and_returns_the_seed(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert Fabric.seed_everything(3) == Loom.seed_everything(3) == 3


# ---- several ranks ---------------------------------------------------------------------------------------------
class _TimesTen(DataLoader):
    """A DataLoader subclass with an argument of its own, whose batches differ from the plain loader's."""

    def __init__(self, new_arg: int, **kwargs: Any) -> None:
        super().__init__(range(5), batch_size=2, **kwargs)
        self.new_arg = new_arg

    def __iter__(self) -> Any:
        for batch in super().__iter__():
            yield batch * 10


def _custom_sampler_one_process(cls: type) -> tuple:
    runner = _one(cls)
    custom = _EveryOther(5)
    loader = runner.setup_dataloaders(DataLoader(list("abcde"), sampler=custom), use_distributed_sampler=True)
    return [list(loader), list(loader)], loader.sampler is custom


def test_one_process_keeps_a_custom_samplers_order():
    fabric, loom = _both(_custom_sampler_one_process)
    assert fabric[0] == [[["e"], ["c"], ["a"]]] * 2
    assert loom[0] == fabric[0]


@pytest.mark.xfail(
    strict=True,
    reason="torchloom hands out a ResumableSampler around the user's sampler (it records the draws for exact "
    "resumes); Fabric's loader.sampler is the user's object in one process",
)
def test_one_process_loader_sampler_is_the_users_object():
    fabric, loom = _both(_custom_sampler_one_process)
    assert fabric[1] is True
    assert loom[1] == fabric[1]


def test_one_process_keeps_a_loader_subclass():
    fabric, loom = _both(lambda cls: [b.tolist() for b in _one(cls).setup_dataloaders(_TimesTen(2))])
    assert fabric == [[0, 10], [20, 30], [40]]
    assert loom == fabric


class _EveryOther(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n - 1, -1, -2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


class _Endless(Sampler):
    """A custom sampler without len(): neither can split its draw across ranks."""

    def __iter__(self) -> Any:
        return iter(range(6))


def _ranks_view(cls: type, rank: int) -> dict:
    """What each public call shows on one rank of two."""
    runner = cls(accelerator="cpu", devices=2, strategy="ddp")
    runner.launch()
    out: dict[str, Any] = {
        "ranks": (runner.world_size, runner.global_rank, runner.local_rank, runner.node_rank)
    }
    model = nn.Linear(2, 2)
    wrapped = runner.setup_module(model)
    out["module"] = (wrapped.module is model, wrapped.weight is model.weight)
    standard = [runner.setup_dataloaders(DataLoader(range(6), shuffle=s)) for s in (True, False)]
    out["standard sampler replaced"] = [isinstance(loader.sampler, DistributedSampler) for loader in standard]
    out["unshuffled order"] = [b.tolist() for b in standard[1]]
    custom = _EveryOther(6)
    kept = runner.setup_dataloaders(DataLoader(range(6), sampler=custom), use_distributed_sampler=False)
    out["custom sampler kept"] = (kept.sampler is custom, [b.tolist() for b in kept])
    endless = DataLoader(range(6), sampler=_Endless())
    out["sampler without len"] = _outcome(lambda: runner.setup_dataloaders(endless))
    # gradients stay local inside no_backward_sync, and are averaged by the next synced backward
    torch.manual_seed(0)
    net = runner.setup(nn.Linear(2, 1, bias=False))
    with runner.no_backward_sync(net):
        runner.backward(net(torch.full((1, 2), float(rank + 1))).sum())
    out["grad without sync"] = net.weight.grad.tolist()
    runner.backward(net(torch.full((1, 2), float(rank + 1))).sum())
    out["grad after a synced backward"] = net.weight.grad.tolist()
    value = torch.tensor([float(rank + 1)])
    out["all_gather"] = _plain(runner.all_gather([value, value * 10, "text"]))
    data = {"a": value.clone(), "b": [value * 10], "c": "text"}
    out["all_reduce"] = _plain(runner.all_reduce(data, reduce_op="sum"))
    out["all_reduce input afterwards"] = _plain(data)
    out["broadcast"] = runner.broadcast({"from": rank}, src=1)
    runner.barrier("named")
    # data order (branch `order` makes it Fabric's): a shuffled loader's first two epochs after seeding
    cls.seed_everything(1)
    shuffled = runner.setup_dataloaders(DataLoader(range(8), shuffle=True))
    out["shuffled epochs"] = [[b.tolist() for b in shuffled] for _ in range(2)]
    out["loader subclass"] = _outcome(lambda: [b.tolist() for b in runner.setup_dataloaders(_TimesTen(2))])
    try:
        runner.setup_dataloaders(_TimesTen(2))
    except Exception as error:  # noqa: BLE001 - the message is what the user reads
        out["loader subclass message"] = str(error)
    return out


def _plain(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _ranks_body(rank: int, world_size: int) -> dict:
    # torchloom joins the process group first; Fabric's DDP launch in the same rank then finds it joined.
    loom = _ranks_view(Loom, rank)
    fabric = _ranks_view(Fabric, rank)
    return {"loom": loom, "fabric": fabric}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_ranks_body, 2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "item",
    [
        "ranks",
        "module",
        "standard sampler replaced",
        "unshuffled order",
        "custom sampler kept",
        "sampler without len",
        "grad without sync",
        "grad after a synced backward",
        "all_gather",
        "all_reduce",
        "broadcast",
        "shuffled epochs",
    ],
)
def test_what_each_rank_sees(two_ranks, item):
    """Public calls on 2 ranks; torchloom joins the group first, then Fabric's DDP launch in the same rank finds
    it joined and uses it."""
    for rank in two_ranks:
        assert rank["loom"][item] == rank["fabric"][item], (item, rank)
    if item == "sampler without len":  # torchloom's MisuseError was not the TypeError Fabric raises
        assert two_ranks[0]["fabric"][item] == ("raises", "TypeError")
    if item == "grad without sync":  # the check can fail: the ranks' local gradients differ
        assert two_ranks[0]["fabric"][item] != two_ranks[1]["fabric"][item]


def test_a_loader_subclass_that_cannot_be_rebuilt_is_refused_on_several_ranks(two_ranks):
    """Both refuse a DataLoader subclass whose __init__ fixes its own dataset and batch size (it cannot be
    rebuilt with a splitting sampler): Fabric with its MisconfigurationException, torchloom with a TypeError
    (also a MisuseError) that names the class, what failed and the fix."""
    for seen in two_ranks:
        assert seen["fabric"]["loader subclass"] == ("raises", "MisconfigurationException")
        assert seen["loom"]["loader subclass"] == ("raises", "TypeError")
        message = seen["loom"]["loader subclass message"]
        assert "_TimesTen" in message and "use_distributed_sampler=False" in message


def test_all_reduce_leaving_its_input_alone_is_a_deliberate_difference(two_ranks):
    """docs/fabric.md: Fabric's all_reduce under DDP reduces the caller's tensors in place (and returns them);
    torchloom returns new tensors and leaves the input as it was, so a value reused after the call (or reduced
    twice through two references) is not silently changed."""
    for rank, seen in enumerate(two_ranks):
        mine = {"a": [float(rank + 1)], "b": [[float(10 * (rank + 1))]], "c": "text"}
        assert seen["fabric"]["all_reduce input afterwards"] == seen["fabric"]["all_reduce"] != mine
        assert seen["loom"]["all_reduce input afterwards"] == mine


# ---- starting a script -----------------------------------------------------------------------------------------
_STARTS_SCRIPT = """
import sys
import torch
from torchloom import Loom


class Job(Loom):
    def run(self, x):
        total = float(self.all_reduce(torch.ones(1), reduce_op="sum"))
        print(f"RUN rank={self.global_rank} x={x} sum={total}", flush=True)


job = Job(accelerator="cpu", devices=2, strategy=sys.argv[1])
job.launch()
job.run(5)
"""


def test_starting_a_script_either_way_is_a_deliberate_difference(tmp_path, monkeypatch):
    """docs/fabric.md: where Fabric refuses `launch()` without a function under "ddp_spawn", and `launch()` or an
    overridden `run()` under its command line, torchloom runs the same script: by running it again once per rank
    (`python script.py`), or by joining the job its command line started."""
    from harness import PYTHON, run_job, wait_no_strays

    with pytest.raises(TypeError, match="needs to be called with a function"):
        Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn").launch()
    monkeypatch.setenv("LT_CLI_USED", "1")  # what `fabric run` sets for the script
    with pytest.raises(RuntimeError, match="launched through the CLI"):
        Fabric(accelerator="cpu", devices=1).launch()

    class FabricJob(Fabric):
        def run(self) -> None:
            pass

    with pytest.raises(TypeError, match="Overriding `Fabric.run\\(\\)` and launching from the CLI"):
        FabricJob()
    monkeypatch.delenv("LT_CLI_USED")

    script = tmp_path / "starts.py"
    script.write_text(_STARTS_SCRIPT)
    for cmd in (
        [PYTHON, str(script), "ddp_spawn"],
        [PYTHON, "-m", "torchloom", "run", "--accelerator=cpu", "--devices=2", str(script), "ddp"],
    ):
        result, token = run_job(cmd, timeout=120)
        assert result.returncode == 0, result.stdout
        found = sorted(re.findall(r"RUN rank=(\d) x=5 sum=([\d.]+)", result.stdout))
        assert found == [("0", "2.0"), ("1", "2.0")], result.stdout
        assert wait_no_strays(token) == []
