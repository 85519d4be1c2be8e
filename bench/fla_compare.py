#!/usr/bin/env python3
"""gdn vs FLA (flash-linear-attention, Triton) in one process, one method, the same inputs.

--op decode (the default): the recurrence alone. bf16 q/k/v/a/b, dense (state row n = batch
row n), state updated, no intermediate cache, the same state layout for both (--layout): VK
[B, HV, V, K] (FLA's state_v_first=True) or KV [B, HV, K, V] (FLA's default). Both get the raw
gates: FLA's fused_recurrent_gated_delta_rule with
use_gate_in_kernel, use_beta_sigmoid_in_kernel and use_qk_l2norm_in_kernel computes
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) and the q/k L2 norm in its
kernel, as gdn does, so nothing is computed outside either timed call (the anchors' FLA
figures, shared/anchors.md, were taken the same way). FLA always writes the final state to
a freshly allocated fp32 tensor; that allocation is captured as it is. gdn updates the state
in place. Checks gdn's o and final state against FLA's at B = 4, T = 2 first.

--op fused: the GDN layer's decode step between its projections (docs/semantics.md section 6),
per (model, state dtype, T, B), on the same inputs (bf16 mixed_qkv [B, T, D], D = 2*H*K + HV*V,
conv taps [D, 4], z [B, T, HV, V], norm weight [V]; raw gates; q/k L2 norm in kernel):
  decode_us     gdn.decode alone, on q, k, v views of a [B, T, D] tensor (the chain's middle call);
  chain_us      the three kernels an engine runs: FLA's causal_conv1d_update (W = 4, SiLU, the
                conv state [B, D, 4] updated in place) -> gdn.decode on q, k, v views of its
                output -> FLA's rms_norm_gated (norm before gate, silu(z)), which allocates its
                output. FLA 0.6.0 has no conv update over T > 1 tokens: at T > 1 its prefill
                conv (causal_conv1d with initial_state and output_final_state, two kernels, the
                new conv state in a fresh tensor) stands in, and that state is copied back into
                the pool (a third kernel);
  fused_us      gdn.fused_decode doing the same work in one call, on the same conv state tensor
                (FLA's [B, D, 4] layout: each channel's columns contiguous, gdn's channel-major
                16-byte conv path);
  fused_vllm_us the same with the conv state in vLLM's [B, 3, D] memory (a [B, D, 3] view, the
                layout of gdn bench --op fused: gdn's 16-byte conv path).
Before timing, each configuration runs the chain and both fused calls once from copies of the
same state and conv state and compares them (the chain rounds the conv output and the
recurrence's output to bf16, the fused step keeps them fp32: o and the state agree to bf16
rounding, the conv states exactly). Dense mode throughout: FLA's conv update has no slots.
FLA's conv and norm kernels are autotuned on their first call per D (their keys hold no batch
size), that is at the sweep's first B; Triton keeps the choice on disk (FLA_CACHE_RESULTS).

--op flashinfer: FlashInfer's own decode kernels (flashinfer-python 0.7.2, its sm_90 CuTe-DSL
kernels; imported only for this op) against gdn.flashinfer's functions of the same names, called
with the same arguments on the same inputs: bf16 q/k/v/a/b, raw gates, q/k L2 norm in kernel,
pool mode (a pool of 2B slots, B distinct random read slots, written in place), no cache, state
updated. T = 1, and bf16 states at T > 1: gated_delta_rule_decode_pretranspose; fp32 states at
T > 1: gated_delta_rule_mtp with disable_state_update=False. Each configuration first runs both
once from copies of one pool and compares o and the written slots (fi_check). FlashInfer
compiles a kernel per configuration on its first call (a few seconds each), outside the timing.

Method (gdn bench's, docs/design.md section 5): per configuration `calls` calls are
captured into one torch.cuda.CUDAGraph, call i on state buffer i % N (and conv state buffer
i % N), with N chosen so the state bytes of the other calls are >= 4x L2: every call finds its
state cold. One warm-up replay, then the median over --reps replays of replay time / calls
(CUDA events). The copy ceiling is a 1 GiB torch copy in the same run; floor_us = state bytes
(read + write; with the conv state for --op fused) plus inputs and o, over it.

    python3 bench/fla_compare.py [--op decode|fused|flashinfer|all] [--model qwen3-next qwen3.5]
                                 [--T 1 2 4] [--B 1 4 16 64 256 512] [--state fp32 bf16]
                                 [--out-of-place] [--json PATH]

Defaults per op: decode: Qwen3-Next, fp32 state, T 1 2 4, B 1..512; fused: both models, fp32 and
bf16 state, T 1, B 1 4 16 64 256; flashinfer: Qwen3-Next, fp32 and bf16, T 1 4 8, B 1 16 64 512
(all: decode and fused). Exits 1 when a check fails (after writing the JSON).
"""

