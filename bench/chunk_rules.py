"""The chunked kernel against the token loop, for scripts/gpu_check.sh's chunkbench stage:
chunk_min_heads's thresholds (src/cuda/decode_cuda.cu) re-measured. Reads <out>/chunk-loop-N.json
(GDN_CUDA_VK_CHUNK=0), chunk-on-N.json (=2) and chunk-default-N.json (the planner's choice) and
prints, per (model, state, layout, T) where the chunked kernel applied, chunked / loop per B
(min of the runs; * where the default plan took the chunked kernel) and the fewest heads
(B x HV, the count the thresholds compare) from which the chunked kernel was faster at every
larger B measured. python3 bench/chunk_rules.py OUT
"""
import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_rows import best_runs  # noqa: E402


def chunk_rules(out):
    """[(model, state, layout, T, [(B, heads, ratio, default_chunked)], min_heads or None)]."""
    best, plan = best_runs(out, "chunk")
    hv = {}
    for f in glob.glob(f"{out}/chunk-*-*.json"):
        for r in json.load(open(f))["rows"]:
            hv[r["model"]] = r["HV"]
    groups = collections.defaultdict(list)
    for (which, k), us in best.items():
        if which != "on" or not plan[which, k].endswith("-chunk") or ("loop", k) not in best:
            continue
        _, model, state, layout, T, B, _ = k
        default = plan.get(("default", k), "").endswith("-chunk")
        groups[model, state, layout, T].append((B, B * hv[model], us / best["loop", k], default))
    result = []
    for g in sorted(groups):
        cells = sorted(groups[g])
        min_heads = None
        for _, heads, ratio, _ in reversed(cells):
            if ratio >= 1:
                break
            min_heads = heads
        result.append((*g, cells, min_heads))
    return result


def main(out):
    print("model state layout T: B chunked / loop (* the default's pick) ...; chunked faster from heads")
    for model, state, layout, T, cells, min_heads in chunk_rules(out):
        row = " ".join(f"{B}:{ratio:.2f}{'*' if d else ''}" for B, _, ratio, d in cells)
        print(model, state, layout, T, row, "; from", min_heads if min_heads is not None else "never")


if __name__ == "__main__":
    main(sys.argv[1])
