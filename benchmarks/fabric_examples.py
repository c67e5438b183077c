"""Lightning's own Fabric examples, run under Lightning Fabric and under torchloom, their printed numbers compared.

A tool, not a test: the examples are not copied into this repository. For each of the seven examples of
`examples/fabric/` (image_classifier, kfold_cv, language_model, build_your_own_trainer, dcgan,
reinforcement_learning, meta_learning) the script extracts the example from a Lightning git repository
(`--lightning-repo`, a bare or normal clone, read with `git show HEAD:...`) into two temporary folders, one per
framework, and runs both copies as the example's README says (`fabric run ...` / `python ...`; 2 CPU processes
where the README starts several). In torchloom's copy only Fabric's import changes:

- `from lightning.fabric import Fabric` becomes `from torchloom import Loom as Fabric` (the other names of that
  import stay Lightning's), `L.Fabric(` becomes `Fabric(` with the same import;
- `from lightning.fabric.wrappers import _unwrap_objects` (a private Lightning name) becomes
  `from torchloom import unwrap as _unwrap_objects`;
- `fabric run` becomes `torchloom run` with the same options.

Both runs get `OMP_NUM_THREADS=1` (Fabric's CLI would set cpu_count // processes threads, torchrun 1, and sums
over another number of threads round differently) and a free `--main-port` each. Both copies get the same edits
besides, listed per example in `EXAMPLES` (each is asserted to apply, so a changed
example fails loudly instead of running unedited): caps on steps (fewer epochs or iterations) so that a run takes
a minute or two on a CPU, a print of values the example only shows in a progress bar, a fixed seed where the
example has none (else neither framework repeats itself), and fixes the example needs under Lightning 2.6 and
torch 2.13 whichever framework runs it.

What cannot be installed or downloaded here is replaced by the stand-ins of
`benchmarks/fabric_examples_standins/` (torchvision's MNIST/CelebA/transforms, scikit-learn's KFold, gymnasium's
CartPole, learn2learn, cherry), put on PYTHONPATH as `standin_<name>` packages, the examples' imports rewritten to them in both copies (`import
gymnasium as gym` -> `import standin_gymnasium as gym`); WikiText-2 is a synthetic text written where Lightning's demo looks for it. The stand-ins are
minimal and synthetic, identical for both runs; their data are not the real data, so only the comparison means
something, not the losses.

The printed records carrying numbers (a regular expression per example, found anywhere in the output: two ranks
can print into one line) are compared as printed, as multisets (ranks interleave in any order). An example
"matches" when every compared record is equal. The torchloom copy also runs with the stand-ins folder and the
chosen torchloom sources first on PYTHONPATH; Fabric's copy with the stand-ins only.

    python benchmarks/fabric_examples.py --json benchmarks/results/fabric_examples.json \
        | tee benchmarks/results/fabric_examples.txt
    python benchmarks/fabric_examples.py --only dcgan kfold_cv     # a subset
    python benchmarks/fabric_examples.py --torchloom-src main=/tmp/main/src --torchloom-src new=src
        # several torchloom versions against one Fabric run
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STANDINS = Path(__file__).resolve().parent / "fabric_examples_standins"
DEFAULT_LIGHTNING = Path("/work/.mirror/Lightning-AI+pytorch-lightning/repo")
TWO_CPU = ["--accelerator=cpu", "--devices=2"]
_TRAIN = r"Train Epoch: \d+ \[\d+/\d+ \(\d+%\)\]\s+Loss: \d+\.\d+"


@dataclass
class Example:
    name: str
    script: str
    launcher: str  # "cli": `fabric run` / `torchloom run` with `cli_args`; "python": `python script`
    cli_args: list[str] = field(default_factory=list)
    script_args: list[str] = field(default_factory=list)
    # (file, old, new, why): applied to both copies; `old` must occur
    edits: list[tuple[str, str, str, str]] = field(default_factory=list)
    numbers: str = ""  # the printed records compared (found anywhere: ranks print into the same stream)
    wikitext: bool = False


EXAMPLES = [
    Example(
        "image_classifier",
        "train_fabric.py",
        "cli",
        TWO_CPU,
        ["--epochs", "2", "--log-interval", "4"],
        numbers=_TRAIN + "|" + r"Test set: Average loss: \d+\.\d+, Accuracy: \(\d+%\)",
    ),
    Example(
        "kfold_cv",
        "train_fabric.py",
        "cli",
        TWO_CPU,
        ["--epochs", "1", "--log-interval", "4", "--folds", "3"],
        numbers=_TRAIN
        + "|"
        + r"For fold: \d+ Validation set: Average loss: \d+\.\d+, Accuracy: \(\d+%\)|Epoch \d+ - Average acc: [\d.]+",
    ),
    Example(
        "language_model",
        "train.py",
        "cli",
        TWO_CPU,
        edits=[
            ("train.py", "max_epochs=20", "max_epochs=3", "cap: 3 epochs of 20"),
            (
                "train.py",
                "batch_idx % 200 == 0",
                "batch_idx % 2 == 0",
                "print every 2nd loss, not every 200th",
            ),
        ],
        numbers=r"epoch: \d+ - iteration: \d+ - loss \d+\.\d+|val loss \d+\.\d+",
        wikitext=True,
    ),
    Example(
        "build_your_own_trainer",
        "run.py",
        "python",
        edits=[
            ("run.py", ", verbose=True)", ")", "torch 2.13 no longer accepts ReduceLROnPlateau(verbose=)"),
            (
                "run.py",
                "    train(MNISTModule())",
                "    L.seed_everything(42)\n    train(MNISTModule())",
                "a seed: the example has none, so no two runs of it agree",
            ),
            (
                "trainer.py",
                "L.fabric.utilities.types.LRScheduler",
                "torch.optim.lr_scheduler.LRScheduler",
                "lightning.fabric.utilities.types.LRScheduler is gone from Lightning 2.6",
            ),
            (
                "trainer.py",
                "            _lr_sched_defaults.update(configure_optim_output)\n"
                "            return None, _lr_sched_defaults",
                "            _lr_sched_defaults.update(configure_optim_output)\n"
                '            return configure_optim_output.get("optimizer"), _lr_sched_defaults',
                "the dictionary form of configure_optimizers() lost its optimizer (the trainer then asserts)",
            ),
            (
                "trainer.py",
                "                prog_bar.set_postfix_str(postfix_str)",
                "                prog_bar.set_postfix_str(postfix_str)\n"
                '                print(f"{prefix}:{postfix_str}", flush=True)',
                "print what the progress bar shows, every step",
            ),
        ],
        numbers=r"(?:train|val):(?: \w+: -?\d+\.\d+)+",
    ),
    Example(
        "dcgan",
        "train_fabric.py",
        "python",
        edits=[
            (
                "train_fabric.py",
                "num_epochs = 5",
                "num_epochs = 2",
                "cap: 2 epochs (of 5 batches: 160 images)",
            ),
            ("train_fabric.py", "batch_size = 128", "batch_size = 32", "cap: batches of 32 images, not 128"),
            ("train_fabric.py", "if i % 50 == 0:", "if i % 1 == 0:", "print every iteration, not every 50th"),
        ],
        numbers=r"\[\d+/\d+\]\[\d+/\d+\]\s+Loss_D: \S+\s+Loss_G: \S+\s+D\(x\): \S+\s+D\(G\(z\)\): \S+ / [\d.]+",
    ),
    Example(
        "reinforcement_learning",
        "train_fabric.py",
        "cli",
        ["--accelerator=cpu", "--strategy=ddp", "--devices=2"],
        ["--total-timesteps", "4096"],
        edits=[
            (
                "train_fabric.py",
                "    agent, optimizer = fabric.setup(agent, optimizer)\n",
                "    agent, optimizer = fabric.setup(agent, optimizer)\n"
                '    agent.mark_forward_method("get_action_and_value")\n'
                '    agent.mark_forward_method("estimate_returns_and_advantages")\n',
                "Fabric refuses the two unmarked methods the script calls (torchloom runs them unmarked too)",
            )
        ],
        numbers=r"global_step=\d+, reward_env_\d+=[\d.]+",
    ),
    Example(
        "meta_learning",
        "train_fabric.py",
        "cli",
        ["--devices=2", "--strategy=ddp", "--accelerator=cpu"],
        edits=[
            ("train_fabric.py", "num_iterations=60000", "num_iterations=10", "cap: 10 iterations of 60,000")
        ],
        numbers=r"Iteration \d+|Meta (?:Train|Valid|Test) (?:Error|Accuracy) [-\d.e+]+",
    ),
]


# ---- extraction and edits ---------------------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def extract(repo: Path, name: str, into: Path) -> None:
    prefix = f"examples/fabric/{name}/"
    for path in _git(repo, "ls-tree", "-r", "--name-only", "HEAD", prefix).split():
        if path.endswith(".py"):
            target = into / path[len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_git(repo, "show", f"HEAD:{path}"))


def apply_edit(folder: Path, file: str, old: str, new: str) -> None:
    path = folder / file
    text = path.read_text()
    if old not in text:
        raise SystemExit(f"{path}: the edit's text {old!r} is not there (has the example changed?)")
    path.write_text(text.replace(old, new))


_FABRIC_IMPORT = re.compile(r"^from lightning\.fabric import (.*)$", re.M)


def to_torchloom(text: str) -> str:
    """Only Fabric's import changes (see the module docstring)."""

    def swap(match: re.Match) -> str:
        names = [n.strip() for n in match.group(1).split(",")]
        if "Fabric" not in names:
            return match.group(0)
        rest = [n for n in names if n != "Fabric"]
        line = "from torchloom import Loom as Fabric"
        return line + (f"\nfrom lightning.fabric import {', '.join(rest)}" if rest else "")

    text = _FABRIC_IMPORT.sub(swap, text)
    text = text.replace(
        "from lightning.fabric.wrappers import _unwrap_objects",
        "from torchloom import unwrap as _unwrap_objects",
    )
    if "L.Fabric(" in text:
        text = text.replace("L.Fabric(", "Fabric(").replace(
            "import lightning as L\n", "import lightning as L\nfrom torchloom import Loom as Fabric\n", 1
        )
    return text


