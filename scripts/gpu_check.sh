#!/usr/bin/env bash
# Build, test, sanitize and benchmark on the GPU machine in one call (it keeps nothing between
# calls and has no network: header-only Debian packages travel in .deps, fetched here with
# `scripts/setup.sh --download .deps`). Logs go to $OUT; a short table is printed last.
#   scripts/gpu_check.sh [stage ...]   stages: build test gputest run sanitize python bench quickbench
#                                      fusedbench groupbench kvvtbench chunkbench prof abbench
# COMMIT names the commit under test in the benchmark JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gdn-out}
mkdir -p "$OUT"
STAGES=${*:-build test run sanitize python quickbench}
B=build-gpu
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }
note() { summary+=("$1"); echo "== $1"; }

scripts/setup.sh --unpack .deps >/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/device.txt" 2>&1

# abbench's base: this tree with .ab-base's files over it (scripts/ab_base.sh REV wrote them; the
# call carries .ab-base), its CLI built beside this tree's, in the background meanwhile.
AB=/tmp/gdn-ab-base
if has abbench; then
  if [ -d .ab-base ]; then
    rm -rf $AB && mkdir -p $AB && tar --exclude=./$B --exclude=./.ab-base --exclude=./.git -cf - . | tar -xf - -C $AB &&
      (cd .ab-base && tar --exclude=./.deleted --exclude=./.rev -cf - .) | tar -xf - -C $AB &&
      { [ ! -f .ab-base/.deleted ] || (cd $AB && xargs -r rm -f) < .ab-base/.deleted; }
    (cmake -S $AB -B $AB/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DGDN_BUILD_TESTS=OFF \
      -DGDN_GIT_COMMIT="$(cat .ab-base/.rev 2>/dev/null || echo base)" > "$OUT/build-base.log" 2>&1 &&
      cmake --build $AB/b -j16 --target gdn_cli >> "$OUT/build-base.log" 2>&1) &
    ab_pid=$!
  else
    note "abbench: no .ab-base (scripts/ab_base.sh REV writes it; carry it)"
  fi
fi

