#!/usr/bin/env bash
# Builds and runs the benchmark suite: on a GPU the given suite (default: llama), on a machine
# without one the CPU reference through the same engine (smoke suite). Extra arguments go to
# trainscale-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
bench="${BUILD_DIR:-build}/tools/trainscale-bench/trainscale-bench"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  suite=${SUITE:-llama}
else
  suite=${SUITE:-smoke}
fi
exec "$bench" --suite "$suite" "$@"
