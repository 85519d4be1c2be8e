"""Shared helpers for gdn's Python tests: random inputs per docs/semantics.md section 6,
the section 6 tolerances, and a float64 numpy model of section 2 that checks the oracle's
wiring independently of the C++ code.
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


def _ordered(x):
    i = np.asarray(x).view(np.int16).astype(np.int32)
    return np.where(i < 0, -(i & 0x7FFF), i)


def ulp_diff(got, want):
    """Distance in units in the last place between two 2-byte float arrays (fp16 or bf16)."""
    return np.abs(_ordered(got) - _ordered(want))


def output_floor(V):
    """Natural scale of an output vector o[n, t, hv, :] of V elements, over 16.

    Each element is a dot product h_r . qh of an updated state row (norm ~1 for section 6's
    inputs) with the normalized, scaled q (norm 1/sqrt(K) <= 1/8): fp32 rounding is relative
    to that scale, not to the result, which cancellation (q nearly orthogonal to k with a
    tiny decay) can make arbitrarily small. 1/sqrt(K) is taken at K = 256, the strictest.
    """
    return math.sqrt(V) / 16 / 16


def assert_matches(got, want, name, group=1, floor=0.0):
    """Section 6 tolerances on numpy arrays; see compare()."""
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    bits = got.dtype.itemsize == 2
    mant = 7 if (BF16 is not None and got.dtype == BF16) else 10
    compare(got.astype(np.float64), want.astype(np.float64), name, group,
            (got.view(np.int16), want.view(np.int16)) if bits else None, mant, floor)


def compare(g64, w64, name, group=1, bits16=None, mant=10, floor=0.0):
    """Section 6: fp32 relative Frobenius error <= 1e-5 per vector (group=1) or matrix
    (group=2) over the innermost dims; bf16/fp16 (``bits16`` = the two int16 bit patterns,
    ``mant`` = 7 for bf16, 10 for fp16) <= 1 ulp on 99.9%, <= 2 ulp everywhere. NaNs
    (unwritten poisoned entries) must sit at the same places; exact zeros stay exact.

    Cancellation floors, as in reference/compare.cpp: fp32 arithmetic leaves an absolute
    error of a few ulps of the operands' scale, and cancellation (a k.q near zero scales a
    whole output vector down; a tiny decay g with a small delta shrinks a state row) can
    make a result far smaller than that scale, where no fp32 implementation can match the
    float64 oracle to 1e-5 of its own norm. So an fp32 vector is measured relative to
    max(its norm, 1/16 of the RMS vector norm of the tensor, ``floor``), where ``floor`` is
    the natural scale of the computation when the whole tensor can be small (outputs: see
    output_floor), and a 16-bit element smaller than 2^-12 of the tensor's RMS (in both
    results) in ulps of that floor.
    """
    gnan, wnan = np.isnan(g64), np.isnan(w64)
    bad = np.argwhere(gnan != wnan)
    assert bad.size == 0, f"{name}: NaN pattern differs, first at {tuple(bad[0])}"
    g64 = np.where(gnan, 0.0, g64)
    w64 = np.where(wnan, 0.0, w64)
    axes = tuple(range(g64.ndim - group, g64.ndim))
    err = np.sqrt(((g64 - w64) ** 2).sum(axis=axes))
    ref = np.sqrt((w64 ** 2).sum(axis=axes))
    zero = ref == 0
    where = np.argwhere(zero & (err != 0))
    assert where.size == 0, f"{name}: nonzero at {tuple(where[0])} where the oracle is exactly zero"
    if bits16 is None:
        floor = max(np.sqrt((ref[~zero] ** 2).mean()) / 16 if (~zero).any() else 0.0, floor)
        rel = err[~zero] / np.maximum(ref[~zero], floor)
        worst = float(rel.max()) if rel.size else 0.0
        assert worst <= 1e-5, f"{name}: relative Frobenius error {worst:.3g} > 1e-5"
        return
    u = np.where(gnan, 0, np.abs(_ordered(bits16[0]) - _ordered(bits16[1]))).astype(np.float64)
    rms = math.sqrt((w64 ** 2).mean()) if w64.size else 0.0
    if floor > 0:  # the natural element scale behind the vector floor
        vec_len = int(np.prod([w64.shape[a] for a in axes]))
        rms = max(rms, floor * 16 / math.sqrt(vec_len))
    if rms > 0:
        floor_mag = math.ldexp(rms, -12)
        # Never finer than the dtype's own subnormal spacing (fp16: 2^-24), or a floor in
        # fp16's subnormal range would count one real ulp as several.
        subnormal = math.ldexp(1.0, -133) if mant == 7 else math.ldexp(1.0, -24)
        floor_ulp = max(math.ldexp(1.0, math.frexp(floor_mag)[1] - 1 - mant), subnormal)
        tiny = (np.abs(w64) < floor_mag) & (np.abs(g64) < floor_mag)
        u = np.where(tiny, np.ceil(np.abs(g64 - w64) / floor_ulp - 1e-9), u)
    worst = int(u.max()) if u.size else 0
    assert worst <= 2, f"{name}: {worst} ulp at {tuple(np.argwhere(u == worst)[0])}"
    frac = float((u > 1).mean()) if u.size else 0.0
    assert frac <= 1e-3, f"{name}: {100 * frac:.3f}% of elements more than 1 ulp off (> 0.1%)"


def assert_all_match(got, want, groups=None):
    groups = groups or {}
    for key in want:
        if want[key].dtype.kind in "iu":
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            group = groups.get(key, 2 if key in ("state", "pool", "inter") else 1)
            floor = output_floor(want[key].shape[-1]) if key in ("o", "wide_o") else 0.0
            assert_matches(got[key], want[key], key, group, floor)


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
