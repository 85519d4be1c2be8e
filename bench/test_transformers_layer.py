"""bench/transformers_layer.py's logic on the CPU (--device cpu --smoke): every path runs, the
gdn paths are the ones that ran (the script asserts it), and the JSON has what the GPU run
reports. The timings mean nothing here; python/tests/test_transformers.py checks the numbers."""

import importlib.util
import inspect
import json
import os

import pytest

pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed (python3 -m pip install transformers)")
pytest.importorskip("transformers.models.qwen3_next", reason="this transformers has no Qwen3-Next")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_smoke_cpu(tmp_path, monkeypatch):
    # Where FLA is installed, transformers calls its Triton kernels, which need a GPU: here the
    # modeling module's conv and recurrence functions are unwrapped to the torch functions they
    # wrap (as python/tests/test_transformers.py does).
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling
    for name in ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
                 "torch_recurrent_gated_delta_rule"):
        if hasattr(modeling, name):
            monkeypatch.setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))
    spec = importlib.util.spec_from_file_location("transformers_layer", os.path.join(HERE, "transformers_layer.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "layer.json"
    bench.main(["--device", "cpu", "--smoke", "--B", "1", "--T", "1", "2", "--json", str(out)])
    doc = json.loads(out.read_text())
    keys = {"device", "date", "gdn_commit", "torch", "transformers", "stock_path", "shape", "method", "rows"}
    assert keys <= set(doc)
    assert [(r["B"], r["T"]) for r in doc["rows"]] == [(1, 1), (1, 2)]
    for r in doc["rows"]:
        for p in ("stock", "gdn_rec", "fused", "gemms"):
            assert r[f"{p}_us"] > 0 and r[f"{p}_mode"] == "eager"
        for p in ("stock", "gdn_rec", "fused"):
            assert r[f"{p}_cuda_ops"] is None  # counted on CUDA only
        assert set(r["gemm_split_us"]) == {"in_proj_qkvz", "in_proj_ba", "out_proj"}
        # A bf16 layer: the paths differ by transformers' roundings between stages (measured
        # about 6e-3 for fused, 1e-4 for gdn_rec, whose output is rounded like stock's); a
        # miswired path is off by order 1.
        assert r["check_rel_frob_vs_stock"]["fused"] < 2e-2 and r["check_rel_frob_vs_stock"]["gdn_rec"] < 2e-2
