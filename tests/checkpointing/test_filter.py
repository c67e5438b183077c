"""`loom.save(..., filter=)`: what a filter keeps is what is saved, in both formats, on several ranks, and an
entry a filter empties is left out, as in Fabric."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from harness import run_ranks
from torch import nn

from torchloom import Loom, MisuseError


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _is_head(name: str, value: object) -> bool:
    return name.startswith("head.")


def _never(name: str, value: object) -> bool:
    return False


def _full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _body(rank: int, world_size: int, root: str) -> dict:
    # One rank group for both formats: a full file (ddp) and a sharded folder (fsdp2).
    return {strategy: _save_and_load(world_size, root, strategy) for strategy in ("ddp", "fsdp2")}


def _save_and_load(world_size: int, root: str, strategy: str) -> dict:
    from pathlib import Path

    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    torch.manual_seed(0)
    model = _Net()
    model, optimizer = loom.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    loom.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    path = Path(root) / strategy
    loom.save(path, {"model": model, "note": {"a": 1}, "step": 5}, filter={"model": _is_head, "note": _never})
    out: dict = {}
    refused = None
    try:
        loom.save(Path(root) / "opt", {"model": model, "opt": optimizer}, filter={"opt": _never})
    except MisuseError as exc:
        refused = str(exc)
    out["optimizer_filter_refused"] = refused
    torch.manual_seed(1)
    fresh = loom.setup_module(_Net())
    before = _full_weights(fresh)
    state: dict = {"model": fresh}
    left = loom.load(path, state, strict=False)
    after, saved = _full_weights(fresh), _full_weights(model)
    out["head_loaded"] = all(torch.equal(after[k], saved[k]) for k in saved if k.startswith("head."))
    out["body_kept"] = all(torch.equal(after[k], before[k]) for k in saved if k.startswith("body."))
    out["left"] = sorted(left)
    try:
        loom.load(path, {"model": loom.setup_module(_Net())}, strict=True)
        out["strict"] = None
    except Exception as exc:  # noqa: BLE001 - the test checks the message
        out["strict"] = f"{type(exc).__name__}: {exc}"
    loom.close()
    return out


@pytest.mark.timeout(300)
def test_filtered_saves_keep_what_the_filter_keeps_in_both_formats(tmp_path):
    ranks = run_ranks(_body, 2, str(tmp_path), timeout=240)
    results = {strategy: [out[strategy] for out in ranks] for strategy in ("ddp", "fsdp2")}
    for strategy, ranks in results.items():
        for out in ranks:
            assert out["head_loaded"] and out["body_kept"], (strategy, out)
            assert out["left"] == ["step"], (strategy, out)  # "note" kept nothing: not saved
            assert out["strict"] is not None and "body" in out["strict"], (strategy, out)
    assert results["ddp"][0]["optimizer_filter_refused"] is None
    for out in results["fsdp2"]:
        assert "optimizer" in out["optimizer_filter_refused"], out


def test_an_emptied_entry_is_left_out_as_in_fabric(tmp_path):
    """Side by side with Lightning: the same filters give a file with the same entries."""
    from lightning.fabric import Fabric

    model = _Net()
    state = {"model": model, "note": {"a": 1}, "step": 5}
    filters = {"model": _is_head, "note": _never}
    Fabric(accelerator="cpu", devices=1).save(tmp_path / "fabric.pt", state, filter=filters)
    Loom(accelerator="cpu", devices=1).save(tmp_path / "loom.pt", state, filter=filters)
    theirs = torch.load(tmp_path / "fabric.pt", weights_only=True)
    ours = torch.load(tmp_path / "loom.pt", weights_only=True)
    ours.pop("__torchloom__", None)
    assert set(ours) == set(theirs) == {"model", "step"}
    assert set(ours["model"]) == set(theirs["model"]) == {"head.weight", "head.bias"}


# ---- a filtered full save on sharded layouts: what rank 0 alone gathered decides nothing by itself -----------------
_SHORT = 5  # seconds: a collective one rank never reaches fails fast instead of hanging the suite


class _Block(nn.Module):
    """A tensor-parallel-ready block with a LoRA-like adapter beside it (what "save only the adapter" keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)
        self.adapter_a, self.adapter_b = nn.Linear(4, 2, bias=False), nn.Linear(2, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) + self.adapter_b(self.adapter_a(x))


