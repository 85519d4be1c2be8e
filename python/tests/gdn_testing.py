"""Shared helpers for gdn's Python tests: random inputs per docs/semantics.md section 5,
its tolerances (through gdn._C._agreement, the C++ comparator), and a float64 numpy model of
section 2 that checks the oracle's wiring independently of the C++ code.
"""

import math

import numpy as np

try:
    import ml_dtypes  # numpy has no bfloat16 of its own

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BF16 = None

import gdn


def normal(rng, shape, dtype, std=1.0):
    return (std * rng.standard_normal(shape)).astype(dtype)


def gates(rng, B, T, HV, form="raw", dtype=np.float32):
    """Gate arguments for gdn.decode: raw (a, b, A_log, dt_bias) or precomputed (g, beta)."""
    if form == "raw":
        return dict(
            a=normal(rng, (B, T, HV), dtype),
            b=normal(rng, (B, T, HV), dtype),
            A_log=np.log(rng.uniform(1.0, 16.0, HV)).astype(np.float32),
            dt_bias=normal(rng, (HV,), np.float32, 0.1),
        )
    # Precomputed: g = log of a decay in (0, 1), beta in (0, 1).
    return dict(
        g=np.log(rng.uniform(0.05, 1.0, (B, T, HV))).astype(np.float32),
        beta=rng.uniform(0.0, 1.0, (B, T, HV)).astype(dtype),
    )


def qkv(rng, B, T, H, HV, K, V, dtype=np.float32):
    return dict(q=normal(rng, (B, T, H, K), dtype), k=normal(rng, (B, T, H, K), dtype),
                v=normal(rng, (B, T, HV, V), dtype))


def state_shape(P, HV, K, V, layout):
    return (P, HV, V, K) if layout == "VK" else (P, HV, K, V)


def pool(rng, P, HV, K, V, layout="VK", dtype=np.float32):
    return normal(rng, state_shape(P, HV, K, V, layout), dtype, 0.1)


def poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)


def run_pair(build, **kwargs):
    """Runs gdn.decode and gdn.reference_decode on two identical sets of buffers.

    ``build()`` returns (arguments for decode, dict of arrays to compare afterwards); it is
    called twice and must draw the same random numbers both times (seeded inside).
    """
    args_got, got = build()
    gdn.decode(**args_got, **kwargs)
    args_want, want = build()
    gdn.reference_decode(**args_want, **kwargs)
    return got, want


def _comparable(x):
    """(x as the comparator reads it, its NaN mask): contiguous float32 or float16, or uint16
    bf16 bit patterns (an ml_dtypes.bfloat16 array is viewed as such)."""
    x = np.ascontiguousarray(x)
    if BF16 is not None and x.dtype == BF16:
        x = x.view(np.uint16)
    if x.dtype == np.uint16:
        return x, (x & 0x7FFF) > 0x7F80
    if x.dtype in (np.float32, np.float16):
        return x, np.isnan(x)
    raise TypeError(f"no tolerance rule for dtype {x.dtype}")


def assert_matches(got, want, name, many_steps=False):
    """docs/semantics.md section 5 on numpy arrays, judged by gdn._C._agreement (the C++
    comparator, reference/compare.cpp, that the C++ tests and `gdn run` use too): every
    vector along the innermost dim (an output vector, a stored state row) against the oracle's
    ``want``; ``many_steps`` for the bound after many steps fed back. float32, float16, and
    bf16 as ml_dtypes.bfloat16 or as uint16 bit patterns.

    Entries that neither call wrote (NaN in both results: poisoned and left alone, e.g. the
    cache rows of a padding row) are not compared: whole such vectors are left out, single
    such elements count as zero in both. Any other NaN fails.
    """
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    n = got.shape[-1] if got.ndim else 1
    (g, gnan), (w, wnan) = _comparable(got), _comparable(want)
    g, w = g.reshape(-1, n).copy(), w.reshape(-1, n).copy()
    unwritten = (gnan & wnan).reshape(-1, n)
    g[unwritten] = 0
    w[unwritten] = 0
    keep = ~unwritten.all(axis=1)
    r = gdn._C._agreement(g[keep], w[keep], n, many_steps)
    if r["ok"]:
        return
    where = ""
    if r["worst_vector"] >= 0:
        index = np.unravel_index(np.flatnonzero(keep)[r["worst_vector"]], got.shape[:-1])
        where = f"; worst at {name}[{', '.join(str(int(i)) for i in index)}]: {r['worst_summary']}"
    dtype = "bfloat16" if g.dtype == np.uint16 else got.dtype
    raise AssertionError(f"{name} ({dtype}{', many steps' if many_steps else ''}): {r['summary']}; "
                         f"{r['failing_vectors']} of {r['vectors']} vectors out of tolerance{where}")


def assert_all_match(got, want):
    for key in want:
        if want[key].dtype.kind in "iu":
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            assert_matches(got[key], want[key], key)


def numpy_decode(q, k, v, state, layout="VK", a=None, b=None, A_log=None, dt_bias=None, g=None,
                 beta=None, scale=None, use_qk_l2norm=True):
    """Docs/semantics.md section 2 in float64 numpy, dense mode; returns (o, new state)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    S = state.astype(np.float64)
    if layout == "KV":
        S = S.swapaxes(-1, -2)
    S = S.copy()  # [B, HV, V, K]
    o = np.zeros((B, T, HV, V))
    f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    for n in range(B):
        for t in range(T):
            for hv in range(HV):
                h = hv // (HV // H)
                if g is None:
                    x = f(a[n, t, hv]) + f(dt_bias[hv])
                    sp = math.log1p(math.exp(x)) if x <= 20 else x
                    decay = math.exp(-math.exp(f(A_log[hv])) * sp)
                    bt = 1.0 / (1.0 + math.exp(-f(b[n, t, hv])))
                else:
                    decay = math.exp(f(g[n, t, hv]))
                    bt = f(beta[n, t, hv])
                qh, kh = f(q[n, t, h]), f(k[n, t, h])
                if use_qk_l2norm:
                    qh = qh / math.sqrt((qh * qh).sum() + 1e-6)
                    kh = kh / math.sqrt((kh * kh).sum() + 1e-6)
                qh = qh * scale
                Sm = decay * S[n, hv]
                delta = bt * (f(v[n, t, hv]) - Sm @ kh)
                Sm = Sm + np.outer(delta, kh)
                o[n, t, hv] = Sm @ qh
                S[n, hv] = Sm
    if layout == "KV":
        S = S.swapaxes(-1, -2)
    return o, S