import argparse
import datetime
import json
import itertools
import math
import os
import statistics
import subprocess
import sys
from collections import deque
from typing import NamedTuple

import torch

try:
    import fla
    import triton
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv
    from fla.modules.causal_conv1d import causal_conv1d_update as fla_conv_update
    from fla.modules.fused_norm_gate import rms_norm_gated as fla_norm_gated
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_gdr
except Exception as e:  # ImportError, or Triton failing to find a GPU driver
    sys.stderr.write(f"fla is not importable ({type(e).__name__}: {e}).\nOn a machine with PyPI: "
                     "scripts/setup.sh --wheels .deps/wheels; then here: "
                     "python3 -m pip install --no-deps .deps/wheels/*.whl\n")
    sys.exit(2)
import gdn
import gdn.flashinfer  # noqa: F401  (--op flashinfer: the drop-ins of FlashInfer's functions)


class Shape(NamedTuple):
    H: int
    HV: int
    K: int
    V: int

    @property
    def D(self):  # conv channels: q | k | v
        return 2 * self.H * self.K + self.HV * self.V


MODELS = {"qwen3-next": Shape(16, 32, 128, 128), "qwen3.5": Shape(16, 64, 128, 128)}  # TP1
CONV_W = 4
NORM_EPS = 1e-6  # both models' rms_norm_eps
DEV = "cuda"  # a test sets "cpu" (gdn's CPU backend, FLA under TRITON_INTERPRET=1) for the checks
FLA_ENTRY = ("fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule(use_qk_l2norm_in_kernel=True, "
             "use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True for the VK layout, "
             "False for KV, output_final_state=True); its final state goes to a fresh fp32 tensor each call "
             "(captured as is, kept alive for N calls); gdn.decode(layout='VK' or 'KV', raw gates) updates the "
             "state in place")
GATING = ("raw a, b, A_log, dt_bias to both; gate, beta sigmoid and q/k L2 norm in kernel for both; "
          "nothing outside the timed calls")
CHAIN_ENTRY = ("chain: fla.modules.causal_conv1d.causal_conv1d_update(x [B, 1, D], cache [B, D, 4] updated in "
               "place, weight [D, 4], activation='silu') (T > 1: causal_conv1d(initial_state=cache, "
               "output_final_state=True, activation='silu') then cache.copy_(final state)) -> gdn.decode(q, k, v "
               "views of its output, raw gates, use_qk_l2norm=True, the state in --layout, o preallocated) -> "
               "fla.modules.fused_norm_gate.rms_norm_gated(o, z, norm_weight, activation='silu', eps=1e-6) "
               "(norm before gate, allocates its output); fused: gdn.fused_decode(mixed_qkv, conv_weight, the "
               "same conv state [B, D, 4], norm_weight, z, norm_eps=1e-6, the same gates); fused_vllm: the same "
               "with a conv state in vLLM's [B, 3, D] memory as a [B, D, 3] view; decode: gdn.decode alone on "
               "q, k, v views of a [B, T, D] tensor; dense, no conv bias, bf16 conv state")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Chain against fused: the chain rounds the conv output (q, k, v) and the recurrence's output to
# bf16 where the fused step keeps fp32. Measured rel_frob (gdn's CPU backend against FLA
# interpreted, both models and state dtypes, T = 1 and 3): o 4.7-4.9e-3, state 3.1-4.5e-3. A
# norm weight 5% off in one of them (bench/test_fla_compare.py) fails.
CHAIN_TOL = 2e-2


def method(args):
    return (f"one torch.cuda.CUDAGraph of `calls` calls per configuration, call i on state (and conv state) buffer "
            f"i % N, N such that the other calls' state bytes are >= {args.l2_multiple:g}x L2 (cold state); one "
            f"warm-up replay, then the median over {args.reps} replays of replay time / calls (CUDA events)")


def uniform(shape, amp, dtype, gen):
    return torch.empty(shape, dtype=dtype, device=DEV).uniform_(-amp, amp, generator=gen)


def make_inputs(sh, B, T, dtype, gen):
    # gdn bench's distributions: unit variance for q, k, v, a, b (uniform amplitude sqrt(3)).
    x = {n: uniform((B, T, sh.H, sh.K), 3 ** 0.5, dtype, gen) for n in ("q", "k")}
    x["v"] = uniform((B, T, sh.HV, sh.V), 3 ** 0.5, dtype, gen)
    x.update(make_gates(sh, B, T, dtype, gen))
    return x


def make_gates(sh, B, T, dtype, gen):
    x = {"a": uniform((B, T, sh.HV), 3 ** 0.5, dtype, gen), "b": uniform((B, T, sh.HV), 3 ** 0.5, dtype, gen)}
    x["A_log"] = torch.empty(sh.HV, device=DEV).uniform_(1, 16, generator=gen).log()
    x["dt_bias"] = uniform((sh.HV,), 0.1732, torch.float32, gen)
    return x


