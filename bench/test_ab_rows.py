"""bench/ab_rows.py: the fastest time per cell over runs, keyed by the file's <which>, with the
plan's kernel name; rows of other cells and other prefixes stay apart."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_rows import best_runs, cell  # noqa: E402


def row(us, T=4, B=64, plan="vk-chunk blocks=2048", layout="VK", cache=False):
    return {"op": "decode", "model": "qwen3-next", "state": "bf16", "layout": layout, "T": T, "B": B,
            "cache": cache, "plan": plan, "us": us}


def write(path, rows):
    with open(path, "w") as f:
        json.dump({"rows": rows}, f)


def test_fastest_per_cell_and_which(tmp_path):
    write(tmp_path / "ab-base-1.json", [row(10.0), row(5.0, T=8)])
    write(tmp_path / "ab-base-2.json", [row(9.5), row(5.5, T=8)])
    write(tmp_path / "ab-tree-1.json", [row(8.0, plan="vk-tile x"), row(4.0, T=8, cache=True)])
    write(tmp_path / "ab-tree-2.json", [row(8.5, plan="vk-tile x")])
    write(tmp_path / "kvvt-on-1.json", [row(1.0)])  # another stage's runs
    best, plan = best_runs(str(tmp_path), "ab")
    c4, c8, c8c = cell(row(0)), cell(row(0, T=8)), cell(row(0, T=8, cache=True))
    assert best == {("base", c4): 9.5, ("base", c8): 5.0, ("tree", c4): 8.0, ("tree", c8c): 4.0}
    assert plan[("tree", c4)] == "vk-tile" and plan[("base", c8)] == "vk-chunk"
    assert c8 != c8c and c8c[-1] == "cache"


def test_ab_summary_groups_by_kernel_and_b_and_lists_outliers(tmp_path):
    from ab_rows import ab_summary
    write(tmp_path / "ab-base-1.json", [row(10.0, B=1), row(10.0, B=16), row(10.0, B=64), row(10.0, B=512)])
    write(tmp_path / "ab-tree-1.json", [row(9.0, B=1), row(10.2, B=16), row(8.0, B=64), row(12.0, B=512)])
    groups, outside = ab_summary(str(tmp_path))
    assert {g: [round(r, 3) for r in v] for g, v in groups.items()} == {
        ("vk-chunk", "bf16", "VK", "B=1"): [0.9], ("vk-chunk", "bf16", "VK", "B<=16"): [1.02],
        ("vk-chunk", "bf16", "VK", "B>16"): [0.8, 1.2]}
    # B = 16 moved 2%: inside +-3%; the others outside.
    assert [line.split("(")[0].split()[5] for line in outside] == ["1", "64", "512"]
