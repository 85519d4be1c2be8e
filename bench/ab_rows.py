"""The fastest time per cell over repeated `gdn bench --json` runs, for scripts/gpu_check.sh's
A/B stages (groupbench, kvvtbench, abbench). Runs are files named <prefix>-<which>-<run>.json;
a cell is (op, model, state, layout, T, B, cache) and its plan the kernel the run named."""
import glob
import json


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
