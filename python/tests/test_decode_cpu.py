"""gdn.decode on host numpy arrays (the CPU backend) against gdn.reference_decode (the
float64 oracle), per docs/semantics.md section 5: fresh random inputs, NaN-poisoned
outputs, every addressing mode, strided views. Runs in CI without torch or a GPU."""

import numpy as np
import pytest

import gdn
from gdn_testing import (
    BF16,
    assert_all_match,
    assert_matches,
    gates,
    normal,
    numpy_decode,
    poisoned,
    pool,
    qkv,
    run_pair,
    state_shape,
)

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
DTYPES = [F32, F16] + ([BF16] if BF16 is not None else [])


def call_args(rng, B, T, H, HV, K, V, P, layout, dtype, state_dtype, o_dtype=None, form="raw",
              gate_dtype=F32):
    """Random inputs, gates and a P-slot state of one call, with a NaN-poisoned output."""
    args = qkv(rng, B, T, H, HV, K, V, dtype)
    args.update(gates(rng, B, T, HV, form, gate_dtype))
    args["state"] = pool(rng, P, HV, K, V, layout, state_dtype)
    args["o"] = poisoned((B, T, HV, V), o_dtype or dtype)
    args["layout"] = layout
    return args


def dense_case(seed, B=3, T=1, H=2, HV=4, K=64, V=64, layout="VK", dtype=F32, state_dtype=F32,
               o_dtype=None, form="raw"):
    def build():
        rng = np.random.default_rng(seed)
        args = call_args(rng, B, T, H, HV, K, V, B, layout, dtype, state_dtype, o_dtype, form, dtype)
        return args, {"o": args["o"], "state": args["state"]}

    return build


# --- the oracle itself, against an independent numpy model of section 2 ---------------

@pytest.mark.parametrize("layout", ["VK", "KV"])
@pytest.mark.parametrize("form", ["raw", "precomputed"])
def test_oracle_matches_numpy_model(layout, form):
    rng = np.random.default_rng(1)
    B, T, H, HV, K, V = 2, 3, 1, 2, 64, 128
    args = qkv(rng, B, T, H, HV, K, V)
    args.update(gates(rng, B, T, HV, form))
    state = pool(rng, B, HV, K, V, layout)
    want_o, want_s = numpy_decode(state=state, layout=layout, scale=0.3, **args)
    o = poisoned((B, T, HV, V), np.float32)
    gdn.reference_decode(state=state, o=o, layout=layout, scale=0.3, **args)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, want_s, rtol=1e-5, atol=1e-7)


def test_oracle_matches_numpy_model_without_l2norm():
    rng = np.random.default_rng(2)
    args = qkv(rng, 2, 2, 2, 2, 64, 64)
    args["q"] *= 0.1
    args["k"] *= 0.1
    args.update(gates(rng, 2, 2, 2))
    state = pool(rng, 2, 2, 64, 64)
    want_o, want_s = numpy_decode(state=state, use_qk_l2norm=False, **args)
    o = gdn.reference_decode(state=state, layout="VK", use_qk_l2norm=False, **args)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, want_s, rtol=1e-5, atol=1e-7)


# --- dense mode, dtypes, layouts -------------------------------------------------------

