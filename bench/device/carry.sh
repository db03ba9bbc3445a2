#!/usr/bin/env bash
# The wheels bench/device_check.sh needs on the GPU machine (no network there), downloaded here into .whl/
# (ignored by git, carried by the device call): the whole set of bench/device/image.py's CARRIED, for the
# image's Python 3.12 on x86-64, then a check that the working tree plus the wheels fit the device call's
# 64 MiB. Run from the repo root:  bash bench/device/carry.sh   (exit 1: a download failed or it does not fit)
set -euo pipefail

LIMIT=$((64 * 1024 * 1024))
PY=${PYTHON:-python3}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
rm -rf .whl
mapfile -t WANTED < <("$PY" -m bench.device.image)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WANTED[@]}"

got=$(find .whl -type f -name '*.whl' | wc -l)
if ((got != ${#WANTED[@]})); then
    echo "expected ${#WANTED[@]} wheels, got $got" >&2
    exit 1
fi
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "carry set: $got wheels, $((wheels / 1024)) KiB; working tree $((tree / 1024)) KiB;" \
    "together $(((wheels + tree) * 100 / LIMIT))% of 64 MiB"
if ((wheels + tree > LIMIT)); then
    echo "too large for one device call (64 MiB)" >&2
    exit 1
fi