_STANDIN_NAMES = ("torchvision", "sklearn", "gymnasium", "learn2learn", "cherry")


def to_standins(text: str) -> str:
    """Imports of the libraries replaced by stand-ins point at `standin_<name>` (under another name, so that
    libraries that look for the real one, e.g. torchmetrics for torchvision, do not find a stand-in)."""
    for name in _STANDIN_NAMES:
        text = re.sub(rf"^(\s*)from {name}([.\s])", rf"\1from standin_{name}\2", text, flags=re.M)
        text = re.sub(
            rf"^(\s*)import {name}((?:\.\w+)*) as (\w+)",
            rf"\1import standin_{name}\2 as \3",
            text,
            flags=re.M,
        )
        text = re.sub(
            rf"^(\s*)import {name}(?:\.\w+)*\s*$", rf"\1import standin_{name} as {name}", text, flags=re.M
        )
    return text


def write_wikitext(folder: Path, words: int = 150_000) -> None:
    """A synthetic text where Lightning's WikiText2 looks first (it downloads only when the file is missing):
    sentences from a 300-word vocabulary with a fixed seed, enough for the example's 4,000-block split."""
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(300)]
    lines, count = [], 0
    while count < words:
        n = rng.randint(5, 15)
        lines.append(" ".join(rng.choice(vocab[: 30 + 10 * (n % 5)]) for _ in range(n)))
        count += n + 1
    (folder / "data").mkdir(exist_ok=True)
    (folder / "data" / "wikitext-2.txt").write_text("\n".join(lines) + "\n")


