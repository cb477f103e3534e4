#!/usr/bin/env bash
# For a GPU host without network access (see gpu_host_build.sh): build, run all tests (GPU ones
# included) and the Python GPU tests, then compute-sanitizer memcheck and racecheck over the GPU
# test binaries. A summary goes to stdout, the logs to $OUT/check-logs.tgz (one file to copy back).
# SANITIZE lists test binaries (default: every *_cuda_test but large_tensor_cuda_test, whose
# kernels the others run at smaller sizes and whose 4-46 GB tensors would take the sanitizers
# minutes; name it to include it); SANITIZE_TIMEOUT caps each run.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_host_build.sh
logs=$OUT/logs
mkdir -p "$logs"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
start=$SECONDS
ctest --test-dir build -j 4 --output-on-failure >"$logs/ctest.log" 2>&1
echo "ctest rc=$? ($((SECONDS - start)) s)"
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|\(SEGFAULT\)" "$logs/ctest.log" | head -40
if [ -f build/pypkg/trainscale/_C.so ]; then
  echo "_C.so: $(nm -DC --defined-only build/pypkg/trainscale/_C.so | grep -c ' std::.*::id$') libstdc++ locale ids defined (0 expected)"
  start=$SECONDS
  (cd build && python3 -m pytest -q -rs -p no:cacheprovider ../python/tests) >"$logs/pytest.log" 2>&1
  echo "pytest rc=$? ($((SECONDS - start)) s): $(tail -1 "$logs/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$logs/pytest.log" | head -20
fi
for t in ${SANITIZE:-$(cd build/tests && ls *_cuda_test 2>/dev/null | grep -v '^large_tensor_cuda_test$')}; do
  for tool in memcheck racecheck; do
    timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 "build/tests/$t" \
      >"$logs/sanitize-$t-$tool.log" 2>&1
    echo "sanitize $t $tool rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$logs/sanitize-$t-$tool.log" | tr '\n' ' ' | cut -c1-200)"
    # the kernels racecheck's hazards are in (cuBLASLt's split-K kernels report some: docs/adding-an-op.md)
    grep -oE '(Read|Write) Thread \([0-9,]+\) at [A-Za-z_0-9]+' "$logs/sanitize-$t-$tool.log" | sed 's/.* at //' |
      sort | uniq -c | sed 's/^/  hazards in /'
  done
done
(cd "$OUT" && tar -czf check-logs.tgz logs $(ls configure.log build.log 2>/dev/null)) && rm -rf "$logs"
