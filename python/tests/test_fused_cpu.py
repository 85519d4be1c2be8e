"""gdn.fused_decode on host numpy arrays (the CPU backend) against gdn.reference_fused_decode
(the float64 oracle), per docs/semantics.md sections 5-6: fresh random inputs, NaN-poisoned
outputs and caches, every addressing mode with the conv pool following the state's slots,
strided views, and the argument errors. The oracle itself is checked against an independent
numpy model of section 6. Runs in CI without torch or a GPU."""

import numpy as np
import pytest

import gdn
from gdn_testing import (
    BF16,
    assert_matches,
    fused_inputs,
    numpy_fused,
    poisoned,
    run_fused_pair,
    state_shape,
)

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
DTYPES = [F32, F16] + ([BF16] if BF16 is not None else [])
FLAGS = ["use_qk_l2norm", "update_state", "check_duplicate_writes"]
ENTRIES = [gdn.fused_decode, gdn.reference_fused_decode, gdn.can_implement_fused]
# Written by the call, compared by tolerance; the conv pool and conv_inter hold copies of
# inputs rounded once to their dtype, so they must be bit-identical to the oracle's.
TOLERANCE = ("o", "state", "inter")
EXACT = ("conv_state", "conv_inter", "error_count")


def assert_fused_match(got, want):
    for name in want:
        if name in EXACT:
            assert got[name].tobytes() == want[name].tobytes(), f"{name} differs from the oracle's"
        else:
            assert name in TOLERANCE, name
            assert_matches(got[name], want[name], name)


def seen(args, *names):
    return {n: args[n] for n in ("o", "state", "conv_state") + names}


def dense_case(seed, B=3, T=1, H=1, HV=2, K=64, V=64, layout="VK", dtype=F32, state_dtype=F32, **kw):
    def build():
        rng = np.random.default_rng(seed)
        args = fused_inputs(rng, B, T, H, HV, K, V, B, layout, dtype, state_dtype, **kw)
        return args, seen(args)

    return build


# --- the oracle itself, against an independent numpy model of section 6 ------------------

ORACLE_CASES = {
    "vk-raw": dict(layout="VK"),
    "kv-precomputed": dict(layout="KV", form="precomputed"),
    "bias-W3-L2": dict(bias=True, W=3, L=2),
    "W2-L16": dict(W=2, L=16),
    "no-gate": dict(gate=False),
    "no-norm": dict(norm=False),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES), ids=str)
