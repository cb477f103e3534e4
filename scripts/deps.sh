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

# nvcc is optional: without it the CPU reference is built alone.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "[deps] add /usr/local/cuda/bin to PATH to build the CUDA kernels"
fi
