#!/usr/bin/env bash
# Installs the build and test dependencies that are missing (Debian/Ubuntu, as root or with
# sudo). Safe to run repeatedly.
set -euo pipefail

need=()
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
[ -f /usr/include/CLI/CLI.hpp ] || need+=(libcli11-dev)
[ -f /usr/include/fmt/format.h ] || need+=(libfmt-dev)

sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
if [ ${#need[@]} -gt 0 ]; then
  echo "[deps] installing: ${need[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

# CMake >= 3.26 (C++20 CUDA); Debian 12 ships 3.25, so take it from PyPI when older.
cmake_ok() {
  command -v cmake >/dev/null &&
    [ "$(printf '%s\n3.26\n' "$(cmake --version | head -1 | awk '{print $3}')" | sort -V | head -1)" = "3.26" ]
}
if ! cmake_ok; then
  command -v pip3 >/dev/null || need_pip=1
  if [ -n "${need_pip:-}" ]; then
    $sudo_cmd apt-get install -y -qq python3-pip >/dev/null
  fi
  echo "[deps] installing cmake>=3.26 from PyPI"
  python3 -m pip install -q "cmake>=3.26,<5" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "cmake>=3.26,<5"
  hash -r
fi

# Headers of the cuDNN frontend (its header-only C++ graph API, from PyPI) for trainscale-bench's
# optional cuDNN baselines; CMake finds them through python3. Only where CUDA is built, and best
# effort: without them (no network, no pip) the baselines are simply not built.
# One pinned wheel without its dependencies, quietly; where pip refuses a system Python, again
# with --break-system-packages.
pip_pinned() {
  local pip=(env PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip install -q --no-deps)
  "${pip[@]}" "$1" >/dev/null 2>&1 || "${pip[@]}" --break-system-packages "$1" >/dev/null 2>&1
}
cudnn_frontend_version=1.32.0
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && command -v python3 >/dev/null &&
  ! python3 - "$cudnn_frontend_version" 2>/dev/null <<'PY'
import sys, importlib.metadata as md
sys.exit(0 if md.version("nvidia-cudnn-frontend") == sys.argv[1] else 1)
PY
then
  echo "[deps] installing nvidia-cudnn-frontend==$cudnn_frontend_version from PyPI (cuDNN baseline headers)"
  pip_pinned "nvidia-cudnn-frontend==$cudnn_frontend_version" ||
    echo "[deps] could not install nvidia-cudnn-frontend: the cuDNN baselines will not be built"
fi

# CUTLASS/CuTe headers (the PyPI wheel nvidia-cutlass; header-only use, so no dependencies) for the
# Hopper attention kernels; CMake finds them through python3 (TRAINSCALE_CUTLASS_INCLUDE overrides).
# Only where CUDA is built. Without them those kernels are left out of the build.
cutlass_version=4.2.0.0
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && command -v python3 >/dev/null &&
  ! python3 -c "import cutlass_library" 2>/dev/null
then
  echo "[deps] installing nvidia-cutlass==$cutlass_version from PyPI (CUTLASS/CuTe headers)"
  pip_pinned "nvidia-cutlass==$cutlass_version" ||
    echo "[deps] could not install nvidia-cutlass: the attention CUDA kernels will not be built"
fi

# nvcc is optional: without it the CPU reference is built alone.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "[deps] add /usr/local/cuda/bin to PATH to build the CUDA kernels"
fi
