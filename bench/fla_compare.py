#!/usr/bin/env python3
"""gdn vs FLA (flash-linear-attention, Triton) in one process, one method, the same inputs.

Qwen3-Next TP1 (H=16, HV=32, K=V=128), bf16 q/k/v/a/b, dense (state row n = batch row n),
state updated, no intermediate cache, state layout [B, HV, V, K] for both (gdn "VK", FLA
state_v_first). Both get the raw gates: FLA's fused_recurrent_gated_delta_rule with
use_gate_in_kernel, use_beta_sigmoid_in_kernel and use_qk_l2norm_in_kernel computes
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) and the q/k L2 norm in its
kernel, as gdn does, so nothing is computed outside either timed call (the anchors' FLA
figures, shared/anchors.md, were taken the same way). FLA always writes the final state to
a freshly allocated fp32 tensor; that allocation is captured as it is. gdn updates the state
in place.

Method (gdn bench's, docs/design.md section 5): per configuration `calls` calls are
captured into one torch.cuda.CUDAGraph, call i on state buffer i % N, with N chosen so the
state bytes of the other calls are >= 4x L2: every call finds its state cold. One warm-up
replay, then the median over --reps replays of replay time / calls (CUDA events). The copy
ceiling is a 1 GiB torch copy in the same run; floor_us = state bytes (read + write) plus
inputs and o, over it.

    python3 bench/fla_compare.py [--T 1 2 4] [--B 1 4 16 64 256 512] [--state fp32 bf16] [--out-of-place]
                                 [--json PATH]
"""

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from collections import deque

import torch

try:
    import fla
    import triton
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_gdr
except Exception as e:  # ImportError, or Triton failing to find a GPU driver
    sys.stderr.write(f"fla is not importable ({type(e).__name__}: {e}).\nOn a machine with PyPI: "
                     "scripts/setup.sh --wheels .deps/wheels; then here: "
                     "python3 -m pip install --no-deps .deps/wheels/*.whl\n")
    sys.exit(2)
import gdn

H, HV, K, V = 16, 32, 128, 128
SCALE = K ** -0.5
DEV = "cuda"  # a test may set "cpu" (gdn's CPU backend, FLA under TRITON_INTERPRET=1) for cross_check
FLA_ENTRY = ("fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule(use_qk_l2norm_in_kernel=True, "
             "use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, "
             "output_final_state=True); its final state goes to a fresh fp32 tensor each call (captured "
             "as is, kept alive for N calls); gdn.decode(layout='VK', raw gates) updates the state in place")
GATING = ("raw a, b, A_log, dt_bias to both; gate, beta sigmoid and q/k L2 norm in kernel for both; "
          "nothing outside the timed calls")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def uniform(shape, amp, dtype, gen):
    return torch.empty(shape, dtype=dtype, device=DEV).uniform_(-amp, amp, generator=gen)


def make_inputs(B, T, dtype, gen):
    # gdn bench's distributions: unit variance for q, k, v, a, b (uniform amplitude sqrt(3)).
    x = {n: uniform((B, T, H, K), 3 ** 0.5, dtype, gen) for n in ("q", "k")}
    x["v"] = uniform((B, T, HV, V), 3 ** 0.5, dtype, gen)
    x["a"] = uniform((B, T, HV), 3 ** 0.5, dtype, gen)
    x["b"] = uniform((B, T, HV), 3 ** 0.5, dtype, gen)
    x["A_log"] = torch.empty(HV, device=DEV).uniform_(1, 16, generator=gen).log()
    x["dt_bias"] = uniform((HV,), 0.1732, torch.float32, gen)
    return x


def run_fla(x, state, g=None, beta=None):
    """Returns (o, new fp32 state). With g, beta given: precomputed gates instead of raw."""
    raw = g is None
    return fla_gdr(x["q"], x["k"], x["v"], g=x["a"] if raw else g, beta=x["b"] if raw else beta,
                   scale=SCALE, initial_state=state, output_final_state=True,
                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=raw, A_log=x["A_log"],
                   dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=raw, state_v_first=True)