def make_fused_inputs(sh, B, T, gen):
    # gdn bench --op fused's distributions: taps of variance 1/4, so the conv output has about unit variance.
    f = {"mixed_qkv": uniform((B, T, sh.D), 3 ** 0.5, torch.bfloat16, gen)}
    f.update(make_gates(sh, B, T, torch.bfloat16, gen))
    f["conv_weight"] = uniform((sh.D, CONV_W), 0.866, torch.bfloat16, gen)
    f["z"] = uniform((B, T, sh.HV, sh.V), 3 ** 0.5, torch.bfloat16, gen)
    f["norm_weight"] = uniform((sh.V,), 1.732, torch.bfloat16, gen)
    return f


def split_qkv(sh, y):
    """q, k, v as views of a [B, T, D] conv output (how engines pass them on)."""
    hk = sh.H * sh.K
    return (y[..., :hk].unflatten(-1, (sh.H, sh.K)), y[..., hk:2 * hk].unflatten(-1, (sh.H, sh.K)),
            y[..., 2 * hk:].unflatten(-1, (sh.HV, sh.V)))


def state_shape(sh, B, layout):
    return (B, sh.HV, sh.V, sh.K) if layout == "VK" else (B, sh.HV, sh.K, sh.V)


def run_fla(x, state, g=None, beta=None, layout="VK"):
    """Returns (o, new fp32 state). With g, beta given: precomputed gates instead of raw."""
    raw = g is None
    return fla_gdr(x["q"], x["k"], x["v"], g=x["a"] if raw else g, beta=x["b"] if raw else beta,
                   scale=x["q"].shape[-1] ** -0.5, initial_state=state, output_final_state=True,
                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=raw, A_log=x["A_log"],
                   dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=raw, state_v_first=layout == "VK")


def run_gdn(x, state, o, g=None, beta=None, slots=None, layout="VK"):
    """slots: (read_slots, write_slots) into a pool `state`; None: dense, in place."""
    rs, ws = slots if slots is not None else (None, None)
    scale = x["q"].shape[-1] ** -0.5
    if g is None:
        return gdn.decode(x["q"], x["k"], x["v"], state, o, a=x["a"], b=x["b"], A_log=x["A_log"],
                          dt_bias=x["dt_bias"], layout=layout, scale=scale, use_qk_l2norm=True,
                          read_slots=rs, write_slots=ws)
    return gdn.decode(x["q"], x["k"], x["v"], state, o, g=g, beta=beta, layout=layout, scale=scale,
                      use_qk_l2norm=True, read_slots=rs, write_slots=ws)


def run_chain(sh, f, state, conv_state, o, layout="VK"):
    """FLA's conv update -> gdn.decode on views of its output (into o) -> FLA's gated RMSNorm;
    returns the norm's output. conv_state [B, D, W] is FLA's layout and is updated in place;
    `state` is in `layout`."""
    x = f["mixed_qkv"]
    if x.shape[1] == 1:
        y, _ = fla_conv_update(x, conv_state, weight=f["conv_weight"], activation="silu")
    else:
        y, final = fla_conv(x, weight=f["conv_weight"], initial_state=conv_state, output_final_state=True,
                            activation="silu")
        conv_state.copy_(final)
    q, k, v = split_qkv(sh, y)
    run_gdn(dict(f, q=q, k=k, v=v), state, o, layout=layout)
    return fla_norm_gated(o, f["z"], f["norm_weight"], None, activation="silu", eps=NORM_EPS)


def fused_kwargs(sh, f, layout="VK"):
    return dict(norm_weight=f["norm_weight"], z=f["z"], norm_eps=NORM_EPS, a=f["a"], b=f["b"], A_log=f["A_log"],
                dt_bias=f["dt_bias"], layout=layout, scale=sh.K ** -0.5, use_qk_l2norm=True)


def run_fused(sh, f, state, conv_state, o, layout="VK"):
    return gdn.fused_decode(f["mixed_qkv"], f["conv_weight"], conv_state, state, o, **fused_kwargs(sh, f, layout))


def vllm_conv_pool(B, D, dtype=torch.bfloat16):
    """A conv state in vLLM's memory layout [B, W - 1, D], as the [B, D, W - 1] view gdn takes."""
    return torch.empty((B, CONV_W - 1, D), dtype=dtype, device=DEV).transpose(1, 2)


def diff(got, want):
    d = (got.float() - want.float())
    return {"max_abs": d.abs().max().item(), "max_abs_over_max": (d.abs().max() / want.float().abs().max()).item(),
            "rel_frob": (d.norm() / want.float().norm()).item()}


