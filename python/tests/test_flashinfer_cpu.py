"""gdn.flashinfer shims on numpy arrays: FlashInfer's names, parameters and return values,
checked against gdn.reference_decode called with the equivalent gdn arguments."""

import numpy as np
import pytest

import gdn
from gdn import flashinfer as fi
from gdn_testing import assert_all_match, gates, poisoned, pool, qkv

B, H, HV, K, V = 3, 1, 2, 64, 64


def inputs(seed, T=1, dtype=np.float16):
    rng = np.random.default_rng(seed)
    x = qkv(rng, B, T, H, HV, K, V, dtype)
    x.update(gates(rng, B, T, HV, "raw", dtype))
    return x, rng


def reference(x, state, **kw):
    o = poisoned(x["v"].shape, kw.pop("o_dtype", x["q"].dtype))
    gdn.reference_decode(x["q"], x["k"], x["v"], state, o, a=x["a"], b=x["b"], A_log=x["A_log"],
                         dt_bias=x["dt_bias"], **kw)
    return o


def fi_args(x):
    return dict(q=x["q"], k=x["k"], v=x["v"], A_log=x["A_log"], a=x["a"], dt_bias=x["dt_bias"], b=x["b"])


def test_pretranspose_dense():
    x, rng = inputs(1)
    state = pool(rng, B, HV, K, V, "VK")
    want_state = state.copy()
    out, ret = fi.gated_delta_rule_decode_pretranspose(state=state, **fi_args(x))
    want = reference(x, want_state, layout="VK")
    assert ret is state
    assert out.dtype == x["q"].dtype and out.shape == (B, 1, HV, V)
    assert_all_match({"o": out, "state": state}, {"o": want, "state": want_state})


def test_pretranspose_positional_order_and_output():
    x, rng = inputs(2)
    state = pool(rng, B, HV, K, V, "VK")
    want_state = state.copy()
    output = poisoned((B, 1, HV, V), np.float32)  # a dtype other than q's is written directly
    out, ret = fi.gated_delta_rule_decode_pretranspose(
        x["q"], x["k"], x["v"], state, x["A_log"], x["a"], x["dt_bias"], x["b"], 0.2, output, False)
    want = reference(x, want_state, layout="VK", scale=0.2, use_qk_l2norm=False, o_dtype=np.float32)
    assert out is output and ret is state
    assert_all_match({"o": out, "state": state}, {"o": want, "state": want_state})


@pytest.mark.parametrize("T", [1, 3])
def test_pretranspose_pool_with_padding_and_split(T):
    x, rng = inputs(3, T)
    P = 8
    initial_state = pool(rng, P, HV, K, V, "VK")
    want_state = initial_state.copy()
    read = np.array([5, -1, 0], np.int32)
    write = np.array([6, 2, -1], np.int64)
    out, ret = fi.gated_delta_rule_decode_pretranspose(
        state=None, initial_state=initial_state, initial_state_indices=read, output_state_indices=write,
        **fi_args(x))
    want = reference(x, want_state, layout="VK", read_slots=read, write_slots=write)
    assert ret is initial_state
    assert np.all(out[1] == 0), "padding (-1) rows are zeros, as on FlashInfer's fp32 path"
    assert_all_match({"o": out, "state": initial_state}, {"o": want, "state": want_state})


def test_pretranspose_intermediate_buffer_larger_than_batch():
    T = 3
    x, rng = inputs(4, T)
    P = 8
    initial_state = pool(rng, P, HV, K, V, "VK")
    before = initial_state.copy()
    buf = poisoned((B + 2, T + 1, HV, V, K), np.float32)
    read = np.array([1, 4, 6], np.int32)
    out, _ = fi.gated_delta_rule_decode_pretranspose(
        state=None, initial_state=initial_state, initial_state_indices=read, intermediate_states_buffer=buf,
        disable_state_update=True, **fi_args(x))
    want_state = before.copy()
    want_inter = poisoned((B, T, HV, V, K), np.float32)
    want = reference(x, want_state, layout="VK", read_slots=read, inter=want_inter, update_state=False)
    assert initial_state.tobytes() == before.tobytes()
    assert np.isnan(buf[B:]).all() and np.isnan(buf[:, T:]).all()
    assert_all_match({"o": out, "inter": buf[:B, :T]}, {"o": want, "inter": want_inter})