def run_gdn(x, state, o, g=None, beta=None, slots=None):
    """slots: (read_slots, write_slots) into a pool `state`; None: dense, in place."""
    rs, ws = slots if slots is not None else (None, None)
    if g is None:
        return gdn.decode(x["q"], x["k"], x["v"], state, o, a=x["a"], b=x["b"], A_log=x["A_log"],
                          dt_bias=x["dt_bias"], layout="VK", scale=SCALE, use_qk_l2norm=True,
                          read_slots=rs, write_slots=ws)
    return gdn.decode(x["q"], x["k"], x["v"], state, o, g=g, beta=beta, layout="VK", scale=SCALE,
                      use_qk_l2norm=True, read_slots=rs, write_slots=ws)


def diff(got, want):
    d = (got.float() - want.float())
    return {"max_abs": d.abs().max().item(), "max_abs_over_max": (d.abs().max() / want.float().abs().max()).item(),
            "rel_frob": (d.norm() / want.float().norm()).item()}


def cross_check(gen):
    """B=4, T=2: o and final state of gdn against FLA's, same inputs, raw and precomputed gates."""
    out = []
    for name in ("bf16", "fp32"):
        x = make_inputs(4, 2, DTYPES[name], gen)
        s0 = uniform((4, HV, V, K), 0.1732, torch.float32, gen)
        g = -x["A_log"].exp() * torch.nn.functional.softplus(x["a"].float() + x["dt_bias"])
        beta = torch.sigmoid(x["b"].float())
        for gates, gb in (("raw", (None, None)), ("precomputed", (g, beta))):
            o_f, s_f = run_fla(x, s0, *gb)
            s_g = s0.clone()
            o_g = run_gdn(x, s_g, torch.empty_like(x["v"]), *gb)
            r = {"qkv": name, "gates": gates, "o": diff(o_g, o_f), "state": diff(s_g, s_f)}
            # fp32 sums in different orders (and FLA's approximate exp/log): ~1e-6 relative;
            # a bf16 o also shows the odd 1-ulp rounding flip.
            r["ok"] = r["state"]["rel_frob"] < 1e-4 and r["o"]["rel_frob"] < (1e-2 if name == "bf16" else 1e-4)
            out.append(r)
            print(f"check B=4 T=2 qkv {name:4} gates {gates:11}: "
                  + "; ".join(f"{t} max abs {r[t]['max_abs']:.2e} (/max {r[t]['max_abs_over_max']:.2e}) "
                              f"rel frob {r[t]['rel_frob']:.2e}" for t in ("o", "state"))
                  + ("" if r["ok"] else "  MISMATCH"))
    return out