@pytest.mark.parametrize("layout", ["VK", "KV"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("form", ["raw", "precomputed"])
def test_dense_fp32(layout, T, form):
    got, want = run_pair(dense_case(10 + T, T=T, layout=layout, form=form))
    assert_all_match(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("state_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 3])
def test_dense_dtypes(dtype, state_dtype, T):
    got, want = run_pair(dense_case(20 + T, B=4, T=T, H=1, HV=4, K=128, V=128, dtype=dtype,
                                    state_dtype=state_dtype))
    assert_all_match(got, want)


@pytest.mark.parametrize("o_dtype", [F32, F16], ids=str)
def test_output_dtype_independent_of_inputs(o_dtype):
    got, want = run_pair(dense_case(30, dtype=F16, o_dtype=o_dtype))
    assert got["o"].dtype == o_dtype
    assert_all_match(got, want)


@pytest.mark.parametrize("K,V", [(64, 256), (256, 64), (128, 128)])
def test_head_dims(K, V):
    got, want = run_pair(dense_case(31, B=2, T=2, H=1, HV=2, K=K, V=V))
    assert_all_match(got, want)


def test_gva_head_mapping():
    # HV / H = 4 value heads per q/k head: a wrong head mapping changes the result.
    got, want = run_pair(dense_case(32, B=2, T=2, H=2, HV=8))
    assert_all_match(got, want)


def test_scale_and_no_l2norm():
    got, want = run_pair(dense_case(33, T=2), scale=0.05, use_qk_l2norm=False)
    assert_all_match(got, want)


def test_output_allocated_like_q():
    rng = np.random.default_rng(34)
    args = qkv(rng, 2, 1, 1, 2, 64, 64, np.float16)
    args.update(gates(rng, 2, 1, 2))
    args["state"] = pool(rng, 2, 2, 64, 64)
    args["layout"] = "VK"
    o = gdn.decode(**args)
    assert o.shape == (2, 1, 2, 64) and o.dtype == np.float16
    assert np.isfinite(o).all()
    o32 = gdn.decode(**args, o_dtype=np.float32)
    assert o32.dtype == np.float32
    o32s = gdn.decode(**args, o_dtype="float32")
    assert o32s.dtype == np.float32


def test_deterministic():
    (a, _), (b, _) = dense_case(35, T=4)(), dense_case(35, T=4)()
    gdn.decode(**a)
    gdn.decode(**b)
    assert a["o"].tobytes() == b["o"].tobytes()
    assert a["state"].tobytes() == b["state"].tobytes()


@pytest.mark.parametrize("state_dtype", [F32, F16], ids=["fp32", "fp16"])
def test_many_steps_fed_back(state_dtype):
    # 256 decode steps through the same state: errors must not accumulate past the many-steps
    # bound of docs/semantics.md section 5.
    rng = np.random.default_rng(36)
    B, H, HV, K, V = 2, 1, 2, 64, 64
    s_got = pool(rng, B, HV, K, V, "VK", state_dtype)
    s_want = s_got.copy()
    for step in range(256):
        args = qkv(rng, B, 1, H, HV, K, V)
        args.update(gates(rng, B, 1, HV))
        o_got = gdn.decode(state=s_got, layout="VK", **args)
        o_want = gdn.reference_decode(state=s_want, layout="VK", **args)
        if state_dtype == F32:
            assert_matches(o_got, o_want, f"o at step {step}", many_steps=True)
    assert_matches(s_got, s_want, "state after 256 steps", many_steps=True)


# --- pool addressing ---------------------------------------------------------------------

def pool_case(seed, read, write=None, P=9, T=1, layout="VK", dtype=F32, state_dtype=F32,
              idx_dtype=np.int32, error_count=True):
    B, H, HV, K, V = len(read), 1, 2, 64, 64

    def build():
        rng = np.random.default_rng(seed)
        args = call_args(rng, B, T, H, HV, K, V, P, layout, dtype, state_dtype)
        args["read_slots"] = np.array(read, dtype=idx_dtype)
        if write is not None:
            args["write_slots"] = np.array(write, dtype=idx_dtype)
        seen = {"o": args["o"], "state": args["state"]}
        if error_count:
            args["error_count"] = np.zeros(1, np.int32)
            seen["error_count"] = args["error_count"]
        return args, seen

    return build


@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layout", ["VK", "KV"])
def test_pool_with_padding(idx_dtype, layout):
    read = [5, -1, 0, 7]
    build = pool_case(40, read, idx_dtype=idx_dtype, layout=layout)
    got, want = run_pair(build)
    assert_all_match(got, want)
    assert np.all(got["o"][1] == 0), "padding row output must be exact zeros"
    original = build()[0]["state"]
    for slot in set(range(9)) - {5, 0, 7}:
        assert got["state"][slot].tobytes() == original[slot].tobytes(), f"slot {slot} was touched"
    assert got["error_count"][0] == 0


def test_split_pool():
    # Row 0 reads 2 and writes 6; row 1 reads 3 and does not write (-1); row 2 in place.
    build = pool_case(41, read=[2, 3, 4], write=[6, -1, 4], T=2)
    got, want = run_pair(build)
    assert_all_match(got, want)
    original = build()[0]["state"]
    for slot in (0, 1, 2, 3, 5, 7, 8):
        assert got["state"][slot].tobytes() == original[slot].tobytes(), f"slot {slot} was touched"
    assert got["state"][6].tobytes() != original[6].tobytes()


def test_slot_zero_is_ordinary():
    # Slot 0 read and written in place, then slot 0 as a split-pool destination. (No row
    # reads a slot another row writes: the order of such a pair is undefined.)
    for read, write in (([0, 1], [0, 2]), ([3, 1], [0, 2])):
        got, want = run_pair(pool_case(42, read=read, write=write))
        assert_all_match(got, want)


def test_pool_many_rows_threaded():
    # Enough (row, head) items to spread over every CPU thread; distinct read and write sets.
    perm = np.random.default_rng(48).permutation(64)
    read, write = perm[:24].copy(), perm[24:48].copy()
    read[[3, 17]] = -1
    got, want = run_pair(pool_case(48, read=list(read), write=list(write), P=64, T=2))
    assert_all_match(got, want)


def test_out_of_range_slot_is_padded_and_counted():
    build = pool_case(43, read=[1, 9, 2], P=9)  # 9 == P is out of range
    got, want = run_pair(build)
    assert_all_match(got, want)
    assert np.all(got["o"][1] == 0)
    assert got["error_count"][0] == 1
    got2, _ = run_pair(pool_case(43, read=[1, 2, 3], write=[4, 100, 5], P=9))
    assert got2["error_count"][0] == 1


def test_update_state_false_leaves_pool_bit_identical():
    build = pool_case(44, read=[3, 1, 7], write=[4, 2, 8], T=3)
    got, want = run_pair(build, update_state=False)
    assert_all_match(got, want)
    assert got["state"].tobytes() == build()[0]["state"].tobytes()


def test_check_duplicate_writes():
    build = pool_case(45, read=[1, 2, 3], write=[5, 5, 6])
    got, want = run_pair(build, check_duplicate_writes=True)
    assert got["error_count"][0] == want["error_count"][0] == 2
    got, _ = run_pair(build)  # checking off: nothing counted
    assert got["error_count"][0] == 0


def test_noncontiguous_pool_view():
    # pool[:, ::2]: every other head of a wider pool; the skipped heads stay bit-identical.
    B, T, H, HV, K, V, P = 3, 2, 1, 2, 64, 64, 6

    def build():
        rng = np.random.default_rng(46)
        args = qkv(rng, B, T, H, HV, K, V)
        args.update(gates(rng, B, T, HV))
        wide = pool(rng, P, 2 * HV, K, V)
        args["state"] = wide[:, ::2]
        args["read_slots"] = np.array([4, 0, 2], np.int64)
        args["o"] = poisoned((B, T, HV, V), np.float32)
        args["layout"] = "VK"
        return args, {"o": args["o"], "pool": wide}

    got, want = run_pair(build)
    assert not build()[0]["state"].flags.c_contiguous
    assert_all_match(got, want)
    original = build()[1]["pool"]
    assert got["pool"][:, 1::2].tobytes() == original[:, 1::2].tobytes()


def test_page_padded_pool():
    # Slots padded to a page boundary (vLLM-style): slot stride larger than HV * V * K.
    B, H, HV, K, V, P = 2, 1, 2, 64, 64, 5

    def build():
        rng = np.random.default_rng(47)
        args = qkv(rng, B, 1, H, HV, K, V)
        args.update(gates(rng, B, 1, HV))
        flat = normal(rng, (P, HV * V * K + 256), np.float32, 0.1)
        args["state"] = flat[:, : HV * V * K].reshape(P, HV, V, K)
        args["read_slots"] = np.array([3, 1], np.int32)
        args["o"] = poisoned((B, 1, HV, V), np.float32)
        args["layout"] = "VK"
        return args, {"o": args["o"], "state": args["state"], "tail": flat[:, -256:]}

    got, want = run_pair(build)
    assert_all_match(got, want)
    assert got["tail"].tobytes() == build()[1]["tail"].tobytes()


# --- speculative decoding: per-token slots, accepted-token continuation, cache ---------

def mtp_case(seed, B=3, T=4, P=20, token_slots=True, read=None, num_accepted=None, inter=False,
             layout="VK", state_dtype=F32, dtype=F32):
    H, HV, K, V = 1, 2, 64, 64

    def build():
        rng = np.random.default_rng(seed)
        args = call_args(rng, B, T, H, HV, K, V, P, layout, dtype, state_dtype)
        seen = {"o": args["o"], "state": args["state"]}
        if token_slots:
            args["token_slots"] = (1 + np.arange(B * T, dtype=np.int32)).reshape(B, T)
        if read is not None:
            args["read_slots"] = np.array(read, np.int32)
        if num_accepted is not None:
            args["num_accepted"] = np.array(num_accepted, np.int32)
        if inter:
            args["inter"] = poisoned((B, T) + state_shape(1, HV, K, V, layout)[1:], state_dtype)
            seen["inter"] = args["inter"]
        args["error_count"] = np.zeros(1, np.int32)
        seen["error_count"] = args["error_count"]
        return args, seen

    return build


def test_token_slots():
    got, want = run_pair(mtp_case(50))
    assert_all_match(got, want)


def test_token_slots_with_read_slots():
    got, want = run_pair(mtp_case(51, read=[0, 19, -1]))
    assert_all_match(got, want)
    assert np.all(got["o"][2] == 0)


@pytest.mark.parametrize("layout", ["VK", "KV"])
def test_num_accepted(layout):
    got, want = run_pair(mtp_case(52, num_accepted=[1, 4, 2], layout=layout))
    assert_all_match(got, want)
    assert got["error_count"][0] == 0


def test_num_accepted_out_of_range_is_counted():
    got, want = run_pair(mtp_case(53, num_accepted=[0, 5, 2]))
    assert_all_match(got, want)
    assert got["error_count"][0] == 2
    assert np.all(got["o"][:2] == 0)


@pytest.mark.parametrize("state_dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("update_state", [True, False])
def test_intermediate_cache(state_dtype, update_state):
    build = mtp_case(54, token_slots=False, read=[3, -1, 7], inter=True, state_dtype=state_dtype)
    got, want = run_pair(build, update_state=update_state)
    assert_all_match(got, want)
    assert np.isnan(got["inter"][1]).all(), "a padding row must not write its cache entries"
    assert not np.isnan(got["inter"][[0, 2]]).any()
    if not update_state:
        assert got["state"].tobytes() == build()[0]["state"].tobytes()


# --- strided inputs ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_packed_qkv_buffer(dtype):
    # One [B, T, 2*H*K + HV*V] projection output sliced into q, k, v views, as serving
    # engines do after the fused QKV projection; gates sliced from one [B, T, 2*HV] buffer.
    B, T, H, HV, K, V = 3, 2, 2, 4, 64, 64

    def build():
        rng = np.random.default_rng(60)
        qkv_buf = normal(rng, (B, T, 2 * H * K + HV * V), dtype)
        ab = normal(rng, (B, T, 2 * HV), dtype)
        args = dict(
            q=qkv_buf[..., : H * K].reshape(B, T, H, K),
            k=qkv_buf[..., H * K: 2 * H * K].reshape(B, T, H, K),
            v=qkv_buf[..., 2 * H * K:].reshape(B, T, HV, V),
            a=ab[..., :HV], b=ab[..., HV:],
            A_log=np.log(rng.uniform(1, 16, HV)).astype(np.float32),
            dt_bias=normal(rng, (HV,), np.float32, 0.1),
            state=pool(rng, B, HV, K, V),
            o=poisoned((B, T, HV, V), dtype),
        )
        for name in ("q", "k", "v"):
            assert np.shares_memory(args[name], qkv_buf), f"{name} must be a view, not a copy"
        return args, {"o": args["o"], "state": args["state"]}

    got, want = run_pair(build, layout="VK")
    assert_all_match(got, want)


def test_strided_output_and_inputs():
    # o written into a slice of a wider buffer; q read with a padded head stride.
    B, T, H, HV, K, V = 2, 1, 1, 2, 64, 64

    def build():
        rng = np.random.default_rng(61)
        args = qkv(rng, B, T, H, HV, K, V)
        args["q"] = normal(rng, (B, T, H, K + 32), np.float32)[..., :K]
        args.update(gates(rng, B, T, HV))
        wide_o = poisoned((B, T, HV, V + 16), np.float32)
        args["o"] = wide_o[..., :V]
        args["state"] = pool(rng, B, HV, K, V)
        return args, {"wide_o": wide_o, "state": args["state"]}

    got, want = run_pair(build, layout="VK")
    assert_all_match(got, want)
    assert np.isnan(got["wide_o"][..., V:]).all()


# --- errors -------------------------------------------------------------------------------

def valid_args():
    rng = np.random.default_rng(70)
    args = qkv(rng, 2, 1, 1, 2, 64, 64)
    args.update(gates(rng, 2, 1, 2))
    args["state"] = pool(rng, 2, 2, 64, 64)
    args["o"] = poisoned((2, 1, 2, 64), np.float32)
    args["layout"] = "VK"
    return args


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(state=a["state"][:, :, :, :32]), "state.shape[3]"),
        (lambda a: a.update(state=a["state"][0]), "state must have rank 4"),
        (lambda a: a.update(state=np.asfortranarray(a["state"])), "state.stride[3] must be 1"),
        (lambda a: a.update(k=a["k"].astype(np.float16)), "q, k and v must share one dtype"),
        (lambda a: a.update(A_log=a["A_log"].astype(np.float16)), "A_log dtype must be float32"),
        (lambda a: a.update(q=a["q"][..., :32], k=a["k"][..., :32]), "(K) must be 64, 128 or 256"),
        (lambda a: a.update(g=a["a"]), "not both"),
        (lambda a: a.pop("b"), "b is required"),
        (lambda a: a.update(read_slots=np.zeros(2, np.float32)), "read_slots dtype must be int32 or int64"),
        (lambda a: a.update(write_slots=np.zeros(2, np.int32)), "write_slots needs read_slots"),
        (lambda a: a.update(o=a["state"][:, :, :1, :].reshape(2, 1, 2, 64)), "o must not overlap state"),
        (lambda a: a.update(layout="XY"), "layout must be 'VK'"),
        (lambda a: a.update(state=a["state"][0, 0, 0, 0, ...]), "state must have rank >= 1"),
    ],
)
def test_errors_raise_value_error_naming_the_argument(change, message):
    args = valid_args()
    change(args)
    before = {k: np.array(v, copy=True) for k, v in args.items() if isinstance(v, np.ndarray)}
    with pytest.raises(ValueError) as info:
        gdn.decode(**args)
    assert message in str(info.value)
    for k, v in before.items():  # nothing is written on error
        assert v.tobytes() == args[k].tobytes(), f"{k} changed by a failed call"


def test_read_only_state_is_refused():
    args = valid_args()
    args["state"].flags.writeable = False
    with pytest.raises(ValueError, match="^state is read-only, but gdn writes it in place"):
        gdn.decode(**args)


def test_read_only_pool_is_fine_without_state_update():
    # The state is imported writable only when the call writes it.
    build = pool_case(49, read=[3, 1, 7], T=2)

    def read_only():
        args, seen = build()
        args["state"].flags.writeable = False
        return args, seen

    got, want = run_pair(read_only, update_state=False)
    assert_all_match(got, want)
    assert got["state"].tobytes() == build()[0]["state"].tobytes()


@pytest.mark.parametrize("entry", [gdn.decode, gdn.reference_decode, gdn.can_implement], ids=lambda f: f.__name__)
def test_layout_is_required(entry):
    args = valid_args()
    del args["layout"]
    with pytest.raises(TypeError) as info:
        entry(**args)
    msg = str(info.value)
    assert msg.startswith("layout is required")
    assert "'VK' = [P, HV, V, K], K contiguous" in msg and "'KV' = [P, HV, K, V], V contiguous" in msg
    assert np.isnan(args["o"]).all()


@pytest.mark.parametrize("layout,error", [("vk", ValueError), ("", ValueError), (0, TypeError), (b"VK", TypeError)])
def test_bad_layout(layout, error):
    with pytest.raises(error, match="^layout must be"):
        gdn.decode(**{**valid_args(), "layout": layout})


FLAGS = ["use_qk_l2norm", "update_state", "check_duplicate_writes"]


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("value", [None, 0, 1, "no", "false", "True", 1.0, np.int64(1)], ids=repr)
def test_flags_must_be_bools(flag, value):
    args = valid_args()
    state = args["state"].copy()
    for entry in (gdn.decode, gdn.reference_decode, gdn.can_implement):
        with pytest.raises(TypeError, match=f"^{flag} must be a bool \\(True or False\\), got "):
            entry(**args, **{flag: value})
    assert np.isnan(args["o"]).all() and args["state"].tobytes() == state.tobytes()


@pytest.mark.parametrize("flag", FLAGS)
def test_numpy_bool_flags_are_read_as_bools(flag):
    for value in (np.True_, np.False_):
        got, want = run_pair(pool_case(71, read=[2, 0], write=[3, 1]), **{flag: value})
        got_py, _ = run_pair(pool_case(71, read=[2, 0], write=[3, 1]), **{flag: bool(value)})
        assert_all_match(got, want)
        for name in got:
            assert got[name].tobytes() == got_py[name].tobytes(), f"{flag}={value!r}: {name}"


class TorchLikeStream:
    cuda_stream = 0


class CupyLikeStream:
    ptr = 0


@pytest.mark.parametrize("stream", [0, np.int64(0), TorchLikeStream(), CupyLikeStream()], ids=repr)
def test_stream_forms_accepted(stream):
    for entry in (gdn.decode, gdn.reference_decode):
        args = valid_args()
        entry(**args, stream=stream)
        assert np.isfinite(args["o"]).all()


@pytest.mark.parametrize(
    "stream,error,message",
    [
        (1.5, TypeError, "^stream must be an int handle .* got float"),
        ("0", TypeError, "^stream must be an int handle .* got str"),
        (True, TypeError, "^stream must be an int handle or a stream object, got bool"),
        (object(), TypeError, "^stream must be an int handle"),
        (-1, ValueError, "^stream must be a cudaStream_t handle: a non-negative integer"),
        (2 ** 80, ValueError, "^stream must be a cudaStream_t handle"),
        (type("S", (), {"cuda_stream": 1.5})(), TypeError, "^stream.cuda_stream must be an int handle, got float"),
        (type("S", (), {"ptr": None})(), TypeError, "^stream.ptr must be an int handle, got None"),
    ],
    ids=repr,
)
def test_bad_stream(stream, error, message):
    for entry in (gdn.decode, gdn.reference_decode, gdn.can_implement):
        args = valid_args()
        with pytest.raises(error, match=message):
            entry(**args, stream=stream)
        assert np.isnan(args["o"]).all()


@pytest.mark.parametrize("scale", [0.125, 2, np.float32(0.3), np.float64(0.07), np.int32(1)], ids=repr)
def test_scale_forms(scale):
    got, want = run_pair(dense_case(72, T=2), scale=float(scale))
    got2, _ = run_pair(dense_case(72, T=2), scale=scale)
    assert_all_match(got2, want)
    assert got2["o"].tobytes() == got["o"].tobytes()


@pytest.mark.parametrize(
    "scale,error,message",
    [
        ("0.1", TypeError, "^scale must be a real number \\(float or int\\), got str"),
        (True, TypeError, "^scale must be a real number .* got bool"),
        (np.True_, TypeError, "^scale must be a real number .* got numpy.bool"),
        (1j, TypeError, "^scale must be a real number .* got complex"),
        ([0.1], TypeError, "^scale must be a real number .* got list"),
        (float("nan"), ValueError, "^scale must be a finite float32 value, got nan"),
        (float("inf"), ValueError, "^scale must be a finite float32 value, got inf"),
        (1e300, ValueError, "^scale must be a finite float32 value, got 1e\\+300"),
        (10 ** 400, ValueError, "^scale must be a finite float32 value"),
    ],
    ids=repr,
)
def test_bad_scale(scale, error, message):
    for entry in (gdn.decode, gdn.reference_decode, gdn.can_implement):
        args = valid_args()
        with pytest.raises(error, match=message):
            entry(**args, scale=scale)
        assert np.isnan(args["o"]).all()


@pytest.mark.parametrize(
    "o_dtype,error,message",
    [
        ("floaty", ValueError, "^o_dtype 'floaty' is not a dtype name numpy knows"),
        ("float64", ValueError, "^o_dtype must be bfloat16, float16 or float32, got float64"),
        (np.int32, ValueError, "^o_dtype must be bfloat16, float16 or float32, got int32"),
        (3, TypeError, "^o_dtype must be a dtype or a dtype name"),
    ],
    ids=repr,
)
def test_bad_o_dtype(o_dtype, error, message):
    args = valid_args()
    del args["o"]
    with pytest.raises(error, match=message):
        gdn.decode(**args, o_dtype=o_dtype)


@pytest.mark.parametrize(
    "dtype,name",
    [(np.float64, "float64"), (np.complex64, "complex64"), (np.bool_, "bool"), (np.uint16, "uint16"),
     (object, "object"), ("datetime64[s]", "datetime64[s]"), (np.longdouble, str(np.dtype(np.longdouble))),
     ("U3", "<U3")],
    ids=str,
)
def test_unsupported_dtypes_are_named(dtype, name):
    args = valid_args()
    args["q"] = np.zeros(args["q"].shape, dtype=dtype)
    with pytest.raises(ValueError) as info:
        gdn.decode(**args)
    msg = str(info.value)
    assert msg.startswith("q dtype") and name in msg and "code" not in msg, msg


@pytest.mark.parametrize("name", ["q", "k", "v", "state", "o", "a", "A_log", "read_slots", "inter", "error_count"])
@pytest.mark.parametrize("value", [[[1.0]], "q", 1.5, object()], ids=lambda v: type(v).__name__)
def test_non_tensors_raise_type_error_naming_the_argument(name, value):
    args = valid_args()
    with pytest.raises(TypeError, match=f"^{name} must be a (writable )?tensor that supports DLPack"):
        gdn.decode(**{**args, name: value})


@pytest.mark.parametrize("name", ["q", "v"])
def test_missing_q_or_v_with_o_allocated(name):
    args = valid_args()
    del args["o"]
    with pytest.raises(TypeError, match=f"^{name} must be a tensor .* got None"):
        gdn.decode(**{**args, name: None})
    with pytest.raises(ValueError, match=f"^{name} must have rank 4"):
        gdn.decode(**{**args, name: args[name][0]})


@pytest.mark.parametrize("name", ["q", "k", "v", "state", "a", "b", "A_log", "dt_bias"])
def test_missing_required_tensor_is_named(name):
    with pytest.raises(ValueError, match=f"^{name} is required"):
        gdn.decode(**{**valid_args(), name: None})


def test_read_only_inputs_are_fine():
    args = valid_args()
    for name in ("q", "k", "v", "a", "b", "A_log", "dt_bias"):
        args[name].flags.writeable = False
    gdn.decode(**args)
    assert np.isfinite(args["o"]).all()


def test_can_implement():
    args = valid_args()
    status = gdn.can_implement(**args)
    assert status and status.ok and status.code == "ok"
    assert np.isnan(args["o"]).all(), "can_implement must not write"
    args["state"] = args["state"][:1]
    status = gdn.can_implement(**args)
    assert not status
    assert status.code == "invalid_argument"
    assert "state.shape[0] must be B = 2" in status.message


def test_reference_checks_like_decode():
    args = valid_args()
    args["v"] = args["v"][:, :, :1]
    with pytest.raises(ValueError, match="o.shape"):
        gdn.reference_decode(**args)


def test_stream_argument_accepted_on_cpu():
    args = valid_args()
    gdn.decode(**args, stream=0)
    assert np.isfinite(args["o"]).all()


def test_cuda_available_is_bool():
    assert isinstance(gdn.cuda_available(), bool)


# --- every public entry point, every argument, malformed values ----------------------------

def _malformed():
    read_only = np.zeros((2, 2, 64, 64), np.float32)
    read_only.flags.writeable = False
    return [None, 0, 1, -1, 1.5, float("nan"), "x", "VK", b"x", True, np.True_, [1.0], (1,), {}, object(),
            np.float64(1), np.int64(3), 2 ** 70, np.zeros(3), np.zeros(()), np.zeros((0,)),
            np.zeros((2, 1, 1, 64), np.float64), np.zeros((2, 1, 1, 64), np.complex64),
            np.zeros((2, 1, 1, 64), object), np.zeros((2, 2, 2, 64, 64, 1), np.float32), read_only,
            np.zeros((2, 2), np.int64), np.full(2, -5, np.int32), np.full(2, 99, np.int64)]


def _entry_points():
    """(function, valid keyword arguments) for every public entry point."""
    from gdn import fla
    from gdn import flashinfer as fi

    def base():
        rng = np.random.default_rng(80)
        x = qkv(rng, 2, 1, 1, 2, 64, 64)
        x.update(gates(rng, 2, 1, 2))
        return x, rng

    def decode_args():
        x, rng = base()
        return dict(x, state=pool(rng, 4, 2, 64, 64), read_slots=np.array([0, 1], np.int32), layout="VK")

    def fi_pre():
        x, rng = base()
        return dict(x, state=pool(rng, 2, 2, 64, 64))

    def fi_mtp():
        x, rng = base()
        return dict(x, initial_state=pool(rng, 4, 2, 64, 64), initial_state_indices=np.array([0, 1], np.int32))

    def fla_args():
        x, rng = base()
        g = gates(rng, 2, 1, 2, "precomputed")
        return dict(q=x["q"], k=x["k"], v=x["v"], initial_state=pool(rng, 2, 2, 64, 64, "KV"), **g)

    def vllm_args():
        args = fla_args()
        args["ssm_state_indices"] = np.array([1, 0], np.int32)
        return args

    def fused_args():
        from gdn_testing import fused_inputs

        args = fused_inputs(np.random.default_rng(81), 2, 1, 1, 2, 64, 64, 4)
        del args["o"]
        return dict(args, read_slots=np.array([0, 1], np.int32))

    return [(gdn.decode, decode_args), (gdn.reference_decode, decode_args), (gdn.can_implement, decode_args),
            (gdn.fused_decode, fused_args), (gdn.reference_fused_decode, fused_args),
            (gdn.can_implement_fused, fused_args),
            (fi.gated_delta_rule_decode_pretranspose, fi_pre), (fi.gated_delta_rule_decode, fi_pre),
            (fi.gated_delta_rule_mtp, fi_mtp), (fla.fused_recurrent_gated_delta_rule, fla_args),
            (fla.fused_recurrent_gated_delta_rule_vllm, vllm_args)]


SCALARS = {"layout", "scale", "norm_eps", "use_qk_l2norm", "update_state", "check_duplicate_writes", "o_dtype", "stream",
           "disable_state_update", "output_final_state", "inplace_final_state", "use_qk_l2norm_in_kernel"}


@pytest.mark.parametrize("entry,valid", _entry_points(), ids=lambda x: getattr(x, "__name__", ""))
def test_malformed_arguments_raise_type_or_value_error(entry, valid):
    # Every parameter of every entry point, set to each malformed value in turn: the call
    # succeeds or raises TypeError / ValueError (never AttributeError, IndexError, ... or a
    # crash); a scalar's error names it.
    import inspect

    for name in inspect.signature(entry).parameters:
        for value in _malformed():
            args = valid()
            args[name] = value
            try:
                entry(**args)
            except (TypeError, ValueError) as e:
                if name in SCALARS:
                    assert name in str(e), f"{entry.__name__}({name}={value!r}): {e}"
