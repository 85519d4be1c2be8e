#!/usr/bin/env bash
# Installs what gdn builds and tests with, from Debian's packages and PyPI.
#   scripts/setup.sh                 install on this machine (apt-get as root, then pip)
#   scripts/setup.sh --download DIR  fetch the header-only Debian packages into DIR, to carry
#                                    to an offline machine (the GPU machine has no network)
#   scripts/setup.sh --unpack DIR    unpack DIR/*.deb into DIR/root; CMake looks in .deps/root
#   scripts/setup.sh --wheels DIR    fetch the pure-Python wheels of FLA (flash-linear-attention)
#                                    into DIR, for bench/fla_compare.py on the offline GPU machine,
#                                    which already has torch 2.11, triton 3.6, transformers 5.17 and
#                                    packaging; there: pip install --no-deps DIR/*.whl
set -euo pipefail
DEBS=(libdlpack-dev libcli11-dev nlohmann-json3-dev)
BUILD_DEBS=(cmake ninja-build g++ libgtest-dev python3-pip)
# fla-core holds the kernels (fla.ops), flash-linear-attention the layers/models that `import fla`
# loads when present; 0.6.0 asks for triton >= 3.3 and transformers >= 5.6.2.
FLA_WHEELS=(fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2)
# ml_dtypes: bf16 arrays for the numpy tests; matplotlib: bench/plot.py (figures of docs/img)
PIP=(nanobind scikit-build-core numpy pytest ml_dtypes matplotlib)

case "${1:-}" in
  --download)
    dir=${2:?DIR}; mkdir -p "$dir"
    (cd "$dir" && apt-get download "${DEBS[@]}")
    ;;
  --unpack)
    dir=${2:?DIR}; mkdir -p "$dir/root"
    for f in "$dir"/*.deb; do dpkg -x "$f" "$dir/root"; done
    ;;
  --wheels)
    dir=${2:?DIR}; mkdir -p "$dir"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir" "${FLA_WHEELS[@]}"
    ;;
  "")
    missing=()
    for p in "${DEBS[@]}" "${BUILD_DEBS[@]}"; do
      dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if ((${#missing[@]})); then
      SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
    fi
    python3 -m pip install -q "${PIP[@]}"
    ;;
  *) echo "usage: $0 [--download DIR | --unpack DIR | --wheels DIR]" >&2; exit 2 ;;
esac