def copy_tbs():
    src = torch.ones(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for i in range(7):
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        if i:
            ts.append(e0.elapsed_time(e1))
    return 2 * src.numel() * 4 / (statistics.median(ts) * 1e-3) / 1e12


def time_graph(launch, calls, reps, after_warmup=lambda: None):
    side = torch.cuda.Stream()  # eager warm-up (Triton JIT, argument errors) as torch documents
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    after_warmup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            launch(i)
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(reps):
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        per_call.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(per_call)


def bench(state_name, T, B, args, l2, tbs, gen):
    es = 2 if state_name == "bf16" else 4
    touched = B * HV * V * K * es * 2
    nbytes = touched + B * T * (2 * H * K + 2 * HV * V) * 2 + B * T * HV * 4
    floor_us = nbytes / (tbs * 1e12) * 1e6
    cold = args.l2_multiple * l2
    N = 1 if touched >= cold else min(512, math.ceil(cold / touched) + 1)
    calls = max(N, 3 if floor_us > 2000 else args.calls)
    x = make_inputs(B, T, torch.bfloat16, gen)
    states = [uniform((B, HV, V, K), 0.1732, DTYPES[state_name], gen) for _ in range(N)]

    # FLA's fresh final states stay alive for N calls, so the allocator hands call i the buffer
    # of call i - N - 1: its writes go to memory as cold as gdn's, not to one L2-resident buffer.
    keep = deque(maxlen=N)
    fla_us = time_graph(lambda i: keep.append(run_fla(x, states[i % N])), calls, args.reps, keep.clear)
    keep.clear()
    o = torch.empty_like(x["v"])
    gdn_us = time_graph(lambda i: run_gdn(x, states[i % N], o), calls, args.reps)
    del states
    torch.cuda.empty_cache()
    row = {"state": state_name, "T": T, "B": B, "N": N, "calls": calls, "floor_us": round(floor_us, 3),
           "fla_us": round(fla_us, 3), "gdn_us": round(gdn_us, 3), "fla_over_gdn": round(fla_us / gdn_us, 3)}
    if args.out_of_place:
        # FLA's traffic with gdn's kernel: each call reads slot n of a pool of 2B slots and writes
        # slot B + n (split read/write slots), so the final state goes to memory other than the
        # initial one, as FLA's fresh tensor does.
        pools = [uniform((2 * B, HV, V, K), 0.1732, DTYPES[state_name], gen) for _ in range(N)]
        rs = torch.arange(B, dtype=torch.int32, device=DEV)
        slots = (rs, rs + B)
        row["gdn_oop_us"] = round(time_graph(lambda i: run_gdn(x, pools[i % N], o, slots=slots), calls,
                                             args.reps), 3)
        row["fla_over_gdn_oop"] = round(fla_us / row["gdn_oop_us"], 3)
        del pools
        torch.cuda.empty_cache()
    return row


def commit():
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--B", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    p.add_argument("--state", nargs="+", choices=sorted(DTYPES), default=["fp32"],
                   help="state dtype (FLA reads it, and writes fp32 whatever it is)")
    p.add_argument("--calls", type=int, default=20, help="calls per graph (at least N; 3 above a 2 ms floor)")
    p.add_argument("--reps", type=int, default=5, help="timed replays (median)")
    p.add_argument("--l2-multiple", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write device, versions, copy ceiling, check and rows to this path")
    p.add_argument("--out-of-place", action="store_true",
                   help="also time gdn writing the final state to other slots than it reads "
                        "(FLA's traffic: gdn_oop_us)")
    args = p.parse_args()
    if not torch.cuda.is_available() or not gdn.cuda_available():
        sys.exit("needs a CUDA GPU and gdn built with its CUDA backend")

    prop = torch.cuda.get_device_properties(0)
    l2 = prop.L2_cache_size
    device = f"{prop.name}, {prop.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB"
    fla_version = fla.__version__  # fla-core's (the kernels' package)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    with torch.no_grad():
        tbs = copy_tbs()
        print(f"device {device}; torch {torch.__version__}, triton {triton.__version__}, "
              f"fla-core {fla_version}, gdn {commit()}; copy ceiling {tbs:.3f} TB/s")
        print(f"FLA: {FLA_ENTRY}\ngating: {GATING}")
        check = cross_check(gen)
        print(f"\n{'state':5} {'T':>2} {'B':>4} {'floor_us':>9} {'FLA_us':>9} {'gdn_us':>9} {'FLA/gdn':>8}")
        rows = []
        for s in args.state:
            for T in args.T:
                for B in args.B:
                    r = bench(s, T, B, args, l2, tbs, gen)
                    rows.append(r)
                    print(f"{s:5} {T:2} {B:4} {r['floor_us']:9.2f} {r['fla_us']:9.2f} {r['gdn_us']:9.2f} "
                          f"{r['fla_over_gdn']:8.2f}" +
                          (f"  out of place {r['gdn_oop_us']:9.2f} {r['fla_over_gdn_oop']:6.2f}"
                           if args.out_of_place else ""), flush=True)
    if args.json:
        doc = {"device": device, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "triton": triton.__version__, "fla_version": fla_version, "gdn_commit": commit(),
               "copy_TBs": round(tbs, 4), "fla_entry": FLA_ENTRY, "gating": GATING,
               "shape": {"H": H, "HV": HV, "K": K, "V": V, "qkv": "bf16", "mode": "dense", "layout": "VK"},
               "cross_check": check, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
