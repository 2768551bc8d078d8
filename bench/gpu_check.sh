#!/usr/bin/env bash
# One call on a GPU machine: every GPU test, then the EXL3 kernel benchmark.
#   bash bench/gpu_check.sh [OUTDIR]      (default bench/results; BENCH_COMMIT=<sha> names the code measured,
#                                          BENCH_ARGS=--sweep adds the split-count and MoE-config sweeps)
# Writes OUTDIR/gpu_tests.log, OUTDIR/exl3_kernels.{json,png,log}. Exit status: the tests' (the benchmark's if they
# passed). The golden EXL3 layers are read from ../shared/fixtures/exl3 when present.
set -o pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
commit="${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || exit 1
# only the modules that have GPU tests: the others import the server stack, which the GPU machine need not have
mapfile -t gpu_modules < <(grep -l "pytest.mark.gpu" tests/*.py)
python3 -m pytest -m gpu -q -p no:cacheprovider "${gpu_modules[@]}" 2>&1 | tee "$out/gpu_tests.log"
tests_rc=$?
BENCH_COMMIT="$commit" python3 bench/exl3_kernels.py --out "$out/exl3_kernels.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/exl3_kernels.log"
bench_rc=$?
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
exit "$bench_rc"
