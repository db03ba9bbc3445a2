#!/usr/bin/env bash
# The GPU path's proof and measurement, one run on a single H200: at most 6 minutes (QUICK=1: 3 minutes),
# every phase under its own timeout so a hang cannot eat the budget.
#  1. the CUDA tests: greedy = HF on the device for every attention path (SDPA and Triton), graphs captured
#     and equal to eager steps, the Triton kernels compiled and checked against torch in bf16/fp16/fp32;
#  2. per model shape (random bf16 weights made on the device: SmolLM2-135M, ~1.1B Llama, Llama-3-8B),
#     bench/device_bench.py: engine start-up (kernel choice + graph capture), inferq tok/s on 256 requests
#     against HF continuous batching (on fewer requests: HF is slow), the decode step at batch 1/16/64/128/256,
#     the GPU-busy share of a decode step (profiled kernel time / wall) and a short profile table.
# Files in $OUT (6): device_check.log, tests.txt, <shape>.json x3, summary.md (the report's tables).
#
# Before the device call, here in the repo root (the device machine cannot reach PyPI; its image has
# transformers 5.17, the project is tested with 5.24, and 5.24 pins regex >= 2025.10.22):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl transformers==5.24.0 regex==2026.11.19
# Then one device call:  command "bash bench/device_check.sh", carry [".whl"], timeout_s 420
# (QUICK=1 bash bench/device_check.sh: timeout_s 240).
# Dry run of everything but the GPU on any machine:  DEVICE=cpu TINY=1 OUT=/tmp/dc bash bench/device_check.sh
set -uo pipefail

START=$(date +%s)
OUT=${OUT:-$PWD/device-check-out}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
TINY=${TINY:-0}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_check.log") 2>&1

elapsed() { echo $(($(date +%s) - START)); }
stage() { echo; echo "=== [$(elapsed) s] $*"; }
# run_for SECONDS CMD...: at most SECONDS, and never past the plan; a phase that times out is reported.
run_for() {
    local limit=$1 left
    shift
    left=$((PLAN_S - $(elapsed)))
    if ((left < 15)); then
        echo "skipped (out of time): $*"
        return 124
    fi
    ((limit > left)) && limit=$left
    timeout --signal=INT --kill-after=10 "$limit" "$@"
    local code=$?
    ((code == 124)) && echo "TIMED OUT after ${limit} s: $*"
    return $code
}

# Per phase: seconds, then the bench's arguments. Full: <= 350 s of the 360; QUICK: <= 175 of 180.
# The tests that need the device (the CPU-only gold and CUDA-step-logic tests run in CI), most telling first.
TESTS_ALL=(tests/gpu/test_cuda_device.py tests/gpu/test_cuda_triton_step.py tests/gpu/test_triton_kernels.py
    tests/gpu/test_grammar_cuda.py tests/gpu/test_n_samples.py::test_samples_on_cuda_are_reproducible_and_greedy_ones_match_hf
    tests/gpu/test_logits_processors.py::test_processing_on_cuda_equals_the_cpu)
if [[ $TINY == 1 ]]; then  # the dry run: tiny models, a few requests, the tests that are quick on a CPU
    PLAN_S=${PLAN_S:-600}
    TESTS=(tests/gpu/test_cuda_triton_step.py -k choice)
    TEST_S=200
    SHAPES=(smollm2-135m-shape:150 llama-3-8b-shape:150)
    ARGS=(--tiny --requests 8 --hf-requests 4 --batches 1,4 --profile 4 --steps 4)
    declare -A HF=()
elif [[ $QUICK == 1 ]]; then
    PLAN_S=${PLAN_S:-175}
    TESTS=(tests/gpu/test_cuda_triton_step.py)
    TEST_S=60
    SHAPES=(llama-1.1b-shape:50 llama-3-8b-shape:60)
    ARGS=(--requests 128 --batches 1,64,256 --profile 64 --steps 16 --kv-cache-gib 24)
    declare -A HF=([llama-1.1b-shape]=16 [llama-3-8b-shape]=0)
else
    PLAN_S=${PLAN_S:-350}
    TESTS=("${TESTS_ALL[@]}")
    TEST_S=100
    SHAPES=(smollm2-135m-shape:50 llama-1.1b-shape:70 llama-3-8b-shape:110)
    ARGS=(--requests 256 --batches 1,16,64,128,256 --profile 64,256 --steps 32 --kv-cache-gib 24)
    declare -A HF=([smollm2-135m-shape]=64 [llama-1.1b-shape]=64 [llama-3-8b-shape]=32)
fi

stage "machine (plan: ${PLAN_S} s)"
if [[ $DEVICE == cuda* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
nproc
"$PY" --version

stage "packages"
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    # Carried wheels first on the path, ahead of the image's own versions.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
"$PY" - <<'EOF'
import torch, transformers
cuda = torch.cuda.is_available()
try:
    import triton
    tv = triton.__version__
except Exception as error:  # the kernels then stay on torch; the log says why
    tv = f"not importable ({error})"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, triton {tv}, cuda {cuda}",
      torch.cuda.get_device_name() if cuda else "")
EOF

stage "tests: ${TESTS[*]}"
run_for "$TEST_S" "$PY" -m pytest "${TESTS[@]}" -q -rs -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/tests.txt"

for entry in "${SHAPES[@]}"; do
    shape=${entry%%:*} seconds=${entry##*:}
    stage "$shape on $DEVICE: start-up, tok/s vs HF CB (${HF[$shape]:-4} requests), decode steps, profile"
    run_for "$seconds" "$PY" -m bench.device_bench "$shape" --device "$DEVICE" "${ARGS[@]}" \
        --hf-requests "${HF[$shape]:-4}" --json "$OUT/$shape.json"
done

stage "summary"
run_for 20 "$PY" -m bench.device_bench --summarize "$OUT"/*-shape.json | tee "$OUT/summary.md"

stage "done in $(elapsed) s; files in $OUT:"
ls -la "$OUT"
