#!/usr/bin/env bash
# The install check: torchloom as a user installs it from git, with its runtime dependencies only, then a 2-process
# job. The test suite runs with the `test` extra installed, so a runtime dependency missing from pyproject.toml
# (numpy, which torch's object collectives need, was one) hides there; here it fails.
#
#   1. a fresh virtual environment in a temporary directory (no system site-packages);
#   2. TORCH_SPEC (default torch==2.13.0; on these machines a local CPU wheel), installed first so that pip never
#      picks a torch build itself; the check fails if installing torchloom changed it;
#   3. `pip install <this checkout>`: no extras, not editable, from a copy of the files git would commit, so
#      neither a stale build/ nor an untracked scratch file reaches the package;
#   4. tests/install/job.py on 2 processes, run from the temporary directory (the source tree is not on the
#      path), then `torchloom inspect` and `torchloom consolidate` on its sharded checkpoint.
#
#   bash tests/install/install_check.sh        # or: make install-check
#
# Environment: PYTHON (default python3) makes the environment; TORCH_SPEC as above (e.g. "torch==2.13.0
# --index-url https://download.pytorch.org/whl/cpu"); JOB_LIMIT (default 300) seconds for the job.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
JOB_LIMIT=${JOB_LIMIT:-300}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/torchloom-install-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
say() { echo "[install-check $((SECONDS - START))s] $*"; }

say "fresh environment in $WORK/venv"
"$PYTHON" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"

say "installing $TORCH_SPEC"
# TORCH_SPEC may carry pip options (--index-url ...): split it into words on purpose.
# shellcheck disable=SC2086
"$PY" -m pip install -q $TORCH_SPEC
# (-W: torch warns on import that numpy is missing, which torchloom's install then brings)
TORCH_BEFORE=$("$PY" -W ignore::UserWarning -c "import torch; print(torch.__version__)")

SRC="$REPO"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    SRC="$WORK/src"
    mkdir -p "$SRC"
    # Tracked files and new ones not ignored: what the next commit would hold.
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
        | xargs -0 cp --parents -t "$SRC")
fi
say "installing torchloom from $REPO (no extras)"
"$PY" -m pip install -q "$SRC"
TORCH_AFTER=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then
    echo "install-check: installing torchloom replaced torch $TORCH_BEFORE with $TORCH_AFTER" >&2
    exit 1
fi
say "installed: $("$PY" -m pip list --format=freeze 2>/dev/null | tr '\n' ' ')"

mkdir -p "$WORK/run"
cp "$REPO/tests/install/job.py" "$WORK/run/job.py"
cd "$WORK/run"
# Nothing from the checkout may be imported: no PYTHONPATH, and the working directory is outside it.
unset PYTHONPATH
"$PY" -c "
import sys, torchloom
assert not torchloom.__file__.startswith(sys.argv[1]), torchloom.__file__
" "$REPO/"
say "2-process job (limit ${JOB_LIMIT}s)"
OMP_NUM_THREADS=1 timeout "$JOB_LIMIT" "$PY" job.py "$WORK/run/out"
say "torchloom inspect / consolidate"
"$WORK/venv/bin/torchloom" inspect "$WORK/run/out/sharded" >/dev/null
"$WORK/venv/bin/torchloom" consolidate "$WORK/run/out/sharded" "$WORK/run/out/consolidated.pt"
"$PY" -c "
import sys, torch
state = torch.load(sys.argv[1], weights_only=True)
assert set(state) >= {'model', 'optimizer', 'step'}, sorted(state)
" "$WORK/run/out/consolidated.pt"
say "passed: torchloom $("$PY" -c 'import torchloom; print(torchloom.__version__)'), torch $TORCH_AFTER"