if has build || has test || has gputest || has run || has sanitize || has bench || has quickbench || has fusedbench || has groupbench ||
  has kvvtbench || has chunkbench || has prof || has abbench; then
  t0=$SECONDS
  # The test suite only where a stage runs it (or `build` is named): the CLI alone builds in
  # about 115 s, which counts in a device session's short remainder. GDN_BUILD_TESTS stated
  # either way: a warm machine may keep a build folder configured the other way.
  tests=OFF target=(--target gdn_cli)
  if has build || has test || has gputest || has sanitize; then tests=ON target=(); fi
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DGDN_BUILD_TESTS=$tests \
    -DGDN_GIT_COMMIT="${COMMIT:-unknown}" > "$OUT/build.log" 2>&1 &&
    cmake --build $B -j16 "${target[@]}" >> "$OUT/build.log" 2>&1
  rc=$?; note "build rc=$rc ($((SECONDS - t0)) s)"
  [ $rc = 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
fi
if has test; then
  t0=$SECONDS
  ctest --test-dir $B --output-on-failure -j8 > "$OUT/ctest.log" 2>&1
  rc=$?; note "ctest rc=$rc ($((SECONDS - t0)) s): $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
  grep -E "Failed|\*\*\*" "$OUT/ctest.log" | head -30
fi
if has gputest; then
  # The suite's GPU tests alone (every CUDA family: the default plans and each kernel forced; the
  # CPU suites are CI's), the check after a kernel change: ~680 tests, about 250-400 s at -j8,
  # the two serving-batch tests of the fused step ~2 minutes each. GPUTEST_LIMIT bounds it (s).
  t0=$SECONDS
  timeout "${GPUTEST_LIMIT:-420}" ctest --test-dir $B --output-on-failure -j"${GPUTEST_J:-8}" \
    -R 'Cuda/|CudaKvVt|CudaFused' > "$OUT/ctest-gpu.log" 2>&1
  rc=$?; note "GPU ctest rc=$rc ($((SECONDS - t0)) s): $(grep -c ' Passed ' "$OUT/ctest-gpu.log") passed, $(grep -cE '\*\*\*|\(Failed\)' "$OUT/ctest-gpu.log") failed; $(grep -E 'tests passed|tests failed' "$OUT/ctest-gpu.log" | tail -1)"
  grep -E "\(Failed\)|\*\*\*" "$OUT/ctest-gpu.log" | head -30
fi
if has run; then
  {
    ./$B/gdn run --model qwen3-next --steps 4
    ./$B/gdn run --model qwen3.5 --batch 100 --state bf16 --steps 4
    ./$B/gdn run --model qwen3-next --tokens 4 --batch 30 --steps 6 --cache
    ./$B/gdn run --model qwen3-next --tokens 3 --batch 7 --layout KV --state bf16 --steps 4
    ./$B/gdn run --model qwen3-next --fused --state bf16 --steps 4
    ./$B/gdn run --model qwen3.5 --fused --tokens 3 --batch 9 --cache --steps 4
    # Read and write slots at T > 1 (the chunked kernels; token slots never take them).
    ./$B/gdn run --model qwen3-next --tokens 4 --batch 64 --state bf16 --slots pool --steps 3
    ./$B/gdn run --model qwen3.5 --fused --tokens 8 --batch 32 --state bf16 --slots pool --steps 3
  } > "$OUT/run.log" 2>&1
  rc=$?; note "gdn run rc=$rc: $(grep -c 'verification PASS' "$OUT/run.log") of 8 PASS"
  grep summary "$OUT/run.log"
fi
if has sanitize; then
  t0=$SECONDS
  filter=${SANITIZE_FILTER:-'Cuda/Decode.*:Cuda/Matrix.*/c0*-*SlotOffsets*:*MultiStep*'}
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 ./$B/tests/gdn_tests --gtest_filter="$filter" \
      > "$OUT/sanitize-$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool rc=$rc: $(grep -E 'ERROR SUMMARY|tests? ran|PASSED|FAILED' "$OUT/sanitize-$tool.log" | tr '\n' ' ' | cut -c1-200)"
  done
  # The VK chunked kernel (src/cuda/vk_chunk.cuh) runs on large grids only by default: forced here.
  cfilter=${SANITIZE_CHUNK_FILTER:-'Cuda/Decode.Verify*:Cuda/Matrix.*/c1*'}
  for tool in memcheck racecheck; do
    GDN_CUDA_VK_CHUNK=2 compute-sanitizer --tool $tool --error-exitcode 9 ./$B/tests/gdn_tests \
      --gtest_filter="$cfilter" > "$OUT/sanitize-chunk-$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool, chunked kernel forced, rc=$rc: $(grep -E 'ERROR SUMMARY|tests? ran|PASSED|FAILED' "$OUT/sanitize-chunk-$tool.log" | tr '\n' ' ' | cut -c1-200)"
  done
  # The fused step (clusters, distributed shared memory, the conv-state handoff), then the group
  # kernel forced on the same tests and on decode's KV cases (stage buffers, the conv state
  # written in place). The serving-batch test (B = 34 of Qwen3-Next) is left to the plain suites:
  # too large for the tools.
  ffilter=${SANITIZE_FUSED_FILTER:-'Cuda/Fused.*:Cuda/FusedMatrix.*/f0*:Cuda/FusedRejects.*-*ServingBatch*'}
  gfilter=${SANITIZE_GROUP_FILTER:-'Cuda/Fused.*:Cuda/FusedMatrix.*/f0*:Cuda/FusedRejects.*:Cuda/Matrix.*_K128_*_KV_*-*ServingBatch*'}
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 ./$B/tests/gdn_tests --gtest_filter="$ffilter" \
      > "$OUT/sanitize-fused-$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool, fused, rc=$rc: $(grep -E 'ERROR SUMMARY|tests? ran|PASSED|FAILED' "$OUT/sanitize-fused-$tool.log" | tr '\n' ' ' | cut -c1-200)"
    GDN_CUDA_GROUP=2 compute-sanitizer --tool $tool --error-exitcode 9 ./$B/tests/gdn_tests \
      --gtest_filter="$gfilter" > "$OUT/sanitize-group-$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool, group kernel forced, rc=$rc: $(grep -E 'ERROR SUMMARY|tests? ran|PASSED|FAILED' "$OUT/sanitize-group-$tool.log" | tr '\n' ' ' | cut -c1-200)"
  done
  note "sanitize took $((SECONDS - t0)) s"
fi
if has python; then
  t0=$SECONDS
  python3 -m pip install . --no-build-isolation --no-deps -q -C build-dir=build-gpu-py > "$OUT/python.log" 2>&1 &&
    python3 -m pytest python/tests -q >> "$OUT/python.log" 2>&1
  rc=$?; note "python rc=$rc ($((SECONDS - t0)) s): $(tail -1 "$OUT/python.log")"
  python3 python/bench_overhead.py --json "$OUT/overhead.json" 2>&1 | tail -6 | tee -a "$OUT/python.log"
fi
if has fusedbench; then
  # The fused step against decode alone, same configurations (issue 17's targets).
  ./$B/gdn bench --op all --mode pool --layout ${FUSED_LAYOUT:-vk} --T ${FUSED_T:-1,4} \
    --B ${FUSED_B:-1,4,16,64,256} --cache off --update on --json "$OUT/bench-fused.json" > "$OUT/bench-fused.log" 2>&1
  note "fusedbench rc=$?"; tail -45 "$OUT/bench-fused.log"
fi
if has groupbench; then
  # decode's KV layout with the planner against the group kernel held off (GDN_CUDA_GROUP=0),
  # alternately twice: plan_kv_group's rule re-measured on this card (src/cuda/decode_cuda.cu).
  # A line per cell where the two differ by more than 1%, min of the two runs each.
  args="--op decode --mode pool --layout kv --T 1,2,4,8 --cache all --update on --B ${GROUP_B:-8,16,32,64,128,256}"
  rc=0
  for r in 1 2; do
    ./$B/gdn bench $args --json "$OUT/group-rule-$r.json" > /dev/null 2>&1 &&
      GDN_CUDA_GROUP=0 ./$B/gdn bench $args --json "$OUT/group-off-$r.json" > /dev/null 2>&1 || rc=1
  done
  note "groupbench rc=$rc"
  python3 - "$OUT" <<'PY'
import sys
sys.path.insert(0, "bench")
from ab_rows import best_runs
best, _ = best_runs(sys.argv[1], "group")
for k in sorted({k for (_, k) in best}):
    a, b = best.get(("off", k)), best.get(("rule", k))
    if a and b and abs(b / a - 1) > 0.01:
        print(*k[1:3], k[4], k[6], k[5], f"off {a:.2f} us, planner {b:.2f} us, {b / a:.3f}")
PY
fi
if has kvvtbench; then
  # The KV layout through VK's token loop (GDN_CUDA_KV_VT=2) against never (0), alternately twice,
  # VK in the same runs: kv_vt_pays's rule re-measured on this card (src/cuda/decode_cuda.cu).
  # A line per KV cell where the kernel applies, min of the two runs each (KVVT_CACHE=all adds the
  # intermediate cache; KVVT_OP=fused or all the fused step, plan_fused_kv_vt).
  args="--op ${KVVT_OP:-decode} --mode pool --layout all --state all --cache ${KVVT_CACHE:-off} --update on
        --T ${KVVT_T:-1,2,4,8} --B ${KVVT_B:-1,16,64,256,512} --model all"
  rc=0
  for r in 1 2; do
    GDN_CUDA_KV_VT=0 ./$B/gdn bench $args --json "$OUT/kvvt-off-$r.json" > /dev/null 2>&1 &&
      GDN_CUDA_KV_VT=2 ./$B/gdn bench $args --json "$OUT/kvvt-on-$r.json" > /dev/null 2>&1 || rc=1
  done
  note "kvvtbench rc=$rc"
  python3 - "$OUT" <<'PY'
import sys
sys.path.insert(0, "bench")
from ab_rows import best_runs
best, plan = best_runs(sys.argv[1], "kvvt")
print("op model state T B cache: KV off (plan), kv-vt, kv-vt / off, kv-vt / VK")
for k in sorted({k for (_, k) in best if k[3] == "KV"}):
    a, b, vk = best.get(("off", k)), best.get(("on", k)), best.get(("off", k[:3] + ("VK",) + k[4:]))
    if a and b and vk and plan[("on", k)].startswith("kv-vt"):
        print(*k[:3], *k[4:], f"{a:.2f} us ({plan[('off', k)]}), {b:.2f} us, {b / a:.3f}, {b / vk:.3f}")
PY
fi
if has chunkbench; then
  # The chunked kernel (GDN_CUDA_VK_CHUNK=2) against the token loop (0), alternately twice, and
  # the default plan once: chunk_min_heads's thresholds re-measured on this card
  # (src/cuda/decode_cuda.cu). A line per (model, state, layout, T) where the chunked kernel
  # applies: chunked / loop per B (min of the runs; * where the default took the chunked kernel)
  # and the fewest heads (B x HV) from which the chunked kernel is faster at every larger B.
  args="--mode pool --layout all --state ${CHUNK_STATE:-all} --cache off --update on --model all
        --T ${CHUNK_T:-2,3,4,5,6,8,16} --B ${CHUNK_B:-1,2,4,8,16,32,64,128,256}"
  rc=0
  for r in 1 2; do
    GDN_CUDA_VK_CHUNK=0 ./$B/gdn bench $args --json "$OUT/chunk-loop-$r.json" > /dev/null 2>&1 &&
      GDN_CUDA_VK_CHUNK=2 ./$B/gdn bench $args --json "$OUT/chunk-on-$r.json" > /dev/null 2>&1 || rc=1
  done
  ./$B/gdn bench $args --json "$OUT/chunk-default-1.json" > /dev/null 2>&1 || rc=1
  note "chunkbench rc=$rc"
  python3 bench/chunk_rules.py "$OUT"
fi
if has prof; then
  # ncu on one launch (after a warm-up) of the decode kernels of each PROF cell
  # "layout,state,T,B" (Qwen3-Next; `gdn run --slots pool`, so no per-token stores: `gdn bench`
  # under ncu fails), with PROF_ENV's knobs, kernels matching PROF_KERNELS: time, DRAM
  # throughput, instructions, issue rate, registers and the top stall reasons per issued
  # instruction, a line per kernel; the whole reports in $OUT/prof-*.txt. The default: kv-vt
  # forced against VK's tile kernel on the same cells (the lean form's and the TMA tile's
  # question, docs/design.md). E.g. the chunked kernels at T = 8:
  #   PROF="VK,bf16,8,64 KV,bf16,8,64" PROF_ENV= PROF_KERNELS='regex:decode_' scripts/gpu_check.sh prof
  # B = 64 profiles the same blocks as B = 512 in a fifth of the time (the pool's setup and the
  # checks grow with B: ~100 s a cell at B = 512). PROF_SOURCE=1 adds ncu's source page (executed
  # instructions and stall samples per SASS instruction) as $OUT/prof-sass.tgz, each cell's
  # phases summarized by bench/sass_phases.py.
  # ncu ARGS... on the cell's second launch of the kernels under study.
  prof_ncu() {
    env ${PROF_ENV-GDN_CUDA_KV_VT=2} timeout 150 ncu "$@" -k "${PROF_KERNELS:-regex:decode_(kv_vt|vk_tile)}" \
      --launch-skip 1 --launch-count 1 \
      ./$B/gdn run --model qwen3-next --layout "$lay" --state "$st" --tokens "$t" --batch "$b" --slots pool --steps 3
  }
  for cell in ${PROF:-KV,bf16,1,16 VK,bf16,1,16 KV,bf16,1,64 VK,bf16,1,64 KV,fp32,1,64 VK,fp32,1,64 KV,bf16,2,256 VK,bf16,2,256}; do
    IFS=, read -r lay st t b <<< "$cell"
    prof_ncu --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section InstructionStats --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      > "$OUT/prof-$lay-$st-T$t-B$b.txt" 2>&1
    if [ -n "${PROF_SOURCE:-}" ]; then
      prof_ncu --section SourceCounters --page source --print-source sass --csv > "$OUT/prof-$lay-$st-T$t-B$b-sass.csv" 2>&1
      echo "== $cell"; python3 bench/sass_phases.py "$OUT/prof-$lay-$st-T$t-B$b-sass.csv"
    fi
  done
  if [ -n "${PROF_SOURCE:-}" ]; then
    (cd "$OUT" && tar czf prof-sass.tgz prof-*-sass.csv && rm -f prof-*-sass.csv)
  fi
  note "prof done"
  python3 - "$OUT" <<'PY'
import glob, re, sys
def num(s):
    return float(s.replace(",", ""))
for f in sorted(glob.glob(sys.argv[1] + "/prof-*.txt")):
    text = open(f).read()
    get = lambda name: " ".join((re.findall(r"^\s*" + re.escape(name) + r"\s+(\S+)\s+([\d.,]+)\s*$", text, re.M) or [("?", "nan")])[0][::-1])
    stalls = {m.group(1): num(m.group(2)) for m in re.finditer(
        r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio\s+\S*\s+([\d.,]+)", text)}
    top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
    print(f.rsplit("/", 1)[1][5:-4], "|", get("Duration"), "| dram", get("DRAM Throughput"), "| inst",
          get("Executed Instructions"), "| cpi", get("Warp Cycles Per Issued Instruction"), "| regs",
          get("Registers Per Thread"), "|", top)
PY
fi
if has abbench && [ -n "${ab_pid:-}" ]; then
  # This tree's CLI against the base's, alternated AB_RUNS times (min of the runs per cell), the
  # runs' JSONs in $OUT/ab.tgz (ab-base-N.json, ab-tree-N.json). AB_ARGS2: a second set of cells
  # in the same runs (ab-*-Nb.json), e.g. fp16 states, which --state all leaves out. Printed:
  # the cells outside +-3% (the first 20; all of them in ab.tgz's ab-outside.txt), then per
  # kernel (this tree's plan), state, layout and B (1, 2..16, more), the ratio tree / base as
  # min, median and max.
  wait $ab_pid
  rc=$?; note "abbench base build rc=$rc"
  if [ $rc = 0 ]; then
    sets=("${AB_ARGS:-"--model all --mode pool --layout all --state all --cache off --update on --T 1,2,4,8 --B 1,16,64,256,512"}")
    [ -z "${AB_ARGS2:-}" ] || sets+=("$AB_ARGS2")
    for r in $(seq ${AB_RUNS:-3}); do
      for i in "${!sets[@]}"; do
        id=$r$([ "$i" = 0 ] || echo b)
        $AB/b/gdn bench ${sets[$i]} --json "$OUT/ab-base-$id.json" > "$OUT/ab-base-$id.log" 2>&1 || rc=1
        ./$B/gdn bench ${sets[$i]} --json "$OUT/ab-tree-$id.json" > "$OUT/ab-tree-$id.log" 2>&1 || rc=1
      done
    done
    note "abbench rc=$rc"
    python3 bench/ab_rows.py "$OUT"
    (cd "$OUT" && tar czf ab.tgz ab-* && rm -f ab-*.json ab-*.log ab-outside.txt)
  fi
fi
if has quickbench; then
  ./$B/gdn bench --quick --json "$OUT/bench-quick.json" > "$OUT/bench-quick.log" 2>&1
  note "quickbench rc=$?"; tail -40 "$OUT/bench-quick.log"
fi
if has bench; then
  ./$B/gdn bench --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  note "bench rc=$?"; tail -60 "$OUT/bench.log"
fi
echo; echo "== summary"; printf '%s\n' "${summary[@]}"
