"""A sharded checkpoint from elsewhere runs no code when it is loaded: a planted pickle in DCP's `.metadata`, or
in a non-tensor item of a shard file, is refused by every reader (`loom.load` on one process and on 2 ranks, the
unnamed entries `loom.load` returns, `torchloom inspect`, `torchloom consolidate`), and nothing it names runs.
Everything torchloom and DCP themselves write still loads with the default `weights_only=True`."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from fsdp_models import D_IN, Block, Net
from harness import run_ranks
from torch import nn

from torchloom import CheckpointError, Loom, cli
from torchloom.checkpointing import integrity, sharded, tools
from torchloom.strategies import FSDP2Strategy


class _Planted:
    """What a malicious checkpoint carries: unpickling it runs code (here: creates a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _write_body(rank: int, world_size: int, path: str) -> None:
    loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(shard_policy={Block}))
    loom.launch()
    torch.manual_seed(0)
    model = loom.setup_module(Net())  # blocks sharded, the layers around them replicated leftovers
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    loom.backward(model(torch.randn(4, D_IN)).sum())
    opt.step()
    loom.save(path, {"model": model, "optimizer": opt, "epoch": 3})


def _plant_in_metadata(path: Path, marker: Path) -> None:
    """A real `.metadata` with a planted object inside (DCP's reader would run it)."""
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own checkpoint: trusted
    md.planner_data["evil"] = _Planted(marker)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _plant_in_item(path: Path, marker: Path, fqn: str = "optimizer.param_groups.0.lr") -> None:
    """The non-tensor item `fqn` (stored pickled by DCP) replaced by a planted object: appended to its shard
    file, with `.metadata` pointing at it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    (index,) = [i for i in md.storage_data if i.fqn == fqn]
    info = md.storage_data[index]
    shard = path / info.relative_path
    blob = Path(str(marker) + ".blob")
    torch.save(_Planted(marker), blob)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob.read_bytes())
    md.storage_data[index] = _StorageInfo(info.relative_path, offset, blob.stat().st_size)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """clean/: a 2-rank FSDP2 checkpoint with optimizer state; in_metadata/ and in_item/: copies with a
    planted pickle (creating marker_metadata or marker_item when run)."""
    root = tmp_path_factory.mktemp("untrusted")
    run_ranks(_write_body, 2, str(root / "clean"), timeout=180)
    shutil.copytree(root / "clean", root / "in_metadata")
    shutil.copytree(root / "clean", root / "in_item")
    _plant_in_metadata(root / "in_metadata", root / "marker_metadata")
    _plant_in_item(root / "in_item", root / "marker_item")
    for planted in ("in_metadata", "in_item"):
        _record_checksums_again(root / planted)
    return root


def _record_checksums_again(path: Path) -> None:
    """What a forger would do: record the planted files' checksums, so that only the safe reader stands
    between the plant and the load (the checksums guard against accidents, not forgery)."""
    meta = json.loads((path / "torchloom.json").read_text())
    files = meta["checksums"]["files"]
    for name in files:
        files[name] = integrity.entry(*integrity.file_digest(path / name))
    (path / "torchloom.json").write_text(json.dumps(integrity.seal(meta)))


def _refused(where: str) -> str:
    return (
        r"refers to pathlib\S*\.Path\.touch, which is not part of a checkpoint's metadata.*weights_only=False"
        if where == "in_metadata"
        else r"'optimizer\.param_groups\.0\.lr' of .*__\d_0\.distcp.* not plain data.*weights_only=False"
    )


def _markers(root: Path) -> list[Path]:
    return [m for m in (root / "marker_metadata", root / "marker_item") if m.exists()]


def test_one_process_refuses_both_plants(checkpoints):
    root = checkpoints
    loom = Loom(accelerator="cpu")
    for where in ("in_metadata", "in_item"):
        model = loom.setup_module(Net())
        opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
        with pytest.raises(CheckpointError, match=_refused(where)):
            loom.load(root / where, {"model": model, "optimizer": opt})
        with pytest.raises(CheckpointError, match=_refused(where)):
            loom.load(root / where)  # every entry unnamed: read whole, in this process
        with pytest.raises(CheckpointError, match=_refused(where)):
            tools.consolidate(root / where, root / f"{where}.pt")
        assert cli.main(["consolidate", str(root / where), str(root / f"{where}.pt")]) == 2
    with pytest.raises(CheckpointError, match=_refused("in_metadata")):
        tools.inspect(root / "in_metadata")
    assert cli.main(["inspect", str(root / "in_metadata")]) == 2
    assert _markers(root) == []
    assert not (root / "in_metadata.pt").exists() and not (root / "in_item.pt").exists()


def _load_body(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for where in ("in_metadata", "in_item", "clean"):
        loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(shard_policy={Block}))
        loom.launch()
        model = loom.setup_module(Net())
        opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
        try:
            out[where] = loom.load(f"{root}/{where}", {"model": model, "optimizer": opt})
        except CheckpointError as exc:
            out[where] = str(exc)
    return out


@pytest.mark.timeout(240)
def test_two_ranks_refuse_both_plants_alike(checkpoints):
    root = checkpoints
    results = run_ranks(_load_body, 2, str(root), timeout=180)
    for where in ("in_metadata", "in_item"):
        assert results[0][where] == results[1][where], where  # one error, the same on every rank
        assert re.search(_refused(where), results[0][where]), results[0][where]
    assert results[0]["clean"] == results[1]["clean"] == {"epoch": 3}
    assert _markers(root) == []


def test_the_plants_run_when_loading_is_trusted(checkpoints, tmp_path):
    """The planted pickles are live (what the refusals above prevent): with weights_only=False / --allow-pickle
    they run, as DCP's own reader always ran them."""
    root = checkpoints
    for where, marker in (("in_metadata", "marker_metadata"), ("in_item", "marker_item")):
        tools.consolidate(root / where, tmp_path / f"{where}.pt", weights_only=False)
        assert (root / marker).exists(), where
        (root / marker).unlink()
    assert cli.main(["inspect", str(root / "in_metadata"), "--allow-pickle"]) == 0
    assert (root / "marker_metadata").exists()
    (root / "marker_metadata").unlink()


