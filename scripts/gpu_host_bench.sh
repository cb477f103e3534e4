#!/usr/bin/env bash
# For a GPU host without network access (see gpu_host_build.sh): builds if needed and runs one
# benchmark (suites, optionally ops and implementations) into $OUT/<name>.json and .md, ready
# to be committed as bench/results/<gpu>/<name>.*; TRAINSCALE_GIT_COMMIT tells a tree without
# .git its commit, e.g.
#   TRAINSCALE_GIT_COMMIT=<sha> bash scripts/gpu_host_bench.sh norms quack,dsv3,llama \
#       rmsnorm_forward,rmsnorm_backward,fused_add_rmsnorm_forward,layernorm_forward,layernorm_backward
# A fourth argument names the implementations (--impl), e.g. to time opt-ins beside ours:
#   bash scripts/gpu_host_bench.sh ns-splits llama newton_schulz trainscale,trainscale-blocks-2
# Builds through gpu_host_build.sh (cuDNN baselines when the frontend wheel is carried).
# The run is stopped with SIGINT after ${BENCH_SECONDS:-500} s so partial results are written.
set -uo pipefail
cd "$(dirname "$0")/.."
name=$1 suites=$2 ops=${3:-} impls=${4:-}
OUT=${OUT:-/tmp/trainscale-out}
mkdir -p "$OUT"
source scripts/gpu_host_build.sh
bench=build/tools/trainscale-bench/trainscale-bench
filter=()
[ -n "$ops" ] && filter=(--ops "$ops")
[ -n "$impls" ] && filter+=(--impl "$impls")
timeout -s INT "${BENCH_SECONDS:-500}" "$bench" --suite "$suites" "${filter[@]}" \
  --json "$OUT/$name.json" --md "$OUT/$name.md" >"$OUT/$name.txt" 2>"$OUT/$name.err"
echo "$name rc=$?"
grep -E "GB/s|TFLOP|FAILED|UNSUPPORTED" "$OUT/$name.txt" | cut -c1-150 | tail -60
