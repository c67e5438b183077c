"""A checkpoint that changed or lost a file after it was written is refused, not loaded with other values.

Checkpoints written by 2 FSDP2 ranks (sharded, full, async sharded) are damaged on purpose: one flipped byte in
a DCP shard or in the full file, ten in extra.pt, a missing extra.pt. Every load raises a `CheckpointError` on
both ranks naming the file; `verify=False` loads a flipped one anyway; a checkpoint written before checksums
were recorded (its checksum record removed) still loads. `torchloom inspect --verify` reports good, bad and
unverifiable checkpoints, and `torchloom inspect` shows the mesh a checkpoint was saved from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from fsdp_models import D_IN, Block, Net
from harness import run_ranks

from torchloom import CheckpointError, Loom, cli, latest_checkpoint
from torchloom.checkpointing import integrity
from torchloom.checkpointing.state import META_KEY
from torchloom.strategies import FSDP2Strategy


def _flip(file: Path, count: int = 1) -> None:
    """Flip `count` bytes (all bits) around the middle of `file`, one every 97 bytes."""
    data = bytearray(file.read_bytes())
    for i in range(count):
        data[len(data) // 2 + 97 * i] ^= 0xFF
    file.write_bytes(bytes(data))


def _largest_shard(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _damage(root: Path) -> dict[str, tuple[Path, str]]:
    """Damaged copies of the good checkpoints: name -> (checkpoint, the file a load must name)."""
    out = {}
    copies = (("shard", "sharded"), ("extra", "sharded"), ("missing", "sharded"), ("async_bad", "async"))
    for name, source in copies:
        shutil.copytree(root / source, root / name)
    shard = _largest_shard(root / "shard")
    _flip(shard)
    out["shard"] = (root / "shard", shard.name)
    _flip(root / "extra" / "extra.pt", 10)
    out["extra"] = (root / "extra", "extra.pt")
    (root / "missing" / "extra.pt").unlink()
    out["missing"] = (root / "missing", "extra.pt")
    # torchloom's files without their record: not a plain DCP checkpoint (whose extra.pt would be no one's)
    shutil.copytree(root / "sharded", root / "norecord")
    (root / "norecord" / "torchloom.json").unlink()
    out["norecord"] = (root / "norecord", "torchloom.json")
    shard = _largest_shard(root / "async_bad")
    _flip(shard)
    out["async"] = (root / "async_bad", shard.name)
    shutil.copy(root / "full.pt", root / "full_bad.pt")
    _flip(root / "full_bad.pt")
    out["full"] = (root / "full_bad.pt", "full_bad.pt")
    # As written before checksums existed: no checksum record in torchloom.json, no zip comment in the file.
    shutil.copytree(root / "sharded", root / "old")
    meta = json.loads((root / "old" / "torchloom.json").read_text())
    meta.pop("checksums")
    meta.pop(integrity.RECORD_DIGEST)
    (root / "old" / "torchloom.json").write_text(json.dumps(meta))
    checkpoint = torch.load(root / "full.pt", weights_only=True)
    checkpoint[META_KEY].pop("checksum")
    torch.save(checkpoint, root / "old.pt")
    return out


def _body(rank: int, world_size: int, root: str) -> dict[str, str]:
    root_path = Path(root)
    strategy = FSDP2Strategy(shard_policy={Block})
    loom = Loom(accelerator="cpu", devices=world_size, strategy=strategy)
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(Net())
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    loom.backward(model(torch.randn(4, D_IN)).sum())
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 3}
    loom.save(root_path / "sharded", state)
    loom.save(root_path / "async", state, async_save=True)
    strategy.state_dict_type = "full"
    loom.save(root_path / "full.pt", state)
    strategy.state_dict_type = "sharded"
    loom._checkpointer.finish_pending_save()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    damaged = _damage(root_path) if rank == 0 else None
    damaged = loom.broadcast(damaged)

    def fresh() -> dict:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        return {"model": model, "optimizer": opt, "step": 0}

    out = {}
    for name, (path, _) in damaged.items():
        try:
            loom.load(path, fresh())
            out[name] = "loaded"
        except CheckpointError as error:
            out[name] = str(error)
    # The opt-out: flipped bytes load (with the values they now hold); a missing file is still refused.
    for name in ("shard", "full"):
        loaded = fresh()
        loom.load(damaged[name][0], loaded, verify=False)
        out[f"{name} verify=False"] = f"step {loaded['step']}"
    try:
        loom.load(damaged["missing"][0], fresh(), verify=False)
        out["missing verify=False"] = "loaded"
    except CheckpointError as error:
        out["missing verify=False"] = str(error)
    # Good and old checkpoints load, with the values saved.
    for name in ("sharded", "full.pt", "old", "old.pt"):
        loaded = fresh()
        loom.load(root_path / name, loaded)
        same = all(torch.equal(_full(v), _full(saved[k])) for k, v in model.state_dict().items())
        out[f"good {name}"] = f"step {loaded['step']} same {same}"
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path, capsys) -> None:
    results = run_ranks(_body, 2, str(tmp_path), timeout=240)
    assert results[0] == results[1], "both ranks must reach the same outcome"
    out = results[0]
    for name in ("shard", "extra", "async", "full"):
        path = {"full": tmp_path / "full_bad.pt", "async": tmp_path / "async_bad"}.get(name, tmp_path / name)
        file = path / ("extra.pt" if name == "extra" else "") if name != "full" else path
        assert "changed after it was written" in out[name] or "damaged" in out[name], (name, out[name])
        assert "verify=False" in out[name], out[name]
        if name == "shard" or name == "async":
            assert ".distcp" in out[name] and str(path) in out[name], out[name]
        else:
            assert str(file) in out[name], out[name]
        if "checksum " in out[name]:
            assert "recorded" in out[name]
    for name in ("missing", "missing verify=False"):
        assert "incomplete" in out[name] and "'extra.pt'" in out[name], out[name]
        assert "latest_checkpoint" in out[name]
    assert "incomplete" in out["norecord"] and "not torchloom.json" in out["norecord"], out["norecord"]
    assert "previous checkpoint" in out["norecord"] and "torchloom inspect" in out["norecord"]
    assert out["shard verify=False"] == "step 3"
    assert out["full verify=False"] == "step 3"
    for name in ("sharded", "full.pt", "old", "old.pt"):
        assert out[f"good {name}"] == "step 3 same True", (name, out[f"good {name}"])

    # torchloom inspect: the mesh, and --verify on good, damaged and old checkpoints.
    capsys.readouterr()
    for name in ("sharded", "full.pt"):
        assert cli.main(["inspect", str(tmp_path / name), "--verify"]) == 0
        text = capsys.readouterr().out
        assert "mesh: shard 2" in text and "written by: 2 ranks, strategy 'fsdp2'" in text, text
        assert "verify: ok" in text, text
    for name in ("shard", "extra", "missing", "async_bad", "full_bad.pt"):
        assert cli.main(["inspect", str(tmp_path / name), "--verify"]) == 1, name
        text = capsys.readouterr().out
        assert "verify: FAILED" in text, text
    assert cli.main(["inspect", str(tmp_path / "norecord"), "--verify"]) == 1
    assert "not torchloom.json" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path / "norecord")]) == 0
    text = capsys.readouterr().out
    assert "INCOMPLETE" in text and "step = 3" in text and "model." in text, text
    for name in ("old", "old.pt"):
        assert cli.main(["inspect", str(tmp_path / name), "--verify"]) == 0
        assert "no checksums recorded" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path / "sharded"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"] == {"shard": 2}

    # consolidate checks what it reads (a consolidated copy of a damaged checkpoint would look intact); a
    # checkpoint without its extra.pt still gives its weights with --model-only.
    assert cli.main(["consolidate", str(tmp_path / "shard"), str(tmp_path / "c1.pt")]) == 2
    assert "changed after it was written" in capsys.readouterr().err
    assert cli.main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "c2.pt")]) == 2
    assert "incomplete" in capsys.readouterr().err
    assert cli.main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "c3.pt"), "--model-only"]) == 0
    assert cli.main(["consolidate", str(tmp_path / "sharded"), str(tmp_path / "c4.pt")]) == 0
    assert cli.main(["inspect", str(tmp_path / "c4.pt"), "--verify"]) == 0
    assert "verify: ok" in capsys.readouterr().out

    # latest_checkpoint agrees: the folder without its record is not a complete checkpoint, however new
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(tmp_path / "sharded", runs / "step-1")
    shutil.copytree(tmp_path / "norecord", runs / "step-2", copy_function=shutil.copy)
    assert latest_checkpoint(runs) == runs / "step-1"


def test_the_record_names_the_mesh() -> None:
    """The layout recorded for a hybrid-sharded and a 2-D model-parallel strategy: dims by name."""
    from torchloom.checkpointing import record
    from torchloom.strategies import ModelParallelStrategy

    assert record.mesh_of(FSDP2Strategy(device_mesh=(2, 4))) == {"replicate": 2, "shard": 4}
    strategy = ModelParallelStrategy(lambda m, mesh: m, data_parallel_size=2, tensor_parallel_size=2)
    assert record.mesh_of(strategy) == {"data_parallel": 2, "tensor_parallel": 2}
    strategy = ModelParallelStrategy(
        lambda m, mesh: m, data_parallel_size=4, tensor_parallel_size=2, data_parallel_replicate_size=2
    )
    assert record.mesh_of(strategy) == {
        "data_parallel_replicate": 2,
        "data_parallel_shard": 2,
        "tensor_parallel": 2,
    }


def test_checksum_detects_single_word_changes_and_is_streamable(tmp_path) -> None:
    """The digest of a stream fed in odd pieces equals the file's; any one flipped bit changes it."""
    data = bytes(range(256)) * 200 + b"tail"
    digest = integrity.Digest()
    for start in range(0, len(data), 1000):
        digest.update(data[start : start + 1000])
    file = tmp_path / "f.bin"
    file.write_bytes(data)
    assert integrity.file_digest(file) == (len(data), digest.hexdigest())
    for position in (0, 7, 8191, 8192, len(data) - 1):
        for bit in (0, 7):
            changed = bytearray(data)
            changed[position] ^= 1 << bit
            file.write_bytes(bytes(changed))
            assert integrity.file_digest(file)[1] != digest.hexdigest(), (position, bit)


