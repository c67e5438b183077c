"""Checkpoints move between world sizes and formats: written by 2 ranks, read by 1 process (a plain model) and by
3 ranks; full <-> sharded both ways; consolidate to one file that plain PyTorch reads; inspect; strictness."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from fsdp_models import D_IN, Block, Net, build_layout, full_state, layout_strategy
from harness import run_ranks
from torch import nn

from torchloom import CheckpointError, Loom
from torchloom.strategies import FSDP2Strategy

WRITERS = {"fsdp2": "units_plus_leftovers", "fsdp": "wrapped_root"}


def _full_optimizer(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(
        model.forward_module, opt.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {f"{k}.{n}": v.clone() for k, s in state["state"].items() for n, v in s.items()}


def _train(loom, model, opt, steps: int = 2) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + loom.global_rank)
        loom.backward(model(torch.randn(4, D_IN, generator=g)).pow(2).mean())
        opt.step()
        opt.zero_grad()


def _write_body(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for flavour, layout in WRITERS.items():
        for fmt in ("sharded", "full"):
            loom = Loom(
                accelerator="cpu",
                devices=world_size,
                strategy=layout_strategy(flavour, layout, state_dict_type=fmt),
            )
            loom.launch()
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                model = loom.setup_module(build_layout(loom, flavour, layout))
            opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
            _train(loom, model, opt)
            loom.save(f"{root}/{flavour}-{fmt}", {"model": model, "optimizer": opt, "epoch": 4})
            out[(flavour, fmt)] = full_state(model)
            out[(flavour, fmt, "optimizer")] = _full_optimizer(model, opt)
    # Two sharded models and their optimizers in one checkpoint (a GAN's generator and discriminator).
    loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(shard_policy={Block}))
    loom.launch()
    torch.manual_seed(0)
    gen, disc = loom.setup_module(Net()), loom.setup_module(Net())
    opt_g = loom.setup_optimizers(torch.optim.Adam(gen.parameters(), lr=1e-2))
    opt_d = loom.setup_optimizers(torch.optim.SGD(disc.parameters(), lr=1e-2, momentum=0.9))
    _train(loom, gen, opt_g)
    _train(loom, disc, opt_d)
    loom.save(f"{root}/gan", {"gen": gen, "disc": disc, "opt_g": opt_g, "opt_d": opt_d})
    out["gan"] = (full_state(gen), full_state(disc))
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    results = run_ranks(_write_body, 2, str(root), timeout=180)
    return root, results[0]


def _read_body(rank: int, world_size: int, root: str) -> dict:
    """Every checkpoint into 3 ranks, with both flavours and both formats on the reading side."""
    out = {}
    for source in ("fsdp2-sharded", "fsdp2-full", "fsdp-sharded", "fsdp-full"):
        for flavour, layout in (("fsdp2", "units_plus_leftovers"), ("fsdp", "units_no_root")):
            loom = Loom(accelerator="cpu", devices=world_size, strategy=layout_strategy(flavour, layout))
            loom.launch()
            torch.manual_seed(7)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                model = loom.setup_module(build_layout(loom, flavour, layout))
            opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
            state = {"model": model, "optimizer": opt}
            rest = loom.load(f"{root}/{source}", state)
            out[(source, flavour)] = (full_state(model), rest, _full_optimizer(model, opt))
    loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(shard_policy={Block}))
    loom.launch()
    gen, disc = loom.setup_module(Net()), loom.setup_module(Net())
    opt_g = loom.setup_optimizers(torch.optim.Adam(gen.parameters(), lr=1e-2))
    opt_d = loom.setup_optimizers(torch.optim.SGD(disc.parameters(), lr=1e-2, momentum=0.9))
    loom.load(f"{root}/gan", {"gen": gen, "disc": disc, "opt_g": opt_g, "opt_d": opt_d})
    out["gan"] = (full_state(gen), full_state(disc), len(opt_g.state), len(opt_d.state))
    return out


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_to_three_ranks_any_format_any_flavour(written):
    root, expected = written
    for rank, result in enumerate(run_ranks(_read_body, 3, str(root), timeout=240)):
        for (source, flavour), (params, rest, optimizer) in ((k, v) for k, v in result.items() if k != "gan"):
            writer, fmt = source.split("-")
            assert _equal(params, expected[(writer, fmt)]), (source, flavour, rank)
            assert rest == {"epoch": 4}
            assert _equal(optimizer, expected[(writer, fmt, "optimizer")]), (source, flavour, rank)
        gen, disc, n_g, n_d = result["gan"]
        assert _equal(gen, expected["gan"][0]) and _equal(disc, expected["gan"][1])
        assert not _equal(gen, disc)
        assert n_g == len(gen) and n_d == len(disc)


def test_two_ranks_to_one_plain_process(written):
    root, expected = written
    for writer in ("fsdp2", "fsdp"):
        for fmt in ("sharded", "full"):
            loom = Loom(accelerator="cpu")  # strategy "auto": one process, a plain unsharded model
            model = loom.setup_module(Net())
            opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
            rest = loom.load(root / f"{writer}-{fmt}", {"model": model, "optimizer": opt})
            assert rest == {"epoch": 4}
            assert _equal(model.state_dict(), expected[(writer, fmt)]), (writer, fmt)
            assert len(opt.state) == len(expected[(writer, fmt)])


def test_replicated_leftovers_stored_once(written):
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(written[0] / "fsdp2-sharded")).read_metadata()
    leftover = md.state_dict_metadata["model.embed.weight"]
    sharded = md.state_dict_metadata["model.blocks.0.fc1.weight"]
    assert len(leftover.chunks) == 1 and tuple(leftover.chunks[0].sizes) == tuple(leftover.size)
    assert len(sharded.chunks) == 2  # one shard from each rank
    stored = [k for k in md.storage_data if k.fqn == "model.embed.weight"]
    assert len(stored) == 1


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchloom", *args], capture_output=True, text=True, timeout=120
    )


def test_consolidate_then_plain_torch(written, tmp_path):
    root, expected = written
    out = tmp_path / "full.pt"
    result = _cli("consolidate", str(root / "fsdp2-sharded"), str(out))
    assert result.returncode == 0, result.stderr
    checkpoint = torch.load(out, weights_only=False)
    model = Net()
    model.load_state_dict(checkpoint["model"])  # plain PyTorch, original key names
    assert _equal(model.state_dict(), expected[("fsdp2", "sharded")])
    assert checkpoint["epoch"] == 4
    assert set(checkpoint["optimizer"]["state"]) == set(expected[("fsdp2", "sharded")])  # keyed by name
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, checkpoint["optimizer"])
    assert len(opt.state) == len(expected[("fsdp2", "sharded")])

    weights = tmp_path / "weights.pt"
    assert _cli("consolidate", str(root / "fsdp-sharded"), str(weights), "--model-only").returncode == 0
    model.load_state_dict(torch.load(weights))  # just the weights, loadable with weights_only
    assert _equal(model.state_dict(), expected[("fsdp", "sharded")])

    from safetensors.torch import load_file

    tensors = tmp_path / "weights.safetensors"
    result = _cli(
        "consolidate", str(root / "fsdp2-sharded"), str(tensors), "--model-only", "--format", "safetensors"
    )
    assert result.returncode == 0, result.stderr
    model.load_state_dict(load_file(str(tensors)))
    assert _equal(model.state_dict(), expected[("fsdp2", "sharded")])
    refused = _cli("consolidate", str(root / "fsdp2-sharded"), str(tensors), "--format", "safetensors")
    assert refused.returncode == 2 and "--model-only" in refused.stderr

    # A consolidated file loads back through torchloom too.
    loom = Loom(accelerator="cpu")
    fresh = loom.setup_module(Net())
    assert loom.load(out, {"model": fresh}, strict=False)["epoch"] == 4
    assert _equal(fresh.state_dict(), expected[("fsdp2", "sharded")])


def test_inspect(written):
    root, expected = written
    result = _cli("inspect", str(root / "fsdp2-sharded"), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["format"] == "sharded" and info["world_size"] == 2
    shapes = {t["name"]: tuple(t["shape"]) for t in info["tensors"]}
    for name, value in expected[("fsdp2", "sharded")].items():
        assert shapes[f"model.{name}"] == tuple(value.shape)
    assert info["extra_entries"] == ["epoch"]
    text = _cli("inspect", str(root / "fsdp-full"))
    assert "format: full" in text.stdout and "model.blocks.0.fc1.weight" in text.stdout
    bad = _cli("inspect", str(root / "missing"))
    assert bad.returncode == 2 and "No checkpoint" in bad.stderr


class Wider(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 2)  # 2 outputs where the checkpoint has 1
        self.extra = nn.Linear(2, 2)  # not in the checkpoint


def test_strict_names_keys_and_shapes(written):
    root, _ = written
    loom = Loom(accelerator="cpu")
    for source in ("fsdp2-sharded", "fsdp2-full"):
        model = loom.setup_module(Wider()) if source.endswith("sharded") else Wider()
        with pytest.raises(CheckpointError) as info:
            loom.load(root / source, {"model": model})
        message = str(info.value)
        assert "extra.weight" in message and "extra.bias" in message  # missing keys, by name
        with pytest.raises(
            CheckpointError, match=r"head.weight: checkpoint shape \(1, 16\) vs module shape \(2, 16\)"
        ):
            loom.load(root / source, {"model": model}, strict=False)
        with pytest.raises(CheckpointError, match="no entries \\['nope'\\]"):
            loom.load(root / source, {"model": Net(), "nope": 1})
        # strict=False loads what matches and leaves the rest alone.
        net = Net()
        del net.head
        net.head = nn.Identity()
        loom.load(root / source, {"model": net}, strict=False)
