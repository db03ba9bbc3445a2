#!/usr/bin/env bash
# The GPU path's proof and measurement, one run on a single H200 or H100, every phase under its own timeout
# so a hang cannot eat the budget. The plan is the sum of the phases' budgets (printed first; the imports of
# each test process and the first Triton compiles of a bare machine are inside each phase's budget):
#  1. the CUDA tests, each file in its own pytest process (a collection error or crash loses that file
#     alone), kernel tests first: the Triton kernels against torch in bf16/fp16/fp32, then greedy = HF on the
#     device for every attention path (SDPA and Triton), graphs captured and equal to eager steps;
#  2. per model shape (random bf16 weights made on the device: SmolLM2-135M and Llama-3-8B; QUICK: ~1.1B
#     Llama and 8B), bench/device/bench.py: engine start-up (kernel choice + graph capture), inferq tok/s on
#     256 requests, then HF continuous batching (on fewer requests: HF is slow) before anything that may
#     fail, the decode step at batch 1/16/64/128/256 with the GPU-busy share of a decode step (profiled
#     kernel time / wall) and a short profile table, and last async scheduling's tok/s (never yet run on a
#     GPU: a failure is recorded in the JSON's `errors` and costs only its own row);
#  3. the summary (outside the plan, its own 20 s): the per-file test table and the benches' tables.
# Files in $OUT (5): device_check.log, tests.txt, <shape>.json x2, summary.md (the report's tables).
#
# Before the device call, here in the repo root: `bash bench/device/carry.sh` downloads the wheels the image
# lacks (bench/device/image.py's CARRIED: transformers 5.24 and regex, xgrammar, jsonschema and their needs;
# the image has no network) into .whl/ and checks that they and the working tree fit the call's 64 MiB.
# Then one device call:  command "bash bench/device_check.sh", carry [".whl"], timeout_s 600 (the plan is
# 515 s; QUICK=1 bash bench/device_check.sh: timeout_s 320). The plan's total is printed first.
# Without the wheels the grammar tests skip with their reason; nothing else needs them.
# Dry run of everything but the GPU on any machine:  DEVICE=cpu TINY=1 OUT=/tmp/dc bash bench/device_check.sh
# CI's dry run of the full test list under the image's packages (tests/bench/test_device_check.py):
#   DEVICE=cpu TESTS_ONLY=1 SIMULATE_IMAGE=1 PYTEST_EXTRA=--setup-only BUDGET_SCALE=4 bash bench/device_check.sh
# (--setup-only: every file collected and its tests' fixtures set up, none run; BUDGET_SCALE: a slow CPU)
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

# Test files, each with its seconds (its process's imports and first Triton compiles included), kernel
# tests first; then shapes with their seconds. The CPU-only gold and CUDA-step-logic tests run in CI.
# Budgets are counted, not guessed, on a bare machine (no Triton cache): imports (torch, transformers, the
# engine) ~5 s on the device (the 2026-12-04 H200 run); one Triton compile 0.3-1.5 s, 5-7 s for the
# 256-dim varlen kernel (tests/gpu/triton_aot.py's timings on a 2-core machine, where the device's cores
# are no slower); each file's compiles counted by launching its kernels under the interpreter:
#  - test_triton_kernels.py: 30 distinct launches in fp32/fp16 + ~12 in bf16 (which only a GPU compiles)
#    = ~42 compiles ~ 60 s, its 60-odd tests ~15 s, imports 5 s: 90 s.
#  - test_cuda_triton_step.py: engine starts at block sizes 4, 8, 16 (each a new PAGE) and the fp16
#    choice: ~35 compiles ~ 45 s, HF generate and graph captures ~20 s: 75 s.
#  - test_cuda_device.py: engines in fp32 and one in bf16, the SDPA fallback's lazy captures: ~20 compiles
#    (most of the fp32 ones cached by the file before) ~ 25 s, HF and captures ~25 s: 60 s.
#  - test_lora_kernels.py: shrink and expand in fp32/fp16/bf16 at a few ranks and widths: ~8 compiles
#    ~ 10 s, imports 5 s: 20 s; the LoRA cases of the two files below add ~10 s and ~15 s (their graphs).
#  - the rest start one engine each (its kernel choice compiles ~8 variants, mostly cached): 30/25/20 s.
# Shapes: random weights (SmolLM2 shape 16.7 s measured, 1.1B 3.1 s), the engine's start (its kernel
# choice and graph capture: ~10 compiles ~15 s), inferq 256 requests (<5 s), HF CB (~1,000 tok/s: 64
# requests ~8 s), decode steps at 5 batch sizes ~10 s, the async phase ~5 s.
TESTS_ALL=(tests/gpu/test_triton_kernels.py:90 tests/gpu/test_lora_kernels.py:20
    tests/gpu/test_cuda_triton_step.py:85 tests/gpu/test_cuda_device.py:75 tests/gpu/test_grammar_cuda.py:30
    tests/gpu/test_n_samples.py::test_samples_on_cuda_are_reproducible_and_greedy_ones_match_hf:25
    tests/gpu/test_logits_processors.py::test_processing_on_cuda_equals_the_cpu:20)
SETUP_S=25    # machine, packages (the carried wheels' install)
SUMMARY_S=20  # outside the plan
if [[ $TINY == 1 ]]; then  # the dry run: tiny models, a few requests, the tests that are quick on a CPU
    TESTS=("tests/gpu/test_cuda_triton_step.py -k choice:200")
    SHAPES=(smollm2-135m-shape:150 llama-3-8b-shape:150)
    ARGS=(--tiny --requests 8 --hf-requests 4 --batches 1,4 --profile 4 --steps 4)
    declare -A HF=()
