#!/usr/bin/env bash
# One call on a fresh GPU machine, inside its 10-minute limit: build every CUDA kernel variant in parallel, run every
# GPU test (the server on the GPU included), then the EXL3 kernel benchmark; print how long each part took.
#   bash bench/gpu_check.sh [OUTDIR]      (default bench/results; BENCH_COMMIT=<sha> names the code measured,
#                                          BENCH_ARGS=--sweep adds the split-count and MoE-config sweeps,
#                                          SKIP_BENCH=1 stops after the tests)
# Python packages the GPU image lacks (the server stack and the openai client, for the GPU server test) are taken
# from the wheels in $DSV41_WHEELS (default .whl/, made here by bench/fetch_gpu_wheels.sh) when that folder exists.
# Writes OUTDIR/gpu_tests.log, OUTDIR/exl3_kernels.{json,png,log}, OUTDIR/gpu_check_times.json. Exit status: the
# build's, else the tests', else the benchmark's. The golden EXL3 layers are read from ../shared/fixtures/exl3 when
# present.
set -o pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
commit="${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader || exit 1
took=""
t0=$(date +%s)
mark() { local s=$(( $(date +%s) - t0 )); took="$took $1=$s"; t0=$(date +%s); echo "gpu_check: $1 took $s s"; }

wheels="${DSV41_WHEELS:-.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  site="$(mktemp -d)/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:$site"
fi
mark wheels

# Every (K, codebook) variant for this GPU, compiled by all cores at once; the tests and the benchmark then load
# them from DSV41_CUBIN_DIR instead of compiling one at a time on first use.
arch="sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')"
export DSV41_CUBIN_DIR="${DSV41_CUBIN_DIR:-$(mktemp -d)/cubins}"
python3 -m dsv41.kernels.cuda_build --arch "$arch" --out "$DSV41_CUBIN_DIR" --jobs "$(nproc)" || exit 1
mark cubins

# Only the modules that have GPU tests: the others need the whole CPU test stack.
mapfile -t gpu_modules < <(grep -l "pytest.mark.gpu" tests/*.py)
python3 -m pytest -m gpu -q -p no:cacheprovider "${gpu_modules[@]}" 2>&1 | tee "$out/gpu_tests.log"
tests_rc=$?
mark gpu_tests

bench_rc=0
if [ -z "${SKIP_BENCH:-}" ]; then
  BENCH_COMMIT="$commit" python3 bench/exl3_kernels.py --out "$out/exl3_kernels.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$out/exl3_kernels.log"
  bench_rc=$?
  mark benchmark
fi

python3 - "$out/gpu_check_times.json" "$commit" $took <<'EOF'
import json, sys
path, commit, *pairs = sys.argv[1:]
times = {k: int(v) for k, v in (p.split("=") for p in pairs)}
json.dump({"commit": commit, "seconds": times, "total": sum(times.values())}, open(path, "w"), indent=1)
print("gpu_check: seconds", times, "total", sum(times.values()))
EOF
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
exit "$bench_rc"
