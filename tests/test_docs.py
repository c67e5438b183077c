"""The documentation is tested like code: every Python block of README.md and docs/ runs (or says why it cannot),
the site builds in strict mode, and the CHANGELOG names this version and checkpoint format.

A block runs according to the HTML comment on the line before its opening fence:

    (none)                          one process, a fresh namespace and an empty directory of its own; all such
                                    blocks share one interpreter, so the check stays fast
    <!-- run: python -->            a script, started as `python script.py` (it launches its own ranks)
    <!-- run: torchloom run ... --> a script, started under `torchloom run ...`
    <!-- tested: FILE::TEST -->     run by that test (which must exist)
    <!-- not-run: REASON -->        not run; the reason is required
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from harness import PYTHON, REPO, run_job, run_ranks, wait_no_strays

import torchloom
from torchloom.checkpointing import FORMAT_VERSION

FENCE = re.compile(r"^\s*```python\s*$")
MARKER = re.compile(r"^\s*<!--\s*([a-z-]+):\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # line of the first code line, 1-based
    code: str
    kind: str | None  # None (run in process), "run", "tested", "not-run"
    arg: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = MARKER.match(previous)
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        found.append(
            Block(path, i + 2, code, marker.group(1) if marker else None, marker.group(2) if marker else "")
        )
        i = end + 1
    return found


ALL_BLOCKS = [block for path in _doc_files() for block in _blocks(path)]


def test_every_python_block_runs_or_says_why():
    assert len(ALL_BLOCKS) > 10, "the parser found too few Python blocks"
    problems = [
        f"{path.relative_to(REPO)}:{number}: write Python blocks as a bare ```python fence, so they are run"
        for path in _doc_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"^\s*```\s*(py|python)", line, re.I) and not FENCE.match(line)
    ]
    for block in ALL_BLOCKS:
        if block.kind == "not-run" and len(block.arg.split()) < 2:
            problems.append(f"{block.where}: `not-run:` needs a reason")
        elif block.kind == "tested":
            file, _, test = block.arg.partition("::")
            target = REPO / file
            if not target.is_file() or not re.search(rf"^def {re.escape(test)}\(", target.read_text(), re.M):
                problems.append(f"{block.where}: `tested: {block.arg}` names no existing test")
        elif block.kind == "run" and _command(block, Path("x.py")) is None:
            problems.append(f"{block.where}: `run: {block.arg}`: use `python` or `torchloom run ...`")
        elif block.kind not in (None, "not-run", "tested", "run"):
            problems.append(f"{block.where}: unknown marker `{block.kind}:` (run, tested or not-run)")
    assert not problems, "\n".join(problems)


# ---- blocks that run in one process -----------------------------------------------------------------------------
_RUNNER = r"""
import json, os, sys, traceback
failures = []
for i, (where, line, code) in enumerate(json.load(open(sys.argv[1]))):
    folder = os.path.join(sys.argv[2], f"block{i}")
    os.makedirs(folder)
    os.chdir(folder)
    try:
        # Padded so that a traceback's line numbers are the documentation file's.
        exec(compile("\n" * (line - 1) + code, where.rsplit(":", 1)[0], "exec"), {"__name__": "__docs__"})
    except BaseException:
        failures.append(where)
        print(f"--- {where} failed:\n{traceback.format_exc()}", flush=True)
