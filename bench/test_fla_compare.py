"""bench/fla_compare.py's checks on the CPU: gdn's CPU backend against FLA's Triton kernels run by
Triton's interpreter (TRITON_INTERPRET=1), on a small shape. The decode cross-check (gdn.decode
against FLA's recurrence) and the fused check (FLA's conv update -> gdn.decode -> FLA's gated
RMSNorm against gdn.fused_decode on the same conv state, and on vLLM's layout), at T = 1 and at
T = 3 (FLA's prefill conv standing in), both state layouts, must pass, and --op flashinfer's calls, made on gdn's
FlashInfer drop-ins, must equal gdn.decode's; the fused check must fail when one side's norm
weight is 5% off. Skipped where torch or FLA (fla-core, einops: scripts/setup.sh --wheels DIR,
then pip install --no-deps DIR/*.whl) is missing.

Each run is a subprocess: the interpreter has to be chosen before Triton's kernels are defined,
and other tests of this session may have imported Triton already."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed")
if importlib.util.find_spec("fla") is None or importlib.util.find_spec("einops") is None:
    pytest.skip("FLA is not installed (scripts/setup.sh --wheels DIR; pip install --no-deps DIR/*.whl)",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))

CHECKS = r"""
import json, sys
import torch
import triton.runtime.autotuner as autotuner

# Autotuning times each config on a GPU, which the interpreter has not; every config computes
# the same, so one is taken, and not timed (Triton 3.6 times even a lone pruned config).
autotuner.Autotuner.prune_configs = lambda self, kwargs: self.configs[-1:]
autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]
sys.path.insert(0, sys.argv[1])
import fla_compare as fc

fc.DEV = "cpu"
gen = torch.Generator().manual_seed(3)
sh = fc.Shape(H=2, HV=4, K=64, V=64)
out = {"decode": fc.cross_check(gen, sh, B=3, T=2, layouts=("VK", "KV")), "fused": []}


def fused_case(T, state, layout):
    f = fc.make_fused_inputs(sh, 3, T, gen)
    s = fc.uniform(fc.state_shape(sh, 3, layout), 0.1732, fc.DTYPES[state], gen)
    c = fc.uniform((3, sh.D, fc.CONV_W), 3 ** 0.5, torch.bfloat16, gen)
    return fc.check_fused(sh, f, s, c, layout)


for layout in ("VK", "KV"):
    for T in (1, 3):
        for state in ("fp32", "bf16"):
            out["fused"].append({"layout": layout, "T": T, "state_dtype": state, **fused_case(T, state, layout)})



def fi_case(state, T):
    # --op flashinfer's calls, made on gdn's drop-ins (FlashInfer's signatures): the same o and
    # pool as gdn.decode over the same slots, so the arguments are complete and the state updated.
    x = fc.make_inputs(sh, 3, T, torch.bfloat16, gen)
    pool = fc.uniform((6, sh.HV, sh.V, sh.K), 0.1732, fc.DTYPES[state], gen)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    name = fc.fi_function(state, T)
    got, o_got = pool.clone(), torch.empty_like(x["v"])
    getattr(gdn.flashinfer, name)(**fc.fi_kwargs(name, x, got, slots, o_got))
    want, o_want = pool.clone(), torch.empty_like(x["v"])
    gdn.decode(x["q"], x["k"], x["v"], want, o_want, a=x["a"], b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"],
               layout="VK", scale=sh.K ** -0.5, use_qk_l2norm=True, read_slots=slots)
    return {"state": state, "T": T, "function": name, "o_equal": torch.equal(o_got, o_want),
            "pool_equal": torch.equal(got, want), "pool_changed": not torch.equal(got, pool)}


import gdn.flashinfer
out["flashinfer_calls"] = [fi_case(s, T) for s, T in (("fp32", 1), ("fp32", 4), ("bf16", 4))]

run_fused = fc.run_fused
fc.run_fused = lambda sh, f, s, c, o, layout: run_fused(sh, dict(f, norm_weight=f["norm_weight"] * 1.05), s, c, o,
                                                       layout)
out["wrong_norm_weight"] = fused_case(1, "fp32", "KV")
print("RESULT " + json.dumps(out))
"""


def test_checks_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", CHECKS, HERE], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert len(out["decode"]) == 8 and all(c["ok"] for c in out["decode"]), out["decode"]
    assert len(out["fused"]) == 8
    for c in out["fused"]:
        assert c["ok"], c
        assert c["conv_state_equal"] and c["vllm_layout"]["conv_state_equal"], c
        # the rounding differences are there (the chain does round), well inside the tolerance
        assert 1e-4 < c["o"]["rel_frob"] < 1e-2, c
    fi = out["flashinfer_calls"]
    assert [c["function"] for c in fi] == ["gated_delta_rule_decode_pretranspose", "gated_delta_rule_mtp",
                                           "gated_delta_rule_decode_pretranspose"], fi
    assert all(c["o_equal"] and c["pool_equal"] and c["pool_changed"] for c in fi), fi
    wrong = out["wrong_norm_weight"]
    assert not wrong["ok"] and wrong["o"]["rel_frob"] > 2e-2 and wrong["conv_state_equal"], wrong
