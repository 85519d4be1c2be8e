#!/usr/bin/env bash
# Builds everything and runs every test: the C++ suite (ctest; GPU tests skip with a reason
# when no GPU is visible) and the Python package's tests (pip install ., then pytest).
# With nvcc present the CUDA backend is compiled too. BUILD_DIR overrides the build folder.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
JOBS=$(nproc)

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j"$JOBS"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS"

# The Python extension builds the CPU backend alone unless a GPU is visible: the CUDA
# sources were already compiled above, and compiling them twice doubles CI time.
py_cuda=OFF
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then py_cuda=ON; fi
python3 -m pip install . --no-build-isolation -q -C cmake.define.GDN_ENABLE_CUDA=$py_cuda -C build-dir="$BUILD-py"
python3 -m pytest python/tests -q
