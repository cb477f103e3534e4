#!/usr/bin/env bash
# On a lent GPU machine (no network, no .git): builds if needed and runs one benchmark into
# $OUT/<name>.json and .md, e.g.
#   TRAINSCALE_GIT_COMMIT=<sha> bash scripts/device_bench.sh norms quack,dsv3,llama \
#       rmsnorm_fwd,rmsnorm_bwd,fused_add_rmsnorm_fwd,layernorm_fwd,layernorm_bwd
# A carried .whl/nvidia_cudnn_frontend-*.whl enables the cuDNN baselines (docs/benchmarking.md).
# The run is stopped with SIGINT after ${BENCH_SECONDS:-500} s so partial results are written.
set -uo pipefail
cd "$(dirname "$0")/.."
name=$1 suites=$2 ops=${3:-}
OUT=${OUT:-/tmp/trainscale-out}
mkdir -p "$OUT"
cmake_args=(-DTRAINSCALE_CUDA_ARCHS="${TRAINSCALE_CUDA_ARCHS:-90a}")
if compgen -G ".whl/nvidia_cudnn_frontend-*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/nvidia_cudnn_frontend-*.whl || exit 1
  cudnn_dir=$(python3 -c "import nvidia.cudnn as m; print(list(m.__path__)[0])")
  export TRAINSCALE_CUDNN_LIB_DIR=$cudnn_dir/lib
  cmake_args+=(-DTRAINSCALE_CUDNN_FRONTEND_INCLUDE=/tmp/site/include
               -DTRAINSCALE_CUDNN_INCLUDE="$cudnn_dir/include")
fi
bench=build/tools/trainscale-bench/trainscale-bench
if [ ! -x "$bench" ]; then
  cmake -S . -B build -G Ninja "${cmake_args[@]}" >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build build -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -E "error" -A3 "$OUT/build.log" | head -40; exit 1; }
fi
grep -h "cuDNN baselines" "$OUT/configure.log" 2>/dev/null
filter=()
[ -n "$ops" ] && filter=(--ops "$ops")
timeout -s INT "${BENCH_SECONDS:-500}" "$bench" --suite "$suites" "${filter[@]}" \
  --json "$OUT/$name.json" --md "$OUT/$name.md" >"$OUT/$name.txt" 2>"$OUT/$name.err"
echo "$name rc=$?"
grep -E "GB/s|TFLOP|FAILED|UNSUPPORTED" "$OUT/$name.txt" | cut -c1-150 | tail -60
