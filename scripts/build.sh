#!/usr/bin/env bash
# Configures and builds into ${BUILD_DIR:-build}. CUDA kernels are built when nvcc is found
# (sm_90a unless TRAINSCALE_CUDA_ARCHS says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTRAINSCALE_CUDA_ARCHS="${TRAINSCALE_CUDA_ARCHS:-90a}" \
  -DTRAINSCALE_WARNINGS_AS_ERRORS="${TRAINSCALE_WARNINGS_AS_ERRORS:-ON}" ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
