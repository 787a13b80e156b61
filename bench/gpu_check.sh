#!/usr/bin/env bash
# GPU check, in one go (a few minutes on one GPU): build and install the extension,
# run the GPU tests, the CPU tests of the native module and the GPU benchmark.
#
#   bench/gpu_check.sh
#
# Environment:
#   OUT                     where results go (default bench/results/gpu); summary.txt first
#   PYTHON                  interpreter (default python); needs torch with CUDA, and for the
#                           build scikit-build-core, nanobind, cmake, a C++ compiler and,
#                           for the native CUDA path, nvcc >= 12.0 (no network is needed)
#   CKPTSTORE_GPU_TEST_GIB  size of the large mixed-size GPU test (default 3)
#   GPU_BENCH_GIB           size of the mixed-size GPU benchmark (default 4)
#   CMAKE_ARGS              passed to CMake, e.g. -DCMAKE_CUDA_ARCHITECTURES=90
#   CKPTSTORE_STAGING_POOL  pool of the save path (default here: auto = native when usable)
#
# If the build fails, the tests and the benchmark still run, from the source tree, on
# the torch fallback; summary.txt says so. Exit status: non-zero if a test or the
# benchmark failed.
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$REPO/bench/results/gpu}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/summary.txt"
log() { echo "[gpu_check] $*" | tee -a "$OUT/summary.txt"; }
t0=$(date +%s)

{
  nvidia-smi || echo "nvidia-smi: not found"
  if command -v nvcc >/dev/null; then nvcc --version; else echo "nvcc: not found"; fi
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count())"
  nproc
} > "$OUT/env.txt" 2>&1
log "machine: $(grep -m1 -o 'Driver Version: [0-9.]*' "$OUT/env.txt" || echo 'no driver'); $(grep -m1 '^torch' "$OUT/env.txt")"

start=$(date +%s)
if (cd "$REPO" && "$PY" -m pip install --no-build-isolation --no-deps -v .) > "$OUT/build.log" 2>&1; then
  log "build: ok in $(( $(date +%s) - start )) s; $(grep -m1 -o 'ckptstore: CUDA staging path: [A-Z]*' "$OUT/build.log")"
  SRC_PATH=""
else
  log "build: FAILED in $(( $(date +%s) - start )) s (tail of build.log below); testing the torch fallback"
  tail -20 "$OUT/build.log" | tee -a "$OUT/summary.txt"
  SRC_PATH="$REPO"
fi

# The save path's pool: auto (the native pinned pool when usable) unless told otherwise.
export CKPTSTORE_STAGING_POOL="${CKPTSTORE_STAGING_POOL:-auto}"

WORK="$(mktemp -d)"
cd "$WORK"  # outside the source tree, so that the installed package (with _C) is imported
py() { PYTHONPATH="$SRC_PATH" "$PY" "$@"; }

py -c "import json, torch; from ckptstore import native; print(json.dumps({'native': native.NATIVE, 'cuda_info': native.cuda_info(), 'torch_cuda': torch.cuda.is_available()}))" \
  > "$OUT/native.txt" 2>&1
log "native: $(tail -1 "$OUT/native.txt")"

py -m pytest "$REPO/tests/test_gpu.py" -m gpu -q -rs -p no:cacheprovider --durations=10 \
  --junitxml "$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
rc_gpu=$?
log "gpu tests (rc=$rc_gpu): $(tail -1 "$OUT/gpu_tests.log")"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"

timeout 600 env PYTHONPATH="$SRC_PATH" "$PY" -m pytest "$REPO/tests/test_native.py" "$REPO/tests/test_staging.py" \
  -q -p no:cacheprovider > "$OUT/cpu_tests.log" 2>&1
rc_cpu=$?
log "native/staging tests (rc=$rc_cpu): $(tail -1 "$OUT/cpu_tests.log")"

timeout 900 env PYTHONPATH="$SRC_PATH" "$PY" "$REPO/bench/bench_native.py" --no-cpu \
  --gpu-gib "${GPU_BENCH_GIB:-4}" --repeats 3 --dir "$WORK" --out "$OUT/native_gpu.json" > "$OUT/bench.log" 2>&1
rc_bench=$?
log "gpu bench (rc=$rc_bench):"
cat "$OUT/bench.log" | tee -a "$OUT/summary.txt"

rm -rf "$WORK"
log "total $(( $(date +%s) - t0 )) s"
[ "$rc_gpu" -eq 0 ] && [ "$rc_cpu" -eq 0 ] && [ "$rc_bench" -eq 0 ]
