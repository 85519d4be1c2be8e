#!/usr/bin/env python3
"""One transformers Qwen3-Next GDN layer's decode step, four ways, timed by CUDA-graph replay.

The layer is transformers' own Qwen3NextGatedDeltaNet with Qwen3-Next-80B-A3B's GDN shapes
(hidden 2048, H = 16 key heads, HV = 32 value heads, K = V = 128, conv W = 4), bf16 weights
and activations, and the cache transformers creates for it (conv state bf16 [B, D, W],
recurrent state fp32 [B, HV, K, V]) after a prefill of --prefill tokens by transformers:

  stock    the layer's forward as transformers runs it here; which conv and recurrence
           functions it resolved to is printed (its torch reference code unless FLA or
           causal-conv1d is installed)
  gdn_rec  the same forward with its recurrent rule (torch_recurrent_gated_delta_rule; for
           T > 1 from a cache transformers calls its chunked rule, swapped too) replaced by
           gdn.fla.fused_recurrent_gated_delta_rule: gdn for the recurrence only (it updates the
           cache's state in place; transformers then copies the state onto itself)
  fused    gdn.transformers.enable: the projections, one gdn.fused_decode (conv, recurrence,
           gated norm), out_proj
  gemms    in_proj_qkvz(x), in_proj_ba(x) and out_proj(o) alone on the same B x T rows

Method: per path and B, --calls layer steps on one input are captured into one
torch.cuda.CUDAGraph after an eager warm-up on a side stream; one warm-up replay, then the
median over --reps replays of replay time / calls (CUDA events). States warm: every call of a
path updates the same cache (at B = 4 the recurrent state is 8 MiB, L2-resident on an H100),
as a decode loop over one batch does. A path that graph capture refuses is timed eagerly (the
median over --reps of `calls` back-to-back calls, synchronised) and marked "eager". Before
timing, one step of each path from copies of the same cache is compared with the stock step
(relative Frobenius error of the layer output; bf16, so ~1e-2: gdn does not round between
stages, transformers does). Each row also counts the GPU operations one step of each path runs
(torch.profiler; `*_cuda_ops`): in a graph each is a node, and at small B most cost their launch.

    python3 bench/transformers_layer.py [--B 4 ...] [--T 1 ...] [--calls 20] [--reps 10] [--json PATH]
    python3 bench/transformers_layer.py --device cpu --smoke     # the script's logic, on the CPU
"""

import argparse
import copy
import datetime
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

import torch

try:
    import transformers
    from transformers import DynamicCache, Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling
except ImportError as e:
    sys.exit(f"needs transformers with Qwen3-Next ({type(e).__name__}: {e}): python3 -m pip install transformers")
import gdn
import gdn.fla
import gdn.transformers

HIDDEN, H, HV, K, V, W = 2048, 16, 32, 128, 128, 4
PATHS = ("stock", "gdn_rec", "fused", "gemms")
FLA_ARGS = frozenset(inspect.signature(gdn.fla.fused_recurrent_gated_delta_rule).parameters)


RULE_CALLS = [0]


def gdn_recurrent_rule(*args, **kwargs):
    """transformers' call of its recurrent (or chunked) rule, on gdn (the arguments FLA's
    function does not take dropped, as transformers' own dispatch to FLA does)."""
    RULE_CALLS[0] += 1
    return gdn.fla.fused_recurrent_gated_delta_rule(*args, **{k: v for k, v in kwargs.items() if k in FLA_ARGS})


def resolved(name):
    """What transformers' wrapper around modeling.<name> calls: FLA's / causal-conv1d's kernel
    where installed, else the torch function it wraps."""
    f = getattr(modeling, name)
    impl = None
    try:
        impl = inspect.getclosurevars(f).nonlocals.get("implementation")
    except (TypeError, ValueError):
        pass
    impl = impl or inspect.unwrap(f)
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', repr(impl))}"


def make_layer(device):
    config = Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=H, linear_num_value_heads=HV,
                             linear_key_head_dim=K, linear_value_head_dim=V, linear_conv_kernel_dim=W,
                             num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=256)
    layer = modeling.Qwen3NextGatedDeltaNet(config, layer_idx=0).to(device=device, dtype=torch.bfloat16).eval()
    return config, layer


def timer(device, reps):
    if device == "cpu":
        def run(step, calls):
            for _ in range(2):
                step()
            per_call = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()
                per_call.append((time.perf_counter() - t0) * 1e6 / calls)
            return statistics.median(per_call), "eager"
        return run

    def eager(step, calls):
        per_call = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
            per_call.append((time.perf_counter() - t0) * 1e6 / calls)
        return statistics.median(per_call)

    def run(step, calls):
        side = torch.cuda.Stream()  # eager warm-up as torch documents for capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    step()
        except Exception as e:  # a path graphs cannot capture (a host sync, a CPU tensor)
            torch.cuda.synchronize()
            print(f"  (capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}; timed eagerly)")
            return eager(step, calls), "eager"
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
        return statistics.median(per_call), "graph"
    return run


