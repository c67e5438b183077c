"""Hugging Face safetensors checkpoints: `loom.load_raw` of a `save_pretrained` directory into every layout, and
`loom.save_raw` that `from_pretrained` loads, compared with `transformers` itself in one process."""

from __future__ import annotations

import json
import os
import shutil
import stat
import warnings
from pathlib import Path

import pytest
import torch
from harness import run_ranks

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from torchloom import Loom, cli  # noqa: E402
from torchloom.checkpointing import hf  # noqa: E402
from torchloom.errors import CheckpointError  # noqa: E402
from torchloom.strategies import FSDP2Strategy, FSDPStrategy  # noqa: E402

# intermediate_size 37 does not split evenly over 2 ranks: the MLP weights get uneven shards.
CONFIG = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
IDS = torch.arange(24).reshape(2, 12) * 5 % 128


def config(tied: bool) -> LlamaConfig:
    return LlamaConfig(**CONFIG, tie_word_embeddings=tied)


def pretrained(tmp: Path, tied: bool, dtype: torch.dtype = torch.float32) -> tuple[Path, torch.Tensor]:
    """A sharded `save_pretrained` checkpoint of a random tiny Llama, and transformers' own logits for it."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config(tied)).to(dtype)
    path = tmp / f"pretrained-{'tied' if tied else 'untied'}-{str(dtype)[6:]}"
    model.save_pretrained(path, max_shard_size="40KB")
    assert (path / hf.INDEX_FILE).exists()
    return path, reference_logits(path)


def reference_logits(path: Path) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(IDS).logits


def _strategy(name: str):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if name == "fsdp":
        return FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})  # units on the layers and a root unit
    if name == "fsdp2-policy":
        return FSDP2Strategy(shard_policy={LlamaDecoderLayer})
    return name


def load_and_save(
    rank: int,
    world_size: int,
    layout: str,
    tied: bool,
    src: str,
    out: str,
    precision: str = "32-true",
    damage: bool = False,
) -> dict:
    """Build a model in `layout`, load `src` into it, run it, and save it to `out`; with `damage`, also load a
    copy of `out` with one byte flipped (`_load_damaged`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's own and the "no policy" advice are not under test here
        loom = Loom(
            accelerator="cpu",
            devices=world_size,
            strategy=_strategy(layout.removesuffix("-meta")),
            precision=precision,
        )
        loom.launch()
        meta = layout.endswith("-meta")
        with loom.init_module(empty_init=meta):
            model = LlamaForCausalLM(config(tied))
        if layout.startswith("fsdp2") and "policy" not in layout:
            from torch.distributed.fsdp import fully_shard

            # Units made by hand: the decoder layers. Embeddings, final norm and head stay replicated.
            for layer in model.model.layers:
                fully_shard(layer, **loom.strategy.unit_kwargs())
        model = loom.setup_module(model)
        result = loom.load_raw(src, model)
        inner = model.module
        tied_now = inner.lm_head.weight is inner.model.embed_tokens.weight
        with torch.no_grad():
            logits = model(IDS).logits.float()
        loom.save_raw(out, model, config=inner.config)
        loom.save(f"{out}-sharded", {"model": model})  # for `torchloom consolidate --format hf`
        dtypes = {type(p).__name__ + ":" + str(p.dtype) for p in inner.parameters()}
        inv_freq = inner.model.rotary_emb.inv_freq.clone()
        refused = _load_damaged(loom, model, Path(out)) if damage else None
    return {
        "logits": logits,
        "result": result,
        "tied": tied_now,
        "dtypes": dtypes,
        "inv_freq": inv_freq,
        "refused": refused,
    }


def _load_damaged(loom, model, out: Path) -> str | None:
    """load_raw of a copy of what save_raw wrote, one byte of its weights flipped: refused on every rank, naming
    the file (None if it loaded); with verify=False it loads; the good copy loads again."""
    bad = out.with_name(out.name + "-damaged")
    if loom.is_global_zero:
        shutil.copytree(out, bad)
        file = max(bad.glob("*.safetensors"), key=lambda f: f.stat().st_size)
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
    loom.barrier()
    try:
        loom.load_raw(bad, model)
        refused = None
    except CheckpointError as error:
        refused = str(error)
    loom.load_raw(bad, model, verify=False)
    loom.load_raw(out, model)
    return refused


def check(results: list[dict], expected: torch.Tensor, out: Path, tied: bool) -> None:
    for r in results:
        torch.testing.assert_close(r["logits"], expected, atol=1e-5, rtol=0)
        assert r["tied"] == tied
        assert r["result"] == hf.LoadResult([], [])
    torch.testing.assert_close(reference_logits(out), expected, atol=1e-5, rtol=0)
    index = json.loads((out / hf.INDEX_FILE).read_text()) if (out / hf.INDEX_FILE).exists() else None
    names = set(index["weight_map"]) if index else set(safetensors_torch.load_file(out / hf.SINGLE_FILE))
    assert ("lm_head.weight" in names) != tied  # a tied weight is stored once, as transformers stores it
    assert "model.embed_tokens.weight" in names


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp2_hand_made_units_meta_init(tmp_path, tied, capsys):
    src, expected = pretrained(tmp_path, tied)
    out = tmp_path / "out"
    results = run_ranks(
        load_and_save, 2, "fsdp2-meta", tied, str(src), str(out), "32-true", not tied, timeout=200
    )
    check(results, expected, out, tied)
    if not tied:  # save_raw's files carry checksums, checked by load_raw on every rank
        damaged = tmp_path / "out-damaged" / hf.SINGLE_FILE
        for result in results:
            assert "changed after it was written" in result["refused"] and str(damaged) in result["refused"]
            assert "verify=False" in result["refused"]
    # The same weights through torchloom's own sharded checkpoint and `torchloom consolidate --format hf`.
    published = tmp_path / "consolidated"
    argv = ["consolidate", f"{out}-sharded", str(published), "--model-only", "--format", "hf"]
    assert cli.main([*argv, "--max-shard-size", "30KB"]) == 0
    assert len(json.loads((published / hf.INDEX_FILE).read_text())["weight_map"]) >= 20
    shutil.copy(out / "config.json", published / "config.json")
    torch.testing.assert_close(reference_logits(published), expected, atol=1e-5, rtol=0)
    # torchloom inspect --verify: every file torchloom wrote checked; transformers' own files carry no checksum
    assert cli.main(["inspect", str(published), "--verify", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["verify"]["checked"]) >= 2
    assert cli.main(["inspect", str(src), "--verify"]) == 0
    assert "no checksums recorded" in capsys.readouterr().out
    if not tied:
        assert cli.main(["inspect", str(tmp_path / "out-damaged"), "--verify"]) == 1
        assert "verify: FAILED" in capsys.readouterr().out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout,tied",
    [("fsdp-meta", True), ("fsdp2-policy-meta", True), ("ddp", True)],
    ids=["fsdp1-policy-root-unit-meta-tied", "fsdp2-policy-root-unit-meta-tied", "ddp-tied"],
)
def test_other_layouts(tmp_path, layout, tied):
    src, expected = pretrained(tmp_path, tied)
    out = tmp_path / "out"
    results = run_ranks(load_and_save, 2, layout, tied, str(src), str(out), timeout=200)
    check(results, expected, out, tied)


def test_single_device_and_one_file(tmp_path):
    # Small enough for one file: `model.safetensors`, no index, loaded by file or by directory.
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config(True))
    src = tmp_path / "one"
    reference.save_pretrained(src)
    assert (src / hf.SINGLE_FILE).exists() and not (src / hf.INDEX_FILE).exists()
    expected = reference_logits(src)
    loom = Loom(accelerator="cpu")
    for path in (src, src / hf.SINGLE_FILE):
        torch.manual_seed(1)
        model = loom.setup_module(LlamaForCausalLM(config(True)))
        assert loom.load_raw(path, model) == hf.LoadResult([], [])
        with torch.no_grad():
            torch.testing.assert_close(model(IDS).logits, expected, atol=1e-5, rtol=0)
    out = tmp_path / "out"
    (out).mkdir()
    (out / "tokenizer.json").write_text("{}")  # a file of the user's own: kept when out_dir is replaced
    loom.save_raw(out, model, config=model.module.config)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    torch.testing.assert_close(reference_logits(out), expected, atol=1e-5, rtol=0)
    # Saved again in shards over the single file: the old weights file does not linger.
    loom.save_raw(out, model, max_shard_size="50KB")
    assert not (out / hf.SINGLE_FILE).exists() and (out / hf.INDEX_FILE).exists()
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    torch.testing.assert_close(reference_logits(out), expected, atol=1e-5, rtol=0)


