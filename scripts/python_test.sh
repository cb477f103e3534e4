#!/usr/bin/env bash
# Builds the Python package (PyTorch extension + the trainscale library, CUDA sources included
# when nvcc is found) with `pip install .` (in scripts/build.sh's tree when there is one) and
# runs its pytest suite (python/tests; GPU tests skip without a device). Installs torch, pytest,
# scikit-build-core, ninja, transformers and matplotlib from PyPI when missing. PYTHON picks the
# interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() {
  "$PY" -m pip install -q "$@" || "$PY" -m pip install -q --break-system-packages "$@"
}
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3-pip >/dev/null
fi
# The extension links the benchmark engine, which needs nlohmann-json (scripts/deps.sh, apt).
[ -f /usr/include/nlohmann/json.hpp ] || bash scripts/deps.sh
need=()
"$PY" -c "import torch" 2>/dev/null || need+=(torch)
"$PY" -c "import pytest" 2>/dev/null || need+=(pytest)
"$PY" -c "import scikit_build_core" 2>/dev/null || need+=("scikit-build-core>=0.10")
command -v ninja >/dev/null || "$PY" -c "import ninja" 2>/dev/null || need+=(ninja)
# Test-only: a tiny Llama for trainscale.patch, and the --plot of python -m trainscale.bench.
"$PY" -c "import transformers" 2>/dev/null || need+=(transformers)
"$PY" -c "import matplotlib" 2>/dev/null || need+=(matplotlib)
if [ ${#need[@]} -gt 0 ]; then
  echo "[python] installing: ${need[*]}"
  pip_install "${need[@]}"
fi

# Without build isolation: the extension must be built against the torch installed here.
# Where scripts/build.sh left a build tree (BUILD_DIR, default build; Ninja, as pip's build
# uses), the package is built in it, keeping its tests and bench as configured: the library is
# compiled once for both, and the extension alone is added. Otherwise pip's own tree
# (build/python-*) is kept, so a second run only rebuilds what changed.
build_args=()
BUILD_DIR=${BUILD_DIR:-build}
if grep -qx "CMAKE_GENERATOR:INTERNAL=Ninja" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
  cached() { sed -n "s/^$1:BOOL=//p" "$BUILD_DIR/CMakeCache.txt"; }
  build_args=(-C "build-dir=$BUILD_DIR"
              -C "cmake.define.TRAINSCALE_BUILD_TESTS=$(cached TRAINSCALE_BUILD_TESTS)"
              -C "cmake.define.TRAINSCALE_BUILD_BENCH=$(cached TRAINSCALE_BUILD_BENCH)")
fi
echo "[python] building and installing trainscale (pip install .${build_args:+ in $BUILD_DIR})"
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)}
log=$(mktemp)
if ! pip_install . --no-build-isolation --no-deps -v "${build_args[@]}" >"$log" 2>&1; then
  grep -E "error|Error" -A3 "$log" | head -60
  tail -20 "$log"
  exit 1
fi
rm -f "$log"

# Run from the tests folder's parent so the installed package (not python/trainscale) is imported.
echo "[python] pytest python/tests"
set +e
"$PY" -m pytest -q -rs -p no:cacheprovider python/tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[python] pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
