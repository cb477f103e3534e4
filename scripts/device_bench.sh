#!/usr/bin/env bash
# On a lent GPU machine (no network, no .git): builds if needed and runs one benchmark into
# $OUT/<name>.json and .md, e.g.
#   TRAINSCALE_GIT_COMMIT=<sha> bash scripts/device_bench.sh norms quack,dsv3,llama \
#       rmsnorm_forward,rmsnorm_backward,fused_add_rmsnorm_forward,layernorm_forward,layernorm_backward
# Builds through device_build.sh (cuDNN baselines when the frontend wheel is carried).
# The run is stopped with SIGINT after ${BENCH_SECONDS:-500} s so partial results are written.
set -uo pipefail
cd "$(dirname "$0")/.."
name=$1 suites=$2 ops=${3:-}
OUT=${OUT:-/tmp/trainscale-out}
mkdir -p "$OUT"
source scripts/device_build.sh
bench=build/tools/trainscale-bench/trainscale-bench
filter=()
[ -n "$ops" ] && filter=(--ops "$ops")
timeout -s INT "${BENCH_SECONDS:-500}" "$bench" --suite "$suites" "${filter[@]}" \
  --json "$OUT/$name.json" --md "$OUT/$name.md" >"$OUT/$name.txt" 2>"$OUT/$name.err"
echo "$name rc=$?"
grep -E "GB/s|TFLOP|FAILED|UNSUPPORTED" "$OUT/$name.txt" | cut -c1-150 | tail -60