def test_a_full_file_saved_again_by_torch_save_loads_unchecked_and_a_damaged_trailer_is_refused(tmp_path):
    """A torchloom checkpoint loaded and saved again with plain torch.save keeps its record (which says a checksum
    was written) but has no zip comment: loaded with a warning. One flipped byte in the checksum's marker, or
    bytes cut from the comment, leave the archive's comment length behind: refused."""
    import pytest

    loom = Loom(accelerator="cpu")
    model = loom.setup(torch.nn.Linear(4, 3))
    loom.save(tmp_path / "full.pt", {"model": model, "step": 3})
    resaved = torch.load(tmp_path / "full.pt", weights_only=True)
    assert resaved[META_KEY].get("checksum")
    torch.save(resaved, tmp_path / "resaved.pt")
    with pytest.warns(UserWarning, match="written again without its checksum"):
        assert loom.load(tmp_path / "resaved.pt", {"model": model})["step"] == 3
    data = bytearray((tmp_path / "full.pt").read_bytes())
    marker = data.rfind(b"torchloom-checksum:")
    assert marker > 0
    damaged = bytearray(data)
    damaged[marker + 3] ^= 0xFF
    (tmp_path / "marker.pt").write_bytes(bytes(damaged))
    (tmp_path / "cut.pt").write_bytes(bytes(data[: marker + 5]))
    for name in ("marker.pt", "cut.pt"):
        with pytest.raises(CheckpointError, match=name):
            loom.load(tmp_path / name, {"model": model})
