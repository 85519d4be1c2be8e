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


# --- the fused layer step (docs/semantics.md section 6) -------------------------------------

def fused_inputs(rng, B, T, H, HV, K, V, P, layout="VK", dtype=np.float32, state_dtype=np.float32,
                 conv_dtype=None, W=4, L=None, form="raw", norm=True, gate=True, bias=False):
    """Random arguments of one fused_decode call: mixed_qkv [B, T, D] ~ N(0, 1), conv taps
    ~ N(0, 1/W) (so the conv outputs are O(1), as trained taps keep them), a conv pool
    [P, D, L] and a state pool [P, ...] with P slots, the gates, the norm's weight and z, and a
    NaN-poisoned o."""
    D = 2 * H * K + HV * V
    conv_dtype = conv_dtype or dtype
    L = W if L is None else L
    args = dict(
        mixed_qkv=normal(rng, (B, T, D), dtype),
        conv_weight=normal(rng, (D, W), dtype, 1.0 / math.sqrt(W)),
        conv_state=normal(rng, (P, D, L), conv_dtype),
        state=pool(rng, P, HV, K, V, layout, state_dtype),
        o=poisoned((B, T, HV, V), dtype),
        layout=layout,
    )
    args.update(gates(rng, B, T, HV, form))
    if bias:
        args["conv_bias"] = normal(rng, (D,), dtype, 0.1)
    if norm:
        args["norm_weight"] = (1.0 + 0.5 * rng.standard_normal(V)).astype(dtype)
        if gate:
            args["z"] = normal(rng, (B, T, HV, V), dtype)
    return args


def run_fused_pair(build, **kwargs):
    """run_pair for fused_decode: ``build()`` is called twice with the same seed; the first
    set of buffers goes to gdn.fused_decode, the second to gdn.reference_fused_decode."""
    args_got, got = build()
    gdn.fused_decode(**args_got, **kwargs)
    args_want, want = build()
    gdn.reference_fused_decode(**args_want, **kwargs)
    return got, want


def numpy_fused(mixed_qkv, conv_weight, conv_state, state, layout="VK", conv_bias=None, norm_weight=None, z=None,
                norm_eps=1e-6, scale=None, use_qk_l2norm=True, **gate_args):
    """Docs/semantics.md section 6 in float64 numpy, dense mode: the conv window over
    [conv_state, mixed_qkv], SiLU, the q | k | v split, numpy_decode, the gated RMSNorm.
    Returns (o, new state, new conv state)."""
    B, T, D = mixed_qkv.shape
    W, L = conv_weight.shape[1], conv_state.shape[2]
    HV = state.shape[1]
    K, V = (state.shape[3], state.shape[2]) if layout == "VK" else (state.shape[2], state.shape[3])
    H = (D - HV * V) // (2 * K)
    f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    window = np.concatenate([f(conv_state), f(mixed_qkv).transpose(0, 2, 1)], axis=2)  # [B, D, L + T]
    y = np.zeros((B, T, D))
    for t in range(T):
        first = L + t - (W - 1)
        y[:, t] = (window[:, :, first:first + W] * f(conv_weight)[None]).sum(axis=2)
    if conv_bias is not None:
        y += f(conv_bias)
    y = y / (1.0 + np.exp(-y))
    q = y[..., :H * K].reshape(B, T, H, K)
    k = y[..., H * K:2 * H * K].reshape(B, T, H, K)
    v = y[..., 2 * H * K:].reshape(B, T, HV, V)
    o, S = numpy_decode(q, k, v, state, layout, scale=scale, use_qk_l2norm=use_qk_l2norm, **gate_args)
    if norm_weight is not None:
        o = o / np.sqrt((o * o).mean(axis=-1, keepdims=True) + norm_eps) * f(norm_weight)
        if z is not None:
            zz = f(z)
            o = o * zz / (1.0 + np.exp(-zz))
    return o, S, window[:, :, T:T + L]
