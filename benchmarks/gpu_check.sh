#!/usr/bin/env bash
# The GPU check: what a machine with a CUDA GPU runs, in under 10 minutes, to prove the GPU path.
#
#   1. the CUDA tests (pytest -m cuda tests: tests/gpu and the CUDA cases elsewhere): every strategy x precision
#      on 1 and 2 GPUs, hand-made units, offload placement, the desync report under NCCL (its watchdog thread
#      on its rank's GPU, tests/gpu/test_watchdog_device.py),
#      meta init with and without cpu_offload, checkpoints with offload, the leftover sync under NCCL;
#      2-D parallelism on a tiny Llama (tensor parallel 2 + FSDP2, ModelParallelStrategy and raw PyTorch against
#      one GPU; needs 2 GPUs, skipped with the reason on one: tests/gpu/test_model_parallel_cuda.py);
#   2. benchmarks/step_overhead.py --device cuda: torchloom's step time against raw PyTorch, on 2 GPUs (1 where
#      the machine has one: no communication then, but torchloom's own costs on the GPU; the model-parallel
#      pairs, which need 2, are then skipped);
#   3. benchmarks/memory.py --device cuda: torch.cuda.max_memory_allocated against the floor, same world size;
#   4. examples/train_lm.py on the GPU as a user runs it (fsdp2 bf16-mixed, then fsdp 16-mixed resumed from its
#      checkpoint), with `python examples/train_lm.py` as the README shows;
#   5. benchmarks/plan_vs_gpu.py: `torchloom plan` of the Llama 3.1 8B recipe at 1 block, then the same script run
#      on the GPU: planned against measured max_memory_allocated (goal 5%) and max_memory_reserved (goal 10%);
#   6. a summary: the tests' pass/fail/skip counts, the benchmarks' ratio lines, the example's last lines.
#
# Without a CUDA GPU, or with a CPU build of torch, the script stops at once with the reason and exit code 2: it
# never reports a CPU run as a GPU check.
#
#   bash benchmarks/gpu_check.sh              # or: make gpu-check
#   bash benchmarks/gpu_check.sh --dry-run    # print what would run, check nothing on the GPU
#
# Environment: VENV (default .venv) is used as it is when it exists: nothing is installed. Otherwise it is
# created with TORCH_SPEC (default torch==2.13.0, a CUDA build on Linux from the default package index; pass a
# CUDA-specific index with --index-url inside TORCH_SPEC if you need another CUDA version). OUT (default
# gpu-check-results) receives the logs and JSON results. Step time limits keep the whole under 10 minutes.
set -uo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
OUT=${OUT:-gpu-check-results}
PY="$VENV/bin/python"
# This checkout's torchloom, whatever the environment has installed.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
TEST_LIMIT=${TEST_LIMIT:-330}   # seconds for the CUDA tests
BENCH_LIMIT=${BENCH_LIMIT:-120} # seconds for each benchmark
EXAMPLE_LIMIT=${EXAMPLE_LIMIT:-90} # seconds for each run of the example
PLAN_LIMIT=${PLAN_LIMIT:-240}   # seconds for the plan against the GPU (a plan, then a run)
DRY_RUN=0

for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h | --help)
            sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "gpu_check: unknown argument '$arg' (known: --dry-run, --help)" >&2
            exit 2
            ;;
    esac
done

fail() {
    echo "gpu_check: FAILED: $*" >&2
    exit 2
}

# The benchmarks' own smoke test is left out: steps 2 and 3 run them at full size.
TESTS_CMD=("$PY" -m pytest -q -m cuda -rs -k "not benchmarks_tiny" tests)
STEP_CMD=("$PY" benchmarks/step_overhead.py --device cuda --dim 1024 --tokens 1024 --repeats 40
    --json "$OUT/step_overhead_cuda.json")
MEMORY_CMD=("$PY" benchmarks/memory.py --device cuda --configs a,a_raw,c --json "$OUT/memory_cuda.json")
PLAN_CMD=("$PY" benchmarks/plan_vs_gpu.py --layers 1 --steps 3 --out "$OUT")
EXAMPLE_DIR=${EXAMPLE_DIR:-$(mktemp -d -t gpu-check-lm.XXXXXX 2>/dev/null || echo /tmp/gpu-check-lm)}
EXAMPLE_CMD=("$PY" examples/train_lm.py --accelerator cuda --steps 40 --eval-every 20
    --checkpoint-every 20 --out-dir "$EXAMPLE_DIR")

if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: dry run; nothing is installed or run."
    if [ -x "$PY" ]; then
        echo "  environment: $VENV exists, used as it is"
    else
        echo "  environment: $VENV is missing: would create it and install '$TORCH_SPEC' and torchloom[test]"
    fi
    echo "  refuses to go on unless torch is a CUDA build and torch.cuda.is_available()"
    echo "  1. timeout ${TEST_LIMIT}s (then SIGINT: pytest prints what ran) ${TESTS_CMD[*]}"
    echo "  2. timeout ${BENCH_LIMIT}s ${STEP_CMD[*]} --world <1 or 2: the GPUs, at most 2>"
    echo "  3. timeout ${BENCH_LIMIT}s ${MEMORY_CMD[*]} --world <1 or 2>"
    echo "  4. timeout ${EXAMPLE_LIMIT}s ${EXAMPLE_CMD[*]} --devices <1 or 2> --precision bf16-mixed --stop-at 20,"
    echo "     then the same with --flavour fsdp --precision 16-mixed --resume (to step 40)"
    echo "  5. timeout ${PLAN_LIMIT}s ${PLAN_CMD[*]} (plan, then run on GPU 0)"
    echo "  6. summary: tests passed/failed/skipped, the benchmarks' ratio lines, the example's last lines; logs in $OUT/"
    exit 0