def cross_check(gen, sh=MODELS["qwen3-next"], B=4, T=2, layouts=("VK",)):
    """o and final state of gdn against FLA's, same inputs, raw and precomputed gates."""
    out = []
    for layout, name in itertools.product(layouts, ("bf16", "fp32")):
        x = make_inputs(sh, B, T, DTYPES[name], gen)
        s0 = uniform(state_shape(sh, B, layout), 0.1732, torch.float32, gen)
        g = -x["A_log"].exp() * torch.nn.functional.softplus(x["a"].float() + x["dt_bias"])
        beta = torch.sigmoid(x["b"].float())
        for gates, gb in (("raw", (None, None)), ("precomputed", (g, beta))):
            o_f, s_f = run_fla(x, s0, *gb, layout=layout)
            s_g = s0.clone()
            o_g = run_gdn(x, s_g, torch.empty_like(x["v"]), *gb, layout=layout)
            r = {"layout": layout, "qkv": name, "gates": gates, "o": diff(o_g, o_f), "state": diff(s_g, s_f)}
            # fp32 sums in different orders (and FLA's approximate exp/log): ~1e-6 relative;
            # a bf16 o also shows the odd 1-ulp rounding flip.
            r["ok"] = r["state"]["rel_frob"] < 1e-4 and r["o"]["rel_frob"] < (1e-2 if name == "bf16" else 1e-4)
            out.append(r)
            print(f"check {layout} B={B} T={T} qkv {name:4} gates {gates:11}: "
                  + "; ".join(f"{t} max abs {r[t]['max_abs']:.2e} (/max {r[t]['max_abs_over_max']:.2e}) "
                              f"rel frob {r[t]['rel_frob']:.2e}" for t in ("o", "state"))
                  + ("" if r["ok"] else "  MISMATCH"))
    return out


def check_fused(sh, f, state, conv_state, layout="VK"):
    """The chain, the fused step on the same conv state layout and the fused step on vLLM's layout,
    each once from copies of `state` (in `layout`) and `conv_state` ([B, D, W], FLA's layout);
    returns the comparisons of o, the state and the conv state, and "ok"."""
    B, T = f["mixed_qkv"].shape[:2]
    o_shape = (B, T, sh.HV, sh.V)
    s_c, c_c = state.clone(), conv_state.clone()
    o_c = run_chain(sh, f, s_c, c_c, torch.empty(o_shape, dtype=torch.bfloat16, device=DEV), layout)
    s_f, c_f = state.clone(), conv_state.clone()
    o_f = run_fused(sh, f, s_f, c_f, torch.empty(o_shape, dtype=torch.bfloat16, device=DEV), layout)
    c_v = vllm_conv_pool(B, sh.D)
    c_v.copy_(conv_state[:, :, 1:])  # the W - 1 columns the step reads (FLA keeps W, the oldest unused)
    s_v = state.clone()
    o_v = run_fused(sh, f, s_v, c_v, torch.empty(o_shape, dtype=torch.bfloat16, device=DEV), layout)
    # conv states hold copies of bf16 inputs in all three: bit-identical
    r = {"o": diff(o_f, o_c), "state": diff(s_f, s_c), "conv_state_equal": torch.equal(c_f, c_c)}
    v = r["vllm_layout"] = {"o": diff(o_v, o_f), "state": diff(s_v, s_f),
                            "conv_state_equal": torch.equal(c_v, c_f[:, :, 1:])}
    r["ok"] = all(c["conv_state_equal"] and c["o"]["rel_frob"] < CHAIN_TOL and c["state"]["rel_frob"] < CHAIN_TOL
                  for c in (r, v))
    return r


FI_ENTRY = ("flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, "
            "scale, output, use_qk_l2norm=True, initial_state=pool, initial_state_indices=slots) at T = 1 and for "
            "bf16 states; gated_delta_rule_mtp(q, k, v, pool, slots, A_log, a, dt_bias, b, scale, output, "
            "disable_state_update=False, use_qk_l2norm=True) for fp32 states at T > 1; gdn: gdn.flashinfer's "
            "function of the same name with the same arguments (gdn.decode, layout VK, in place); pool of 2B "
            "slots, B distinct random read slots, no padding, no cache")


def fi_function(state_name, T):
    """FlashInfer's entry for a configuration (its mtp function takes fp32 states only)."""
    return "gated_delta_rule_decode_pretranspose" if T == 1 or state_name == "bf16" else "gated_delta_rule_mtp"


def fi_kwargs(name, x, pool, slots, o):
    kw = dict(q=x["q"], k=x["k"], v=x["v"], A_log=x["A_log"], a=x["a"], dt_bias=x["dt_bias"], b=x["b"],
              scale=x["q"].shape[-1] ** -0.5, output=o, use_qk_l2norm=True, initial_state=pool,
              initial_state_indices=slots)
    if name == "gated_delta_rule_mtp":
        return dict(kw, disable_state_update=False)
    return dict(kw, state=None)