class swapped_rule:
    """transformers' recurrent and chunked rules = gdn's, for the duration (the layer looks the
    functions up at each call; a captured graph keeps what it called). Only the steps from a
    cache run inside: the chunked rule is also transformers' prefill, which gdn does not do."""

    NAMES = ("torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule")

    def __enter__(self):
        self.saved = {n: getattr(modeling, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(modeling, n, gdn_recurrent_rule)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(modeling, n, f)


class enabled:
    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        gdn.transformers.enable(self.layer)

    def __exit__(self, *exc):
        gdn.transformers.disable(self.layer)


class stock_ctx:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


def contexts(layer):
    return {"stock": stock_ctx, "gdn_rec": swapped_rule, "fused": lambda: enabled(layer)}


def bench(layer, config, B, T, args, run_timed, gen):
    dev = args.device
    x_prefill = torch.randn(B, args.prefill, HIDDEN, generator=gen, device="cpu").to(dev, torch.bfloat16)
    x = torch.randn(B, T, HIDDEN, generator=gen, device="cpu").to(dev, torch.bfloat16)
    o_in = torch.randn(B, T, HV * V, generator=gen, device="cpu").to(dev, torch.bfloat16)
    cache = DynamicCache(config=config)
    layer(x_prefill, cache_params=cache)  # transformers' prefill (chunked rule) fills the cache
    assert cache.has_previous_state(0)

    ctx = contexts(layer)
    outs = {}
    for p in ("stock", "gdn_rec", "fused"):
        calls = RULE_CALLS[0]
        with ctx[p]():
            outs[p] = layer(x, cache_params=copy.deepcopy(cache)).float()
            assert gdn.transformers.is_enabled(layer) == (p == "fused")
        ran = RULE_CALLS[0] - calls
        assert (ran == 1) == (p == "gdn_rec"), f"{p}: gdn's recurrent rule ran {ran}x"
    want = outs["stock"]
    check = {p: float((outs[p] - want).norm() / want.norm()) for p in ("gdn_rec", "fused")}

    row = {"B": B, "T": T, "check_rel_frob_vs_stock": {p: round(c, 5) for p, c in check.items()}}
    for p in ("stock", "gdn_rec", "fused"):
        c = copy.deepcopy(cache)
        with ctx[p]():
            row[f"{p}_cuda_ops"] = cuda_ops(lambda: layer(x, cache_params=c), dev)
            us, mode = run_timed(lambda: layer(x, cache_params=c), args.calls)
        row[f"{p}_us"], row[f"{p}_mode"] = round(us, 3), mode
        del c
    gemm = {"in_proj_qkvz": lambda: layer.in_proj_qkvz(x), "in_proj_ba": lambda: layer.in_proj_ba(x),
            "out_proj": lambda: layer.out_proj(o_in)}
    us, row["gemms_mode"] = run_timed(lambda: [f() for f in gemm.values()], args.calls)
    row["gemms_us"] = round(us, 3)
    row["gemm_split_us"] = {n: round(run_timed(f, args.calls)[0], 3) for n, f in gemm.items()}
    return row


def cuda_ops(step, device):
    """The GPU operations (kernels, copies, memsets) one call of ``step`` runs, by torch.profiler
    after one warm-up call; None on the CPU. In a graph each is a node, and at B = 4 most of
    them cost their launch, not their bytes."""
    if device != "cuda":
        return None
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def commit():
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, nargs="+", default=[4])
    p.add_argument("--T", type=int, nargs="+", default=[1], help="tokens per step (1 = decode; up to 16)")
    p.add_argument("--prefill", type=int, default=16, help="tokens transformers prefills the cache with")
    p.add_argument("--calls", type=int, default=20, help="layer steps per graph")
    p.add_argument("--reps", type=int, default=10, help="timed replays (median)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gdn's CPU backend, eager timing (checks the script, times nothing that matters)")
    p.add_argument("--smoke", action="store_true", help="tiny run: --calls 2 --reps 2 --prefill 4")
    p.add_argument("--json", help="write device, versions, commit, date and rows to this path")
    args = p.parse_args(argv)
    if args.smoke:
        args.calls, args.reps, args.prefill = 2, 2, 4
    if args.device == "cuda" and (not torch.cuda.is_available() or not gdn.cuda_available()):
        sys.exit("needs a CUDA GPU and gdn built with its CUDA backend (or --device cpu)")
    if any(not 1 <= t <= 16 for t in args.T):
        sys.exit("--T must be within 1..16 (gdn's fused step)")

    if args.device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        device = f"{prop.name}, {prop.multi_processor_count} SMs, L2 {prop.L2_cache_size / 2**20:.0f} MiB"
    else:
        device = f"CPU ({os.cpu_count()} threads)"
    stock_path = {n: resolved(n) for n in ("causal_conv1d_update", "torch_recurrent_gated_delta_rule",
                                           "causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
    installed = {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d", "kernels")}
    print(f"device {device}; torch {torch.__version__}, transformers {transformers.__version__}, gdn {commit()} "
          f"({gdn._run.__self__.__name__}); installed: "
          + ", ".join(f"{m} {'yes' if v else 'no'}" for m, v in installed.items()))
    print("stock decode path: " + ", ".join(f"{n} -> {v}" for n, v in stock_path.items()
                                             if n in ("causal_conv1d_update", "torch_recurrent_gated_delta_rule")))
    print(f"shape: hidden {HIDDEN}, H {H}, HV {HV}, K {K}, V {V}, W {W}; bf16 layer, fp32 recurrent state; "
          f"{args.calls} calls per {'graph' if args.device == 'cuda' else 'timing'}, median of {args.reps}; "
          "states warm (one cache per path)\n")

    gen = torch.Generator().manual_seed(args.seed)
    run_timed = timer(args.device, args.reps)
    rows = []
    print(f"{'B':>4} {'T':>2} {'stock_us':>10} {'gdn_rec_us':>10} {'fused_us':>10} {'gemms_us':>9} "
          f"{'stock-gemms':>11} {'fused-gemms':>11}  check (rel vs stock: gdn_rec, fused)  GPU ops per step")
    with torch.no_grad():
        config, layer = make_layer(args.device)
        for B in args.B:
            for T in args.T:
                r = bench(layer, config, B, T, args, run_timed, gen)
                rows.append(r)
                flag = lambda p: "*" if r[f"{p}_mode"] == "eager" and args.device == "cuda" else " "  # noqa: E731
                print(f"{B:4} {T:2} {r['stock_us']:9.2f}{flag('stock')} {r['gdn_rec_us']:9.2f}{flag('gdn_rec')} "
                      f"{r['fused_us']:9.2f}{flag('fused')} {r['gemms_us']:8.2f}{flag('gemms')} "
                      f"{r['stock_us'] - r['gemms_us']:11.2f} {r['fused_us'] - r['gemms_us']:11.2f}  "
                      f"{r['check_rel_frob_vs_stock']['gdn_rec']:.2e}, {r['check_rel_frob_vs_stock']['fused']:.2e}  "
                      + "/".join(str(r[f"{p}_cuda_ops"]) for p in ("stock", "gdn_rec", "fused")), flush=True)
    if args.device == "cuda" and any(r[f"{p}_mode"] == "eager" for r in rows for p in PATHS):
        print("* graph capture failed for this path: timed eagerly (includes launch overhead)")
    if args.device == "cpu":
        print("(CPU: eager wall-clock timing, for checking the script only)")
    if args.json:
        doc = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "gdn_commit": commit(), "gdn_binding": gdn._run.__self__.__name__, "torch": torch.__version__,
               "transformers": transformers.__version__, "installed": installed, "stock_path": stock_path,
               "shape": {"hidden": HIDDEN, "H": H, "HV": HV, "K": K, "V": V, "W": W, "dtype": "bf16",
                         "recurrent_state": "fp32", "prefill": args.prefill},
               "method": {"timing": "CUDA graph of `calls` steps, median over `reps` replays of replay/calls "
                                    "(CUDA events)" if args.device == "cuda" else "eager wall clock (CPU)",
                          "calls": args.calls, "reps": args.reps,
                          "states": "warm: every call of a path updates the same cache",
                          "cuda_ops": "GPU operations (kernels, copies, memsets) of one eager step, by "
                                      "torch.profiler after one warm-up step; null on the CPU"},
               "paths": {"stock": "Qwen3NextGatedDeltaNet.forward as resolved (stock_path)",
                         "gdn_rec": "stock forward, torch_recurrent_gated_delta_rule -> "
                                    "gdn.fla.fused_recurrent_gated_delta_rule",
                         "fused": "gdn.transformers.enable: projections + gdn.fused_decode + out_proj",
                         "gemms": "in_proj_qkvz(x) + in_proj_ba(x) + out_proj(o)"},
               "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
