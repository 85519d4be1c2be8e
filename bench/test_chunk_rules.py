"""bench/chunk_rules.py: chunked / loop per B from the min of the runs, the default's pick, and
the fewest heads from which the chunked kernel wins at every larger B."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chunk_rules import chunk_rules  # noqa: E402


def row(us, B, plan, T=4, state="bf16"):
    return {"op": "decode", "model": "qwen3-next", "HV": 32, "state": state, "layout": "VK", "T": T,
            "B": B, "cache": False, "plan": plan + " blocks=1", "us": us}


def write(path, rows):
    with open(path, "w") as f:
        json.dump({"rows": rows}, f)


def test_ratios_default_and_threshold(tmp_path):
    # B = 1 chunked loses, B = 2 wins, B = 4 loses, B = 8 and 16 win: from 8 x 32 heads.
    loop = {1: 10.0, 2: 10.0, 4: 10.0, 8: 20.0, 16: 40.0}
    on = {1: 12.0, 2: 9.0, 4: 11.0, 8: 15.0, 16: 30.0}
    write(tmp_path / "chunk-loop-1.json", [row(loop[B], B, "vk-tile") for B in loop])
    write(tmp_path / "chunk-loop-2.json", [row(loop[B] + 1, B, "vk-tile") for B in loop])
    write(tmp_path / "chunk-on-1.json", [row(on[B] + 5, B, "vk-chunk") for B in on])
    write(tmp_path / "chunk-on-2.json", [row(on[B], B, "vk-chunk") for B in on])
    # fp32 VK: the chunked kernel does not apply (the token loop in both): no line.
    write(tmp_path / "chunk-on-3.json", [row(5.0, 1, "vk-tile", state="fp32")])
    write(tmp_path / "chunk-loop-3.json", [row(5.0, 1, "vk-tile", state="fp32")])
    write(tmp_path / "chunk-default-1.json",
          [row(on[B], B, "vk-chunk" if B >= 16 else "vk-tile") for B in on])
    (line,) = chunk_rules(str(tmp_path))
    model, state, layout, T, cells, min_heads = line
    assert (model, state, layout, T) == ("qwen3-next", "bf16", "VK", 4)
    assert [(B, heads) for B, heads, _, _ in cells] == [(1, 32), (2, 64), (4, 128), (8, 256), (16, 512)]
    assert [round(r, 3) for _, _, r, _ in cells] == [1.2, 0.9, 1.1, 0.75, 0.75]
    assert [d for *_, d in cells] == [False, False, False, False, True]
    assert min_heads == 256


def test_never_when_the_largest_b_does_not_win(tmp_path):
    for on_b2 in (10.5, 10.0):  # slower, then level: neither is faster
        write(tmp_path / "chunk-loop-1.json", [row(10.0, 1, "vk-tile"), row(10.0, 2, "vk-tile")])
        write(tmp_path / "chunk-on-1.json", [row(9.0, 1, "vk-chunk"), row(on_b2, 2, "vk-chunk")])
        ((*_, min_heads),) = chunk_rules(str(tmp_path))
        assert min_heads is None
