#!/usr/bin/env bash
# On a GPU machine: build with every core, run all tests (GPU ones included), run
# compute-sanitizer memcheck and racecheck over the GPU test binaries, and leave logs in
# $OUT (default /tmp/trainscale-out). SANITIZE lists test binaries (default: every *_cuda_test).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/trainscale-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv | tee "$OUT/gpu.txt"
cmake -S . -B build -G Ninja -DTRAINSCALE_CUDA_ARCHS="${TRAINSCALE_CUDA_ARCHS:-90a}" \
  -DTRAINSCALE_WARNINGS_AS_ERRORS=ON >"$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
cmake --build build -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -E "error" -A3 "$OUT/build.log" | head -60; exit 1; }
ctest --test-dir build -j 4 --output-on-failure >"$OUT/ctest.log" 2>&1
echo "ctest rc=$?"
grep -E "tests passed|tests failed|\(Failed\)|Skipped" "$OUT/ctest.log" | grep -v "_cpu\b" | head -40
for t in ${SANITIZE:-$(cd build/tests && ls *_cuda_test 2>/dev/null)}; do
  for tool in memcheck racecheck; do
    timeout 400 compute-sanitizer --tool "$tool" --error-exitcode 9 "build/tests/$t" \
      >"$OUT/sanitize-$t-$tool.log" 2>&1
    echo "sanitize $t $tool rc=$? $(grep -E 'ERROR SUMMARY|tests? from .* ran|PASSED|FAILED' "$OUT/sanitize-$t-$tool.log" | tr '\n' ' ')"
  done
done