def bench_flashinfer(fi, sh, state_name, T, B, args, l2, tbs, gen):
    """FlashInfer's kernel against gdn.flashinfer's drop-in of the same function, same arguments."""
    floor_us, N, calls = decode_sizes(sh, state_name, T, B, args, l2, tbs)
    x = make_inputs(sh, B, T, torch.bfloat16, gen)
    P = 2 * B
    slots = torch.randperm(P, device=DEV, generator=gen)[:B].to(torch.int32)
    pools = [uniform((P, sh.HV, sh.V, sh.K), 0.1732, DTYPES[state_name], gen) for _ in range(N)]
    name = fi_function(state_name, T)
    fi_fn, gdn_fn = getattr(fi, name), getattr(gdn.flashinfer, name)
    o = torch.empty_like(x["v"])
    # Once each from copies of one pool (FlashInfer compiles its kernel here): o, the slots written.
    p_fi, p_gdn = pools[0].clone(), pools[0].clone()
    o_fi, o_gdn = torch.empty_like(o), torch.empty_like(o)
    fi_fn(**fi_kwargs(name, x, p_fi, slots, o_fi))
    gdn_fn(**fi_kwargs(name, x, p_gdn, slots, o_gdn))
    idx = slots.long()
    check = {"o": diff(o_gdn, o_fi), "state": diff(p_gdn[idx], p_fi[idx])}
    # bf16 o and bf16 states round the same fp32 values: a 1-ulp flip here and there.
    check["ok"] = check["o"]["rel_frob"] < 1e-2 and check["state"]["rel_frob"] < (1e-2 if state_name == "bf16" else 1e-4)
    fi_us = time_graph(lambda i: fi_fn(**fi_kwargs(name, x, pools[i % N], slots, o)), calls, args.reps)
    gdn_us = time_graph(lambda i: gdn_fn(**fi_kwargs(name, x, pools[i % N], slots, o)), calls, args.reps)
    del pools
    torch.cuda.empty_cache()
    return {"state": state_name, "T": T, "B": B, "N": N, "calls": calls, "function": name,
            "floor_us": round(floor_us, 3), "flashinfer_us": round(fi_us, 3), "gdn_us": round(gdn_us, 3),
            "flashinfer_over_gdn": round(fi_us / gdn_us, 3), "fi_check": check}


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


def rotation(touched, floor_us, args, l2):
    """(N, calls): N buffers so that the other calls' state bytes are >= l2_multiple x L2."""
    cold = args.l2_multiple * l2
    N = 1 if touched >= cold else min(512, math.ceil(cold / touched) + 1)
    return N, max(N, 3 if floor_us > 2000 else args.calls)


def decode_sizes(sh, state_name, T, B, args, l2, tbs):
    """(floor_us, N, calls) of a decode configuration: its bytes (B states read and written,
    bf16 q/k/v/o, fp32 gates) over the copy ceiling, and the rotation that keeps states cold."""
    touched = B * sh.HV * sh.V * sh.K * (2 if state_name == "bf16" else 4) * 2
    nbytes = touched + B * T * (2 * sh.H * sh.K + 2 * sh.HV * sh.V) * 2 + B * T * sh.HV * 4
    floor_us = nbytes / (tbs * 1e12) * 1e6
    return (floor_us, *rotation(touched, floor_us, args, l2))


def bench(sh, state_name, T, B, args, l2, tbs, gen, layout="VK"):
    floor_us, N, calls = decode_sizes(sh, state_name, T, B, args, l2, tbs)
    x = make_inputs(sh, B, T, torch.bfloat16, gen)
    states = [uniform(state_shape(sh, B, layout), 0.1732, DTYPES[state_name], gen) for _ in range(N)]

    # FLA's fresh final states stay alive for N calls, so the allocator hands call i the buffer
    # of call i - N - 1: its writes go to memory as cold as gdn's, not to one L2-resident buffer.
    keep = deque(maxlen=N)
    fla_us = time_graph(lambda i: keep.append(run_fla(x, states[i % N], layout=layout)), calls, args.reps,
                        keep.clear)
    keep.clear()
    o = torch.empty_like(x["v"])
    gdn_us = time_graph(lambda i: run_gdn(x, states[i % N], o, layout=layout), calls, args.reps)
    del states
    torch.cuda.empty_cache()
    row = {"layout": layout, "state": state_name, "T": T, "B": B, "N": N, "calls": calls,
           "floor_us": round(floor_us, 3), "fla_us": round(fla_us, 3), "gdn_us": round(gdn_us, 3),
           "fla_over_gdn": round(fla_us / gdn_us, 3)}
    if args.out_of_place:
        # FLA's traffic with gdn's kernel: each call reads slot n of a pool of 2B slots and writes
        # slot B + n (split read/write slots), so the final state goes to memory other than the
        # initial one, as FLA's fresh tensor does.
        pools = [uniform(state_shape(sh, 2 * B, layout), 0.1732, DTYPES[state_name], gen) for _ in range(N)]
        rs = torch.arange(B, dtype=torch.int32, device=DEV)
        slots = (rs, rs + B)
        row["gdn_oop_us"] = round(time_graph(lambda i: run_gdn(x, pools[i % N], o, slots=slots, layout=layout),
                                             calls, args.reps), 3)
        row["fla_over_gdn_oop"] = round(fla_us / row["gdn_oop_us"], 3)
        del pools
        torch.cuda.empty_cache()
    return row