elif [[ $QUICK == 1 ]]; then
    TESTS=(tests/gpu/test_triton_kernels.py:90 tests/gpu/test_cuda_triton_step.py:75)
    SHAPES=(llama-1.1b-shape:55 llama-3-8b-shape:75)
    ARGS=(--requests 128 --batches 1,64,256 --profile 64 --steps 16 --kv-cache-gib 24)
    declare -A HF=([llama-1.1b-shape]=16 [llama-3-8b-shape]=0)
else
    # The 1.1B shape is left out of the full run to fit one call (its step times equalled the SmolLM2
    # shape's on the last H200 run); QUICK runs it.
    TESTS=("${TESTS_ALL[@]}")
    SHAPES=(smollm2-135m-shape:75 llama-3-8b-shape:115)
    ARGS=(--requests 256 --batches 1,16,64,128,256 --profile 64,256 --steps 32 --kv-cache-gib 24)
    declare -A HF=([smollm2-135m-shape]=64 [llama-3-8b-shape]=32)
fi
if [[ ${TESTS_ONLY:-0} == 1 ]]; then
    [[ $TINY == 1 ]] || TESTS=("${TESTS_ALL[@]}")
    SHAPES=()
fi
# The plan adds up: setup + every test file + every shape (the summary runs after it, on its own budget).
PLAN=$SETUP_S
for entry in "${TESTS[@]}"; do PLAN=$((PLAN + ${entry##*:} * ${BUDGET_SCALE:-1})); done
for entry in "${SHAPES[@]}"; do PLAN=$((PLAN + ${entry##*:})); done
PLAN_S=${PLAN_S:-$PLAN}

stage "machine (plan: ${PLAN_S} s = setup ${SETUP_S} + tests + shapes; summary ${SUMMARY_S} s after it)"
for entry in "${TESTS[@]}"; do echo "  $((${entry##*:} * ${BUDGET_SCALE:-1})) s  ${entry%:*}"; done
for entry in "${SHAPES[@]}"; do echo "  ${entry##*:} s  ${entry%:*}"; done
if [[ $DEVICE == cuda* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
nproc
"$PY" --version

stage "packages"
export PYTHONPATH=$PWD
if [[ ${SIMULATE_IMAGE:-0} != 1 ]] && compgen -G ".whl/*.whl" >/dev/null; then
    # Carried wheels first on the path, ahead of the image's own versions.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
if [[ ${SIMULATE_IMAGE:-0} == 1 ]]; then  # CI: what the GPU image lacks made unimportable (bench/device/image.py)
    export INFERQ_SIMULATE_IMAGE=1 PYTHONPATH=$PYTHONPATH:$PWD/bench/device/simulated_image
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

stage "tests, one pytest process per file"
: >"$OUT/tests.txt"
TESTS_FAILED=()
TEST_TABLE="| test file | exit | seconds | budget | result |"$'\n'"|---|---|---|---|---|"
for entry in "${TESTS[@]}"; do
    target=${entry%:*} seconds=$((${entry##*:} * ${BUDGET_SCALE:-1}))
    read -ra words <<<"$target"
    echo "--- ${words[*]} (budget ${seconds} s)" | tee -a "$OUT/tests.txt"
    began=$(date +%s)
    # shellcheck disable=SC2086  # PYTEST_EXTRA: words for pytest (the CI dry run's --collect-only)
    run_for "$seconds" "$PY" -m pytest "${words[@]}" -q -rs -p no:cacheprovider --durations=5 \
        ${PYTEST_EXTRA:-} 2>&1 | tee -a "$OUT/tests.txt"
    code=${PIPESTATUS[0]}
    last=$(grep -E '(passed|failed|skipped|error|no tests ran|collected|TIMED OUT|skipped \(out)' \
        "$OUT/tests.txt" | tail -1 | tr -d '=|' | sed 's/^ *//;s/ *$//')
    TEST_TABLE+=$'\n'"| ${words[*]} | $code | $(($(date +%s) - began)) | $seconds | $last |"
    ((code == 0 || code == 5)) || TESTS_FAILED+=("${words[*]}")  # 5: nothing collected (a module skip)
done
echo "$TEST_TABLE"

for entry in "${SHAPES[@]}"; do
    shape=${entry%%:*} seconds=${entry##*:}
    stage "$shape on $DEVICE: start-up, tok/s vs HF CB (${HF[$shape]:-4} requests), decode steps, profile"
    run_for "$seconds" "$PY" -m bench.device.bench "$shape" --device "$DEVICE" "${ARGS[@]}" \
        --hf-requests "${HF[$shape]:-4}" --json "$OUT/$shape.json"
done

stage "summary (outside the plan of ${PLAN_S} s)"
{
    echo "## Tests ($(date -u +%FT%TZ))"
    echo
    echo "$TEST_TABLE"
    echo
    if ((${#SHAPES[@]})); then
        timeout --signal=INT --kill-after=5 "$SUMMARY_S" "$PY" -m bench.device.bench --summarize "$OUT"/*-shape.json
    fi
} | tee "$OUT/summary.md"

stage "done in $(elapsed) s (plan ${PLAN_S} s + summary); files in $OUT:"
ls -la "$OUT"
if ((${#TESTS_FAILED[@]})); then
    echo "test files that failed: ${TESTS_FAILED[*]}"
    exit 1
fi
