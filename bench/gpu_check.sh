#!/usr/bin/env bash
# Device check of ckptstore's GPU path (issue 20), in one call that fits well inside a
# 15-minute device lease: no network, no CPU suite. About 7-9 minutes on one GPU.
#
#   bench/gpu_check.sh [--dry-run | --injob-only]
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
#    off FAILS them), CKPTSTORE_GPU_TEST_GIB (default 1) sized;
# 6. in-job restart on the GPU (issue 36), in the INJOB_BUDGET seconds (default 200) kept
#    for it out of GPU_CHECK_BUDGET: tests/test_gpu_injob.py (NCCL: a hung rank aborts and
#    re-forms its group in its process, a killed rank is replaced by the warm spare, both
#    bit-identical; two ranks sharing the GPU over gloo), then bench/bench_goodput.py with
#    NCCL (one rank: NCCL refuses two ranks of a communicator on one GPU; in-job, then the
#    relaunch mode, a SIGKILL every 5 s), then over gloo with CUDA tensors (two ranks) if
#    60 s are left. Each bench stops at SIGINT when its time is up and writes what ran.
#    Results: injob.json (tests' verdict, both benches' tables and runs), injob.log.
#
# Environment: OUT (results; default bench/results/gpu), PYTHON (default python3),
# GPU_CHECK_BUDGET (seconds for everything, default 540: under the device tool's 600 s
# per command), BUILD_TIMEOUT (default 240), GPU_CHECK_ARGS (extra gpu_check.py arguments,
# e.g. "--gib 2"), INJOB_BUDGET (seconds kept for step 6; 0 skips it). Exit status:
# non-zero if a check or a test failed (step 6's benches report, they do not fail it).
# --dry-run: only step 1, gpu_check.py --dry-run and step 6's bench arguments checked
# (bench_goodput.py --dry-run; what the CPU test runs).
# --injob-only: steps 1, 2 and 6 (a session that ran steps 3-5 before), all the budget to 6.
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$REPO/bench/results/gpu}"
PY="${PYTHON:-python3}"
DRY=0
INJOB_ONLY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
[ "${1:-}" = "--injob-only" ] && INJOB_ONLY=1
INJOB_BUDGET="${INJOB_BUDGET:-200}"
# Step 6's benches (bench_goodput.py arguments; --out and the time bound are added).
INJOB_NCCL_ARGS="--modes in-job,relaunch --schedule kill --backend nccl --nproc 1 --steps 80 --kill-every 5 --timeout 60"
INJOB_GLOO_ARGS="--modes in-job --schedule kill --backend gloo --device cuda --nproc 2 --steps 80 --kill-every 5 --timeout 60"
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
  rc_injob=0
  for a in "$INJOB_NCCL_ARGS" "$INJOB_GLOO_ARGS"; do
    # shellcheck disable=SC2086
    "$PY" "$REPO/bench/bench_goodput.py" --dry-run $a >> "$OUT/gpu_check.log" 2>&1 || rc_injob=1
  done
  log "step 6 dry run (rc=$rc_injob): $(grep -c '^would run' "$OUT/gpu_check.log") bench commands"
  [ "$rc" -eq 0 ] && [ "$rc_injob" -eq 0 ]
  exit $?
fi

# One bench_goodput.py run of step 6, when more than MIN s are left (less 5 s), cut at
# that time by SIGINT (the bench then scores and writes what ran).
injob_bench() {
  local min="$1" what="$2" out="$3" limit
  shift 3
  limit=$(( $(left) - 5 ))
  if [ "$limit" -le "$min" ]; then
    log "in-job bench, ${what}: NOT RUN (${limit} s left)"
    return 0
  fi
  log "in-job bench, ${what} (${limit} s): bench_goodput.py $*"
  timeout -s INT -k 15 "$limit" "$PY" "$REPO/bench/bench_goodput.py" "$@" --out "$out" >> "$OUT/injob.log" 2>&1
  log "  rc=$?"
}