@pytest.mark.parametrize(
    ("payload", "refused"),
    [
        (b"cposix\nsystem\n(S'true'\ntR.", "posix.system"),
        (b"cbuiltins\ngetattr\n(cpathlib\nPath\nS'touch'\ntR.", "builtins.getattr"),
        # Only torch's dtypes, layouts and memory formats are admitted by name from `torch`, not its functions.
        (b"ctorch\nload\n(S'x'\ntR.", "torch.load"),
        (b"ctorch\nnn.Module\n.", "torch.nn.Module"),
        (b"\x80\x02cpathlib\nPath.touch\nq\x00.", "pathlib.Path.touch"),
    ],
)
def test_metadata_unpickler_refuses_every_other_global(tmp_path, payload, refused):
    from torchloom.checkpointing._safe_reader import read_metadata_file

    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match=re.escape(f"refers to {refused}, which is not part of")):
        read_metadata_file(tmp_path / ".metadata")


def test_metadata_that_is_not_metadata_is_refused(tmp_path):
    from torchloom.checkpointing._safe_reader import read_metadata_file

    (tmp_path / ".metadata").write_bytes(pickle.dumps({"dtype": torch.float32, "shape": torch.Size([2])}))
    with pytest.raises(CheckpointError, match="does not hold a checkpoint's metadata.*a dict.*corrupt"):
        read_metadata_file(tmp_path / ".metadata")


def test_shard_files_outside_the_checkpoint_are_refused(checkpoints, tmp_path):
    """A tampered `.metadata` (plain data, so admitted) cannot make torchloom read files elsewhere."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for outside in ("../elsewhere.distcp", str(tmp_path / "abs.distcp")):
        copy = tmp_path / "ckpt"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(checkpoints / "clean", copy)
        with open(copy / ".metadata", "rb") as f:
            md = pickle.load(f)
        index = next(iter(md.storage_data))
        info = md.storage_data[index]
        md.storage_data[index] = _StorageInfo(outside, info.offset, info.length)
        with open(copy / ".metadata", "wb") as f:
            pickle.dump(md, f)
        with pytest.raises(CheckpointError, match=re.escape(f"names shard file {outside!r}, outside")):
            tools.inspect(copy)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_what_torch_and_torchloom_write_loads_with_weights_only(checkpoints, tmp_path):
    """The allowlist is complete: DCP's metadata of every kind of item (bf16 and int tensors, plain values of
    each type, a Path as the checkpoint id), and torchloom's one-process sharded save (async too) load with the
    default weights_only=True. (2-rank FSDP2 and FSDP1 checkpoints: test_resharding.py.)"""
    import torch.distributed.checkpoint as dcp

    plain = {
        "w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "n": {"i": torch.arange(4), "lr": 0.1, "betas": (0.9, 0.95), "names": ["a", "b"], "off": None},
        "flag": True,
        "shape": torch.Size([3, 4]),
    }
    for checkpoint_id in (str(tmp_path / "dcp-str"), tmp_path / "dcp-path"):
        dcp.save(plain, checkpoint_id=checkpoint_id, no_dist=True)
        got = sharded.read_entries(Path(checkpoint_id))  # every item, read whole
        assert len(tools.inspect(checkpoint_id)["tensors"]) == 2
        assert torch.equal(got["w"], plain["w"]) and torch.equal(got["n"].pop("i"), plain["n"]["i"])
        assert got["n"] == {k: v for k, v in plain["n"].items() if k != "i"}
        assert got["flag"] is True and got["shape"] == plain["shape"]

    loom = Loom(accelerator="cpu", devices=1, strategy="fsdp2")
    loom.launch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = loom.setup_module(nn.Linear(4, 3))
    opt = loom.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loom.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    loom.save(tmp_path / "one", {"model": model, "optimizer": opt, "step": 1})
    loom.save(tmp_path / "one-async", {"model": model, "optimizer": opt, "step": 2}, async_save=True)
    for name, step in (("one", 1), ("one-async", 2)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            fresh = loom.setup_module(nn.Linear(4, 3))
        fresh_opt = loom.setup_optimizers(torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.1))
        assert loom.load(tmp_path / name, {"model": fresh, "optimizer": fresh_opt}) == {"step": step}
        assert fresh_opt.param_groups[0]["lr"] == 0.1 and fresh_opt.param_groups[0]["momentum"] == 0.9
        unnamed = loom.load(tmp_path / name)  # read whole, in this process
        assert unnamed["optimizer"]["param_groups"][0]["lr"] == 0.1
        assert tools.inspect(tmp_path / name)["format"] == "sharded"
    # A clean 2-rank checkpoint, read by every offline reader.
    assert tools.consolidate(checkpoints / "clean", tmp_path / "clean.pt")["epoch"] == 3
    assert cli.main(["inspect", str(checkpoints / "clean")]) == 0