def test_pretranspose_argument_errors():
    x, rng = inputs(5)
    pool_ = pool(rng, 4, HV, K, V, "VK")
    with pytest.raises(ValueError, match="provided together"):
        fi.gated_delta_rule_decode_pretranspose(state=None, initial_state=pool_, **fi_args(x))
    with pytest.raises(ValueError, match="Either state or initial_state"):
        fi.gated_delta_rule_decode_pretranspose(state=None, **fi_args(x))
    with pytest.raises(ValueError, match="output_state_indices can only be used"):
        fi.gated_delta_rule_decode_pretranspose(state=pool_[:B], output_state_indices=np.zeros(B, np.int32),
                                                **fi_args(x))
    with pytest.raises(ValueError, match="state.shape"):  # a KV-shaped state with K != V
        fi.gated_delta_rule_decode_pretranspose(state=np.zeros((B, HV, K, 2 * V), np.float32), **fi_args(x))


def test_nontranspose_decode():
    x, rng = inputs(6)
    state = pool(rng, B, HV, K, V, "KV")
    want_state = state.copy()
    out, ret = fi.gated_delta_rule_decode(x["q"], x["k"], x["v"], state, x["A_log"], x["a"],
                                          x["dt_bias"], x["b"])
    want = reference(x, want_state, layout="KV")
    assert ret is state
    assert_all_match({"o": out, "state": state}, {"o": want, "state": want_state})


def test_mtp_default_leaves_pool_unchanged():
    # FlashInfer's disable_state_update=None currently means True.
    T = 4
    x, rng = inputs(7, T)
    initial_state = pool(rng, 10, HV, K, V, "VK")
    before = initial_state.copy()
    idx = np.array([9, 0, 3], np.int32)
    out, ret = fi.gated_delta_rule_mtp(x["q"], x["k"], x["v"], initial_state, idx, x["A_log"], x["a"],
                                       x["dt_bias"], x["b"])
    assert ret is initial_state
    assert initial_state.tobytes() == before.tobytes()
    want = reference(x, before.copy(), layout="VK", read_slots=idx, update_state=False)
    assert_all_match({"o": out}, {"o": want})


def test_mtp_intermediate_cache_and_state_update():
    T = 3
    x, rng = inputs(8, T, np.float32)
    initial_state = pool(rng, 10, HV, K, V, "VK")
    want_state = initial_state.copy()
    idx = np.array([2, -1, 7], np.int64)
    out_idx = np.array([3, 4, 8], np.int64)
    buf = poisoned((B, T, HV, V, K), np.float32)
    out, _ = fi.gated_delta_rule_mtp(**fi_args(x), initial_state=initial_state, initial_state_indices=idx,
                                     intermediate_states_buffer=buf, disable_state_update=False,
                                     output_state_indices=out_idx, scale=0.1)
    want_inter = poisoned((B, T, HV, V, K), np.float32)
    want = reference(x, want_state, layout="VK", read_slots=idx, write_slots=out_idx, inter=want_inter,
                     scale=0.1)
    assert_all_match({"o": out, "state": initial_state, "inter": buf},
                     {"o": want, "state": want_state, "inter": want_inter})


def test_mtp_ssm_state_indices():
    T = 3
    x, rng = inputs(9, T)
    initial_state = pool(rng, 16, HV, K, V, "VK")
    want_state = initial_state.copy()
    idx = np.array([0, 1, 2], np.int32)
    ssm = (3 + np.arange(B * T, dtype=np.int32)).reshape(B, T)
    ignored = np.array([15, 15, 15], np.int32)  # FlashInfer ignores output_state_indices here
    out, _ = fi.gated_delta_rule_mtp(**fi_args(x), initial_state=initial_state, initial_state_indices=idx,
                                     ssm_state_indices=ssm, disable_state_update=False,
                                     output_state_indices=ignored)
    want = reference(x, want_state, layout="VK", read_slots=idx, token_slots=ssm)
    assert_all_match({"o": out, "state": initial_state}, {"o": want, "state": want_state})
    with pytest.raises(ValueError, match="disable_state_update must be False"):
        fi.gated_delta_rule_mtp(**fi_args(x), initial_state=initial_state, initial_state_indices=idx,
                                ssm_state_indices=ssm)