# Step 6 (a function: --injob-only runs it alone). Its time: what is left, less 5 s.
injob_step() {
  local limit rc_t nccl_out gloo_out
  nccl_out="$WORK/goodput_nccl.json"; gloo_out="$WORK/goodput_gloo_cuda.json"
  : > "$OUT/injob.log"
  limit=$(( $(left) - 5 ))
  if [ "$limit" -lt 40 ]; then
    log "in-job step: NOT RUN (${limit} s left; INJOB_BUDGET=${INJOB_BUDGET})"
    return 0
  fi
  log "in-job step (budget ${limit} s): tests/test_gpu_injob.py"
  timeout -s INT -k 10 $(( limit * 60 / 100 )) "$PY" -m pytest "$REPO/tests/test_gpu_injob.py" -q -rs -s \
    -p no:cacheprovider > "$WORK/injob_tests.log" 2>&1
  rc_t=$?
  cat "$WORK/injob_tests.log" >> "$OUT/injob.log"
  log "in-job tests (rc=$rc_t): $(tail -1 "$WORK/injob_tests.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)|recovery: " "$WORK/injob_tests.log" | head -12 | tee -a "$OUT/summary.txt"
  # shellcheck disable=SC2086
  injob_bench 40 "NCCL, 1 rank" "$nccl_out" $INJOB_NCCL_ARGS
  injob_bench 60 "gloo with CUDA tensors, 2 ranks" "$gloo_out" $INJOB_GLOO_ARGS
  "$PY" - "$OUT/injob.json" "$WORK/injob_tests.log" "$rc_t" "$nccl_out" "$gloo_out" <<'PYEOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, os, sys
out, tests_log, rc, *benches = sys.argv[1:]
tail = open(tests_log).read().splitlines()[-40:] if os.path.exists(tests_log) else []
report = {"tests": {"rc": int(rc), "tail": tail}}
for name, path in zip(("goodput_nccl", "goodput_gloo_cuda"), benches):
    report[name] = json.load(open(path)) if os.path.exists(path) else None
    if report[name]:
        print(f"{name}:\n{report[name]['table']}\n{report[name].get('breakdown') or ''}")
json.dump(report, open(out, "w"), indent=1, default=str)
PYEOF
  return "$rc_t"
}

reserve=0
[ "$INJOB_BUDGET" -gt 0 ] 2>/dev/null && reserve=$INJOB_BUDGET
if [ "$INJOB_ONLY" = 1 ]; then
  injob_step
  rc_injob=$?
  log "total $(( $(date +%s) - t0 )) s"
  exit $rc_injob
fi

# The extension: the carried build if it imports with its CUDA path, else build it here.
probe='import json; from ckptstore import native; i = native.cuda_info(); print(json.dumps({"native": native.NATIVE, "file": getattr(native._C, "__file__", None), "compiled": i["compiled"], "available": i["available"], "error": i["error"]}))'
if carried=$("$PY" -c "$probe" 2>&1) && echo "$carried" | grep -q '"compiled": true'; then
  log "extension: carried build: $(echo "$carried" | tail -1)"
else
  log "extension: the carried build does not serve ($(echo "$carried" | tail -1 | cut -c1-300)); building here"
  start=$(date +%s)
  limit=$(( $(left) - 300 - reserve )); [ "$limit" -gt "${BUILD_TIMEOUT:-240}" ] && limit=${BUILD_TIMEOUT:-240}
  if [ "$limit" -gt 30 ] && timeout "$limit" "$PY" -m pip wheel --no-build-isolation --no-deps --no-index \
        -w "$WORK/wheel" "$REPO" > "$OUT/build.log" 2>&1 \
      && "$PY" -c "import glob, sys, zipfile; w = glob.glob(sys.argv[1] + '/ckptstore-*.whl')[0]; z = zipfile.ZipFile(w); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith('ckptstore/_C')]" "$WORK/wheel" "$REPO"; then
    log "extension: built here in $(( $(date +%s) - start )) s: $("$PY" -c "$probe" 2>&1 | tail -1)"
  else
    log "extension: build FAILED in $(( $(date +%s) - start )) s (limit ${limit} s); tail of build.log:"
    tail -15 "$OUT/build.log" 2>/dev/null | tee -a "$OUT/summary.txt"
  fi
fi

limit=$(( $(left) - 150 - reserve ))
log "checks (budget ${limit} s):"
"$PY" "$REPO/bench/gpu_check.py" --out "$OUT" --budget "$limit" ${GPU_CHECK_ARGS:-} > "$OUT/gpu_check.log" 2>&1
rc_check=$?
log "gpu_check.py rc=$rc_check (table above in summary.txt; figures in gpu_check.json)"

limit=$(( $(left) - 10 - reserve ))
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

rc_injob=0
if [ "$reserve" -gt 0 ]; then
  injob_step
  rc_injob=$?
fi

log "total $(( $(date +%s) - t0 )) s"
[ "$rc_check" -eq 0 ] && [ "$rc_tests" -eq 0 ] && [ "$rc_injob" -eq 0 ]
