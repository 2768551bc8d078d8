#!/usr/bin/env bash
# One device call of a work round: the GPU tests named in $TESTS, then each line of $BENCH as a command, each part
# under its own timeout, everything logged to OUTDIR; prints how long each part took.
#   TESTS="tests/a.py::test_x tests/b.py" BENCH=$'python3 bench/x.py --out $OUT/x.json\n...' \
#     BENCH_COMMIT=<sha> bash bench/device_round.sh OUTDIR
# Cubins: the carried build/cubins (built here: `python3 -m dsv41.kernels.cuda_build --arch sm_90 --out build/cubins
# --jobs 2`, then `carry: ["build/cubins"]`), else built on the machine into build/cubins (kept while it is warm). Wheels of what the image lacks: .whl/
# (bench/fetch_gpu_wheels.sh) when carried. TESTS_TIMEOUT (default 300 s) and BENCH_TIMEOUT (default 240 s a line).
# The machine's copy of the tree may carry a stale .git: pass BENCH_COMMIT (git rev-parse --short HEAD, read here).
# PACK=1: everything under OUTDIR packed into OUTDIR/round.tgz at the end (the device tool brings back only a few
# files of a call: 5 of a round's 12 were left out once, the test log among them).
set -o pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results}}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export BENCH_COMMIT="${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$out/gpu.txt" || exit 1
t0=$(date +%s)
mark() { echo "device_round: $1 at $(( $(date +%s) - t0 )) s" | tee -a "$out/round_times.log"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  site="$(mktemp -d)/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:$site"
fi
arch="sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')"
# built into the tree's (ignored) build/cubins: a warm machine keeps it for the next call of the session
export DSV41_CUBIN_DIR="$PWD/build/cubins"
if ! compgen -G "$DSV41_CUBIN_DIR/*$arch*" >/dev/null; then
  python3 -m dsv41.kernels.cuda_build --arch "$arch" --out "$DSV41_CUBIN_DIR" --jobs "$(nproc)" || exit 1
fi
if [ "$arch" = sm_90 ] && ! compgen -G "$DSV41_CUBIN_DIR/*sm_90a*" >/dev/null; then
  # Hopper's own image (the wgmma prefill tiles, DSV41_PREFILL_WGMMA): the pack's expert K (2, 3) and the tests' 8
  python3 -m dsv41.kernels.cuda_build --arch sm_90a --K 2 --K 3 --K 8 --codebook mul1 --out "$DSV41_CUBIN_DIR" \
    --jobs "$(nproc)" || exit 1
fi
mark setup

rc=0
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider $TESTS 2>&1 | tee "$out/gpu_tests.log"
  rc=$?
  mark tests
fi
n=0
while IFS= read -r line; do
  [ -n "$line" ] || continue
  n=$((n + 1))
  echo "device_round: bench $n: $line" | tee -a "$out/round_times.log"
  OUT="$out" timeout "${BENCH_TIMEOUT:-240}" bash -c "$line" 2>&1 | tee "$out/bench_$n.log"
  b=$?
  [ "$b" -ne 0 ] && [ "$rc" -eq 0 ] && rc=$b
  mark "bench $n (rc $b)"
done <<< "${BENCH:-}"
if [ "${PACK:-0}" = 1 ]; then
  tar czf "/tmp/round.$$.tgz" -C "$out" --exclude=round.tgz . && rm -rf "${out:?}"/* "$out"/.start* && \
    mv "/tmp/round.$$.tgz" "$out/round.tgz"
fi
exit "$rc"
