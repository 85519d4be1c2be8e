"""gdn.fla drop-ins on numpy arrays (the CPU backend): FLA's fused_recurrent_gated_delta_rule
as transformers calls it, and vLLM's varlen / continuous-batching copy of it. Each is checked
against a float64 numpy transliteration of the FLA / vLLM Triton kernel loop (state [K, V] per
head, the kernel's own order of operations), which pins down what the drop-in must compute,
and against gdn.reference_decode for dtypes the numpy model does not round like gdn."""

import math

import numpy as np
import pytest

import gdn
from gdn import fla
from gdn_testing import BF16, assert_matches, normal, poisoned

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


# --- the kernels' semantics, in float64 numpy ------------------------------------------------

def fla_step(h, q, k, v, g, beta, scale, l2):
    """One token of FLA's fused_recurrent kernel for one (row, value head); h [K, V] in place."""
    f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    bq, bk, bv = f(q), f(k), f(v)
    if l2:
        bq = bq / math.sqrt((bq * bq).sum() + 1e-6)
        bk = bk / math.sqrt((bk * bk).sum() + 1e-6)
    bq = bq * scale
    h *= math.exp(f(g))
    bv = (bv - (h * bk[:, None]).sum(0)) * f(beta)
    h += np.outer(bk, bv)
    return (h * bq[:, None]).sum(0)