def bf16_into_mixed(rank: int, world_size: int, src: str, out: str) -> dict:
    loom = Loom(accelerator="cpu", devices=world_size, strategy="fsdp2", precision="bf16-mixed")
    loom.launch()
    from torch.distributed.fsdp import fully_shard

    with loom.init_module(empty_init=True):
        model = LlamaForCausalLM(config(False))
    for layer in model.model.layers:
        fully_shard(layer, **loom.strategy.unit_kwargs())
    model = loom.setup_module(model)
    loom.load_raw(src, model)
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.module.named_parameters()
    }
    loom.save_raw(out, model, dtype=torch.bfloat16, max_shard_size="30KB")
    return params


@pytest.mark.timeout(240)
def test_bf16_weights_into_fp32_master_weights_and_published_in_bf16(tmp_path):
    src, _ = pretrained(tmp_path, tied=False, dtype=torch.bfloat16)
    saved = {}
    for file in src.glob("*.safetensors"):
        saved.update(safetensors_torch.load_file(file))
    out = tmp_path / "out"
    params = run_ranks(bf16_into_mixed, 2, str(src), str(out), timeout=200)[0]
    assert set(params) == set(saved)
    for name, value in params.items():
        assert value.dtype == torch.float32, name  # master weights stay fp32 under bf16-mixed
        assert torch.equal(value, saved[name].float()), name
    index = json.loads((out / hf.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors" and len(files) > 1
    published = {}
    for file in files:
        published.update(safetensors_torch.load_file(out / file))
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in published.values())
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert all(torch.equal(published[n], saved[n]) for n in saved)  # bf16 -> fp32 -> bf16 is exact


@pytest.fixture
def loom() -> Loom:
    return Loom(accelerator="cpu")


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    safetensors_torch.save_file(tensors, path / hf.SINGLE_FILE, metadata={"format": "pt"})
    return path


def test_errors_name_the_problem_and_the_fix(loom, tmp_path):
    torch.manual_seed(0)
    model = loom.setup_module(LlamaForCausalLM(config(False)))
    full = {k: v.clone() for k, v in model.module.state_dict().items()}

    missing = dict(full)
    del missing["model.norm.weight"]
    with pytest.raises(CheckpointError, match=r"no tensor for 1 .*'model\.norm\.weight'.*strict=False"):
        loom.load_raw(_write(tmp_path / "missing", missing), model)

    extra = {**full, "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match=r"'model\.layers\.9\.mlp\.up_proj\.weight'.*strict=False"):
        loom.load_raw(_write(tmp_path / "extra", extra), model)

    wrong = {**full, "lm_head.weight": torch.zeros(100, 32)}
    with pytest.raises(
        CheckpointError,
        match=r"lm_head\.weight: checkpoint shape \(100, 32\) vs model shape \(128, 32\).*config",
    ):
        loom.load_raw(_write(tmp_path / "wrong", wrong), model)
    with pytest.raises(CheckpointError, match="shape"):  # no value could be loaded, whatever strict says
        loom.load_raw(tmp_path / "wrong", model, strict=False)

    # strict=False loads what matches, keeps the rest, and says what it skipped.
    norm = model.module.model.norm.weight.detach().clone()
    with pytest.warns(UserWarning, match="model.norm.weight"):
        result = loom.load_raw(tmp_path / "missing", model, strict=False)
    assert result == hf.LoadResult(["model.norm.weight"], [])
    assert torch.equal(model.module.model.norm.weight, norm)
    assert loom.load_raw(tmp_path / "extra", model, strict=False).unexpected_keys == [
        "model.layers.9.mlp.up_proj.weight"
    ]

    with pytest.raises(CheckpointError, match="No checkpoint"):
        loom.load_raw(tmp_path / "nothing.safetensors", model)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / hf.INDEX_FILE).write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors"}}'
    )
    with pytest.raises(CheckpointError, match="names the shard 'model-00001-of-00002.safetensors'"):
        loom.load_raw(tmp_path / "broken", model)


