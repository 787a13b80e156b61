#!/usr/bin/env bash
# Device check of ckptstore's GPU path (issue 20), in one call that fits well inside a
# 15-minute device lease: no network, no CPU suite. About 5-8 minutes on one GPU.
#
#   bench/gpu_check.sh [--dry-run]
#
# 1. records the machine (nvidia-smi, nvcc, torch) in env.txt;
# 2. installs carried wheels (.whl/*.whl, e.g. zstandard, which the device image lacks)
#    into a private folder;
# 3. uses the extension carried in the tree (ckptstore/_C*.so, built on the build machine
#    for the device's Python) when it imports and its CUDA path is compiled; else builds
#    it here (no nvcc needed: the CUDA path uses the driver API) within BUILD_TIMEOUT;
# 4. runs bench/gpu_check.py: driver, torch CUDA, cuda_info(), the native path on, and
#    checks a-h with real data (gpu_check.json, summary table);
# 5. runs tests/test_gpu.py and tests/test_gpu_native.py (a GPU node whose native path is
#    off FAILS them), CKPTSTORE_GPU_TEST_GIB (default 1) sized.
#
# Environment: OUT (results; default bench/results/gpu), PYTHON (default python3),
# GPU_CHECK_BUDGET (seconds for everything, default 540: under the device tool's 600 s
# per command), BUILD_TIMEOUT (default 240), GPU_CHECK_ARGS (extra gpu_check.py arguments,
# e.g. "--gib 2"). Exit status: non-zero if a check or a test failed.
# --dry-run: only step 1 and gpu_check.py --dry-run (what the CPU test runs).
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$REPO/bench/results/gpu}"
PY="${PYTHON:-python3}"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/summary.txt"
log() { echo "[gpu_check] $*" | tee -a "$OUT/summary.txt"; }
t0=$(date +%s)
deadline=$(( t0 + ${GPU_CHECK_BUDGET:-540} ))
left() { echo $(( deadline - $(date +%s) )); }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

{
  nvidia-smi || echo "nvidia-smi: not found"
  if command -v nvcc >/dev/null; then nvcc --version; else echo "nvcc: not found"; fi
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count())"
  nproc
} > "$OUT/env.txt" 2>&1
log "machine: $(grep -m1 -o 'Driver Version: [0-9.]*' "$OUT/env.txt" || echo 'no driver'); $(grep -m1 '^python' "$OUT/env.txt")"

# Carried wheels (pure installs into a private folder; nothing else on the machine changes).
SITE=""
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$REPO"/.whl/*.whl \
      > "$WORK/wheels.log" 2>&1; then
    SITE="$WORK/site"
    log "wheels: $(cd "$REPO/.whl" && ls *.whl | tr '\n' ' ')"
  else
    log "wheels: install FAILED: $(tail -3 "$WORK/wheels.log")"
  fi
fi
export PYTHONPATH="$REPO${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
cd "$WORK"  # nothing shadows the package from the current directory

if [ "$DRY" = 1 ]; then
  "$PY" "$REPO/bench/gpu_check.py" --dry-run --out "$OUT" > "$OUT/gpu_check.log" 2>&1
  rc=$?
  log "dry run (rc=$rc): $(tail -1 "$OUT/gpu_check.log")"
  exit $rc
fi

# The extension: the carried build if it imports with its CUDA path, else build it here.
probe='import json; from ckptstore import native; i = native.cuda_info(); print(json.dumps({"native": native.NATIVE, "file": getattr(native._C, "__file__", None), "compiled": i["compiled"], "available": i["available"], "error": i["error"]}))'
if carried=$("$PY" -c "$probe" 2>&1) && echo "$carried" | grep -q '"compiled": true'; then
  log "extension: carried build: $(echo "$carried" | tail -1)"
else
  log "extension: the carried build does not serve ($(echo "$carried" | tail -1 | cut -c1-300)); building here"
  start=$(date +%s)
  limit=$(( $(left) - 300 )); [ "$limit" -gt "${BUILD_TIMEOUT:-240}" ] && limit=${BUILD_TIMEOUT:-240}
  if [ "$limit" -gt 30 ] && timeout "$limit" "$PY" -m pip wheel --no-build-isolation --no-deps --no-index \
        -w "$WORK/wheel" "$REPO" > "$OUT/build.log" 2>&1 \
      && "$PY" -c "import glob, sys, zipfile; w = glob.glob(sys.argv[1] + '/ckptstore-*.whl')[0]; z = zipfile.ZipFile(w); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith('ckptstore/_C')]" "$WORK/wheel" "$REPO"; then
    log "extension: built here in $(( $(date +%s) - start )) s: $("$PY" -c "$probe" 2>&1 | tail -1)"
  else
    log "extension: build FAILED in $(( $(date +%s) - start )) s (limit ${limit} s); tail of build.log:"
    tail -15 "$OUT/build.log" 2>/dev/null | tee -a "$OUT/summary.txt"
  fi
fi

limit=$(( $(left) - 150 ))
log "checks (budget ${limit} s):"
"$PY" "$REPO/bench/gpu_check.py" --out "$OUT" --budget "$limit" ${GPU_CHECK_ARGS:-} > "$OUT/gpu_check.log" 2>&1
rc_check=$?
log "gpu_check.py rc=$rc_check (table above in summary.txt; figures in gpu_check.json)"

limit=$(( $(left) - 10 ))
if [ "$limit" -gt 30 ]; then
  CKPTSTORE_GPU_TEST_GIB="${CKPTSTORE_GPU_TEST_GIB:-1}" timeout "$limit" "$PY" -m pytest \
    "$REPO/tests/test_gpu_native.py" "$REPO/tests/test_gpu.py" -q -rs -p no:cacheprovider --durations=5 \
    > "$OUT/gpu_tests.log" 2>&1
  rc_tests=$?
  log "gpu tests (rc=$rc_tests): $(tail -1 "$OUT/gpu_tests.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | head -30 | tee -a "$OUT/summary.txt"
else
  rc_tests=1
  log "gpu tests: NOT RUN (time budget spent)"
fi

log "total $(( $(date +%s) - t0 )) s"
[ "$rc_check" -eq 0 ] && [ "$rc_tests" -eq 0 ]