def fla_tuned_configs():
    """The configs FLA's autotuners chose for the conv update and the norm (their keys hold no B)."""
    from fla.modules.causal_conv1d import ops as conv_ops
    from fla.modules.norm import fused_norm_gate as norm_ops

    def best(kernel):
        while kernel is not None and not hasattr(kernel, "best_config"):
            kernel = getattr(kernel, "fn", None)
        return str(kernel.best_config) if kernel is not None else None
    try:
        return {"conv": best(conv_ops.causal_conv1d_update_kernel), "norm": best(norm_ops.layer_norm_gated_fwd_kernel)}
    except AttributeError:  # another FLA version's internals
        return None


def bench_fused(model, state_name, T, B, args, l2, tbs, gen, layout="VK"):
    sh = MODELS[model]
    es = 2 if state_name == "bf16" else 4
    conv_bytes = B * sh.D * CONV_W * 2  # FLA's layout keeps W columns (vLLM's W - 1)
    touched = 2 * (B * sh.HV * sh.V * sh.K * es + conv_bytes)
    # inputs mixed_qkv, z, a, b and o: the fused step's traffic, the chain's least
    nbytes = touched + B * T * (sh.D + 2 * sh.HV * sh.V + 2 * sh.HV) * 2
    floor_us = nbytes / (tbs * 1e12) * 1e6
    N, calls = rotation(touched, floor_us, args, l2)
    f = make_fused_inputs(sh, B, T, gen)
    states = [uniform(state_shape(sh, B, layout), 0.1732, DTYPES[state_name], gen) for _ in range(N)]
    convs = [uniform((B, sh.D, CONV_W), 3 ** 0.5, torch.bfloat16, gen) for _ in range(N)]
    vconvs = [vllm_conv_pool(B, sh.D) for _ in range(N)]
    for cf, cv in zip(convs, vconvs):
        cv.copy_(cf[:, :, 1:])
    o = torch.empty((B, T, sh.HV, sh.V), dtype=torch.bfloat16, device=DEV)
    # A valid call the CUDA backend cannot run (a GVA group that does not fit one cluster) is
    # kNotSupported: the row says why and has no fused times. The conv layout does not enter this.
    can = gdn.can_implement_fused(f["mixed_qkv"], f["conv_weight"], convs[0], states[0], o,
                                  **fused_kwargs(sh, f, layout))
    check = check_fused(sh, f, states[0], convs[0], layout) if can else None

    y = uniform((B, T, sh.D), 1.0, torch.bfloat16, gen)
    q, k, v = split_qkv(sh, y)
    xd = dict(f, q=q, k=k, v=v)
    us = {"decode": time_graph(lambda i: run_gdn(xd, states[i % N], o, layout=layout), calls, args.reps),
          "chain": time_graph(lambda i: run_chain(sh, f, states[i % N], convs[i % N], o, layout), calls, args.reps)}
    if can:
        us["fused"] = time_graph(lambda i: run_fused(sh, f, states[i % N], convs[i % N], o, layout), calls,
                                 args.reps)
        us["fused_vllm"] = time_graph(lambda i: run_fused(sh, f, states[i % N], vconvs[i % N], o, layout), calls,
                                      args.reps)
    del states, convs, vconvs
    torch.cuda.empty_cache()
    row = {"op": "fused", "model": model, **sh._asdict(), "D": sh.D, "W": CONV_W, "layout": layout,
           "state": state_name, "T": T,
           "B": B, "N": N, "calls": calls, "floor_us": round(floor_us, 3)}
    row.update({f"{k}_us": round(us[k], 3) if k in us else None for k in ("decode", "chain", "fused", "fused_vllm")})
    for a, b in (("chain", "fused"), ("chain", "fused_vllm"), ("chain", "decode"), ("fused", "decode")):
        row[f"{a}_over_{b}"] = round(us[a] / us[b], 3) if a in us and b in us else None
    row.update({"chain_conv": "causal_conv1d_update" if T == 1 else "causal_conv1d(initial_state) + copy_",
                "fla_configs": fla_tuned_configs(), "check": check})
    if not can:
        row["fused_unsupported"] = can.message
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


DEFAULTS = {"decode": {"model": ["qwen3-next"], "state": ["fp32"], "T": [1, 2, 4], "B": [1, 4, 16, 64, 256, 512]},
            "fused": {"model": list(MODELS), "state": ["fp32", "bf16"], "T": [1], "B": [1, 4, 16, 64, 256]},
            "flashinfer": {"model": ["qwen3-next"], "state": ["fp32", "bf16"], "T": [1, 4, 8], "B": [1, 16, 64, 512]}}


