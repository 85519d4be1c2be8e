"""A kernel's executed instructions and warp-stall samples by phase, from ncu's source page.

Input: the CSV that `ncu --section SourceCounters --page source --print-source sass --csv`
prints for one profiled launch (scripts/gpu_check.sh prof with PROF_SOURCE=1 writes one per
cell). The SASS is cut at every BAR instruction (a phase ends at its barrier); for each phase
the script prints the instructions executed per warp, its share of the warp-stall samples (the
time warps spent there), the commonest opcodes per warp and the top stall reasons. With
--lines A B it lists the executed instructions A..B with their counts per warp and samples.
docs/design.md, "The tile walks", quotes it on the chunked kernel.

    python3 bench/sass_phases.py prof-VK-bf16-T8-B64-sass.csv
    python3 bench/sass_phases.py prof-VK-bf16-T8-B64-sass.csv --lines 2190 2330
"""
import argparse
import collections
import csv
import re


def read(path):
    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = list(csv.reader(lines[start:]))
    return rows[0], rows[1:]


def opcode(src):
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return s.split()[0].split(".")[0] if s else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--lines", nargs=2, type=int, metavar=("A", "B"))
    a = ap.parse_args()
    hdr, rows = read(a.csv)
    ix = {h: i for i, h in enumerate(hdr)}
    n_ex, n_smp = ix["Instructions Executed"], ix["Warp Stall Sampling (All Samples)"]
    stall_cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    warps = int(rows[0][n_ex])  # the first instruction runs once per warp
    samples = sum(int(r[n_smp]) for r in rows) or 1
    if a.lines:
        for k in range(a.lines[0], min(a.lines[1], len(rows) - 1) + 1):
            if int(rows[k][n_ex]):
                print(f"{k:5d} {int(rows[k][n_ex]) / warps:7.2f} {int(rows[k][n_smp]):5d}  {rows[k][ix['Source']].strip()}")
        return
    total = sum(int(r[n_ex]) for r in rows) / warps
    print(f"{warps} warps, {total:.0f} instructions per warp, {samples} samples")
    first, ops, stalls, ex, smp = 0, collections.Counter(), collections.Counter(), 0, 0
    for k, r in enumerate(rows):
        op, n = opcode(r[ix["Source"]]), int(r[n_ex])
        ops[op] += n
        ex += n
        smp += int(r[n_smp])
        for i in stall_cols:
            stalls[hdr[i][6:]] += int(r[i])
        if op == "BAR" or k == len(rows) - 1:
            if ex:
                print(f"[{first:5d}-{k:5d}] {ex / warps:6.0f}/warp {100 * smp / samples:5.1f}% samples | "
                      + " ".join(f"{o}:{c / warps:.0f}" for o, c in ops.most_common(8)) + " | "
                      + " ".join(f"{s}:{c}" for s, c in stalls.most_common(4)))
            first, ops, stalls, ex, smp = k + 1, collections.Counter(), collections.Counter(), 0, 0


if __name__ == "__main__":
    main()
