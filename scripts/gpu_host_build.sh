#!/usr/bin/env bash
# For a GPU host without network access, given a copy of the source tree without .git, with
# any Python packages it needs carried in as wheels under .whl/. Configures and builds
# everything once into build/ with every core — library, tests, trainscale-bench, and the
# PyTorch extension when torch imports — and stages the Python package in build/pypkg (put it on
# PYTHONPATH). .whl/nvidia_cudnn_frontend-*.whl, when present, enables the cuDNN baselines
# (docs/benchmarking.md); .whl/nvidia_cutlass-*.whl the attention kernels (without it they are left
# out). Logs go to $OUT (default /tmp/trainscale-out).
# Sourced by gpu_host_check.sh and gpu_host_bench.sh; a second call reuses the build.
# TRAINSCALE_BUILD_TARGET=<target> builds only that target (e.g. trainscale-bench).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/trainscale-out}
mkdir -p "$OUT"
cmake_args=(-G Ninja -DTRAINSCALE_CUDA_ARCHS="${TRAINSCALE_CUDA_ARCHS:-90a}" -DTRAINSCALE_WARNINGS_AS_ERRORS=ON)
if compgen -G ".whl/nvidia_cudnn_frontend-*.whl" >/dev/null && [ ! -d /tmp/site/include ]; then
  cudnn_wheels=()
  for w in .whl/*.whl; do [[ $(basename "$w") == nvidia_cutlass-* ]] || cudnn_wheels+=("$w"); done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "${cudnn_wheels[@]}" || return 1 2>/dev/null || exit 1
fi
# .whl/nvidia_cutlass-*.whl: the CUTLASS/CuTe headers of the Hopper attention kernels, installed
# on their own (with or without the cuDNN wheels) into /tmp/site/cutlass_library.
if compgen -G ".whl/nvidia_cutlass-*.whl" >/dev/null && [ ! -d /tmp/site/cutlass_library ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/nvidia_cutlass-*.whl || return 1 2>/dev/null || exit 1
fi
if [ -d /tmp/site/cutlass_library/source/include ]; then
  cmake_args+=(-DTRAINSCALE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include)
fi
if [ -d /tmp/site/include ]; then
  cudnn_dir=$(python3 -c "import nvidia.cudnn as m; print(list(m.__path__)[0])")
  export TRAINSCALE_CUDNN_LIB_DIR=$cudnn_dir/lib
  cmake_args+=(-DTRAINSCALE_CUDNN_FRONTEND_INCLUDE=/tmp/site/include
               -DTRAINSCALE_CUDNN_INCLUDE="$cudnn_dir/include")
fi
python3 -c "import torch" 2>/dev/null && cmake_args+=(-DTRAINSCALE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)")
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build "${cmake_args[@]}" >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
fi
start=$SECONDS
cmake --build build -j "$(nproc)" ${TRAINSCALE_BUILD_TARGET:+--target "$TRAINSCALE_BUILD_TARGET"} >"$OUT/build.log" 2>&1 || { grep -E "error" -A3 "$OUT/build.log" | head -40; exit 1; }
echo "build: $((SECONDS - start)) s; $(grep -h 'cuDNN baselines' "$OUT/configure.log" 2>/dev/null)"
if [ -f build/python/_C.so ]; then
  rm -rf build/pypkg && mkdir -p build/pypkg/trainscale
  cp -r python/trainscale/. build/pypkg/trainscale/ && cp build/python/_C.so build/pypkg/trainscale/
  export PYTHONPATH=$PWD/build/pypkg${PYTHONPATH:+:$PYTHONPATH}
fi