def print_decode_table(rows):
    print(f"\n{'model':10} {'layout':6} {'state':5} {'T':>2} {'B':>4} {'floor_us':>9} {'FLA_us':>9} {'gdn_us':>9} "
          f"{'FLA/gdn':>8}" + ("  gdn_oop_us FLA/oop" if any("gdn_oop_us" in r for r in rows) else ""))
    for r in rows:
        print(f"{r['model']:10} {r['layout']:6} {r['state']:5} {r['T']:2} {r['B']:4} {r['floor_us']:9.2f} "
              f"{r['fla_us']:9.2f} {r['gdn_us']:9.2f} {r['fla_over_gdn']:8.2f}"
              + (f"  {r['gdn_oop_us']:10.2f} {r['fla_over_gdn_oop']:7.2f}" if "gdn_oop_us" in r else ""))


def print_fused_table(rows):
    def num(x, w):
        return f"{x:{w}.2f}" if x is not None else f"{'-':>{w}}"

    print(f"\n{'model':10} {'layout':6} {'state':5} {'T':>2} {'B':>4} {'floor_us':>9} {'decode_us':>9} "
          f"{'chain_us':>9} {'fused_us':>9} {'f_vllm_us':>9} {'chain/fused':>11} {'chain/f_vllm':>12} "
          f"{'fused/decode':>12} check")
    for r in rows:
        print(f"{r['model']:10} {r['layout']:6} {r['state']:5} {r['T']:2} {r['B']:4} {num(r['floor_us'], 9)} "
              f"{num(r['decode_us'], 9)} "
              f"{num(r['chain_us'], 9)} {num(r['fused_us'], 9)} {num(r['fused_vllm_us'], 9)} "
              f"{num(r['chain_over_fused'], 11)} {num(r['chain_over_fused_vllm'], 12)} "
              f"{num(r['fused_over_decode'], 12)} " + check_word(r))


def print_flashinfer_table(rows):
    print(f"\n{'model':10} {'state':5} {'T':>2} {'B':>4} {'floor_us':>9} {'FI_us':>9} {'gdn_us':>9} {'FI/gdn':>7} check")
    for r in rows:
        print(f"{r['model']:10} {r['state']:5} {r['T']:2} {r['B']:4} {r['floor_us']:9.2f} {r['flashinfer_us']:9.2f} "
              f"{r['gdn_us']:9.2f} {r['flashinfer_over_gdn']:7.2f} {'ok' if r['fi_check']['ok'] else 'MISMATCH'}")


