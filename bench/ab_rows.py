"""The fastest time per cell over repeated `gdn bench --json` runs, for scripts/gpu_check.sh's
A/B stages (groupbench, kvvtbench, chunkbench, abbench). Runs are files named
<prefix>-<which>-<run>.json; a cell is (op, model, state, layout, T, B, cache) and its plan the
kernel the run named. `python3 bench/ab_rows.py OUT` prints abbench's summary (ab_summary)."""
import collections
import glob
import json
import statistics
import sys


def cell(r):
    return (r["op"], r["model"], r["state"], r["layout"], r["T"], r["B"], "cache" if r["cache"] else "-")


def best_runs(out, prefix):
    """{(which, cell): min us} and {(which, cell): kernel} over out/<prefix>-<which>-<run>.json."""
    best, plan = {}, {}
    for f in glob.glob(f"{out}/{prefix}-*-*.json"):
        which = f.rsplit("/", 1)[1][len(prefix) + 1:].split("-")[0]
        for r in json.load(open(f))["rows"]:
            k = cell(r)
            best[which, k] = min(best.get((which, k), float("inf")), r["us"])
            plan[which, k] = r["plan"].split()[0]
    return best, plan


def b_bucket(B):
    return "B=1" if B == 1 else "B<=16" if B <= 16 else "B>16"


def ab_summary(out):
    """abbench's tree against base: ({(kernel, state, layout, B bucket): [tree / base]}, the lines
    of the cells outside +-3%), the kernel being the tree's plan."""
    best, plan = best_runs(out, "ab")
    groups, outside = collections.defaultdict(list), []
    for k in sorted(k for (w, k) in plan if w == "tree"):
        a, b, kern = best.get(("base", k)), best.get(("tree", k)), plan["tree", k]
        if a and b:
            groups[kern, k[2], k[3], b_bucket(k[5])].append(b / a)
            if abs(b / a - 1) > 0.03:
                outside.append(f"  {' '.join(map(str, k))} ({kern}): {a:.2f} -> {b:.2f} us, {b / a:.3f}")
    return groups, outside


def main(out):
    # The cells outside +-3% to a file (a wide sweep lists hundreds), the per-kernel table last,
    # so that the device call's output tail keeps it.
    groups, outside = ab_summary(out)
    with open(f"{out}/ab-outside.txt", "w") as f:
        print(*outside, sep="\n", file=f)
    print(f"cells outside +-3%: {len(outside)} (ab-outside.txt in ab.tgz); the first 20:", *outside[:20], sep="\n")
    print("kernel state layout B: cells, tree / base min median max")
    for g, v in sorted(groups.items()):
        print(*g, f"{len(v)}: {min(v):.3f} {statistics.median(v):.3f} {max(v):.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
