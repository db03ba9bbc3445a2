#!/usr/bin/env bash
# The GPU path's proof, in one run on a single H200 (well under 8 minutes): the CUDA tests (greedy equal to
# HF on the device, graphs captured and equal to eager steps, KV sized from device memory, bf16 default),
# then `bench engine` against HF continuous batching on the SmolLM2-135M shape and on a ~1.1B Llama
# (random weights, made on the device). Tables, JSON, PNG and the whole log go to $OUT.
#
# Before the device call, here in the repo root (the device machine cannot reach PyPI; its image has
# transformers 5.17, the project is tested with 5.24, and 5.24 pins regex >= 2025.10.22):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl transformers==5.24.0 regex==2026.11.19
# Then one device call:  command "bash bench/device_check.sh", carry [".whl"], timeout_s 540.
# Dry run of everything but the GPU on any machine:  DEVICE=cpu SMALL=1 OUT=/tmp/dc bash bench/device_check.sh
set -uo pipefail

START=$(date +%s)
OUT=${OUT:-$PWD/device-check-out}
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
PY=${PYTHON:-python3}
PLAN_S=${PLAN_S:-460}  # seconds this script plans to use in all; stages are cut to fit
MODELS=${MODELS:-/tmp/inferq-models}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_check.log") 2>&1

elapsed() { echo $(($(date +%s) - START)); }
stage() { echo; echo "=== [$(elapsed) s] $*"; }
# run_for SECONDS CMD...: at most SECONDS, and never past the plan; a stage that times out is reported.
run_for() {
    local limit=$1 left
    shift
    left=$((PLAN_S - $(elapsed)))
    if ((left < 15)); then
        echo "skipped (out of time): $*"
        return 124
    fi
    ((limit > left)) && limit=$left
    timeout --signal=INT --kill-after=15 "$limit" "$@"
    local code=$?
    ((code == 124)) && echo "TIMED OUT after ${limit} s: $*"
    return $code
}

stage "machine"
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
print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda {cuda}",
      torch.cuda.get_device_name() if cuda else "")
EOF

if [[ $SMALL == 1 ]]; then  # the dry run: tiny models, a few requests, one repetition
    DTYPE=float32 REQUESTS=8 SEQS=8 REPS=1 SMALL_MODELS=(--small) STEP_TIME=(--no-step-time) KV=()
else
    DTYPE=${DTYPE:-bfloat16} REQUESTS=256 SEQS=256 REPS=2 SMALL_MODELS=() STEP_TIME=() KV=(--kv-cache-gib 24)
fi
[[ $DEVICE == cpu ]] && DTYPE=float32

stage "tests: the CUDA path on the device, gold (greedy = HF) and the CUDA-step logic"
run_for 170 "$PY" -m pytest tests/gpu/test_cuda_device.py tests/gpu/test_cuda_path.py tests/gpu/test_gold.py \
    -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt"

stage "random-weight models (SmolLM2-135M shape, ~1.1B Llama) on $DEVICE in $DTYPE"
run_for 90 "$PY" -m bench.device_models "$MODELS" --device "$DEVICE" --dtype "$DTYPE" "${SMALL_MODELS[@]}"

bench() {  # bench NAME SECONDS
    local name=$1 seconds=$2
    stage "bench engine: $name, hf_cb vs inferq on $DEVICE ($DTYPE), $REQUESTS requests"
    run_for "$seconds" "$PY" -m bench.engine --device "$DEVICE" --dtype "$DTYPE" --model "$MODELS/$name" \
        --only hf_cb,inferq,limit --requests "$REQUESTS" --max-num-seqs "$SEQS" --max-batched-tokens 2048 \
        --hf-max-batch-tokens 2048 --threads 4 --reps "$REPS" "${KV[@]}" "${STEP_TIME[@]}" \
        --json "$OUT/$name.json"
}
bench smollm2-135m-shape 140
bench llama-1.1b-shape 150

stage "done in $(elapsed) s; files in $OUT:"
ls -la "$OUT"