def test_intermediate_states_buffer_errors():
    T = 2
    x, rng = inputs(10, T)
    pool_ = pool(rng, 6, HV, K, V, "VK")
    idx = np.array([0, 1, 2], np.int32)
    kw = dict(initial_state=pool_, initial_state_indices=idx, disable_state_update=False)
    for f in (lambda buf: fi.gated_delta_rule_decode_pretranspose(state=None, intermediate_states_buffer=buf,
                                                                  **kw, **fi_args(x)),
              lambda buf: fi.gated_delta_rule_mtp(x["q"], x["k"], x["v"], pool_, idx, x["A_log"], x["a"],
                                                  x["dt_bias"], x["b"], intermediate_states_buffer=buf,
                                                  disable_state_update=False)):
        before = pool_.copy()
        with pytest.raises(TypeError, match="^intermediate_states_buffer must be a tensor .* got list"):
            f([[0.0]])
        with pytest.raises(ValueError, match=r"^intermediate_states_buffer must have rank 5 .* got shape \(3, 2, 2, 64\)"):
            f(poisoned((B, T, HV, V), np.float32))
        with pytest.raises(ValueError, match=r"^intermediate_states_buffer must be at least \[B=3, T=2, \.\.\.\]"):
            f(poisoned((B - 1, T, HV, V, K), np.float32))
        with pytest.raises(ValueError, match=r"^intermediate_states_buffer must be at least"):
            f(poisoned((B, T - 1, HV, V, K), np.float32))
        with pytest.raises(ValueError, match=r"^intermediate_states_buffer\.shape\[4\] must be K = 64"):
            f(poisoned((B, T, HV, V, 2 * K), np.float32))
        with pytest.raises(ValueError, match="^intermediate_states_buffer dtype must match the initial_state dtype"):
            f(poisoned((B, T, HV, V, K), np.float16))
        assert pool_.tobytes() == before.tobytes()


def test_missing_tensors_and_flags_are_named():
    x, rng = inputs(11)
    state = pool(rng, B, HV, K, V, "VK")
    pool_ = pool(rng, 6, HV, K, V, "VK")
    idx = np.array([0, 1, 2], np.int32)
    with pytest.raises(TypeError, match="^q must be a tensor .* got None"):
        fi.gated_delta_rule_decode_pretranspose(**{**fi_args(x), "q": None}, state=state,
                                                intermediate_states_buffer=poisoned((B, 1, HV, V, K), np.float32))
    with pytest.raises(TypeError, match="^q must be a tensor .* got None"):
        fi.gated_delta_rule_mtp(**{**fi_args(x), "q": None}, initial_state=pool_, initial_state_indices=idx)
    with pytest.raises(TypeError, match="^v must be a tensor .* got None"):  # o is allocated from q and v
        fi.gated_delta_rule_decode(**{**fi_args(x), "v": None}, state=state)
    for name in ("k", "A_log", "a", "dt_bias", "b"):
        with pytest.raises(ValueError, match=f"^{name} is required"):
            fi.gated_delta_rule_decode_pretranspose(**{**fi_args(x), name: None}, state=state)
        with pytest.raises(ValueError, match=f"^{name} is required"):
            fi.gated_delta_rule_decode(**{**fi_args(x), name: None}, state=state)
    with pytest.raises(TypeError, match="^disable_state_update must be a bool .* got str"):
        fi.gated_delta_rule_decode_pretranspose(state=state, disable_state_update="no", **fi_args(x))
    with pytest.raises(TypeError, match="^disable_state_update must be a bool .* got int"):
        fi.gated_delta_rule_mtp(**fi_args(x), initial_state=pool_, initial_state_indices=idx, disable_state_update=0)
    with pytest.raises(TypeError, match="^use_qk_l2norm must be a bool"):
        fi.gated_delta_rule_decode(state=state, use_qk_l2norm=None, **fi_args(x))
    with pytest.raises(TypeError, match="^scale must be a real number"):
        fi.gated_delta_rule_decode(state=state, scale="1", **fi_args(x))


def test_messages_use_flashinfer_names():
    x, rng = inputs(12)
    pool_ = pool(rng, 6, HV, K, V, "VK")
    idx = np.array([0, 1, 2], np.int32)
    with pytest.raises(ValueError, match="^initial_state_indices dtype must be int32 or int64, got float32"):
        fi.gated_delta_rule_decode_pretranspose(state=None, initial_state=pool_,
                                                initial_state_indices=idx.astype(np.float32), **fi_args(x))
    with pytest.raises(ValueError, match=r"^initial_state\.shape\[3\] must be K = 64"):
        fi.gated_delta_rule_mtp(**fi_args(x), initial_state=pool_[..., :32], initial_state_indices=idx)
    with pytest.raises(ValueError, match=r"^output\.shape\[2\] must be HV = 2"):
        fi.gated_delta_rule_decode(state=pool(rng, B, HV, K, V, "KV"), output=poisoned((B, 1, 1, V), np.float16),
                                   **fi_args(x))
    with pytest.raises(ValueError, match="^output_state_indices dtype must be int32 or int64"):
        fi.gated_delta_rule_mtp(**fi_args(x), initial_state=pool_, initial_state_indices=idx,
                                output_state_indices=idx.astype(np.float64), disable_state_update=False)
