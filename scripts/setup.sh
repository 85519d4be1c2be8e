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
#   scripts/setup.sh --flashinfer DIR
#                                    fetch FlashInfer 0.7.2 (bench/fla_compare.py --op flashinfer)
#                                    and pack it in two parts that each fit one call to the GPU
#                                    machine (64 MiB with the tree): DIR/part1, its CUDA 13 CuTe-DSL
#                                    libraries (~58 MiB); DIR/part2, the rest (~15 MiB)
#   scripts/setup.sh --flashinfer-install DIR TARGET
#                                    there: unpack the parts present in DIR into TARGET (call 1
#                                    part1, call 2 right after on the same machine part2); then
#                                    PYTHONPATH=TARGET:TARGET/nvidia_cutlass_dsl/dsl_packages
set -euo pipefail
DEBS=(libdlpack-dev libcli11-dev nlohmann-json3-dev)
BUILD_DEBS=(cmake ninja-build g++ libgtest-dev python3-pip)
# fla-core holds the kernels (fla.ops), flash-linear-attention the layers/models that `import fla`
# loads when present; 0.6.0 asks for triton >= 3.3 and transformers >= 5.6.2.
FLA_WHEELS=(fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2)
# ml_dtypes: bf16 arrays for the numpy tests; matplotlib: bench/plot.py (figures of docs/img)
PIP=(nanobind scikit-build-core numpy pytest ml_dtypes matplotlib)
# FlashInfer's sm_90 GDN decode kernels are CuTe-DSL: flashinfer-python and these (cuda-tile,
# nccl and cudnn-frontend, also listed by it, are not on that path; their imports are guarded).
FI_WHEELS=(flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 nvidia-cutlass-dsl==4.8.1
           nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1)
FI_CU13=nvidia-cutlass-dsl-libs-cu13==4.8.1

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
  --flashinfer)
    dir=${2:?DIR}; mkdir -p "$dir/part1" "$dir/part2"
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    for w in "${FI_WHEELS[@]}" "$FI_CU13"; do  # the GPU machine's Python: 3.12, x86-64
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$tmp/whl" "$w"
    done
    # The cu13 wheel is two shared objects (237 MB unpacked); xz with the x86 filter: ~58 MiB.
    mkdir "$tmp/cu13" && python3 -m zipfile -e "$tmp"/whl/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/cu13"
    tar -C "$tmp/cu13" -cf - . | xz -T0 --x86 --lzma2=preset=9e > "$dir/part1/cutlass-dsl-cu13.tar.xz"
    # flashinfer/data holds the CUDA sources of its JIT paths, which the CuTe-DSL kernels do not use.
    mkdir "$tmp/fi" && python3 -m zipfile -e "$tmp"/whl/flashinfer_python-*.whl "$tmp/fi"
    tar -C "$tmp/fi" --exclude=flashinfer/data -cJf "$dir/part2/flashinfer-slim.tar.xz" .
    rm "$tmp"/whl/flashinfer_python-*.whl "$tmp"/whl/nvidia_cutlass_dsl_libs_cu13-*.whl
    mv "$tmp"/whl/*.whl "$dir/part2/"
    du -sh "$dir/part1" "$dir/part2"
    ;;
  --flashinfer-install)
    dir=${2:?DIR}; target=${3:?TARGET}; mkdir -p "$target"
    # Wheels are zip archives: unpacked, not `pip install --target`, which skips a package whose
    # folder already exists (nvidia_cutlass_dsl, from part1). Their .pth files are not read
    # outside site-packages, hence the second PYTHONPATH entry.
    for f in "$dir"/part1/*.tar.xz "$dir"/part2/*.tar.xz; do
      if [ -f "$f" ]; then tar -xJf "$f" -C "$target"; fi
    done
    for f in "$dir"/part2/*.whl; do
      if [ -f "$f" ]; then python3 -m zipfile -e "$f" "$target"; fi
    done
    echo "PYTHONPATH=$target:$target/nvidia_cutlass_dsl/dsl_packages"
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
  *) echo "usage: $0 [--download DIR | --unpack DIR | --wheels DIR | --flashinfer DIR |" \
          "--flashinfer-install DIR TARGET]" >&2; exit 2 ;;
esac