class _Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tp_plan(model: _Adapted, device_mesh) -> _Adapted:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(
            block, device_mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
    return model


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor whole on every rank, by PyTorch's own state-dict API (FSDP1's flat shards too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from torchloom.wrappers import state_module

    state = get_model_state_dict(state_module(model), options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _adapter(name: str, value: object) -> bool:
    return ".adapter_" in name


def _adapter_and_a_sharded_weight(name: str, value: object) -> bool:
    # blocks.0.up.weight is sharded under every layout here (FSDP units, or tensor parallel): its full value must
    # come back whole.
    return ".adapter_" in name or name == "blocks.0.up.weight"


def _full_strategy(kind: str):
    from torchloom.strategies import FSDP2Strategy, FSDPStrategy, ModelParallelStrategy

    short = timedelta(seconds=_SHORT)
    if kind == "fsdp":
        return FSDPStrategy(auto_wrap_policy={_Block}, state_dict_type="full", timeout=short)
    if kind == "fsdp2":
        return FSDP2Strategy(shard_policy={_Block}, state_dict_type="full", timeout=short)
    return ModelParallelStrategy(_tp_plan, 1, 2, save_distributed_checkpoint=False, timeout=short)


def _outcome(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test checks class and message on every rank
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _filtered_full_body(rank: int, world_size: int, root: str) -> dict:
    return {kind: _filtered_full(rank, root, kind) for kind in ("fsdp", "fsdp2", "model_parallel")}


def _filtered_full(rank: int, root: str, kind: str) -> dict:
    from pathlib import Path

    loom = Loom(accelerator="cpu", devices=2, strategy=_full_strategy(kind))
    loom.launch()
    torch.manual_seed(0)
    model = _Adapted()
    unsharded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = loom.setup_module(model)
    optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.1))
    out: dict = {"unsharded": unsharded}
    adapter, both = Path(root) / f"{kind}-adapter.pt", Path(root) / f"{kind}-both.pt"
    # The model alone, filtered: the hang of issue 34 (rank 1 gathered nothing, so its filter kept nothing).
    out["save_adapter"] = _outcome(lambda: loom.save(adapter, {"model": model}, filter={"model": _adapter}))
    # With an optimizer whose filter keeps nothing (left out) and a sharded weight kept.
    out["save_both"] = _outcome(
        lambda: loom.save(
            both,
            {"model": model, "optimizer": optimizer, "step": 3},
            filter={"model": _adapter_and_a_sharded_weight, "optimizer": _never},
        )
    )
    # A filter that raises (rank 0 alone runs it on the gathered values): every rank raises.
    out["save_raising"] = _outcome(
        lambda: loom.save(Path(root) / f"{kind}-x.pt", {"model": model}, filter={"model": lambda k, v: 1 / 0})
    )
    if rank == 0 and out["save_adapter"] == "ok" and out["save_both"] == "ok":
        out["file_adapter"] = torch.load(adapter, weights_only=True)
        out["file_both"] = torch.load(both, weights_only=True)
    # Loading the filtered files back into a model initialised otherwise: strict=False loads what is there.
    torch.manual_seed(1)
    fresh = _Adapted()
    fresh_before = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    fresh = loom.setup_module(fresh)
    fresh_optimizer = loom.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=0.1))
    out["fresh_before"] = fresh_before
    out["load_strict"] = _outcome(lambda: loom.load(adapter, {"model": fresh}))
    out["load_adapter"] = _outcome(lambda: loom.load(adapter, {"model": fresh}, strict=False))
    out["after_adapter"] = _gathered(fresh)
    state: dict = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    out["load_both"] = _outcome(lambda: loom.load(both, state, strict=False))
    out["after_both"], out["step"] = _gathered(fresh), state["step"]
    loom.close()
    return out