fi

# ---- the environment: installed only when missing --------------------------------------------------------
if [ ! -x "$PY" ]; then
    echo "gpu_check: creating $VENV with $TORCH_SPEC (a few GB for a CUDA build)"
    python3 -m venv "$VENV" || fail "could not create $VENV"
    # shellcheck disable=SC2086 # TORCH_SPEC may carry pip options such as --index-url
    "$PY" -m pip install -q $TORCH_SPEC || fail "could not install $TORCH_SPEC"
    "$PY" -m pip install -q -e ".[test]" || fail "could not install torchloom[test]"
fi

# ---- refuse clearly without a GPU -----------------------------------------------------------------------
GPUS=$("$PY" - <<'EOF'
import sys

import torch

if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} is a CPU build: install a CUDA build (e.g. TORCH_SPEC='torch==2.13.0' "
             "in a new VENV) to run the GPU check")
if not torch.cuda.is_available():
    sys.exit(f"no CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
             "(torch.cuda.is_available() is False; check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)")
print(torch.cuda.device_count())
EOF
) || fail "this machine cannot run the GPU check (see the reason above); nothing was run"
mkdir -p "$OUT"
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {p.name}')" | tee "$OUT/machine.txt"
START=$(date +%s)

# ---- 1. the CUDA tests ----------------------------------------------------------------------------------
echo "gpu_check: 1/4 CUDA tests (limit ${TEST_LIMIT}s)"
# At the limit pytest gets SIGINT, as from Ctrl-C: it stops and still prints its counts of what passed, failed
# and was skipped (SIGTERM would kill it with no summary at all); SIGKILL follows 30 s later if it hangs.
timeout -s INT -k 30 "$TEST_LIMIT" "${TESTS_CMD[@]}" 2>&1 | tee "$OUT/tests.log"
TESTS_RC=${PIPESTATUS[0]}
TESTS_LINE=$(grep -E '^=*\s*[0-9]+ (passed|failed|skipped|error)' "$OUT/tests.log" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//')
[ -n "$TESTS_LINE" ] || TESTS_LINE="no summary (exit code $TESTS_RC)"
if [ "$TESTS_RC" = 124 ] || [ "$TESTS_RC" = 137 ]; then
    TESTS_LINE="$TESTS_LINE; STOPPED at the ${TEST_LIMIT}s limit (raise TEST_LIMIT to run the rest)"
fi

# ---- 2, 3. the benchmarks, on 2 GPUs or on the one there is ----------------------------------------------
WORLD=$((GPUS >= 2 ? 2 : 1))
BENCH_RC=0
run_step() { # step label, log name, limit, command...
    local label=$1 name=$2 limit=$3
    shift 3
    echo "gpu_check: $label $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" != 0 ]; then
        echo "gpu_check: $name exited with $rc (124: past the ${limit}s limit)" | tee -a "$OUT/$name.log"
        BENCH_RC=1
    fi
}
run_step 2/4 step_overhead "$BENCH_LIMIT" "${STEP_CMD[@]}" --world "$WORLD"
run_step 3/4 memory "$BENCH_LIMIT" "${MEMORY_CMD[@]}" --world "$WORLD"

# ---- 4. the example, as a user runs it: fsdp2 in bf16 to a checkpoint, then resumed under fsdp in fp16 ------
run_step 4/4 example "$EXAMPLE_LIMIT" "${EXAMPLE_CMD[@]}" --devices "$WORLD" --precision bf16-mixed --stop-at 20
run_step 4/4 example_resumed "$EXAMPLE_LIMIT" "${EXAMPLE_CMD[@]}" --devices "$WORLD" --flavour fsdp \
    --precision 16-mixed --resume

# ---- 5. the plan against the GPU: the Llama recipe at 1 block, planned then run ---------------------------------
run_step 5/5 plan_vs_gpu "$PLAN_LIMIT" "${PLAN_CMD[@]}"

# ---- 6. summary -----------------------------------------------------------------------------------------
echo
echo "==== gpu_check summary ($(($(date +%s) - START)) s) ===="
cat "$OUT/machine.txt"
echo "tests: $TESTS_LINE"
echo "benchmarks on $WORLD GPU(s):"
grep -h '^ratio  step_time\|^ratio  memory' "$OUT/step_overhead.log" "$OUT/memory.log" 2>/dev/null || true
echo "plan against the GPU (Llama 3.1 8B recipe, 1 block):"
grep -h '^ratio  max_memory' "$OUT/plan_vs_gpu.log" 2>/dev/null || true
echo "example (last lines of each run):"
tail -n 3 "$OUT/example.log" "$OUT/example_resumed.log" 2>/dev/null || true
echo "logs and JSON: $OUT/"
if [ "$TESTS_RC" != 0 ] || [ "$BENCH_RC" != 0 ]; then
    echo "gpu_check: FAILED (tests exit code $TESTS_RC, benchmarks and example $([ "$BENCH_RC" = 0 ] && echo ok || echo failed))"
    exit 1
fi
echo "gpu_check: passed"