def check_word(r):
    return "not supported" if r["check"] is None else "ok" if r["check"]["ok"] else "MISMATCH"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=["decode", "fused", "flashinfer", "all"], default="decode",
                   help="decode: gdn.decode against FLA's recurrence; fused: decode, the conv -> decode -> norm "
                        "chain and gdn.fused_decode; flashinfer: FlashInfer's decode kernels against gdn's drop-ins "
                        "(needs flashinfer-python); all: decode and fused")
    p.add_argument("--model", nargs="+", choices=list(MODELS), help="default: qwen3-next for decode, both for fused")
    p.add_argument("--T", type=int, nargs="+", help="default: 1 2 4 for decode, 1 for fused")
    p.add_argument("--B", type=int, nargs="+", help="default: 1 4 16 64 256 512 for decode, 1 4 16 64 256 for fused")
    p.add_argument("--state", nargs="+", choices=sorted(DTYPES),
                   help="state dtype (FLA's recurrence reads it, and writes fp32 whatever it is); default: fp32 "
                        "for decode, fp32 bf16 for fused")
    p.add_argument("--layout", nargs="+", choices=["VK", "KV"], default=["VK"],
                   help="the state layout: decode, of both (VK: FLA's state_v_first=True; KV: FLA's default); "
                        "fused, of gdn.decode in the chain and of gdn.fused_decode (KV: transformers' and FLA's cache)")
    p.add_argument("--calls", type=int, default=20, help="calls per graph (at least N; 3 above a 2 ms floor)")
    p.add_argument("--reps", type=int, default=5, help="timed replays (median)")
    p.add_argument("--l2-multiple", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write device, versions, copy ceiling, checks and rows to this path")
    p.add_argument("--out-of-place", action="store_true",
                   help="decode: also time gdn writing the final state to other slots than it reads "
                        "(FLA's traffic: gdn_oop_us)")
    args = p.parse_args()
    if not torch.cuda.is_available() or not gdn.cuda_available():
        sys.exit("needs a CUDA GPU and gdn built with its CUDA backend")
    ops = ["decode", "fused"] if args.op == "all" else [args.op]

    def sweep(op, key):
        return getattr(args, key) or DEFAULTS[op][key]

    prop = torch.cuda.get_device_properties(0)
    l2 = prop.L2_cache_size
    device = f"{prop.name}, {prop.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB"
    fla_version = fla.__version__  # fla-core's (the kernels' package)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    # on every row too, so that rows of several runs can be pooled
    stamp = {"device": device, "commit": commit(), "date": datetime.date.today().isoformat(),
             "method": method(args)}
    rows, check, ok = [], None, True
    with torch.no_grad():
        tbs = copy_tbs()
        print(f"device {device}; torch {torch.__version__}, triton {triton.__version__}, "
              f"fla-core {fla_version}, gdn {stamp['commit']}; copy ceiling {tbs:.3f} TB/s\nmethod: {stamp['method']}")
        if "decode" in ops:
            print(f"FLA: {FLA_ENTRY}\ngating: {GATING}")
            check = cross_check(gen, layouts=args.layout)
            ok = all(r["ok"] for r in check)
            for model, layout, s, T, B in itertools.product(sweep("decode", "model"), args.layout,
                                                            sweep("decode", "state"), sweep("decode", "T"),
                                                            sweep("decode", "B")):
                r = {"op": "decode", "model": model,
                     **bench(MODELS[model], s, T, B, args, l2, tbs, gen, layout), **stamp}
                rows.append(r)
                print(f"decode {model} {layout} {s} T={T} B={B}: FLA {r['fla_us']:.2f} us, gdn {r['gdn_us']:.2f} "
                      "us" + (f", gdn out of place {r['gdn_oop_us']:.2f} us" if args.out_of_place else ""),
                      flush=True)
        if "flashinfer" in ops:
            import flashinfer
            from flashinfer import gdn_decode as fi

            stamp["flashinfer_version"] = flashinfer.__version__
            print(f"flashinfer {flashinfer.__version__}: {FI_ENTRY}")
            for model in sweep("flashinfer", "model"):
                for s in sweep("flashinfer", "state"):
                    for T in sweep("flashinfer", "T"):
                        for B in sweep("flashinfer", "B"):
                            r = {"op": "flashinfer", "model": model,
                                 **bench_flashinfer(fi, MODELS[model], s, T, B, args, l2, tbs, gen), **stamp}
                            rows.append(r)
                            ok = ok and r["fi_check"]["ok"]
                            c = r["fi_check"]
                            print(f"flashinfer {model} {s} T={T} B={B} ({r['function']}): FlashInfer "
                                  f"{r['flashinfer_us']:.2f} us, gdn {r['gdn_us']:.2f} us; check o rel frob "
                                  f"{c['o']['rel_frob']:.2e}, state {c['state']['rel_frob']:.2e}"
                                  + ("" if c["ok"] else "  MISMATCH"), flush=True)
        if "fused" in ops:
            print(f"fused: {CHAIN_ENTRY}")
            for model, layout, s, T, B in itertools.product(sweep("fused", "model"), args.layout,
                                                            sweep("fused", "state"), sweep("fused", "T"),
                                                            sweep("fused", "B")):
                r = {**bench_fused(model, s, T, B, args, l2, tbs, gen, layout), **stamp}
                rows.append(r)
                c = r["check"]
                ok = ok and (c is None or c["ok"])
                print(f"fused {model} {layout} {s} T={T} B={B}: decode {r['decode_us']:.2f}, chain "
                      f"{r['chain_us']:.2f} us; " + (
                          f"fused not supported: {r['fused_unsupported']}" if c is None else
                          f"fused {r['fused_us']:.2f}, fused (vLLM conv layout) {r['fused_vllm_us']:.2f} "
                          f"us; check o rel frob {c['o']['rel_frob']:.2e}, state "
                          f"{c['state']['rel_frob']:.2e}, conv state "
                          f"{'equal' if c['conv_state_equal'] else 'DIFFERS'}: {check_word(r)}"),
                      flush=True)
    if "decode" in ops:
        print_decode_table([r for r in rows if r["op"] == "decode"])
    if "fused" in ops:
        print_fused_table([r for r in rows if r["op"] == "fused"])
    if "flashinfer" in ops:
        print_flashinfer_table([r for r in rows if r["op"] == "flashinfer"])
    if args.json:
        doc = {**stamp, "torch": torch.__version__, "triton": triton.__version__, "fla_version": fla_version,
               "gdn_commit": stamp["commit"], "copy_TBs": round(tbs, 4), "ops": ops,
               "fla_entry": FLA_ENTRY, "gating": GATING, "chain_entry": CHAIN_ENTRY, "flashinfer_entry": FI_ENTRY,
               "shape": {"models": {m: MODELS[m]._asdict() for m in MODELS}, "qkv": "bf16", "mode": "dense",
                         "layout": args.layout},
               "cross_check": check, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if not ok:
        sys.exit("a check failed: see MISMATCH above")


if __name__ == "__main__":
    main()