print("FAILED BLOCKS: " + json.dumps(failures))
"""


def test_single_process_blocks(tmp_path):
    """Every unmarked block, each in a fresh namespace and an empty directory, in one interpreter."""
    blocks = [block for block in ALL_BLOCKS if block.kind is None]
    (tmp_path / "blocks.json").write_text(json.dumps([[b.where, b.line, b.code] for b in blocks]))
    (tmp_path / "runner.py").write_text(_RUNNER)
    proc, token = run_job([PYTHON, "runner.py", "blocks.json", str(tmp_path)], timeout=180, cwd=tmp_path)
    assert wait_no_strays(token) == []
    assert "FAILED BLOCKS: []" in proc.stdout, proc.stdout
    assert proc.returncode == 0, proc.stdout


# ---- scripts, run as jobs ----------------------------------------------------------------------------------------
def _command(block: Block, script: Path) -> list[str] | None:
    words = block.arg.split()
    if words == ["python"]:
        return [PYTHON, str(script)]
    if words[:2] == ["torchloom", "run"]:
        return [PYTHON, "-m", "torchloom", "run", *words[2:], str(script)]
    return None


def _check_ddp_loop(out: str, folder: Path) -> None:
    losses = [float(x) for x in re.findall(r"^epoch \d: loss ([\d.]+)$", out, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    assert torch.load(folder / "checkpoint.pt", weights_only=False)["epoch"] == 2


def _check_fsdp_units(out: str, folder: Path) -> None:
    assert "done, last gradient norm" in out, out
    assert "the root is not a unit" in out and "replicated on every rank" in out, out
    assert (folder / "ckpt" / ".metadata").exists()


def _check_launch_fn(out: str, folder: Path) -> None:
    assert re.search(r"^2 ranks, final loss [\d.]+$", out, re.M), out


def _check_3d(out: str, folder: Path) -> None:
    found = dict(re.findall(r"^(pp 2 x tp 2 x dp 2|one process) losses: +([\d. ]+)$", out, re.M))
    assert set(found) == {"pp 2 x tp 2 x dp 2", "one process"}, out
    losses, expected = ([float(x) for x in found[k].split()] for k in ("pp 2 x tp 2 x dp 2", "one process"))
    assert len(losses) == 3 and losses == pytest.approx(expected, abs=1e-5), out


# What a script's output must show beyond a clean exit, keyed by a line of the script.
_CHECKS = {
    'loom.print(f"epoch {epoch}: loss': _check_ddp_loop,
    'loom.print(f"done, last gradient norm': _check_fsdp_units,
    'print(f"2 ranks, final loss': _check_launch_fn,
    'print("pp 2 x tp 2 x dp 2 losses: "': _check_3d,
}


# Pages whose `run:` scripts are launched as a user runs them, one job each: `launch(fn)` returning rank 0's result
# (launching.md), an elastic agent and `torchloom run` (resuming.md); a module-level `launch()` starting its own
# ranks is README.md's script, launched by tests/test_example.py. The other `run: python` scripts differ in what
# their ranks do, not in how they start: each runs on the `devices=N` ranks its Loom names, started from
# `run_ranks`'s fork server with the environment torchrun gives a rank (`launch()` then starts nothing), which
# saves every rank's interpreter and torch import.
_LAUNCHED_PAGES = {"docs/launching.md", "docs/resuming.md"}


def _on_forked_ranks(block: Block) -> int | None:
    """The number of ranks to run `block` on from the fork server, or None to launch it as a job."""
    if block.kind != "run" or block.where.split(":")[0] in _LAUNCHED_PAGES or block.arg.split() != ["python"]:
        return None
    devices = re.findall(r"\bLoom\(.*\bdevices=(\d+)", block.code)
    assert len(devices) == 1, f"{block.where}: one `Loom(..., devices=N)` expected, found {devices}"
    return int(devices[0])


def _script_rank(rank: int, world_size: int, folder: str) -> str:
    """One rank of `folder/script.py`, run there as `__main__`; its stdout and stderr (also what is logged)."""
    os.chdir(folder)
    log = Path(folder) / f"rank{rank}.txt"
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    sys.argv = ["script.py"]
    try:
        runpy.run_path("script.py", run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return log.read_text()


def _run_script(block: Block, folder: Path) -> tuple[Block, subprocess.CompletedProcess[str], str, Path]:
    folder.mkdir()
    (folder / "script.py").write_text(block.code)
    proc, token = run_job(_command(block, Path("script.py")), timeout=240, cwd=folder)
    return block, proc, token, folder


def _run_on_forked_ranks(block: Block, folder: Path, ranks: int) -> str:
    folder.mkdir()
    (folder / "script.py").write_text(block.code)
    try:
        return "".join(run_ranks(_script_rank, ranks, str(folder), timeout=240))
    except Exception as e:
        outputs = "".join(f"--- {log.name}:\n{log.read_text()}" for log in sorted(folder.glob("rank*.txt")))
        raise AssertionError(f"{block.where} failed on {ranks} ranks: {e}\n{outputs}") from None


def test_script_blocks(tmp_path):
    """The blocks marked `run:`: the launched ones as jobs of their own, side by side, each exits 0 and leaves no
    process; meanwhile the others, one after the other, on ranks from the fork server."""
    blocks = [block for block in ALL_BLOCKS if block.kind == "run"]
    assert blocks, "no multi-process block found"
    launched = [(i, b) for i, b in enumerate(blocks) if _on_forked_ranks(b) is None]
    forked = [(i, b, _on_forked_ranks(b)) for i, b in enumerate(blocks) if _on_forked_ranks(b) is not None]
    assert launched and forked
    outputs = []
    with ThreadPoolExecutor(len(launched)) as pool:
        jobs = pool.map(lambda ib: _run_script(ib[1], tmp_path / f"script{ib[0]}"), launched)
        for i, block, ranks in forked:
            folder = tmp_path / f"script{i}"
            outputs.append((block, _run_on_forked_ranks(block, folder, ranks), folder))
        for block, proc, token, folder in jobs:
            assert proc.returncode == 0, f"{block.where}:\n{proc.stdout}"
            assert wait_no_strays(token) == [], block.where
            outputs.append((block, proc.stdout, folder))
    checked = set()
    for block, out, folder in outputs:
        for line, check in _CHECKS.items():
            if line in block.code:
                check(out, folder)
                checked.add(line)
    assert checked == set(_CHECKS), f"scripts not found in the docs: {set(_CHECKS) - checked}"


# ---- the site and the versions -----------------------------------------------------------------------------------
@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs/mkdocstrings not installed: `pip install -e .[docs]` (make docs) to build the site",
)
def test_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "api" / "loom" / "index.html").is_file()


def _newest_changelog_section() -> tuple[str, str]:
    text = (REPO / "CHANGELOG.md").read_text()
    headings = list(re.finditer(r"^## \[?(\d+\.\d+\.\d+[^\]\s]*)\]?.*$", text, re.M))
    assert headings, "CHANGELOG.md has no `## X.Y.Z` heading"
    end = headings[1].start() if len(headings) > 1 else len(text)
    return headings[0].group(1), text[headings[0].end() : end]


def test_changelog_names_this_version_and_checkpoint_format():
    version, section = _newest_changelog_section()
    assert version == torchloom.__version__, (
        f"CHANGELOG.md's newest version {version} != {torchloom.__version__}"
    )
    formats = re.findall(r"checkpoint format version (\d+)", section, re.I)
    assert formats, f"the {version} section names no 'checkpoint format version N'"
    assert int(formats[0]) == FORMAT_VERSION, (formats, FORMAT_VERSION)
