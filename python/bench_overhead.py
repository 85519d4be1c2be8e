#!/usr/bin/env python3
"""Host overhead of one eager gdn.decode call from torch (target: <= 10 us).

The call is T=1, B=1 with 10 tensor arguments (q, k, v, a, b, A_log, dt_bias, state, o,
read_slots), the shape of a decode step for one request. Host time is measured with the
GPU kept out of the way: calls are issued in bursts short enough that the launch queue
never fills, the burst's wall time is divided by its length, and the median over bursts
is reported. For scale it also times the raw binding, the checks alone (can_implement:
argument conversion without a launch) and a one-kernel torch op.

    python3 python/bench_overhead.py [--device cuda|cpu] [--calls 200] [--bursts 50] [--binding generic]
"""

import argparse
import os
import statistics
import sys
import time

# Run as `python3 python/bench_overhead.py`, Python puts python/ first on sys.path, where
# the source package (without its compiled _C) would shadow the installed one.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import torch  # noqa: E402

import gdn  # noqa: E402


def per_call_us(fn, calls, bursts, sync):
    for _ in range(20):
        fn()
    sync()
    times = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=200, help="calls per burst (keep below the launch queue depth)")
    p.add_argument("--bursts", type=int, default=50)
    p.add_argument("--json", help="also write the figures as JSON (device, commit, date, rows) to this path")
    p.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"), help="commit under test, for the JSON")
    p.add_argument("--binding", choices=["auto", "generic"], default="auto",
                   help="generic: force gdn._C (torch tensors read through Python attributes)")
    args = p.parse_args()
    if args.binding == "generic":
        gdn._run = gdn._C.decode

    dev = args.device
    if dev == "cuda" and not gdn.cuda_available():
        sys.exit("gdn was built without CUDA; run with --device cpu")
    B, T, H, HV, K, V, P = 1, 1, 16, 32, 128, 128, 8
    bf16 = torch.bfloat16
    q = torch.randn(B, T, H, K, dtype=bf16, device=dev)
    k = torch.randn(B, T, H, K, dtype=bf16, device=dev)
    v = torch.randn(B, T, HV, V, dtype=bf16, device=dev)
    a = torch.randn(B, T, HV, dtype=bf16, device=dev)
    b = torch.randn(B, T, HV, dtype=bf16, device=dev)
    A_log = torch.rand(HV, device=dev).mul(15).add(1).log()
    dt_bias = 0.1 * torch.randn(HV, device=dev)
    state = 0.1 * torch.randn(P, HV, V, K, device=dev)
    o = torch.empty(B, T, HV, V, dtype=bf16, device=dev)
    slots = torch.tensor([3], dtype=torch.int32, device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def wrapper():
        gdn.decode(q, k, v, state, o, a=a, b=b, A_log=A_log, dt_bias=dt_bias, read_slots=slots, layout="VK")

    raw = gdn._run  # gdn._C_torch.decode where it was built for this torch, else gdn._C.decode

    def binding():
        raw(q, k, v, state, o, a, b, A_log, dt_bias, None, None, slots, None, None, None, None, None, None,
            "VK", None, True, True, False, None)

    check = getattr(raw, "__self__", gdn._C).can_implement

    def checks_only():
        check(q, k, v, state, o, a, b, A_log, dt_bias, None, None, slots, None, None, None, None, None, None,
              "VK", None, True, True, False, None)

    def torch_op():
        torch.add(q, k, out=q)

    rows = [
        ("gdn.decode (eager, 10 tensors)", wrapper),
        ("raw binding, same call", binding),
        ("can_implement (conversion + checks)", checks_only),
        ("torch.add(out=) (one torch kernel)", torch_op),
    ]
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"B={B} T={T} H={H} HV={HV} K={K} V={V}, bf16 inputs, fp32 pool of {P}; "
          f"binding {getattr(getattr(raw, '__self__', None), '__name__', '?')}")
    results = {}
    for name, fn in rows:
        results[name] = per_call_us(fn, args.calls, args.bursts, sync)
        print(f"  {name:38s} {results[name]:7.2f} us/call")
    main_us = results[rows[0][0]]
    verdict = "PASS" if main_us <= 10.0 else "FAIL"
    print(f"gdn.decode host overhead: {main_us:.2f} us per call (target <= 10 us): {verdict}")
    if args.json:
        import datetime
        import json

        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "commit": args.commit,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "torch": torch.__version__, "binding": args.binding, "shape": dict(B=B, T=T, H=H, HV=HV, K=K, V=V),
                       "rows": [{"what": name, "us_per_call": us} for name, us in results.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
