#!/usr/bin/env bash
# Times kernel variants side by side in one GPU call: builds gdn with each set of compile-time
# knobs (VARIANTS: name=flags;...), then runs a few bench cells under each runtime knob.
# Usage on the GPU machine: bench/variants.sh; results in $OUT/variants.log, a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gdn-out}; mkdir -p "$OUT"
scripts/setup.sh --unpack .deps >/dev/null
VARIANTS=${VARIANTS:-"base=;occ=-DGDN_VK_MIN_BLOCKS_R1=8 -DGDN_VK_MIN_BLOCKS_R2=6 -DGDN_VK_MIN_BLOCKS_R4=4"}
CELLS=${CELLS:-"--model qwen3-next --state all --mode pool --layout vk --T 1 --B 1 16 64 512"}
RUNTIME=${RUNTIME:-"GDN_CUDA_VK_ROWS=1;GDN_CUDA_VK_ROWS=2;GDN_CUDA_VK_ROWS=4;GDN_CUDA_PDL=0"}
IFS=';' read -ra vs <<< "$VARIANTS"
for v in "${vs[@]}"; do
  name=${v%%=*}; flags=${v#*=}
  cmake -S . -B "build-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DGDN_BUILD_TESTS=OFF -DCMAKE_CUDA_FLAGS="$flags" > "$OUT/build-$name.log" 2>&1 &
done
wait
for v in "${vs[@]}"; do name=${v%%=*}; cmake --build "build-$name" -j16 >> "$OUT/build-$name.log" 2>&1 || echo "build $name failed"; done
IFS=';' read -ra rs <<< "$RUNTIME"
for v in "${vs[@]}"; do
  name=${v%%=*}
  for r in "" "${rs[@]}"; do
    echo "## variant $name runtime ${r:-default}"
    env $r ./build-$name/gdn bench $CELLS 2>/dev/null | grep -E "^ *qwen" | awk '{printf "  %-10s %-5s %-3s %-6s T=%s B=%-4s %9s us %6s TB/s %6s\n", $1,$2,$3,$4,$5,$6,$9,$10,$11}'
  done
done 2>&1 | tee "$OUT/variants.log"
