#!/usr/bin/env bash
# The prepared GPU check of issue #16: on ONE CUDA device, in at most ~8 minutes,
#   1. the CUDA-marked tests (tests/test_flex.py: FlexAttention = SDPA = explicit softmax for every
#      elementwise-bias PE and nope, causal/bidirectional, no/padding/document masks, fp32 and bf16,
#      forward and gradients; auto picks Flex and compiles once for several lengths);
#   2. posformer-bench in bf16 against x-transformers at d_model 1024 / 16 heads / T 2048: training
#      tok/s and peak memory, and 16k / 64k-token evaluation (posformer with --attention-backend auto,
#      i.e. FlexAttention for the bias PEs).
# Everything goes to one folder: versions.txt, nvidia-smi.txt, cuda_tests.txt (+ .xml), bench/
# (bench.json with every repetition, bench.md), summary.txt. Exit status: 0 only if every stage passed.
#
#   scripts/gpu_check.sh                      # -> gpu_check_out/<date-time>/
#   scripts/gpu_check.sh /path/to/folder      # -> that folder
# Env: TEST_BUDGET_S (default 270), BENCH_BUDGET_S (default 200), PES (bench PEs), PYTHON (.venv/bin/python),
#      PYTEST_ARGS (more pytest arguments, e.g. "-n 8" with pytest-xdist: the 61 tests compile in parallel).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PYTHON")
OUT=${1:-gpu_check_out/$(date +%Y%m%d-%H%M%S)}
TEST_BUDGET_S=${TEST_BUDGET_S:-270}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-200}
PES=${PES:-nope,rope,alibi,t5,kerple,fire}
PYTEST_ARGS=${PYTEST_ARGS:-}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check.sh: no CUDA device is visible to $PYTHON (torch.cuda.is_available() is False);" \
        "run it on a machine with one NVIDIA GPU and a CUDA build of torch." >&2
    exit 2
fi
mkdir -p "$OUT" || { echo "gpu_check.sh: cannot create the output folder $OUT" >&2; exit 2; }
echo "gpu_check.sh: writing to $OUT"

"$PYTHON" - > "$OUT/versions.txt" 2>&1 <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
try:
    import importlib.metadata as m
    print("x-transformers", m.version("x-transformers"), "| triton", m.version("triton"))
except Exception as exc:  # noqa: BLE001
    print("versions:", exc)
EOF
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
cat "$OUT/versions.txt"

status=0
stage() {  # stage NAME SECONDS LOG CMD...: run with a time budget, log its output, record the outcome
    local name=$1 budget=$2 log=$3
    shift 3
    local start=$SECONDS
    timeout --kill-after=10 "$budget" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    if [ $rc -eq 0 ]; then
        echo "$name: passed in ${took}s" | tee -a "$OUT/summary.txt"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "$name: TIMED OUT after ${budget}s (budget; raise it with the env variable)" | tee -a "$OUT/summary.txt"
        status=1
    else
        echo "$name: FAILED (exit $rc) after ${took}s" | tee -a "$OUT/summary.txt"
        status=1
    fi
}

# 1. the CUDA-marked tests (compile once per PE, mask kind and dtype)
stage "cuda tests" "$TEST_BUDGET_S" "$OUT/cuda_tests.txt" \
    "$PYTHON" -m pytest tests/test_flex.py -m cuda -p no:cacheprovider -q -rfE --junitxml "$OUT/cuda_tests.xml" $PYTEST_ARGS

# 2. the side-by-side benchmark, bf16, d1024 / 16 heads / T2048 (training) and 16k / 64k evaluation
stage "bench bf16 d1024 T2048 vs x-transformers" "$BENCH_BUDGET_S" "$OUT/bench.txt" \
    "$BIN/posformer-bench" --device cuda --dtype bf16 --attention-backend auto \
    --d-model 1024 --n-heads 16 --n-layers 4 --seq-len 2048 --batch 4 --reps 3 --warmup 1 \
    --sections train,eval --pes "$PES" --eval-pes nope,rope,alibi,fire \
    --eval-d-model 1024 --eval-lengths 16384,65536 --eval-reps 1 \
    --out "$OUT/bench"

echo "gpu_check.sh: done; summary in $OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status
