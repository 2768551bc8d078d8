#!/usr/bin/env bash
# Wheels of what the GPU image lacks (docs: the device tool's package list): the server stack, xgrammar, the
# official openai client and jsonschema, for the GPU server test. Run here (PyPI reachable); .whl/ is git-ignored
# and carried to the GPU machine, where bench/gpu_check.sh installs it. The versions are the lock file's.
set -euo pipefail
cd "$(dirname "$0")/.."
lock="${LOCK:-requirements/dev.lock}"
names=(starlette hypercorn h2 hpack hyperframe priority wsproto pydantic pydantic-core annotated-types
       typing-inspection xgrammar apache-tvm-ffi openai jiter sniffio httpx2 httpcore2 truststore jsonschema
       jsonschema-specifications referencing rpds-py sdnotify)
pins=()
for n in "${names[@]}"; do
  pin=$(grep -i -E "^${n//-/[-_]}==" "$lock" | head -1 | cut -d' ' -f1 || true)
  [ -n "$pin" ] || { echo "fetch_gpu_wheels: $n is not in $lock" >&2; exit 1; }
  pins+=("$pin")
done
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pin in "${pins[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "$pin" 2>/dev/null || python3 -m pip wheel -q --no-deps -w .whl "$pin"   # sdist-only (sdnotify)
done
ls .whl
