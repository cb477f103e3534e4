#!/usr/bin/env bash
# Builds everything and runs every test, C++ (ctest) and Python (pytest, scripts/python_test.sh);
# GPU tests skip without a device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-$(nproc)}"
bash scripts/python_test.sh