def prepare(repo: Path, example: Example, kind: str, root: Path) -> Path:
    folder = root / kind / example.name
    extract(repo, example.name, folder)
    for file, old, new, _ in example.edits:
        apply_edit(folder, file, old, new)
    for path in folder.rglob("*.py"):
        path.write_text(to_standins(path.read_text()))
    if kind == "torchloom":
        for path in folder.rglob("*.py"):
            path.write_text(to_torchloom(path.read_text()))
    if example.wikitext:
        write_wikitext(folder)
    return folder


# ---- running and comparing ------------------------------------------------------------------------------------
def command(example: Example, kind: str, port: int | str = "FREE_PORT") -> list[str]:
    if example.launcher == "python":
        return [sys.executable, example.script, *example.script_args]
    # `fabric run` is the console script installed next to this Python; `torchloom run` is `python -m torchloom`
    cli = (
        [str(Path(sys.executable).with_name("fabric"))]
        if kind == "fabric"
        else [sys.executable, "-m", "torchloom"]
    )
    # A port of its own: Fabric's CLI defaults to 29400, which other jobs on the machine may hold.
    return [*cli, "run", *example.cli_args, f"--main-port={port}", example.script, *example.script_args]


def _free_port() -> int:
    from torchloom.environments import find_free_port

    # below the ephemeral range, where outgoing connections do not land
    return find_free_port("127.0.0.1")


def _shown(cmd: list[str]) -> str:
    return " ".join([Path(cmd[0]).name, *cmd[1:]])