def _user_files(out: Path) -> dict[str, bytes]:
    """What a user keeps in a published model's directory besides the weights torchloom writes."""
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    (out / "runs" / "eval").mkdir(parents=True)
    (out / "runs" / "eval" / "scores.txt").write_text("0.5")
    (out / "README.md").write_text("# my model")
    safetensors_torch.save_file({"w": torch.ones(3)}, out / "model_ema.safetensors")
    safetensors_torch.save_file({"w": torch.zeros(3)}, out / "model-00009-of-00009.safetensors")  # no index
    return _contents(out)


def _contents(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_save_raw_keeps_everything_but_the_previous_weights(loom, tmp_path):
    torch.manual_seed(0)
    model = loom.setup_module(LlamaForCausalLM(config(True)))
    out = tmp_path / "out"
    mine = _user_files(out)
    weights = {"model.safetensors"}

    def check_kept() -> set[str]:
        now = _contents(out)
        assert {k: now.get(k) for k in mine} == mine  # every file of the user's, byte for byte
        return set(now) - set(mine)

    os.mkfifo(out / "pipe")  # not a file to flush: opening it to fsync would block
    loom.save_raw(out, model, config=model.module.config)
    assert check_kept() == weights | {"config.json"}
    assert stat.S_ISFIFO(os.lstat(out / "pipe").st_mode)
    # In shards: the single file goes (from_pretrained would load it instead of the index), the rest stays.
    loom.save_raw(out, model, max_shard_size="50KB")
    written = check_kept()
    shards = {n for n in written if n.startswith("model-")}
    assert len(shards) > 1 and written == shards | {hf.INDEX_FILE, "config.json"}
    index = json.loads((out / hf.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == shards
    # Back to one file: the index and the shards it named go; model-00009-of-00009 (named by no index) stays.
    loom.save_raw(out, model)
    assert check_kept() == weights | {"config.json"}
    torch.testing.assert_close(reference_logits(out), model.module(IDS).logits.detach(), atol=1e-5, rtol=0)

    # Where it cannot tell what to replace, it refuses and changes nothing.
    (out / hf.INDEX_FILE).write_text("{not json")
    before = _contents(out)
    with pytest.raises(CheckpointError, match=r"Cannot read .*index\.json.*Remove the old index"):
        loom.save_raw(out, model)
    assert _contents(out) == before
    file = tmp_path / "weights.bin"
    file.write_bytes(b"a file")
    with pytest.raises(CheckpointError, match="a file is there"):
        loom.save_raw(file, model)
    assert file.read_bytes() == b"a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "weights.bin"]  # no temporary left


def _save_raw_refused_on_ranks(rank: int, world_size: int, root: str) -> list[str | None]:
    loom = Loom(accelerator="cpu", devices=world_size, strategy="fsdp2")
    loom.launch()
    model = loom.setup_module(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    out: list[str | None] = []
    for target in ("weights.bin", "broken-index"):
        try:
            loom.save_raw(Path(root) / target, model)
            out.append(None)
        except CheckpointError as error:
            out.append(str(error))
    loom.save_raw(Path(root) / "good", model)  # the ranks are still in step
    return out


def test_save_raw_refusal_reaches_every_rank(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"a file")
    (tmp_path / "broken-index").mkdir()
    (tmp_path / "broken-index" / hf.INDEX_FILE).write_text("{not json")
    for messages in run_ranks(_save_raw_refused_on_ranks, 2, str(tmp_path), timeout=120):
        assert "a file is there" in (messages[0] or "") and "Cannot read" in (messages[1] or ""), messages
    assert (tmp_path / "weights.bin").read_bytes() == b"a file"
    assert (tmp_path / "broken-index" / hf.INDEX_FILE).read_text() == "{not json"
    assert (tmp_path / "good" / hf.SINGLE_FILE).is_file()


def test_meta_buffers_are_refused(loom, tmp_path):
    model = loom.setup_module(LlamaForCausalLM(config(False)))
    src = tmp_path / "ok"
    loom.save_raw(src, model)
    model.module.model.rotary_emb.inv_freq = torch.empty(4, device="meta")
    with pytest.raises(CheckpointError, match=r"'model\.rotary_emb\.inv_freq' are on the meta device"):
        loom.load_raw(src, model)


def test_rotary_buffers_are_real_under_meta_init():
    # The non-persistent buffers no checkpoint holds: init_module(empty_init=True) must compute them.
    loom = Loom(accelerator="cpu", strategy="fsdp2")
    with loom.init_module(empty_init=True):
        model = LlamaForCausalLM(config(False))
    assert model.model.embed_tokens.weight.is_meta
    expected = LlamaForCausalLM(config(False)).model.rotary_emb.inv_freq
    assert torch.equal(model.model.rotary_emb.inv_freq, expected)


def test_shard_planning():
    assert hf.parse_size("5GB") == 5 * 10**9 and hf.parse_size("2MiB") == 2 * 2**20 and hf.parse_size(7) == 7
    with pytest.raises(ValueError, match="'5 apples' is not a size"):
        hf.parse_size("5 apples")
    # In order; a new file when the next tensor would overflow; an oversized tensor alone.
    assert hf.plan_files({"a": 4, "b": 4, "c": 10, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]
    assert hf.file_names(1) == ["model.safetensors"]
    assert hf.file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def _save_raw_write_fails_on_rank_zero(rank: int, world_size: int, root: str) -> str:
    from datetime import timedelta

    loom = Loom(accelerator="cpu", devices=world_size, strategy=FSDP2Strategy(timeout=timedelta(seconds=5)))
    loom.launch()
    model = loom.setup_module(torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4))))
    if rank == 0:

        def disk_full(path: Path, tensors: dict, fsync: bool) -> None:
            raise OSError(28, "No space left on device")

        hf._write_file = disk_full
    try:
        # One file per layer, taken in turn by the ranks: rank 0's first failure shows while files remain to be
        # gathered, which every rank must still take part in.
        loom.save_raw(Path(root) / "out", model, max_shard_size=300)
    except CheckpointError as error:
        return str(error)
    return "saved"


def test_a_write_failing_on_one_rank_fails_save_raw_on_every_rank(tmp_path):
    for message in run_ranks(_save_raw_write_fails_on_rank_zero, 2, str(tmp_path), timeout=120):
        assert "rank 0: OSError" in message and "No space left" in message, message
    assert not (tmp_path / "out").exists()
