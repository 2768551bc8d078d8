#!/usr/bin/env bash
# One device call for the fast path (issues 14, 16): the runtime's GPU tests (parity on the tiny model at TP=1 and
# TP=2, bitwise rows alone and among others, build memory, graphs == eager), the step kernels' GPU tests, the EXL3
# kernel GPU tests the runtime's launcher seams touch, then bench/decode_step.py on the full-shape synthetic rank. Cubins: the carried build/cubins (built here with
# `python3 -m dsv41.kernels.cuda_build --arch sm_90 --out build/cubins --K 2 --K 3 --K 4 --K 5 --K 6 --K 8
# --codebook mul1`), else built on the machine.
#   bash bench/fast_path_gpu.sh OUTDIR     (writes OUTDIR/fast_path_gpu_tests.log, decode_step.{json,png,log})
# The device machine's copy of the tree may carry a stale .git (seen: every JSON of a session named its first
# commit): pass BENCH_COMMIT=<git rev-parse --short HEAD, read here> in the command.
set -o pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || exit 1
t0=$(date +%s)
mark() { echo "fast_path_gpu: $1 at $(( $(date +%s) - t0 )) s"; }
export DSV41_CUBIN_DIR="${DSV41_CUBIN_DIR:-$PWD/build/cubins}"
Ks="--K 2 --K 3 --K 4 --K 5 --K 6 --K 8"
if [ -z "${SKIP_CUBIN_CHECK:-}" ] && ! python3 - <<'PY'
import os, sys, torch
from pathlib import Path
from dsv41.kernels.cuda_build import EXL3_SOURCE, exl3_variants, image_name
folder = Path(os.environ["DSV41_CUBIN_DIR"])
missing = [v for v in exl3_variants(None, [2, 3, 4, 5, 6, 8], ["mul1"])
           if not (folder / image_name(EXL3_SOURCE, v, "sm_90", "cubin")).is_file()]
if missing:
    sys.exit(f"{len(missing)} cubins missing in {folder}")
from dsv41.kernels.exl3.cuda import kernels_for
for K in (2, 3, 4, 5, 6, 8):
    kernels_for(torch.device("cuda"), K, "mul1")
print("carried cubins load")
PY
then
  export DSV41_CUBIN_DIR=/tmp/cubins
  python3 -m dsv41.kernels.cuda_build --arch sm_90 --out "$DSV41_CUBIN_DIR" --jobs "$(nproc)" $Ks --codebook mul1 || exit 1
fi
mark cubins
# RUNTIME_TESTS / KERNEL_TESTS: the test files (or nothing) to run, for calls that must stay short
timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu -q -s -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} \
  ${RUNTIME_TESTS-tests/test_runtime_build.py tests/test_runtime_fast.py tests/test_runtime_fast_tp.py
    tests/test_runtime_fast_engine.py tests/test_runtime_prefill_core.py tests/test_runtime_moe_prefill.py
    tests/test_runtime_pool_attention.py
    $(ls tests/test_kernels_step_*.py tests/test_runtime_graphs.py 2>/dev/null)} 2>&1 \
  | tee "$out/fast_path_gpu_tests.log"
tests_rc=$?
kernel_rc=0
if [ -n "${KERNEL_TESTS-tests/test_exl3_cuda.py}" ]; then
  timeout "${KERNEL_TESTS_TIMEOUT:-90}" python3 -m pytest -m gpu -q -p no:cacheprovider ${KERNEL_TESTS-tests/test_exl3_cuda.py} \
    -k "(pack_shapes and mul1) or (cuda_moe and mul1) or chained" 2>&1 | tail -3 | tee -a "$out/fast_path_gpu_tests.log"
  kernel_rc=$?
fi
mark tests
BENCH_COMMIT="${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" timeout "${BENCH_TIMEOUT:-330}" \
  python3 bench/decode_step.py --out "$out/decode_step.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/decode_step.log"
bench_rc=$?
mark bench
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
[ "$kernel_rc" -ne 0 ] && exit "$kernel_rc"
exit "$bench_rc"
