"""How many bf16 terms the chunked form needs for fp32 q and k (the fused step's conv outputs).

A float64 emulation of one value head (V = K = 128, bf16 state of N(0, 0.1), random gates): the
token-by-token oracle (SPEC section 2) against the chunked form (src/cuda/vk_chunk.cuh) whose
tensor-core operands are q and k split into n bf16 terms and the update weights into three (P3
keeps the products whose term orders sum to at most p3; p3 = None: P3 exact, as fp32 FMAs).
Everything else is exact, so the error is the split's alone. Reports, per T and n, the largest
share of elements over 1 bf16 ulp and the largest error in ulps, with SPEC section 6's floor
(2^-12 of the RMS) for small elements. Last, decode's case (bf16 q and k): whether P3's weights
could drop from three bf16 terms to two (they cannot: docs/design.md, "The tile walks").
Usage: python3 bench/chunk_precision.py
"""
import numpy as np


def bf16(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


def split(x, n):
    terms, r = [], np.asarray(x, np.float64)
    for _ in range(n):
        terms.append(bf16(r))
        r = r - terms[-1]
    return terms


def ulps(got, ref):
    floor = 2.0**-12 * np.sqrt(np.mean(ref**2))
    mag = np.maximum(np.abs(bf16(ref)), floor)
    return np.abs(bf16(got) - bf16(ref)) / 2.0 ** (np.floor(np.log2(mag)) - 7)


def one_head(rng, T, n, p3=2, V=128, K=128, qk_bf16=False):
    S0 = bf16(rng.normal(0, 0.1, (V, K)))
    q = rng.normal(0, 1, (T, K)).astype(np.float32).astype(np.float64)
    k = rng.normal(0, 1, (T, K)).astype(np.float32).astype(np.float64)
    if qk_bf16:  # decode's inputs: q and k in bf16, so one term holds them exactly
        q, k = bf16(q), bf16(k)
    v = rng.normal(0, 1, (T, V))
    g = np.exp(-rng.uniform(0.01, 0.5, T))
    beta = 1 / (1 + np.exp(-rng.normal(0, 1, T)))
    rq = K**-0.5 / np.linalg.norm(q, axis=1)
    rk = 1 / np.linalg.norm(k, axis=1)
    S, O = S0.copy(), []
    for t in range(T):
        kh, qh = k[t] * rk[t], q[t] * rq[t]
        S = g[t] * S
        d = beta[t] * (v[t] - S @ kh)
        S = S + np.outer(d, kh)
        O.append(S @ qh)
    O = np.array(O)
    qt, kt = split(q, n), split(k, n)
    Sq, Sk = S0 @ sum(qt).T, S0 @ sum(kt).T  # P1
    kk, qk = k @ k.T, q @ k.T  # the Gram matrix, fp32 inputs
    gam = np.cumprod(g)
    G = lambda s, t: np.prod(g[s + 1 : t + 1])
    d, o = np.zeros((V, T)), np.zeros((V, T))
    for t in range(T):  # P2
        x = v[t] - gam[t] * rk[t] * Sk[:, t]
        for s in range(t):
            x -= G(s, t) * rk[s] * rk[t] * kk[t, s] * d[:, s]
        d[:, t] = beta[t] * x
        o[:, t] = gam[t] * rq[t] * Sq[:, t] + sum(G(s, t) * rk[s] * rq[t] * qk[t, s] * d[:, s] for s in range(t + 1))
    w = np.stack([G(s, T - 1) * rk[s] * d[:, s] for s in range(T)], 1)
    if p3 is None:
        ST = gam[-1] * S0 + w @ k  # P3 exact
    else:
        wt = split(w, 3)
        ST = gam[-1] * S0 + sum(wt[a] @ kt[b] for a in range(3) for b in range(n) if a + b <= p3)  # P3
    return ulps(ST, S), ulps(o.T, O)


if __name__ == "__main__":
    rng = np.random.default_rng(7)
    for p3 in (2, 1, None):
        for T in (4, 8, 16):
            for n in (1, 2, 3):
                res = [one_head(rng, T, n, p3) for _ in range(6)]
                print("P3 %s, T = %2d, q/k as %d terms: state %.4f%% over 1 ulp, max %.1f; outputs %.4f%%, max %.1f" % (
                    "exact" if p3 is None else "orders <= %d" % p3, T, n,
                    100 * max((e > 1).mean() for e, _ in res), max(e.max() for e, _ in res),
                    100 * max((e > 1).mean() for _, e in res), max(e.max() for _, e in res)))
    # decode (bf16 q and k, one term each): P3's weights as three bf16 terms (p3 = 2) or two (p3 = 1)
    for T in (4, 8, 16):
        for p3 in (2, 1):
            res = [one_head(rng, T, 1, p3, qk_bf16=True)[0] for _ in range(8)]
            print("decode, bf16 q/k, T = %2d, weights as %d terms: state %.4f%% over 1 ulp, max %.1f" % (
                T, p3 + 1, 100 * max((e > 1).mean() for e in res), max(e.max() for e in res)))
