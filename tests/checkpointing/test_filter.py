"""`loom.save(..., filter=)`: what a filter keeps is what is saved, in both formats, on several ranks, and an
entry a filter empties is left out, as in Fabric."""

from __future__ import annotations

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