def fla_model(q, k, v, g, beta, h0, scale, l2):
    """FLA: q [N, T, H, K] ..., h0 [N, HV, K, V] or None; returns (o, final state) in float64."""
    N, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    h = np.zeros((N, HV, K, V)) if h0 is None else h0.astype(np.float64)
    o = np.zeros((N, T, HV, V))
    for n in range(N):
        for hv in range(HV):
            for t in range(T):
                o[n, t, hv] = fla_step(h[n, hv], q[n, t, hv // (HV // H)], k[n, t, hv // (HV // H)], v[n, t, hv],
                                       g[n, t, hv], beta[n, t, hv], scale, l2)
    return o, h


def vllm_model(q, k, v, g, beta, pool, idx, num_accepted, scale, l2, inplace):
    """vLLM's kernel with ssm_state_indices idx [N, >= T] (or [N] with T = 1): row n reads
    slot idx[n, num_accepted[n] - 1] (idx[n, 0] without num_accepted) and writes the state after
    token t to slot idx[n, t] (inplace) or to row n*T + t of a new tensor. Negative slots are
    padding (gdn's rule: output zeros, nothing read or written). Returns (o, pool or states)."""
    N, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    idx = idx.reshape(N, -1)
    pool = pool.astype(np.float64)
    states = np.full((N * T, HV, K, V), np.nan)
    o = np.zeros((N, T, HV, V))
    for n in range(N):
        read = idx[n, 0 if num_accepted is None else num_accepted[n] - 1]
        if read < 0:
            continue
        for hv in range(HV):
            h = pool[read, hv].copy()
            for t in range(T):
                o[n, t, hv] = fla_step(h, q[n, t, hv // (HV // H)], k[n, t, hv // (HV // H)], v[n, t, hv],
                                       g[n, t, hv], beta[n, t, hv], scale, l2)
                if inplace and idx[n, t] >= 0:
                    pool[idx[n, t], hv] = h
                states[n * T + t, hv] = h
    return o, (pool if inplace else states)


# --- inputs -------------------------------------------------------------------------------

def draw(seed, N, T, H, HV, K, V, dtype=F32, flat=False):
    """q, k, v, g, beta of N sequences of T tokens; flat: varlen layout [1, N*T, ...]."""
    rng = np.random.default_rng(seed)
    x = dict(q=normal(rng, (N, T, H, K), dtype), k=normal(rng, (N, T, H, K), dtype),
             v=normal(rng, (N, T, HV, V), dtype),
             g=np.log(rng.uniform(0.05, 1.0, (N, T, HV))).astype(np.float32),
             beta=rng.uniform(0.0, 1.0, (N, T, HV)).astype(dtype))
    if flat:
        x = {n: a.reshape((1, N * T) + a.shape[2:]) for n, a in x.items()}
    return x, rng


def rows(x, N, T):
    return {n: a.reshape((N, T) + a.shape[2:]) for n, a in x.items()}


def as_f32(x):
    return x.astype(np.float32)


# --- FLA: fused_recurrent_gated_delta_rule --------------------------------------------------------

@pytest.mark.parametrize("l2", [True, False])
def test_fla_transformers_decode_call(l2):
    # transformers' Qwen3-Next decode step: q, k repeated to HV heads, keyword gates, the
    # cached state as initial_state, output_final_state=True.
    N, T, H, HV, K, V = 3, 1, 4, 4, 64, 128
    x, rng = draw(1, N, T, H, HV, K, V)
    if not l2:
        x["q"] *= 0.1
        x["k"] *= 0.1
    h0 = normal(rng, (N, HV, K, V), np.float32, 0.1)
    want_o, want_h = fla_model(**x, h0=h0, scale=K ** -0.5, l2=l2)
    state = h0.copy()
    o, final = fla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                                    initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=l2)
    assert final is state, "the final state is the initial state, updated in place"
    assert o.shape == x["v"].shape and o.dtype == F32
    assert_matches(o, as_f32(want_o), "o")
    assert_matches(final, as_f32(want_h), "final_state")


def test_fla_without_output_final_state_leaves_initial_state():
    N, T, H, HV, K, V = 2, 3, 1, 2, 64, 64
    x, rng = draw(2, N, T, H, HV, K, V)
    h0 = normal(rng, (N, HV, K, V), np.float32, 0.1)
    h0.flags.writeable = False  # only read: a read-only array is fine
    o, final = fla.fused_recurrent_gated_delta_rule(**x, initial_state=h0, scale=0.2)
    assert final is None
    want_o, _ = fla_model(**x, h0=h0, scale=0.2, l2=False)
    assert_matches(o, as_f32(want_o), "o")


@pytest.mark.parametrize("output_final_state", [True, False])
def test_fla_without_initial_state_starts_from_zeros(output_final_state):
    N, T, H, HV, K, V = 2, 2, 2, 4, 64, 64
    x, _ = draw(3, N, T, H, HV, K, V)
    o, final = fla.fused_recurrent_gated_delta_rule(**x, output_final_state=output_final_state,
                                                    use_qk_l2norm_in_kernel=True)
    want_o, want_h = fla_model(**x, h0=None, scale=K ** -0.5, l2=True)
    assert_matches(o, as_f32(want_o), "o")
    if output_final_state:
        assert final.dtype == F32 and final.shape == (N, HV, K, V), "FLA's final state: a new fp32 [N, HV, K, V]"
        assert_matches(final, as_f32(want_h), "final_state")
    else:
        assert final is None


def test_fla_defaults_beta_one_and_no_decay():
    N, T, H, HV, K, V = 2, 2, 1, 2, 64, 64
    x, rng = draw(4, N, T, H, HV, K, V)
    h0 = normal(rng, (N, HV, K, V), np.float32, 0.1)
    state = h0.copy()
    o, final = fla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    ones, zeros = np.ones_like(x["beta"]), np.zeros_like(x["g"])
    want_o, want_h = fla_model(x["q"], x["k"], x["v"], zeros, ones, h0, K ** -0.5, True)
    assert_matches(o, as_f32(want_o), "o")
    assert_matches(final, as_f32(want_h), "final_state")


def test_fla_varlen_equal_lengths_are_views():
    N, T, H, HV, K, V = 3, 2, 1, 2, 64, 64
    x, rng = draw(5, N, T, H, HV, K, V, flat=True)
    h0 = normal(rng, (N, HV, K, V), np.float32, 0.1)
    state = h0.copy()
    cu = np.arange(0, N * T + 1, T, dtype=np.int64)
    o, final = fla.fused_recurrent_gated_delta_rule(**x, initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert o.shape == (1, N * T, HV, V)
    want_o, want_h = fla_model(**rows(x, N, T), h0=h0, scale=K ** -0.5, l2=True)
    assert_matches(o, as_f32(want_o.reshape(1, N * T, HV, V)), "o")
    assert_matches(final, as_f32(want_h), "final_state")
    # The [1, N*T] -> [N, T] split is a view for every input.
    for name, a in x.items():
        assert np.shares_memory(fla._rows(a, N, T), a), name


@pytest.mark.parametrize("dtype,state_dtype", [(F16, F32), (F16, F16)] + ([(BF16, BF16)] if BF16 else []), ids=str)
def test_fla_16bit_against_the_oracle(dtype, state_dtype):
    # 16-bit inputs and states round where gdn stores them: judged against the oracle
    # called with the equivalent gdn arguments (layout "KV", dense).
    N, T, H, HV, K, V = 2, 3, 1, 4, 128, 64
    x, rng = draw(6, N, T, H, HV, K, V, dtype)
    h0 = normal(rng, (N, HV, K, V), state_dtype, 0.1)
    state, want_state = h0.copy(), h0.copy()
    o, _ = fla.fused_recurrent_gated_delta_rule(**x, initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    want = gdn.reference_decode(x["q"], x["k"], x["v"], want_state, poisoned(x["v"].shape, dtype), g=x["g"],
                                beta=x["beta"], layout="KV")
    assert_matches(o, want, "o")
    assert_matches(state, want_state, "final_state")


def test_fla_argument_errors():
    N, T, H, HV, K, V = 2, 1, 1, 2, 64, 64
    x, rng = draw(7, N, T, H, HV, K, V)
    h0 = normal(rng, (N, HV, K, V), np.float32, 0.1)
    with pytest.raises(ValueError, match=r"^gk \(a per-key decay\) is not supported.*pass it as beta="):
        fla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])  # FLA's older order
    with pytest.raises(ValueError, match=r"^gv "):
        fla.fused_recurrent_gated_delta_rule(**x, gv=x["v"])
    with pytest.raises(TypeError, match=r"^output_final_state must be a bool"):
        fla.fused_recurrent_gated_delta_rule(**x, initial_state=h0, output_final_state=1)
    with pytest.raises(ValueError, match=r"^initial_state\.shape\[2\] must be K = 64"):  # gdn's 'state', renamed
        fla.fused_recurrent_gated_delta_rule(**x, initial_state=h0[:, :, :32], output_final_state=True)
    with pytest.raises(TypeError, match=r"^use_qk_l2norm_in_kernel must be a bool"):
        fla.fused_recurrent_gated_delta_rule(**x, use_qk_l2norm_in_kernel="false")
    with pytest.raises(TypeError, match=r"^q must be a tensor"):
        fla.fused_recurrent_gated_delta_rule(None, x["k"], x["v"], g=x["g"], beta=x["beta"])
    with pytest.raises(TypeError, match=r"^k must be a tensor"):
        fla.fused_recurrent_gated_delta_rule(x["q"], [1.0], x["v"], g=x["g"], beta=x["beta"])
    with pytest.raises(TypeError, match=r"^scale must be a real number"):
        fla.fused_recurrent_gated_delta_rule(**x, scale="0.1")


def test_fla_cu_seqlens_errors():
    N, T, H, HV, K, V = 3, 2, 1, 2, 64, 64
    flat, _ = draw(8, N, T, H, HV, K, V, flat=True)
    batched, _ = draw(8, N, T, H, HV, K, V)
    with pytest.raises(ValueError, match=r"^q\.shape\[0\] must be 1 with cu_seqlens"):
        fla.fused_recurrent_gated_delta_rule(**batched, cu_seqlens=np.array([0, 2, 4, 6]))
    with pytest.raises(ValueError, match=r"^cu_seqlens: gdn runs sequences of one length"):
        fla.fused_recurrent_gated_delta_rule(**flat, cu_seqlens=np.array([0, 2, 3, 4, 6]))  # 6 tokens, 4 rows
    with pytest.raises(ValueError, match=r"^cu_seqlens must be \[0, T, 2T, \.\.\., N\*T\] with T = 2"):
        fla.fused_recurrent_gated_delta_rule(**flat, cu_seqlens=np.array([0, 1, 3, 6]))  # unequal lengths
    with pytest.raises(ValueError, match=r"^cu_seqlens must have rank 1"):
        fla.fused_recurrent_gated_delta_rule(**flat, cu_seqlens=np.array([[0, 6]]))
    with pytest.raises(TypeError, match=r"^cu_seqlens must be a tensor"):
        fla.fused_recurrent_gated_delta_rule(**flat, cu_seqlens=[0, 2, 4, 6])


# --- vLLM: fused_recurrent_gated_delta_rule with continuous batching ------------------------------

def vllm_case(seed, N, T, P, H=1, HV=2, K=64, V=64):
    x, rng = draw(seed, N, T, H, HV, K, V, flat=True)
    pool = normal(rng, (P, HV, K, V), np.float32, 0.1)
    cu = np.arange(0, N * T + 1, T, dtype=np.int32)
    return x, pool, cu


def test_vllm_decode_with_slots_and_padding():
    # vLLM's non-speculative decode: one token per sequence, ssm_state_indices [N], padding -1.
    N, T, P = 4, 1, 9
    x, pool, cu = vllm_case(10, N, T, P)
    idx = np.array([7, -1, 0, 4], np.int32)
    before = pool.copy()
    o, final = fla.fused_recurrent_gated_delta_rule_vllm(**x, initial_state=pool, inplace_final_state=True,
                                                         cu_seqlens=cu, ssm_state_indices=idx,
                                                         use_qk_l2norm_in_kernel=True)
    assert final is pool and o.shape == (1, N, 2, 64)
    want_o, want_pool = vllm_model(**rows(x, N, T), pool=before, idx=idx, num_accepted=None, scale=64 ** -0.5,
                                   l2=True, inplace=True)
    assert np.all(o[0, 1] == 0), "a padding row's output is exact zeros"
    assert_matches(o, as_f32(want_o.reshape(o.shape)), "o")
    assert_matches(pool, as_f32(want_pool), "pool")
    for slot in sorted(set(range(P)) - {7, 0, 4}):
        assert pool[slot].tobytes() == before[slot].tobytes(), f"slot {slot} was touched"


@pytest.mark.parametrize("columns", [3, 4])
def test_vllm_spec_decode_num_accepted(columns):
    # vLLM's speculative verify: T tokens per sequence, ssm_state_indices [N, >= T] (vLLM's is
    # num_spec + 1 wide), num_accepted_tokens [N]: row n continues from its last accepted
    # token's slot and writes the state after token t to ssm_state_indices[n, t].
    N, T, P = 3, 3, 16
    x, pool, cu = vllm_case(11, N, T, P)
    idx = (1 + np.arange(N * columns, dtype=np.int32)).reshape(N, columns)
    idx[2] = -1  # a padding sequence
    accepted = np.array([2, 3, 1], np.int32)
    before = pool.copy()
    o, final = fla.fused_recurrent_gated_delta_rule_vllm(**x, initial_state=pool, cu_seqlens=cu,
                                                         ssm_state_indices=idx, num_accepted_tokens=accepted,
                                                         use_qk_l2norm_in_kernel=True)
    assert final is pool
    want_o, want_pool = vllm_model(**rows(x, N, T), pool=before, idx=idx, num_accepted=accepted,
                                   scale=64 ** -0.5, l2=True, inplace=True)
    assert_matches(o, as_f32(want_o.reshape(o.shape)), "o")
    assert_matches(pool, as_f32(want_pool), "pool")
    # And as gdn's own call: token_slots = the first T columns, num_accepted.
    ref_pool = before.copy()
    want = gdn.reference_decode(*(rows(x, N, T)[n] for n in ("q", "k", "v")), ref_pool, g=rows(x, N, T)["g"],
                                beta=rows(x, N, T)["beta"], token_slots=idx[:, :T], num_accepted=accepted,
                                layout="KV", use_qk_l2norm=True)
    assert_matches(o.reshape(want.shape), want, "o (oracle)")
    assert_matches(pool, ref_pool, "pool (oracle)")


def test_vllm_not_inplace_returns_every_token_state():
    N, T, P = 2, 3, 6
    x, pool, cu = vllm_case(12, N, T, P)
    idx = np.array([[4, 5, 0], [1, 2, 3]], np.int64)
    before = pool.copy()
    o, final = fla.fused_recurrent_gated_delta_rule_vllm(**x, initial_state=pool, inplace_final_state=False,
                                                         cu_seqlens=cu, ssm_state_indices=idx, scale=0.1)
    assert pool.tobytes() == before.tobytes(), "inplace_final_state=False only reads the pool"
    assert final.shape == (N * T, 2, 64, 64) and final.dtype == pool.dtype
    want_o, want_states = vllm_model(**rows(x, N, T), pool=before, idx=idx, num_accepted=None, scale=0.1,
                                     l2=False, inplace=False)
    assert_matches(o, as_f32(want_o.reshape(o.shape)), "o")
    assert_matches(final, as_f32(want_states), "final_state")


def test_vllm_dense_without_indices():
    N, T = 3, 1
    x, pool, cu = vllm_case(13, N, T, N)
    before = pool.copy()
    o, final = fla.fused_recurrent_gated_delta_rule_vllm(**x, initial_state=pool, cu_seqlens=cu)
    want_o, want_h = fla_model(**rows(x, N, T), h0=before, scale=64 ** -0.5, l2=False)
    assert final is pool
    assert_matches(o, as_f32(want_o.reshape(o.shape)), "o")
    assert_matches(pool, as_f32(want_h), "pool")


def test_vllm_argument_errors():
    N, T, P = 2, 2, 6
    x, pool, cu = vllm_case(14, N, T, P)
    idx2 = np.array([[0, 1], [2, 3]], np.int32)
    call = fla.fused_recurrent_gated_delta_rule_vllm
    with pytest.raises(ValueError, match=r"^retrieve_parent_token .* not supported"):
        call(**x, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx2, retrieve_parent_token=idx2)
    with pytest.raises(ValueError, match=r"^initial_state is required"):
        call(**x, cu_seqlens=cu, ssm_state_indices=idx2)
    with pytest.raises(TypeError, match=r"^inplace_final_state must be a bool"):
        call(**x, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx2, inplace_final_state=None)
    with pytest.raises(ValueError, match=r"^ssm_state_indices \[N\] names one slot per sequence.*T = 2"):
        call(**x, initial_state=pool, cu_seqlens=cu, ssm_state_indices=np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match=r"^ssm_state_indices must be \[N, >= T\] with T = 2"):
        call(**x, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx2[:, :1])
    with pytest.raises(ValueError, match=r"^num_accepted_tokens needs ssm_state_indices \[N, T\]"):
        call(**x, initial_state=pool, cu_seqlens=cu, num_accepted_tokens=np.array([1, 1], np.int32))
    with pytest.raises(ValueError, match=r"^ssm_state_indices dtype must be int32 or int64, got float32"):
        call(**x, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx2.astype(np.float32))
    with pytest.raises(ValueError, match=r"^initial_state\.shape\[3\] must be V = 64"):
        call(**x, initial_state=pool[..., :32], cu_seqlens=cu, ssm_state_indices=idx2)
    with pytest.raises(ValueError, match=r"^cu_seqlens must be \[0, T, 2T"):
        call(**x, initial_state=pool, cu_seqlens=np.array([0, 1, 4], np.int32), ssm_state_indices=idx2)
    with pytest.raises(TypeError, match=r"^initial_state must be a tensor"):
        call(**x, initial_state=[0.0], cu_seqlens=cu, ssm_state_indices=idx2, inplace_final_state=False)
