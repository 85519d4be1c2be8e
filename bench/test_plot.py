"""bench/plot.py on tiny synthetic JSON of every kind, and on the committed results it draws
docs/img from: the PNGs appear and are PNGs."""

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/setup.sh installs it)")

HERE = os.path.dirname(os.path.abspath(__file__))
PLOT = os.path.join(HERE, "plot.py")


def run_plot(out, *files):
    r = subprocess.run([sys.executable, PLOT, *map(str, files), "--out", str(out), "--dpi", "40"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def assert_pngs(paths, names):
    assert sorted(os.path.basename(p) for p in paths) == sorted(names)
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", p


def bench_row(model, state, layout, mode, T, B, us, copy_us=None, cache=False):
    r = {"model": model, "state": state, "layout": layout, "mode": mode, "T": T, "B": B, "us": us,
         "update": True, "cache": cache, "H": 16, "HV": 32, "K": 128, "V": 128, "floor_us": us / 2,
         "TBs": 1.0}
    if copy_us is not None:
        r["copy_us"] = copy_us
    return r


def test_bench_json(tmp_path):
    rows = [bench_row("qwen3-next", s, lay, mode, T, B, 10.0 * B * T, 9.0 * B)
            for s in ("fp32", "bf16") for T in (1, 4) for B in (1, 8)
            for lay, mode in (("VK", "dense"), ("VK", "pool"), ("KV", "dense"))]
    rows.append(bench_row("qwen3-next", "fp32", "VK", "dense", 2, 8, 30.0, cache=True))  # no copy_us: left out
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"commit": "abc1234", "device": "test GPU", "copy_TBs": 3.0, "rows": rows}))
    paths = run_plot(tmp_path / "img", src)
    assert_pngs(paths, ["copy-qwen3-next-dense.png", "copy-qwen3-next-pool.png"])


def test_peers_json(tmp_path):
    rows = [{"state": s, "T": T, "B": B, "floor_us": 1.0, "fla_us": 2.0 * B, "gdn_us": 1.5 * B,
             "gdn_oop_us": 1.6 * B} for s in ("fp32", "bf16") for T in (1, 4) for B in (1, 4, 16)]
    src = tmp_path / "peers.json"
    src.write_text(json.dumps({"device": "test GPU, 1 SM", "gdn_commit": "abc1234", "fla_version": "0.6.0",
                               "shape": {"mode": "dense", "layout": "VK"}, "rows": rows}))
    assert_pngs(run_plot(tmp_path, src), ["vs-fla.png"])


def test_peers_json_with_fused_rows(tmp_path):
    # fla_compare --op all over two models: decode rows per model, fused rows (no gdn_us) left out
    rows = [{"op": "decode", "model": m, "state": "fp32", "T": 1, "B": B, "floor_us": 1.0, "fla_us": 2.0 * B,
             "gdn_us": 1.5 * B} for m in ("qwen3-next", "qwen3.5") for B in (1, 4)]
    rows += [{"op": "fused", "model": "qwen3-next", "state": "bf16", "T": 1, "B": B, "floor_us": 1.0,
              "decode_us": 1.0 * B, "chain_us": 1.4 * B, "fused_us": 1.1 * B, "fused_vllm_us": 1.05 * B}
             for B in (1, 4)]
    src = tmp_path / "all.json"
    src.write_text(json.dumps({"device": "test GPU, 1 SM", "gdn_commit": "abc1234", "fla_version": "0.6.0",
                               "shape": {"mode": "dense", "layout": "VK"}, "rows": rows}))
    assert_pngs(run_plot(tmp_path, src), ["vs-fla-qwen3-next.png", "vs-fla-qwen3.5.png"])
    src.write_text(json.dumps({"rows": rows[-2:]}))  # fused rows alone: nothing to draw
    r = subprocess.run([sys.executable, PLOT, str(src), "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and "decode rows" in r.stderr


def test_drift_json(tmp_path):
    variants = [("fp32", "fp32", "nearest"), ("bf16", "bf16", "nearest"), ("bf16+sr", "bf16", "stochastic")]
    modes = [{"mode": "decode", "T": T, "tokens": [1, 2, 4, 8], "variants": [
        {"name": n, "state": st, "rounding": r, "o_mean": [1e-3 * i for i in range(1, 5)],
         "state_err": [2e-3 * i for i in range(1, 5)]} for n, st, r in variants]} for T in (1, 4)]
    src = tmp_path / "drift.json"
    src.write_text(json.dumps({"tool": "gdn drift", "device": "cpu", "commit": "abc1234",
                               "shape": {"model": "qwen3-next", "tp": 8, "B": 2}, "modes": modes}))
    assert_pngs(run_plot(tmp_path, src), ["drift.png"])


def test_rejects_other_json(tmp_path):
    src = tmp_path / "other.json"
    src.write_text(json.dumps({"rows": [{"x": 1}]}))
    r = subprocess.run([sys.executable, PLOT, str(src), "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and "neither" in r.stderr


COMMITTED = sorted(glob.glob(os.path.join(HERE, "results", "*-all.json"))
                   + glob.glob(os.path.join(HERE, "results", "*-fla-compare.json"))
                   + glob.glob(os.path.join(HERE, "results", "*-drift*.json")))


@pytest.mark.parametrize("src", COMMITTED, ids=os.path.basename)
def test_committed_results(tmp_path, src):
    assert run_plot(tmp_path, src)
