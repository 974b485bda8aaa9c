#!/usr/bin/env bash
# The GPU procedure of docs/gpu-check.md as a user runs it, on this machine (CI: make
# gpu-image-test, in the venv with the GPU image's versions, which has no Ray and no gguf):
#
#   1. scripts/gpu_pack.py pack: the SmolLM2 wheels into gpu-pack/ (needs pip's network);
#   2. device call 1: a fresh copy of the checkout carrying gpu-pack/manifest.json and
#      gpu-pack/part-1 runs `scripts/gpu_pack.py stash`;
#   3. device call 2: another fresh copy carrying gpu-pack/manifest.json and gpu-pack/part-2
#      runs `scripts/gpu_run.sh` (it unpacks the wheels, then runs gpu-check), then
#      `pytest -m gpu` on the gpu test files (they skip without CUDA; collecting them must
#      work without Ray).
#
# A call's copy holds what a device call gets: the files git tracks or does not ignore, plus
# the files it carries (gpu-pack/ is ignored, so only the parts named reach it). The stash
# lives in a temporary folder in place of /tmp/knapspec-pack (KNAPSPEC_PACK_STASH), so that
# runs side by side do not share one.
#
#   PYTHON=.venv-gpu-image/bin/python scripts/gpu_procedure.sh [gpu_run.sh options]
#   (default: --device cpu --quick)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The calls run in other folders: a relative path to the interpreter made absolute (not
# resolved: a venv's python is a link, and resolving it leaves the venv).
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export KNAPSPEC_PACK_STASH=$WORK/stash
unset PYTHONPATH  # as on the device: gpu_run.sh puts the checkout and the wheels on it
[ $# -gt 0 ] || set -- --device cpu --quick

# The checkout as one device call gets it, plus the pack files it carries.
device_copy() {
    local dir=$1
    shift
    mkdir -p "$dir/gpu-pack"
    git ls-files -z --cached --others --exclude-standard |
        tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$dir"
    for name in "$@"; do cp "gpu-pack/$name" "$dir/gpu-pack/"; done
}

start=$SECONDS
"$PY" scripts/gpu_pack.py pack
echo "gpu_procedure: pack $((SECONDS - start)) s"

device_copy "$WORK/call-1" manifest.json part-1
(cd "$WORK/call-1" && "$PY" scripts/gpu_pack.py stash --to "$KNAPSPEC_PACK_STASH")
rm -rf "$WORK/call-1"

device_copy "$WORK/call-2" manifest.json part-2
start=$SECONDS
OUT=$WORK/out PYTHON=$PY bash "$WORK/call-2/scripts/gpu_run.sh" "$@" | tee "$WORK/run.log"
echo "gpu_procedure: gpu_run.sh $((SECONDS - start)) s"
# gpu_run.sh goes on without the wheels (gpu-check then says so); here they must have come.
grep -q '^gpu_run: SmolLM2 wheels in ' "$WORK/run.log" || {
    echo "gpu_procedure: the wheels did not unpack:" >&2
    cat "$WORK/out/unpack.log" >&2
    exit 1
}
test -s "$WORK/out/gpu-check/gpu-check.json"

cd "$WORK/call-2"
PYTHONPATH="$PWD:$KNAPSPEC_PACK_STASH/site" KNAPSPEC_CACHE=$KNAPSPEC_PACK_STASH/cache \
    "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_check.py