@pytest.mark.timeout(300)
def test_a_filtered_full_save_on_sharded_layouts_writes_the_filtered_full_values(tmp_path):
    """fsdp, fsdp2 and ModelParallelStrategy(save_distributed_checkpoint=False), 2 ranks: the full state is
    gathered to rank 0 alone, and the filter's decision reaches every rank, so no rank waits in a collective the
    others skipped (the old code timed out under fsdp2 and model_parallel)."""
    ranks = run_ranks(_filtered_full_body, 2, str(tmp_path), timeout=240)
    for kind in ("fsdp", "fsdp2", "model_parallel"):
        outs = [out[kind] for out in ranks]
        for out in outs:
            assert out["save_adapter"] == "ok", (kind, out["save_adapter"])
            assert out["save_both"] == "ok", (kind, out["save_both"])
            # The user's own error on rank 0, where the filter ran; an error naming it on the others.
            raised = outs[0]["save_raising"], outs[1]["save_raising"]
            assert raised[0].startswith("ZeroDivisionError"), (kind, raised)
            assert raised[1].startswith("CheckpointError") and "'model'" in raised[1], (kind, raised)
            assert "ZeroDivisionError on rank 0" in raised[1], (kind, raised)
            assert (
                out["load_strict"].startswith("CheckpointError")
                and "blocks.0.up.weight" in out["load_strict"]
            )
            assert out["load_adapter"] == "ok" and out["load_both"] == "ok", (kind, out)
        unsharded, fresh = outs[0]["unsharded"], outs[0]["fresh_before"]
        adapter = {k for k in unsharded if _adapter(k, None)}
        both = {k for k in unsharded if _adapter_and_a_sharded_weight(k, None)}
        saved = outs[0]["file_adapter"]
        assert set(saved) == {"model", "__torchloom__"}, (kind, set(saved))
        assert set(saved["model"]) == adapter, kind
        for k in adapter:
            assert torch.equal(saved["model"][k], unsharded[k]), (kind, k)
        saved = outs[0]["file_both"]
        assert set(saved) == {"model", "step", "__torchloom__"}, (kind, set(saved))
        assert set(saved["model"]) == both and saved["step"] == 3, kind
        for k in both:
            assert saved["model"][k].shape == unsharded[k].shape, (kind, k)
            assert torch.equal(saved["model"][k], unsharded[k]), (kind, k)
        for out in outs:
            for k, v in out["after_adapter"].items():
                assert torch.equal(v, unsharded[k] if k in adapter else fresh[k]), (kind, k)
            for k, v in out["after_both"].items():
                assert torch.equal(v, unsharded[k] if k in both else fresh[k]), (kind, k)
            assert out["step"] == 3, kind


class _NoCopy:
    """Picklable, but refuses copy.deepcopy: an asynchronous save cannot take a private copy of it."""

    def __deepcopy__(self, memo: dict) -> _NoCopy:
        raise TypeError("no copies")


def _disagreeing(name: str, value: object) -> bool:
    import torch.distributed as dist

    return ".adapter_" in name or (name == "head.bias" and dist.get_rank() == 0)


def _rank_dependent_body(rank: int, world_size: int, root: str) -> dict:
    from pathlib import Path

    from torchloom.strategies import FSDP2Strategy

    out: dict = {}
    short = timedelta(seconds=_SHORT)
    loom = Loom(accelerator="cpu", devices=2, strategy=FSDP2Strategy(shard_policy={_Block}, timeout=short))
    loom.launch()
    model = loom.setup_module(_Adapted())
    # Sharded: every rank filters its own shards; ranks that keep different items are refused on every rank.
    out["sharded"] = _outcome(
        lambda: loom.save(Path(root) / "sharded", {"model": model}, filter={"model": _disagreeing})
    )
    # Ranks given different entries or filters would gather different things: refused on every rank, by name.
    other = {"model": model} if rank == 0 else {"model": model, "other": nn.Linear(2, 2)}
    out["state_differs"] = _outcome(lambda: loom.save(Path(root) / "differs", other))
    filters = {"model": _adapter} if rank == 0 else None
    out["filter_differs"] = _outcome(
        lambda: loom.save(Path(root) / "differs", {"model": model}, filter=filters)
    )
    strategy = FSDP2Strategy(shard_policy={_Block}, state_dict_type="full", timeout=short)
    loom = Loom(accelerator="cpu", devices=2, strategy=strategy)
    loom.launch()
    model = loom.setup_module(_Adapted())
    # Full and asynchronous: rank 0 alone copies the state; its failure must reach the others too.
    out["async"] = _outcome(
        lambda: loom.save(Path(root) / "async.pt", {"model": model, "user": _NoCopy()}, async_save=True)
    )
    out["close"] = _outcome(loom.close)
    return out


@pytest.mark.timeout(300)
def test_a_failure_or_disagreement_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    """Each is a decision one rank would make alone: refused or raised on every rank instead."""
    ranks = run_ranks(_rank_dependent_body, 2, str(tmp_path), timeout=120)
    for out in ranks:
        assert out["sharded"].startswith("MisuseError"), out
        assert "'head.bias'" in out["sharded"] and "by the item's name" in out["sharded"], out
        assert out["async"].startswith("CheckpointError") and "'user'" in out["async"], out
        assert out["state_differs"].startswith("MisuseError: loom.save() was given different state"), out
        assert "rank 1 {'model': 'module', 'other': 'module'}" in out["state_differs"], out
        assert (
            out["filter_differs"].startswith("MisuseError")
            and "with a filter on ['model']" in out["filter_differs"]
        )
        assert out["close"] == "ok", out
