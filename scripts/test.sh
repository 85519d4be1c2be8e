#!/usr/bin/env bash
# Builds everything and runs every test: the C++ suite (ctest; GPU tests skip with a reason
# when no GPU is visible), the installed C++ package through examples/consumer, and the Python
# tests (pip install ., then pytest: the package's tests, bench/'s plotting script and, where FLA
# is installed, bench/fla_compare.py's checks on the CPU under Triton's interpreter).
# With nvcc present the CUDA backend is compiled too. BUILD_DIR overrides the build folder.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
JOBS=$(nproc)

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j"$JOBS"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS"

# The installed C++ package as an engine sees it: install into a scratch prefix, then build and
# run examples/consumer (find_package(gdn CONFIG), gdn::gdn) against it. .deps: where an offline
# machine has dlpack's CMake package (scripts/setup.sh --unpack).
pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
cmake --install "$BUILD" --prefix "$pkg/prefix" >/dev/null
cmake -S examples/consumer -B "$pkg/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$pkg/prefix;$PWD/.deps/root/usr"
cmake --build "$pkg/build"
"$pkg/build/gdn_consumer"

# The Python extension builds the CPU backend alone unless a GPU is visible: the CUDA
# sources were already compiled above, and compiling them twice doubles CI time.
py_cuda=OFF
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then py_cuda=ON; fi
python3 -m pip install . --no-build-isolation -q -C cmake.define.GDN_ENABLE_CUDA=$py_cuda -C build-dir="$BUILD-py"
python3 -m pytest python/tests bench -q