def test_oracle_matches_numpy_model(case):
    rng = np.random.default_rng(1)
    B, T, H, HV, K, V = 2, 3, 1, 2, 64, 128
    args = fused_inputs(rng, B, T, H, HV, K, V, B, **ORACLE_CASES[case])
    model_in = {n: x.copy() if isinstance(x, np.ndarray) else x for n, x in args.items() if n != "o"}
    want_o, want_s, want_c = numpy_fused(**model_in, norm_eps=1e-5, scale=0.3)
    gdn.reference_fused_decode(**args, norm_eps=1e-5, scale=0.3)
    np.testing.assert_allclose(args["o"], want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(args["state"], want_s, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(args["conv_state"], want_c.astype(np.float32))


def test_oracle_matches_numpy_model_without_l2norm():
    rng = np.random.default_rng(2)
    args = fused_inputs(rng, 2, 2, 2, 2, 64, 64, 2)
    args["mixed_qkv"] *= 0.1
    model_in = {n: x.copy() if isinstance(x, np.ndarray) else x for n, x in args.items() if n != "o"}
    want_o, want_s, _ = numpy_fused(**model_in, use_qk_l2norm=False)
    gdn.reference_fused_decode(**args, use_qk_l2norm=False)
    np.testing.assert_allclose(args["o"], want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(args["state"], want_s, rtol=1e-5, atol=1e-7)


# --- dense mode, dtypes, layouts, shapes --------------------------------------------------

@pytest.mark.parametrize("layout", ["VK", "KV"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("form", ["raw", "precomputed"])
def test_dense_fp32(layout, T, form):
    got, want = run_fused_pair(dense_case(10 + T, T=T, layout=layout, form=form))
    assert_fused_match(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("state_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 3])
def test_dense_dtypes(dtype, state_dtype, T):
    got, want = run_fused_pair(dense_case(20 + T, B=3, T=T, H=1, HV=2, K=128, V=128, dtype=dtype,
                                          state_dtype=state_dtype))
    assert_fused_match(got, want)


@pytest.mark.parametrize("conv_dtype", [d for d in DTYPES if d != F32], ids=str)
def test_conv_pool_dtype_of_its_own(conv_dtype):
    # fp32 inputs into a 16-bit conv pool: each input is rounded once, when it is stored.
    got, want = run_fused_pair(dense_case(25, T=3, conv_dtype=conv_dtype))
    assert got["conv_state"].dtype == conv_dtype
    assert_fused_match(got, want)


@pytest.mark.parametrize("K,V", [(64, 256), (256, 64), (128, 128)])
def test_head_dims(K, V):
    got, want = run_fused_pair(dense_case(31, B=2, T=2, K=K, V=V))
    assert_fused_match(got, want)


def test_gva_head_mapping():
    # HV / H = 4 value heads per q/k head, and H = 2 q/k heads in mixed_qkv's q | k | v order.
    got, want = run_fused_pair(dense_case(32, B=2, T=2, H=2, HV=8))
    assert_fused_match(got, want)


@pytest.mark.parametrize("W,L", [(2, 1), (3, 2), (4, 3), (4, 4), (4, 16)])
def test_conv_widths_and_pool_lengths(W, L):
    # L = W - 1 is vLLM's pool, L = W transformers'; the oldest columns of a longer pool still shift.
    got, want = run_fused_pair(dense_case(33, T=3, W=W, L=L, bias=True))
    assert_fused_match(got, want)


@pytest.mark.parametrize("norm", ["gated", "no-gate", "none"])
def test_norm_variants(norm):
    kw = {"gated": {}, "no-gate": dict(gate=False), "none": dict(norm=False)}[norm]
    got, want = run_fused_pair(dense_case(34, T=2, **kw), norm_eps=1e-5)
    assert_fused_match(got, want)


def test_scale_and_no_l2norm():
    got, want = run_fused_pair(dense_case(35, T=2), scale=0.05, use_qk_l2norm=False)
    assert_fused_match(got, want)


def test_output_allocated_like_mixed_qkv():
    # K != V, so a V taken from the wrong place of the state's shape would show.
    for layout in ("VK", "KV"):
        rng = np.random.default_rng(36)
        args = fused_inputs(rng, 2, 3, 1, 2, 64, 128, 2, layout, dtype=F16)
        del args["o"]
        o = gdn.fused_decode(**args)
        assert o.shape == (2, 3, 2, 128) and o.dtype == F16 and np.isfinite(o).all()
        assert gdn.fused_decode(**args, o_dtype=np.float32).dtype == F32
        assert gdn.fused_decode(**args, o_dtype="float32").dtype == F32
        assert gdn.reference_fused_decode(**args).shape == (2, 3, 2, 128)


def test_deterministic():
    (a, _), (b, _) = dense_case(37, T=4)(), dense_case(37, T=4)()
    gdn.fused_decode(**a)
    gdn.fused_decode(**b)
    for name in ("o", "state", "conv_state"):
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("state_dtype", [F32, F16], ids=["fp32", "fp16"])
def test_many_steps_fed_back(state_dtype):
    # 128 decode steps through the same two pools: errors must not accumulate past the
    # many-steps bound of docs/semantics.md section 5. Without the norm: the rule's vector
    # floor excuses a raw output vector shrunk by cancellation (k.q near 0 under a strong
    # decay), and the norm scales such a vector back up to full size, so over a long chain a
    # few normed vectors exceed 1e-5 while the raw ones and the state stay near 1e-6. The norm
    # does not feed back; single calls cover it.
    rng = np.random.default_rng(38)
    B, H, HV, K, V = 2, 1, 2, 64, 64
    got = fused_inputs(rng, B, 1, H, HV, K, V, B, state_dtype=state_dtype, norm=False)
    want = {n: x.copy() if isinstance(x, np.ndarray) else x for n, x in got.items()}
    for step in range(128):
        fresh = fused_inputs(rng, B, 1, H, HV, K, V, B, norm=False)
        for name in ("mixed_qkv", "a", "b"):
            got[name] = want[name] = fresh[name]
        o_got = gdn.fused_decode(**dict(got, o=None))
        o_want = gdn.reference_fused_decode(**dict(want, o=None))
        if state_dtype == F32:
            assert_matches(o_got, o_want, f"o at step {step}", many_steps=True)
        assert got["conv_state"].tobytes() == want["conv_state"].tobytes(), f"conv_state at step {step}"
    assert_matches(got["state"], want["state"], "state after 128 steps", many_steps=True)


# --- pools: padding, bad slots, split pools, per-token slots -------------------------------

def pool_case(seed, read, write=None, P=9, T=1, layout="VK", state_dtype=F32, dtype=F32):
    B = len(read)

    def build():
        rng = np.random.default_rng(seed)
        args = fused_inputs(rng, B, T, 1, 2, 64, 64, P, layout, dtype, state_dtype)
        args["read_slots"] = np.array(read, np.int32)
        if write is not None:
            args["write_slots"] = np.array(write, np.int64)
        args["error_count"] = np.zeros(1, np.int32)
        return args, seen(args, "error_count")

    return build


@pytest.mark.parametrize("layout", ["VK", "KV"])
def test_pool_padding_and_out_of_range(layout):
    # Row 1 is padding (-1), row 3 names slot 9 == P: both read and write neither pool and
    # output exact zeros; row 3 is counted. Rows 0, 2, 4 write split slots.
    build = pool_case(40, read=[3, -1, 0, 9, 5], write=[4, 7, 2, 1, 6], T=2, layout=layout)
    got, want = run_fused_pair(build)
    assert_fused_match(got, want)
    assert got["error_count"][0] == 1
    assert np.all(got["o"][[1, 3]] == 0)
    before = build()[0]
    untouched = [s for s in range(9) if s not in (4, 2, 6)]
    for name in ("state", "conv_state"):
        assert got[name][untouched].tobytes() == before[name][untouched].tobytes(), name


def test_write_slot_negative_skips_the_write():
    build = pool_case(41, read=[2, 5], write=[-1, 7])
    got, want = run_fused_pair(build)
    assert_fused_match(got, want)
    before = build()[0]
    assert np.isfinite(got["o"][0]).all() and (got["o"][0] != 0).any()
    for name in ("state", "conv_state"):
        assert got[name][[0, 1, 2, 3, 4, 5, 6, 8]].tobytes() == before[name][[0, 1, 2, 3, 4, 5, 6, 8]].tobytes()


def test_check_duplicate_writes():
    got, want = run_fused_pair(pool_case(42, read=[1, 2, 3], write=[4, 4, 5]), check_duplicate_writes=True)
    # Slot 4 has two writers, whose rows run concurrently: its content is the caller's error.
    keep = [s for s in range(9) if s != 4]
    assert_fused_match({n: got[n][keep] for n in ("state", "conv_state")},
                       {n: want[n][keep] for n in ("state", "conv_state")})
    assert_fused_match({n: got[n] for n in ("o", "error_count")}, {n: want[n] for n in ("o", "error_count")})
    assert got["error_count"][0] == 2


def mtp_case(seed, B=3, T=4, P=20, num_accepted=None, read=None, layout="VK", state_dtype=F32, caches=True):
    H, HV, K, V = 1, 2, 64, 64

    def build():
        rng = np.random.default_rng(seed)
        args = fused_inputs(rng, B, T, H, HV, K, V, P, layout, state_dtype=state_dtype)
        args["token_slots"] = (1 + np.arange(B * T, dtype=np.int32)).reshape(B, T)
        if read is not None:
            args["read_slots"] = np.array(read, np.int32)
        if num_accepted is not None:
            args["num_accepted"] = np.array(num_accepted, np.int32)
        if caches:
            D = args["mixed_qkv"].shape[2]
            args["inter"] = poisoned((B, T) + state_shape(1, HV, K, V, layout)[1:], state_dtype)
            args["conv_inter"] = poisoned((B, T, D, args["conv_state"].shape[2]), F32)
        args["error_count"] = np.zeros(1, np.int32)
        return args, seen(args, "error_count", *(("inter", "conv_inter") if caches else ()))

    return build


@pytest.mark.parametrize("layout", ["VK", "KV"])
def test_token_slots_num_accepted_and_caches(layout):
    got, want = run_fused_pair(mtp_case(50, num_accepted=[1, 4, 2], layout=layout))
    assert_fused_match(got, want)
    assert got["error_count"][0] == 0
    assert not np.isnan(got["conv_inter"]).any() and not np.isnan(got["inter"]).any()


def test_conv_inter_is_the_conv_state_after_each_token():
    # conv_inter[n, t] is what the conv pool would hold after token t: with token slots, the
    # slot of token t holds it too.
    build = mtp_case(51)
    got, _ = run_fused_pair(build)
    slots = build()[0]["token_slots"]
    for n in range(3):
        for t in range(4):
            assert got["conv_state"][slots[n, t]].tobytes() == got["conv_inter"][n, t].tobytes()


def test_token_slots_padding_row():
    build = mtp_case(52, read=[0, 19, -1])
    got, want = run_fused_pair(build)
    assert_fused_match(got, want)
    assert np.all(got["o"][2] == 0)
    assert np.isnan(got["conv_inter"][2]).all() and np.isnan(got["inter"][2]).all()


def test_num_accepted_out_of_range_is_counted():
    got, want = run_fused_pair(mtp_case(53, num_accepted=[0, 5, 2]))
    assert_fused_match(got, want)
    assert got["error_count"][0] == 2
    assert np.all(got["o"][:2] == 0)


@pytest.mark.parametrize("state_dtype", [F32, F16], ids=str)
def test_update_state_false_with_read_only_pools(state_dtype):
    # Both pools are imported read-only when the call does not write them: a read-only conv
    # pool and state pool work, the caches are still written, and the pools stay bit-identical.
    build = mtp_case(54, read=[3, -1, 7], state_dtype=state_dtype)

    def read_only():
        args, observed = build()
        args["state"].flags.writeable = False
        args["conv_state"].flags.writeable = False
        return args, observed

    got, want = run_fused_pair(read_only, update_state=False)
    assert_fused_match(got, want)
    before = build()[0]
    for name in ("state", "conv_state"):
        assert got[name].tobytes() == before[name].tobytes(), name
    assert not np.isnan(got["conv_inter"][[0, 2]]).any()


def test_read_only_conv_pool_is_refused_when_updated():
    args, _ = dense_case(55)()
    args["conv_state"].flags.writeable = False
    with pytest.raises(ValueError, match=r"^conv_state is read-only, but gdn writes it in place \(pass update_state="):
        gdn.fused_decode(**args)
    assert np.isnan(args["o"]).all()


# --- strided views --------------------------------------------------------------------------

def test_vllm_conv_pool_layout():
    # vLLM keeps the conv pool as [P, L, D] (channels contiguous), L = W - 1, in one buffer
    # per slot page with the recurrent state; gdn takes it as a transposed [P, D, L] view.
    B, T, P, H, HV, K, V = 3, 2, 8, 1, 2, 64, 64

    def build():
        rng = np.random.default_rng(60)
        args = fused_inputs(rng, B, T, H, HV, K, V, P, "KV", dtype=F16, L=3)
        raw = np.ascontiguousarray(args["conv_state"].transpose(0, 2, 1))  # [P, L, D]
        args["conv_state"] = raw.transpose(0, 2, 1)
        assert args["conv_state"].strides[1] == 2 and np.shares_memory(args["conv_state"], raw)
        args["read_slots"] = np.array([6, 0, 3], np.int64)
        return args, dict(seen(args), raw=raw)

    got, want = run_fused_pair(build)
    assert_fused_match({n: got[n] for n in ("o", "state", "conv_state")},
                       {n: want[n] for n in ("o", "state", "conv_state")})
    assert got["raw"].tobytes() == want["raw"].tobytes()


def test_packed_projection_views():
    # Qwen3.5's projections land in one buffer: mixed_qkv, then z, sliced as views (no copies),
    # and o written into a slice of a wider buffer.
    B, T, H, HV, K, V = 2, 3, 1, 2, 64, 64
    D = 2 * H * K + HV * V

    def build():
        rng = np.random.default_rng(61)
        args = fused_inputs(rng, B, T, H, HV, K, V, B)
        proj = rng.standard_normal((B, T, D + HV * V)).astype(np.float32)
        args["mixed_qkv"] = proj[..., :D]
        args["z"] = proj[..., D:].reshape(B, T, HV, V)
        assert np.shares_memory(args["z"], proj) and np.shares_memory(args["mixed_qkv"], proj)
        wide_o = poisoned((B, T, HV, V + 16), np.float32)
        args["o"] = wide_o[..., :V]
        return args, dict(seen(args), wide_o=wide_o)

    got, want = run_fused_pair(build)
    assert_matches(got["wide_o"][..., :64], want["wide_o"][..., :64], "o")
    assert np.isnan(got["wide_o"][..., 64:]).all()
    assert_fused_match({n: got[n] for n in ("state", "conv_state")}, {n: want[n] for n in ("state", "conv_state")})


def test_conv_weight_as_a_squeezed_torch_layout():
    # torch's Conv1d weight is [D, 1, W]; its [D, W] view has strides (W, 1). A transposed
    # [W, D] buffer viewed as [D, W] (strides (1, D)) must read the same taps.
    def build(transposed):
        def b():
            args, observed = dense_case(62, T=2)()
            if transposed:
                args["conv_weight"] = np.ascontiguousarray(args["conv_weight"].T).T
            return args, observed
        return b

    got, want = run_fused_pair(build(True))
    assert_fused_match(got, want)
    plain, _ = run_fused_pair(build(False))
    assert got["o"].tobytes() == plain["o"].tobytes()


# --- errors ---------------------------------------------------------------------------------

def valid_args():
    rng = np.random.default_rng(70)
    return fused_inputs(rng, 2, 1, 1, 2, 64, 64, 2)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(mixed_qkv=a["mixed_qkv"][0]), "mixed_qkv must have rank 3"),
        (lambda a: a.update(mixed_qkv=a["mixed_qkv"][..., :-64]), "mixed_qkv.shape[2] (D = 192) must be 2*H*K + HV*V"),
        (lambda a: a.update(mixed_qkv=np.zeros((2, 17, 256), np.float32), o=None, z=None),
         "mixed_qkv.shape[1] (T) must be in 1..16"),
        (lambda a: a.update(conv_weight=np.zeros((256, 5), np.float32)), "conv_weight.shape[1] (W) must be in 2..4"),
        (lambda a: a.update(conv_weight=a["conv_weight"][:128]), "conv_weight.shape[0]"),
        (lambda a: a.update(conv_state=a["conv_state"][..., :2]), "conv_state.shape[2] (L) must be in W - 1 = 3 .. 16"),
        (lambda a: a.update(conv_state=a["conv_state"][:1]), "conv_state.shape[0]"),
        (lambda a: a.update(conv_bias=np.zeros(255, np.float32)), "conv_bias.shape[0]"),
        (lambda a: a.update(conv_inter=np.zeros((2, 1, 256, 4), np.float16)), "conv_inter dtype must match"),
        (lambda a: a.update(norm_weight=None), "z needs norm_weight"),
        (lambda a: a.update(norm_weight=np.ones(32, np.float32)), "norm_weight.shape[0]"),
        (lambda a: a.update(z=a["z"][:, :, :1]), "z.shape[2]"),
        (lambda a: a.update(mixed_qkv=a["mixed_qkv"].astype(np.float64)), "mixed_qkv dtype"),
        (lambda a: a.update(A_log=a["A_log"].astype(np.float16)), "A_log dtype must be float32"),
        (lambda a: a.update(state=np.asfortranarray(a["state"])), "state.stride[3] must be 1"),
        (lambda a: a.update(conv_inter=a["conv_state"].reshape(2, 1, 256, 4)), "must not overlap"),
        (lambda a: a.update(layout="XY"), "layout must be 'VK'"),
        (lambda a: a.update(norm_eps=-1e-6), "norm_eps must be finite and >= 0"),
    ],
)
def test_errors_raise_value_error_naming_the_argument(change, message):
    args = valid_args()
    change(args)
    before = {k: np.array(v, copy=True) for k, v in args.items() if isinstance(v, np.ndarray)}
    with pytest.raises(ValueError) as info:
        gdn.fused_decode(**args)
    assert message in str(info.value)
    for k, v in before.items():  # nothing is written on error
        assert v.tobytes() == args[k].tobytes(), f"{k} changed by a failed call"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("with_o", [True, False])
def test_layout_is_required(entry, with_o):
    args = valid_args()
    del args["layout"]
    if not with_o:
        del args["o"]
    with pytest.raises(TypeError, match=r"^layout is required .*'VK' = \[P, HV, V, K\], K contiguous"):
        entry(**args)


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("value", [None, 0, 1, "no", "True", 1.0, np.int64(1)], ids=repr)
def test_flags_must_be_bools(flag, value):
    args = valid_args()
    state, conv = args["state"].copy(), args["conv_state"].copy()
    for entry in ENTRIES:
        with pytest.raises(TypeError, match=f"^{flag} must be a bool \\(True or False\\), got "):
            entry(**args, **{flag: value})
    assert np.isnan(args["o"]).all() and args["state"].tobytes() == state.tobytes()
    assert args["conv_state"].tobytes() == conv.tobytes()


@pytest.mark.parametrize(
    "eps,error,message",
    [
        (None, TypeError, "^norm_eps must be a real number \\(float or int\\), got None"),
        ("1e-6", TypeError, "^norm_eps must be a real number .* got str"),
        (True, TypeError, "^norm_eps must be a real number .* got bool"),
        (np.zeros(1), TypeError, "^norm_eps must be a real number"),
        (float("nan"), ValueError, "^norm_eps must be a finite float32 value, got nan"),
        (float("inf"), ValueError, "^norm_eps must be a finite float32 value, got inf"),
        (-1e-6, ValueError, "^norm_eps must be finite and >= 0, got -1e-06"),
    ],
    ids=repr,
)
def test_bad_norm_eps(eps, error, message):
    for entry in ENTRIES:
        args = valid_args()
        with pytest.raises(error, match=message):
            entry(**args, norm_eps=eps)
        assert np.isnan(args["o"]).all()


@pytest.mark.parametrize("eps", [0, 1e-5, np.float32(1e-6), np.float64(1e-6), np.int32(0)], ids=repr)
def test_norm_eps_forms(eps):
    got, want = run_fused_pair(dense_case(71, T=2), norm_eps=float(eps))
    got2, _ = run_fused_pair(dense_case(71, T=2), norm_eps=eps)
    assert_fused_match(got2, want)
    assert got2["o"].tobytes() == got["o"].tobytes()


TENSORS = ["mixed_qkv", "conv_weight", "conv_state", "state", "o", "conv_bias", "conv_inter", "norm_weight", "z",
           "a", "A_log", "read_slots", "inter", "error_count"]


@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.parametrize("value", [[[1.0]], "x", 1.5, object()], ids=lambda v: type(v).__name__)
def test_non_tensors_raise_type_error_naming_the_argument(name, value):
    args = valid_args()
    with pytest.raises(TypeError, match=f"^{name} must be a (writable )?tensor that supports DLPack"):
        gdn.fused_decode(**{**args, name: value})


@pytest.mark.parametrize("name", ["mixed_qkv", "conv_weight", "conv_state", "state", "a", "b", "A_log", "dt_bias"])
def test_missing_required_tensor_is_named(name):
    with pytest.raises(ValueError, match=f"^{name} is required"):
        gdn.fused_decode(**{**valid_args(), name: None})


@pytest.mark.parametrize("name", ["mixed_qkv", "state"])
def test_missing_shape_source_with_o_allocated(name):
    args = valid_args()
    del args["o"]
    with pytest.raises(TypeError, match=f"^{name} must be a tensor .* got None"):
        gdn.fused_decode(**{**args, name: None})
    with pytest.raises(ValueError, match=f"^{name} must have rank"):
        gdn.fused_decode(**{**args, name: args[name][0]})


def test_can_implement_fused():
    args = valid_args()
    status = gdn.can_implement_fused(**args)
    assert status and status.ok and status.code == "ok"
    assert np.isnan(args["o"]).all(), "can_implement_fused must not write"
    args["conv_state"] = args["conv_state"][..., :2]
    status = gdn.can_implement_fused(**args)
    assert not status and status.code == "invalid_argument"
    assert "conv_state.shape[2] (L) must be in W - 1 = 3 .. 16, got 2" in status.message


def test_reference_checks_like_fused_decode():
    args = valid_args()
    args["z"] = args["z"][:, :, :1]
    with pytest.raises(ValueError, match="z.shape"):
        gdn.reference_fused_decode(**args)