def run(example: Example, kind: str, folder: Path, timeout: float, torchloom_src: Path | None = None) -> dict:
    """Run one copy of the example; its exit status, seconds, the compared records and the whole output."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    # Fabric's copy gets no torchloom on the path at all; torchloom's gets the sources asked for first.
    paths = [STANDINS] if torchloom_src is None else [STANDINS, torchloom_src]
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    # The same number of threads per rank for both: Fabric's CLI sets OMP_NUM_THREADS to cpu_count // processes
    # where it is unset, torchrun (under `torchloom run`) to 1, and sums over another number of threads round
    # differently in the last digits (image_classifier's losses then drift apart after a few steps).
    env["OMP_NUM_THREADS"] = "1"
    start = time.monotonic()
    proc = subprocess.Popen(
        command(example, kind, _free_port()),
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        code = f"timeout after {timeout:.0f}s"
    lines = [" ".join(m.split()) for m in re.findall(example.numbers, out)]
    return {"exit": code, "seconds": round(time.monotonic() - start, 1), "lines": lines, "output": out}


def compare(fabric: dict, loom: dict) -> dict:
    a, b = collections.Counter(fabric["lines"]), collections.Counter(loom["lines"])
    equal = sum((a & b).values())
    total = max(len(fabric["lines"]), len(loom["lines"]))
    ok = fabric["exit"] == 0 and loom["exit"] == 0
    verdict = "matches" if ok and total and a == b else ("differs" if ok else "did not finish")
    first = next(
        ((x, y) for x, y in zip(sorted(fabric["lines"]), sorted(loom["lines"]), strict=False) if x != y), None
    )
    return {"verdict": verdict, "equal_lines": equal, "lines": total, "first_difference": first}


def _source(text: str) -> tuple[str, Path]:
    label, _, path = text.rpartition("=")
    return (label or path), Path(path)


def _report(name: str, label: str, verdict: dict, fabric: dict, loom: dict) -> None:
    print(
        f"{name:24s} {label:12s} {verdict['verdict']:15s} {verdict['equal_lines']}/{verdict['lines']} equal"
        f"  (fabric {fabric['seconds']}s exit {fabric['exit']}, torchloom {loom['seconds']}s exit {loom['exit']})",
        flush=True,
    )
    if verdict["first_difference"]:
        print(f"    first difference: fabric    {verdict['first_difference'][0]!r}")
        print(f"                      torchloom {verdict['first_difference'][1]!r}", flush=True)
    for kind, r in (("fabric", fabric), ("torchloom", loom)):
        if r["exit"] != 0:
            print(
                f"    {kind} output tail:\n" + "\n".join("      " + x for x in r["output"].splitlines()[-15:])
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lightning-repo", type=Path, default=DEFAULT_LIGHTNING)
    parser.add_argument(
        "--only", nargs="*", choices=[e.name for e in EXAMPLES], help="examples, in this order"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write the results here (after every example)")
    parser.add_argument("--keep-output", type=Path, help="write every run's whole output into this folder")
    parser.add_argument(
        "--torchloom-src",
        action="append",
        type=_source,
        help="[LABEL=]PATH of torchloom sources to run; repeat to compare several against one Fabric run "
        "(default: this checkout's src)",
    )
    args = parser.parse_args()
    sources = args.torchloom_src or [("checkout", REPO / "src")]

    import lightning
    import torch

    by_name = {e.name: e for e in EXAMPLES}
    chosen = [by_name[name] for name in args.only] if args.only else EXAMPLES
    print(
        f"# {datetime.datetime.now():%Y-%m-%d %H:%M}  lightning {lightning.__version__}  torch {torch.__version__}"
        f"  examples from {args.lightning_repo} at {_git(args.lightning_repo, 'rev-parse', 'HEAD').strip()[:12]}"
    )
    for label, path in sources:
        print(f"# torchloom {label}: {path}", flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fabric-examples-") as tmp:
        for example in chosen:
            fabric = run(
                example, "fabric", prepare(args.lightning_repo, example, "fabric", Path(tmp)), args.timeout
            )
            entry: dict[str, Any] = {
                "command": {k: _shown(command(example, k)) for k in ("fabric", "torchloom")},
                "edits": [why for *_, why in example.edits],
                "fabric": _summary(fabric),
                "torchloom": {},
            }
            folder = prepare(args.lightning_repo, example, "torchloom", Path(tmp))
            for label, path in sources:
                loom = run(example, "torchloom", folder, args.timeout, path)
                verdict = compare(fabric, loom)
                entry["torchloom"][label] = {**verdict, **_summary(loom)}
                _report(example.name, label, verdict, fabric, loom)
                _keep(args.keep_output, f"{example.name}-torchloom-{label}", loom)
            _keep(args.keep_output, f"{example.name}-fabric", fabric)
            results[example.name] = entry
            if args.json:
                args.json.write_text(json.dumps(results, indent=1) + "\n")


def _summary(r: dict) -> dict:
    out = {key: r[key] for key in ("exit", "seconds", "lines")}
    if r["exit"] != 0:
        out["output tail"] = r["output"][-3000:]
    return out


def _keep(folder: Path | None, name: str, r: dict) -> None:
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.txt").write_text(r["output"])


if __name__ == "__main__":
    main()
