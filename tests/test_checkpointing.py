"""Full checkpoints: `loom.save` / `loom.load` / `loom.load_raw` in one process and on 2 DDP ranks."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from torch import nn

from torchloom import CheckpointError, Loom


class Net(nn.Module):
    def __init__(self, hidden: int = 8, extra: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 2)
        self.register_buffer("seen", torch.zeros(()))
        if extra:
            self.extra = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += len(x)
        return self.head(self.body(x))


class Counter:
    """A user object with state_dict()/load_state_dict()."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _trained(loom: Loom, seed: int = 0, steps: int = 3):
    """A set-up model, Adam with state, an LR scheduler and a counter, after a few steps on rank-local data."""
    torch.manual_seed(seed)
    model = Net()
    model, opt = loom.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    counter = Counter()
    g = torch.Generator().manual_seed(100 + loom.global_rank)
    for _ in range(steps):
        loom.backward(model(torch.randn(6, 4, generator=g)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        scheduler.step()
        counter.count += 1
    return model, opt, scheduler, counter


def _snapshot(model, opt) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": _clone(opt.state_dict())}


def _clone(obj):
    return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, obj)


def _equal(a, b) -> bool:
    """Exact equality of nested dicts/lists/tuples of tensors and plain values (OrderedDict == dict)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _round_trip(loom: Loom, path: Path) -> dict:
    """Save after training, restore into fresh objects, and continue training both; report what matched."""
    model, opt, scheduler, counter = _trained(loom)
    before = _snapshot(model, opt)
    extras = {"step": 3, "note": "hello", "nested": {"t": torch.arange(3), "xs": [1.5, None]}}
    loom.save(path, {"model": model, "optimizer": opt, "scheduler": scheduler, "counter": counter, **extras})
    # Fresh objects with a different init and no optimizer state.
    fresh_model, fresh_opt, fresh_sched, fresh_counter = _trained(loom, seed=1, steps=0)
    state = {"model": fresh_model, "optimizer": fresh_opt, "scheduler": fresh_sched, "counter": fresh_counter}
    state.update(step=0, note=None)
    remaining = loom.load(path, state)
    after = _snapshot(fresh_model, fresh_opt)
    out = {
        "model_equal": _equal(before["model"], after["model"]),
        "optimizer_equal": _equal(before["opt"], after["opt"]),
        "has_adam_state": len(before["opt"]["state"]) == 4 and int(before["opt"]["state"][0]["step"]) == 3,
        "scheduler": (fresh_sched.last_epoch, fresh_opt.param_groups[0]["lr"], opt.param_groups[0]["lr"]),
        "counter": fresh_counter.count,
        "plain": (state["step"], state["note"]),
        "remaining": remaining,
    }
    # Continuing from the restored objects is exactly continuing the original run.
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(7 + loom.global_rank))
    for m, o in ((model, opt), (fresh_model, fresh_opt)):
        loom.backward(m(x).pow(2).mean())
        o.step()
    out["continued_equal"] = _equal(model.state_dict(), fresh_model.state_dict())
    out["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _check_round_trip(out: dict) -> None:
    assert out["has_adam_state"]
    assert out["model_equal"]
    assert out["optimizer_equal"]
    last_epoch, restored_lr, original_lr = out["scheduler"]
    assert last_epoch == 3 and restored_lr == original_lr
    assert out["counter"] == 3
    assert out["plain"] == (3, "hello")
    remaining = out["remaining"]
    assert set(remaining) == {"nested"}
    assert torch.equal(remaining["nested"]["t"], torch.arange(3)) and remaining["nested"]["xs"] == [1.5, None]
    assert out["continued_equal"]


def test_round_trip_single_process(tmp_path):
    _check_round_trip(_round_trip(Loom(accelerator="cpu"), tmp_path / "ckpt.pt"))


def _ddp_body(rank: int, world_size: int, directory: str) -> dict:
    loom = Loom(accelerator="cpu", devices=world_size, strategy="ddp")
    loom.launch()
    path = Path(directory) / "ddp.pt"
    out = _round_trip(loom, path)
    loom.barrier()
    out["files"] = sorted(p.name for p in Path(directory).iterdir())
    loom.barrier()  # rank 0's next save must not start while another rank is still listing
    # A save that fails on rank 0 fails on every rank, and leaves the good file in place.
    good = path.read_bytes()
    try:
        loom.save(path, {"model": out["params"], "lock": threading.Lock()})
    except CheckpointError as error:
        out["failed_save"] = str(error)
    out["intact"] = path.read_bytes() == good
    return out


def test_round_trip_ddp(tmp_path):
    ranks = run_ranks(_ddp_body, 2, str(tmp_path), timeout=120)
    for out in ranks:
        _check_round_trip(out)
        assert out["files"] == ["ddp.pt"]  # one file, no temporaries
        assert "'lock'" in out.get("failed_save", ""), "every rank must learn that the save failed"
        assert out["intact"]
    assert _equal(ranks[0]["params"], ranks[1]["params"])
    # The file holds the DDP model under its own names, loadable by plain torch.
    checkpoint = torch.load(tmp_path / "ddp.pt", weights_only=False)
    assert list(checkpoint["model"]) == list(Net().state_dict())


@pytest.fixture
def loom() -> Loom:
    return Loom(accelerator="cpu")


def test_file_is_readable_by_plain_torch(loom, tmp_path):
    model, opt, _, _ = _trained(loom)
    path = tmp_path / "plain.pt"
    loom.save(path, {"model": model, "optimizer": opt, "epoch": 5})
    checkpoint = torch.load(path, weights_only=False)
    plain = Net()
    plain.load_state_dict(checkpoint["model"])  # the original key names, no wrapper prefixes
    assert _equal(plain.state_dict(), model.module.state_dict())
    names = [n for n, _ in model.module.named_parameters()]
    assert list(checkpoint["optimizer"]["state"]) == names  # optimizer state keyed by parameter name
    assert checkpoint["optimizer"]["param_groups"][0]["params"] == names
    for i, name in enumerate(names):
        assert torch.equal(
            checkpoint["optimizer"]["state"][name]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"]
        )
    assert checkpoint["epoch"] == 5


def test_load_without_state_returns_everything(loom, tmp_path):
    path = tmp_path / "c.pt"
    loom.save(path, {"a": 1, "b": torch.ones(2)})
    everything = loom.load(path)
    assert (
        set(everything) == {"a", "b"} and everything["a"] == 1 and torch.equal(everything["b"], torch.ones(2))
    )


def test_strict_names_missing_and_unexpected_keys(loom, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "c.pt"
    loom.save(path, {"model": loom.setup_module(Net()), "epoch": 1})
    bigger = Net(extra=True)
    with pytest.raises(CheckpointError) as info:
        loom.load(path, {"model": bigger})
    assert "extra.weight" in str(info.value) and "extra.bias" in str(info.value)

    smaller = Net()
    del smaller.head
    smaller.head2 = nn.Linear(8, 2)
    with pytest.raises(CheckpointError) as info:
        loom.load(path, {"model": smaller})
    message = str(info.value)
    for key in ("head.weight", "head.bias", "head2.weight", "head2.bias"):
        assert key in message

    with pytest.raises(CheckpointError, match="optimizer_state"):
        loom.load(path, {"model": Net(), "optimizer_state": {}})


def test_shape_mismatch_names_tensor_and_both_shapes(loom, tmp_path):
    path = tmp_path / "c.pt"
    loom.save(path, {"model": Net(hidden=8)})
    for strict in (True, False):
        with pytest.raises(CheckpointError) as info:
            loom.load(path, {"model": Net(hidden=5)}, strict=strict)
        message = str(info.value)
        assert "body.0.weight" in message and "(8, 4)" in message and "(5, 4)" in message


def test_non_strict_loads_what_matches(loom, tmp_path):
    torch.manual_seed(0)
    source = Net()
    path = tmp_path / "c.pt"
    loom.save(path, {"model": source, "epoch": 2})
    torch.manual_seed(1)
    target = Net(extra=True)
    extra_before = {k: v.clone() for k, v in target.extra.state_dict().items()}
    state = {"model": target, "epoch": 0, "not_in_file": "kept"}
    loom.load(path, state, strict=False)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)
    assert _equal(target.extra.state_dict(), extra_before)
    assert state["epoch"] == 2 and state["not_in_file"] == "kept"


def test_unpicklable_value_names_its_key_and_keeps_the_old_file(loom, tmp_path):
    path = tmp_path / "c.pt"
    loom.save(path, {"epoch": 1})
    good = path.read_bytes()
    with pytest.raises(CheckpointError, match="'callback'"):
        loom.save(path, {"epoch": 2, "callback": lambda: None})
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]  # no temporary left behind
    assert loom.load(path)["epoch"] == 1


def test_atomic_write_leaves_no_temporaries(loom, tmp_path):
    path = tmp_path / "sub" / "c.pt"
    for epoch in range(3):
        loom.save(path, {"epoch": epoch, "model": Net()})
    assert sorted(p.name for p in path.parent.iterdir()) == ["c.pt"]
    assert torch.load(path, weights_only=False)["epoch"] == 2


def test_truncated_file_names_the_file(loom, tmp_path):
    path = tmp_path / "c.pt"
    loom.save(path, {"model": Net()})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(path)):
        loom.load(path, {"model": Net()})
    with pytest.raises(CheckpointError, match="missing.pt"):
        loom.load(tmp_path / "missing.pt")


def test_load_raw_plain_state_dict(loom, tmp_path):
    torch.manual_seed(0)
    source = Net()
    path = tmp_path / "raw.pt"
    torch.save(source.state_dict(), path)
    target = loom.setup_module(Net())
    loom.load_raw(path, target)
    assert _equal(target.state_dict(), source.state_dict())
    plain = Net()
    loom.load_raw(path, plain)
    assert _equal(plain.state_dict(), source.state_dict())
    with pytest.raises(CheckpointError, match="extra.weight"):
        loom.load_raw(path, Net(extra=True))
    # An optimizer's own state_dict() file.
    model, opt, _, _ = _trained(loom)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    _, fresh_opt, _, _ = _trained(loom, seed=1, steps=0)
    loom.load_raw(tmp_path / "opt.pt", fresh_opt)
    assert _equal(fresh_opt.state_dict(), opt.state_dict())


def _failed_save_body(rank: int, world_size: int, root: str, strategy: str) -> dict:
    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    model = loom.setup_module(nn.Linear(2, 2))
    try:
        loom.save(f"{root}/{strategy}", {"model": model, "bad": threading.Lock()})  # a lock cannot be pickled
    except CheckpointError as error:
        cause = error.__cause__
        return {
            "message": str(error),
            "cause": type(cause).__name__,
            "cause_text": str(cause),
            "remote_rank": getattr(cause, "rank", None),
        }
    return {}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_failed_save_carries_its_cause_to_every_rank(tmp_path, strategy):
    """Rank 0 writes and fails; rank 0's error is chained to the real exception, the others' to its traceback."""
    r0, r1 = run_ranks(_failed_save_body, 2, str(tmp_path), strategy, timeout=150)
    assert "Cannot save entry 'bad'" in r0["message"] and r0["message"] == r1["message"]
    assert r0["cause"] == "TypeError" and "pickle" in r0["cause_text"]
    assert r1["cause"] == "RemoteError" and r1["remote_rank"] == 0
    assert (
        "raised on rank 0" in r1["cause_text"]
        and "Traceback" in r1["cause_text"]
        and "TypeError" in r1["cause_text"]
    )


class _Planted:
    """What a malicious checkpoint carries: unpickling it runs code (here: creates a file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _save_sharded_body(rank: int, world_size: int, path: str) -> None:
    loom = Loom(accelerator="cpu", devices=world_size, strategy="fsdp2")
    loom.launch()
    model = loom.setup_module(nn.Linear(2, 2))
    loom.save(path, {"model": model, "step": 3})


@pytest.mark.timeout(180)
def test_a_checkpoint_carrying_a_malicious_pickle_runs_nothing(tmp_path):
    from torchloom import cli
    from torchloom.checkpointing import tools

    sharded_path, full_path, marker = tmp_path / "sharded", tmp_path / "full.pt", tmp_path / "pwned"
    run_ranks(_save_sharded_body, 2, str(sharded_path), timeout=150)
    torch.save({"step": 3, "evil": _Planted(str(marker))}, sharded_path / "extra.pt")
    torch.save({"model": nn.Linear(2, 2).state_dict(), "evil": _Planted(str(marker))}, full_path)
    # As a forger would: the planted extra.pt's checksum recorded (checksums guard against accidents only).
    from torchloom.checkpointing import integrity

    meta = json.loads((sharded_path / "torchloom.json").read_text())
    meta["checksums"]["files"]["extra.pt"] = integrity.entry(
        *integrity.file_digest(sharded_path / "extra.pt")
    )
    (sharded_path / "torchloom.json").write_text(json.dumps(integrity.seal(meta)))

    loom = Loom(accelerator="cpu", devices=1)
    for path in (sharded_path, full_path):
        with pytest.raises(CheckpointError, match="not plain data.*weights_only=False"):
            loom.load(path, {"model": nn.Linear(2, 2)})
    with pytest.raises(CheckpointError, match="not plain data"):
        tools.inspect(full_path)
    with pytest.raises(CheckpointError, match="not plain data"):
        tools.consolidate(sharded_path, tmp_path / "out.pt")
    assert cli.main(["consolidate", str(sharded_path), str(tmp_path / "out.pt")]) == 2
    assert not marker.exists()
    # The test can see the planted code run: asked explicitly, for a file one trusts, it does.
    loom.load(full_path, {"model": nn.Linear(2, 2)}, weights_only=False)
    assert marker.exists()
