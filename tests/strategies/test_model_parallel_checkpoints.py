"""Checkpoints of 2-D models (tensor parallel + FSDP2 over data parallel, plain leftovers): the reshard matrix.

Written at (dp 2, tp 2), sharded and full, with two models and their optimizers in one checkpoint; read at
(dp 4, tp 1), at (dp 1, tp 4) and in one process into a plain model; consolidated into one file that plain
PyTorch loads. Every read must give back the saved parameters and optimizer state exactly, and training on from
them must match the run that was never interrupted (fp32, 1e-5). `save_raw`/`load_raw` (Hugging Face
safetensors) round-trip through tensor-parallel shards; `save(filter=)` keeps what the filter keeps.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from torch import nn

from torchloom import Loom

pytest.importorskip("safetensors")
# Whichever test runs first also writes the checkpoints (a 4-rank group), then reads them with another.
pytestmark = pytest.mark.timeout(600)

GLOBAL_BATCH, D_IN, HIDDEN, FFN = 8, 4, 16, 32
SAVED_AT, STEPS_AFTER = 2, 2
LR = 1e-2


class TPNet(nn.Module):
    """An MLP block made tensor parallel (w1 column-wise, w2 row-wise), between plain leftovers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(D_IN, HIDDEN)
        self.w1 = nn.Linear(HIDDEN, FFN)
        self.w2 = nn.Linear(FFN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(self.norm(h + self.w2(torch.relu(self.w1(h)))))


def tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Tensor parallel, then FSDP2 (HSDP where the mesh has a replicate dim) over the data-parallel ranks."""
    from torch.distributed.fsdp import fully_shard

    tensor_parallel(model, mesh)
    hsdp = "data_parallel_replicate" in mesh.mesh_dim_names
    dp_mesh = mesh["data_parallel_replicate", "data_parallel_shard"] if hsdp else mesh["data_parallel"]
    for block in (model.w1, model.w2):
        fully_shard(block, mesh=dp_mesh)
    return model


def _setup(dp: int, tp: int, fmt: str = "sharded", replicate: int = 1, parallelize_fn=parallelize):
    """A Loom on dp * tp ranks with two 2-D models (seeds 0 and 1) and their Adam optimizers; HSDP over the
    data-parallel ranks with `replicate` > 1."""
    from torchloom.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize_fn,
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        save_distributed_checkpoint=fmt == "sharded",
        data_parallel_replicate_size=replicate,
    )
    loom = Loom(accelerator="cpu", devices=dp * tp, strategy=strategy)
    loom.launch()
    models, optimizers = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = loom.setup_module(TPNet())
        models.append(model)
        optimizers.append(loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR)))
    dp_rank = strategy.device_mesh["data_parallel"].get_local_rank()
    return loom, models, optimizers, (dp_rank, dp)


def _state(models, optimizers) -> dict:
    return {"model": models[0], "optimizer": optimizers[0], "critic": models[1], "critic_opt": optimizers[1]}


def _train(loom, models, optimizers, steps: range, dp: tuple[int, int] = (0, 1)) -> None:
    """The same global batch at every layout: data-parallel rank i takes its rows of it."""
    dp_rank, dp_size = dp
    rows = GLOBAL_BATCH // dp_size
    for step in steps:
        x = torch.randn(GLOBAL_BATCH, D_IN, generator=torch.Generator().manual_seed(step))
        x = x[dp_rank * rows : (dp_rank + 1) * rows]
        for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            loom.backward(model(x + i).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()


def _full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = getattr(model, "forward_module", model)
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _full_optimizer(model, optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    module = getattr(model, "forward_module", model)
    opt = getattr(optimizer, "optimizer", optimizer)
    state = get_optimizer_state_dict(module, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{k}.{n}": torch.as_tensor(v).clone() for k, s in state["state"].items() for n, v in s.items()}


def _snapshot(models, optimizers) -> dict:
    return {
        "params": [_full_params(m) for m in models],
        "optimizer": [_full_optimizer(m, o) for m, o in zip(models, optimizers, strict=True)],
    }


def _is_w1(name: str, value: object) -> bool:
    return name.startswith("w1.")


# ---- writing at (dp 2, tp 2) --------------------------------------------------------------------------------
def _write_body(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    for fmt in ("sharded", "full"):
        loom, models, optimizers, dp = _setup(2, 2, fmt)
        _train(loom, models, optimizers, range(SAVED_AT), dp)
        loom.save(f"{root}/{fmt}", {**_state(models, optimizers), "step": SAVED_AT})
        out[fmt] = _snapshot(models, optimizers)
        if fmt == "sharded":
            # A filtered save of a distributed checkpoint: only w1 of the first model, nothing of the second.
            loom.save(f"{root}/filtered", {"model": models[0], "step": 7}, filter={"model": _is_w1})
            # The same state, written in the background.
            loom.save(f"{root}/async", {**_state(models, optimizers), "step": SAVED_AT}, async_save=True)
            loom.save_raw(f"{root}/hf", models[0])
            # load_raw into the same 2-D layout (FSDP2's strided shards of the column-parallel weight), into a
            # model created on the meta device: pretrained weights into a model never materialised whole.
            with loom.init_module(empty_init=True):
                fresh = TPNet()
            fresh = loom.setup_module(fresh)
            loom.load_raw(f"{root}/hf", fresh)
            out["load_raw_2x2"] = _full_params(fresh)
        _train(loom, models, optimizers, range(SAVED_AT, SAVED_AT + STEPS_AFTER), dp)
        out[f"{fmt}_uninterrupted"] = [_full_params(m) for m in models]
        loom.close()
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp-ckpts")
    results = run_ranks(_write_body, 4, str(root), timeout=400)
    # What `torch.save(model.state_dict())` of the saved model writes: for load_raw at other layouts.
    torch.save(results[0]["sharded"]["params"][0], root / "plain.pt")
    return root, results[0]


# ---- reading at (dp 4, tp 1) and (dp 1, tp 4) ---------------------------------------------------------------
# (data parallel, tensor parallel, replicate, FSDP2): the same layout (a plain resume), dp only, tp only (with
# and without FSDP2 over its one data-parallel rank), and HSDP.
LAYOUTS = ((2, 2, 1, True), (4, 1, 1, True), (1, 4, 1, True), (1, 4, 1, False), (4, 1, 2, True))


def _read_body(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    for layout in LAYOUTS:
        for fmt in ("sharded", "full"):
            dp_size, tp_size, replicate, fsdp = layout
            how = parallelize if fsdp else tensor_parallel
            loom, models, optimizers, dp = _setup(dp_size, tp_size, replicate=replicate, parallelize_fn=how)
            state = {**_state(models, optimizers), "step": 0}
            loom.load(f"{root}/{fmt}", state)
            snapshot = _snapshot(models, optimizers)
            _train(loom, models, optimizers, range(SAVED_AT, SAVED_AT + STEPS_AFTER), dp)
            out[(layout, fmt)] = (snapshot, [_full_params(m) for m in models], state["step"])
            if fmt == "full":
                out.update({(layout, k): v for k, v in _read_weights(loom, root).items()})
            loom.close()
    return out


def _read_weights(loom, root: str) -> dict:
    """A filtered checkpoint, a Hugging Face directory and a plain state dict, each into a fresh 2-D model."""
    out = {}
    torch.manual_seed(5)
    fresh = loom.setup_module(TPNet())
    before = _full_params(fresh)
    left = loom.load(f"{root}/filtered", {"model": fresh}, strict=False)
    out["filtered"] = (before, _full_params(fresh), left)
    for source in ("hf", "plain.pt"):
        torch.manual_seed(5)
        fresh = loom.setup_module(TPNet())
        loom.load_raw(f"{root}/{source}", fresh)
        out[source] = _full_params(fresh)
    return out


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _close(a: dict, b: dict, tol: float = 1e-5) -> bool:
    return set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=tol, rtol=0) for k in a)


def _check_resumed(saved: dict, reference: list, snapshot: dict, continued: list, where) -> None:
    for i in range(2):
        assert _equal(snapshot["params"][i], saved["params"][i]), (where, i)
        assert _equal(snapshot["optimizer"][i], saved["optimizer"][i]), (where, i)
        assert _close(continued[i], reference[i]), (where, i)
    assert not _equal(saved["params"][0], saved["params"][1])  # two models, each loaded into its own


def test_saved_at_dp2_tp2_loads_at_dp2_tp2_dp4_tp1_dp1_tp4_and_hsdp(written):
    root, expected = written
    for rank, result in enumerate(run_ranks(_read_body, 4, str(root), timeout=400)):
        for layout in LAYOUTS:
            for fmt in ("sharded", "full"):
                snapshot, continued, step = result[(layout, fmt)]
                where = (rank, layout, fmt)
                _check_resumed(expected[fmt], expected[f"{fmt}_uninterrupted"], snapshot, continued, where)
                assert step == SAVED_AT
            before, after, left = result[(layout, "filtered")]
            saved = expected["sharded"]["params"][0]
            assert all(torch.equal(after[k], saved[k]) for k in saved if k.startswith("w1."))
            assert all(torch.equal(after[k], before[k]) for k in saved if not k.startswith("w1."))
            assert left == {"step": 7}
            assert _equal(result[(layout, "hf")], saved)
            assert _equal(result[(layout, "plain.pt")], saved)
    assert _equal(expected["load_raw_2x2"], expected["sharded"]["params"][0])


# ---- one process, a plain model -----------------------------------------------------------------------------
def _plain(fmt_path: Path):
    """One process, plain models and optimizers loaded from `fmt_path`, then trained on."""
    loom = Loom(accelerator="cpu", devices=1)
    models, optimizers = [], []
    for seed in (3, 4):
        torch.manual_seed(seed)
        model = loom.setup_module(TPNet())
        models.append(model)
        optimizers.append(loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR)))
    state = {**_state(models, optimizers), "step": 0}
    loom.load(fmt_path, state)
    snapshot = _snapshot(models, optimizers)
    _train(loom, models, optimizers, range(SAVED_AT, SAVED_AT + STEPS_AFTER))
    assert state["step"] == SAVED_AT
    return snapshot, [_full_params(m) for m in models]


@pytest.mark.parametrize("fmt", ["sharded", "full", "async"])
def test_loads_into_one_process_and_trains_on(written, fmt):
    root, expected = written
    snapshot, continued = _plain(root / fmt)
    saved_as = "sharded" if fmt == "async" else fmt
    _check_resumed(expected[saved_as], expected[f"{saved_as}_uninterrupted"], snapshot, continued, fmt)


def test_plain_torch_reads_the_sharded_checkpoint_without_torchloom(written):
    """The directory is a DCP checkpoint: torch's own `dcp.load` reads it into a plain model, no Loom at all."""
    import torch.distributed.checkpoint as dcp

    root, expected = written
    plain = TPNet()
    state = {"model": plain.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's note that it loads without a process group
        dcp.load(state, checkpoint_id=str(root / "sharded"))
    plain.load_state_dict(state["model"])
    assert _equal({k: v.detach() for k, v in plain.state_dict().items()}, expected["sharded"]["params"][0])


def test_consolidates_into_one_file_plain_torch_loads(written, tmp_path):
    root, expected = written
    out = tmp_path / "one.pt"
    done = subprocess.run(
        [sys.executable, "-m", "torchloom", "consolidate", str(root / "sharded"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # Plain PyTorch: the weights under the module's own names, every tensor whole.
    checkpoint = torch.load(out, weights_only=True)
    for key, i in (("model", 0), ("critic", 1)):
        plain = TPNet()
        plain.load_state_dict(checkpoint[key])
        assert _equal(
            {k: v.detach() for k, v in plain.state_dict().items()}, expected["sharded"]["params"][i]
        )
    assert checkpoint["step"] == SAVED_AT
    # And torchloom's full format: optimizer state too, training on as the uninterrupted run did.
    snapshot, continued = _plain(out)
    _check_resumed(
        expected["sharded"], expected["sharded_uninterrupted"], snapshot, continued, "consolidated"
    )
