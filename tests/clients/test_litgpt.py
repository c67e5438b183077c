"""litgpt 0.5.13, a Fabric program torchloom does not own, run unchanged through the Fabric switch
(`torchloom.lightning_compat`) on a tiny pythia-shaped model (random init, random tokens, a character tokenizer:
nothing downloaded): `pretrain` and `finetune/lora_legacy.py`.

- One process: the losses and the final weights equal real Lightning Fabric's bit for bit.
- Two processes, Lightning's `FSDPStrategy` run as "fsdp" and as "fsdp2": pretraining saves, and a run resumed
  from its step-2 checkpoint ends with the uninterrupted run's weights and losses; LoRA saves its adapter with
  `save(..., filter=...)` and merges it on rank 0 in a one-device `Fabric(devices=1)` made inside the job.

Run by `make clients` (`pytest -m clients tests/clients`, after `pip install -e .[test,clients]`); skipped
elsewhere. About 9 minutes on 2 idle cores (19 on a loaded machine), most of it starting litgpt (its imports)
14 times.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("litgpt")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
LORA = HERE / "lora_legacy_cli.py"


def _litgpt_command() -> str:
    found = shutil.which("litgpt", path=str(Path(sys.executable).parent)) or shutil.which("litgpt")
    assert found, "litgpt's command is not installed beside this Python"
    return found


def _run(args: list[str], cwd: Path) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")])
    # torch.compile (pretrain compiles its model) would spend minutes in inductor on CPU; both sides skip it.
    env["TORCHDYNAMO_DISABLE"] = "1"
    env.pop("TORCHLOOM_FABRIC_COMPAT", None)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout + done.stderr


def _switched(*program: str, fsdp: str = "fsdp") -> list[str]:
    return [sys.executable, "-m", "torchloom.lightning_compat", "--fsdp", fsdp, *program]


def _losses(out: Path) -> dict[int, str]:
    (metrics,) = (out / "logs" / "csv").glob("version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    return {int(r["iter"]): r["loss"] for r in rows if r.get("loss")}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, weights_only=False, map_location="cpu")
    state = state.get("model", state)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import tinydata

    return tinydata.write_fixtures(tmp_path_factory.mktemp("litgpt"))


def test_pretrain_one_process_equals_fabric(fixtures: dict[str, Path]) -> None:
    cwd = fixtures["base"].parent
    config = str(fixtures["pretrain"])
    _run([_litgpt_command(), "pretrain", "--config", config, "--out_dir", "fabric1", "--devices", "1"], cwd)
    _run(_switched("litgpt", "pretrain", "--config", config, "--out_dir", "loom1", "--devices", "1"), cwd)
    fabric, loom = _losses(cwd / "fabric1"), _losses(cwd / "loom1")
    assert len(fabric) == 4 and loom == fabric
    _assert_same(_tensors(cwd / "fabric1/final/lit_model.pth"), _tensors(cwd / "loom1/final/lit_model.pth"))


def test_lora_one_process_equals_fabric(fixtures: dict[str, Path]) -> None:
    cwd = fixtures["base"].parent
    config = str(fixtures["lora"])
    _run([sys.executable, str(LORA), "--config", config, "--out_dir", "lfabric1", "--devices", "1"], cwd)
    _run(_switched(str(LORA), "--config", config, "--out_dir", "lloom1", "--devices", "1"), cwd)
    fabric, loom = _losses(cwd / "lfabric1"), _losses(cwd / "lloom1")
    assert len(fabric) >= 8 and loom == fabric
    for name in ("lit_model.pth.lora", "lit_model.pth"):
        _assert_same(_tensors(cwd / "lfabric1/final" / name), _tensors(cwd / "lloom1/final" / name))


@pytest.mark.parametrize("fsdp", ["fsdp", "fsdp2"])
def test_pretrain_two_processes_resumes_exactly(fixtures: dict[str, Path], fsdp: str) -> None:
    cwd = fixtures["base"].parent
    config = str(fixtures["pretrain"])
    full, resumed = f"full-{fsdp}", f"resumed-{fsdp}"
    args = ["litgpt", "pretrain", "--config", config, "--devices", "2"]
    if fsdp == "fsdp":  # the program launches its ranks (Fabric's launch() runs the command again per rank)
        _run(_switched(*args, "--out_dir", full, fsdp=fsdp), cwd)
    else:  # torchloom run starts them; after `--`, litgpt's own --devices
        run = [
            sys.executable,
            "-m",
            "torchloom",
            "run",
            "--fabric-compat",
            "--fabric-fsdp",
            fsdp,
            "--devices",
            "2",
        ]
        _run([*run, "litgpt", "--", *args[1:], "--out_dir", full], cwd)
    checkpoint = cwd / full / "step-00000002" / "lit_model.pth"
    _run(_switched(*args, "--out_dir", resumed, "--resume", str(checkpoint), fsdp=fsdp), cwd)
    before, after = _losses(cwd / full), _losses(cwd / resumed)
    assert sorted(before) == [1, 2, 3, 4] and sorted(after) == [3, 4]
    assert {i: before[i] for i in after} == after
    _assert_same(
        _tensors(cwd / full / "final/lit_model.pth"), _tensors(cwd / resumed / "final/lit_model.pth")
    )


@pytest.mark.parametrize("fsdp", ["fsdp", "fsdp2"])
def test_lora_two_processes_saves_adapter_and_merges(fixtures: dict[str, Path], fsdp: str) -> None:
    import tinydata
    from litgpt.lora import GPT, Config, merge_lora_weights

    cwd = fixtures["base"].parent
    out = cwd / f"lora-{fsdp}"
    _run(
        _switched(
            str(LORA), "--config", str(fixtures["lora"]), "--out_dir", out.name, "--devices", "2", fsdp=fsdp
        ),
        cwd,
    )
    assert len(_losses(out)) == 5  # 18 training samples, 2 ranks x micro-batches of 2: 5 steps
    adapter = _tensors(out / "final/lit_model.pth.lora")
    lora_config = Config(**tinydata.CONFIG, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True)
    model = GPT(lora_config)
    trainable = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert set(adapter) == trainable  # filter= kept the adapter alone
    base = _tensors(fixtures["base"] / "lit_model.pth")
    assert not any(
        torch.equal(t, torch.zeros_like(t)) for n, t in adapter.items() if "lora_B" in n
    )  # it trained
    # The merged file is what litgpt's merge_lora makes of base + adapter (on rank 0, in its own one-device Fabric).
    model.load_state_dict({**base, **adapter}, strict=False)
    merge_lora_weights(model)
    expected = {k.replace("linear.", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    merged = _tensors(out / "final/lit_model.pth")
    assert sorted(merged) == sorted(expected)
    for key in merged:
        torch.testing.assert_close(merged[key], expected[key], rtol=0, atol=1e-6)
