"""Stochastic rounding of 16-bit state stores (``rounding_seed``, docs/semantics.md section 2;
StepArgs::rounding_seed in include/gdn/gdn.h) through the Python API on host numpy arrays (the
CPU backend): the argument's checks on every entry point, and its effect on gdn.decode and
gdn.fused_decode against the float64 oracle given the same seed. Fresh random inputs,
NaN-poisoned outputs and caches; any int64 value is a seed, negative ones too. Runs in CI
without torch or a GPU."""

import re

import numpy as np
import pytest

import gdn
from gdn_testing import (
    BF16,
    assert_matches,
    fused_inputs,
    gates,
    poisoned,
    pool,
    qkv,
    run_fused_pair,
    run_pair,
    state_shape,
)

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
NO_BF16 = pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed (numpy has no bfloat16)")
# The state dtypes stochastic rounding applies to.
SR_DTYPES = [pytest.param(F16, id="fp16"), pytest.param(BF16, id="bf16", marks=NO_BF16)]
DECODE_ENTRIES = [gdn.decode, gdn.reference_decode, gdn.can_implement]
FUSED_ENTRIES = [gdn.fused_decode, gdn.reference_fused_decode, gdn.can_implement_fused]


def seed(value):
    """A rounding seed as the API takes it: int64 [1] on the state's device (here the host)."""
    return np.array([value], np.int64)


def random_seed(rng):
    # Any int64 value is a seed, negative ones included.
    return int(rng.integers(-(2 ** 63), 2 ** 63 - 1, dtype=np.int64))


def bits(x):
    """The stored bit patterns of a 16- or 32-bit array (NaN payloads included)."""
    return np.ascontiguousarray(x).view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def fraction_differing(x, y):
    bx, by = bits(x), bits(y)
    return float(np.mean(bx != by))


# --- decode -----------------------------------------------------------------------------------

def decode_case(rng_seed, state_dtype, B=3, T=2, H=1, HV=2, K=64, V=64, layout="VK", P=7):
    """A pool call (read_slots a random permutation, so rows read slots other than their index)
    with the intermediate cache, both stored in state_dtype: every store stochastic rounding
    applies to. Observed: o, the pool and inter."""

    def build():
        rng = np.random.default_rng(rng_seed)
        args = qkv(rng, B, T, H, HV, K, V)
        args.update(gates(rng, B, T, HV))
        args["state"] = pool(rng, P, HV, K, V, layout, state_dtype)
        args["read_slots"] = rng.permutation(P)[:B].astype(np.int32)
        args["inter"] = poisoned((B, T) + state_shape(P, HV, K, V, layout)[1:], state_dtype)
        args["o"] = poisoned((B, T, HV, V), F32)
        args["layout"] = layout
        return args, {n: args[n] for n in ("o", "state", "inter", "read_slots")}

    return build


def run_decode(build, **kwargs):
    args, seen = build()
    gdn.decode(**args, **kwargs)
    return seen


def stored(seen):
    """What a decode_case call stored in the state's dtype: the slots it wrote, and inter."""
    return {"state": seen["state"][seen["read_slots"]], "inter": seen["inter"]}


@pytest.mark.parametrize("state_dtype", SR_DTYPES)
@pytest.mark.parametrize("layout", ["VK", "KV"])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_matches_oracle_with_the_same_seed(state_dtype, layout, T):
    rng = np.random.default_rng(901)
    s = seed(random_seed(rng))
    got, want = run_pair(decode_case(int(rng.integers(1 << 30)), state_dtype, T=T, layout=layout), rounding_seed=s)
    for name in ("o", "state", "inter"):
        assert_matches(got[name], want[name], name)
    got, want = stored(got), stored(want)
    # The backend and the oracle draw the same random bits (src/rounding.h, one definition for
    # both): their stored values differ only where their fp32 values straddle a rounding
    # threshold, a few in 10^4. Round-to-nearest, or other bits, would differ in a quarter to a
    # third of the elements.
    for name in ("state", "inter"):
        assert fraction_differing(got[name], want[name]) < 0.01, f"{name}: decode and the oracle drew other bits"


@pytest.mark.parametrize("state_dtype", SR_DTYPES)
def test_decode_same_seed_same_bits_other_seed_other_bits(state_dtype):
    rng = np.random.default_rng(902)
    build = decode_case(int(rng.integers(1 << 30)), state_dtype, T=2)
    s = random_seed(rng)
    first = run_decode(build, rounding_seed=seed(s))
    again = run_decode(build, rounding_seed=seed(s))
    other = run_decode(build, rounding_seed=seed(s ^ 1))
    nearest = run_decode(build)
    assert bits(first["state"]).tobytes() == bits(again["state"]).tobytes(), "same seed, other bits in the pool"
    assert bits(first["inter"]).tobytes() == bits(again["inter"]).tobytes(), "same seed, other bits in inter"
    # o is computed from the fp32 state, before any store: the seed has no effect on it.
    for run in (other, nearest):
        assert bits(first["o"]).tobytes() == bits(run["o"]).tobytes(), "the seed changed o"
    first, other, nearest = stored(first), stored(other), stored(nearest)
    for name in ("state", "inter"):
        # Two independent stochastic roundings of one value differ with probability 2p(1 - p)
        # (a third on average), stochastic and nearest rounding with probability min(p, 1 - p).
        assert fraction_differing(first[name], other[name]) > 0.1, f"{name}: another seed changed too few bits"
        assert fraction_differing(first[name], nearest[name]) > 0.1, f"{name}: the seed changed too few bits"


@pytest.mark.parametrize("state_dtype", SR_DTYPES)
def test_decode_rows_draw_their_own_bits(state_dtype):
    # Two rows with the same inputs and the same state (dense mode: read slots 0 and 1) store
    # the same values under round-to-nearest, but draw other bits with a seed: the read slot is
    # part of the key, so rows of one call are not rounded alike.
    rng = np.random.default_rng(903)
    one = qkv(rng, 1, 2, 1, 2, 64, 64)
    one.update(gates(rng, 1, 2, 2))
    args = {n: np.concatenate([x, x]) if x.shape[0] == 1 else x for n, x in one.items()}
    state = pool(rng, 1, 2, 64, 64, "VK", state_dtype)
    near, sr = np.concatenate([state, state]), np.concatenate([state, state])
    gdn.decode(state=near, layout="VK", **args)
    gdn.decode(state=sr, layout="VK", rounding_seed=seed(random_seed(rng)), **args)
    assert bits(near[0]).tobytes() == bits(near[1]).tobytes(), "the two rows are not the same computation"
    assert fraction_differing(sr[0], sr[1]) > 0.1, "both rows drew the same bits"


@pytest.mark.parametrize("state_dtype", SR_DTYPES)
def test_decode_rounding_is_unbiased(state_dtype):
    # The mean over seeds of the stochastically rounded state converges to the unrounded
    # value (the same step on an fp32 copy of the state); round-to-nearest keeps its error
    # whatever the seed. 64 seeds cut the mean's error to about a fifth of nearest rounding's.
    rng = np.random.default_rng(904)
    B, HV, K, V = 2, 2, 64, 64
    args = qkv(rng, B, 1, 1, HV, K, V)
    args.update(gates(rng, B, 1, HV))
    state = pool(rng, B, HV, K, V, "VK", state_dtype)
    exact = state.astype(F32)
    gdn.decode(state=exact, layout="VK", **args)
    nearest = state.copy()
    gdn.decode(state=nearest, layout="VK", **args)
    total = np.zeros(state.shape)
    first = random_seed(rng) >> 1
    for i in range(64):
        s = state.copy()
        gdn.decode(state=s, layout="VK", rounding_seed=seed(first + i), **args)
        total += s.astype(np.float64)
    err_sr = np.abs(total / 64 - exact).mean()
    err_nearest = np.abs(nearest.astype(np.float64) - exact).mean()
    assert err_sr < 0.5 * err_nearest, f"mean over seeds off by {err_sr:.3g}, nearest rounding by {err_nearest:.3g}"


def test_decode_fp32_state_unaffected():
    rng = np.random.default_rng(905)
    build = decode_case(int(rng.integers(1 << 30)), F32, T=2)
    plain = run_decode(build)
    seeded = run_decode(build, rounding_seed=seed(random_seed(rng)))
    for name in plain:
        assert bits(plain[name]).tobytes() == bits(seeded[name]).tobytes(), f"the seed changed an fp32 {name}"


def test_read_only_seed_is_fine():
    rng = np.random.default_rng(906)
    build = decode_case(int(rng.integers(1 << 30)), F16)
    s = seed(random_seed(rng))
    s.flags.writeable = False
    got = run_decode(build, rounding_seed=s)
    assert np.isfinite(got["o"]).all() and np.isfinite(got["state"]).all()


# --- fused_decode --------------------------------------------------------------------------------

def fused_case(rng_seed, state_dtype, B=3, T=2, H=1, HV=2, K=64, V=64, layout="VK"):
    def build():
        rng = np.random.default_rng(rng_seed)
        args = fused_inputs(rng, B, T, H, HV, K, V, B, layout, F32, state_dtype, conv_dtype=F16)
        args["inter"] = poisoned((B, T) + state_shape(B, HV, K, V, layout)[1:], state_dtype)
        return args, {n: args[n] for n in ("o", "state", "inter", "conv_state")}

    return build


def run_fused(build, **kwargs):
    args, seen = build()
    gdn.fused_decode(**args, **kwargs)
    return seen


@pytest.mark.parametrize("state_dtype", SR_DTYPES)
@pytest.mark.parametrize("layout", ["VK", "KV"])
def test_fused_matches_oracle_with_the_same_seed(state_dtype, layout):
    rng = np.random.default_rng(907)
    s = seed(random_seed(rng))
    got, want = run_fused_pair(fused_case(int(rng.integers(1 << 30)), state_dtype, layout=layout), rounding_seed=s)
    for name in ("o", "state", "inter"):
        assert_matches(got[name], want[name], name)
    assert got["conv_state"].tobytes() == want["conv_state"].tobytes(), "conv_state differs from the oracle's"
    for name in ("state", "inter"):
        assert fraction_differing(got[name], want[name]) < 0.01, f"{name}: fused_decode and the oracle drew other bits"


@pytest.mark.parametrize("state_dtype", SR_DTYPES)
def test_fused_same_seed_same_bits_other_seed_other_bits(state_dtype):
    rng = np.random.default_rng(908)
    build = fused_case(int(rng.integers(1 << 30)), state_dtype)
    s = random_seed(rng)
    first = run_fused(build, rounding_seed=seed(s))
    again = run_fused(build, rounding_seed=seed(s))
    other = run_fused(build, rounding_seed=seed(s + 1))
    nearest = run_fused(build)
    for name in ("state", "inter"):
        assert bits(first[name]).tobytes() == bits(again[name]).tobytes(), f"{name}: same seed, other bits"
        assert fraction_differing(first[name], other[name]) > 0.1, f"{name}: another seed changed too few bits"
        assert fraction_differing(first[name], nearest[name]) > 0.1, f"{name}: the seed changed too few bits"
    # Neither o nor the fp16 conv pool is rounded stochastically.
    for run in (other, nearest):
        for name in ("o", "conv_state"):
            assert bits(first[name]).tobytes() == bits(run[name]).tobytes(), f"the seed changed {name}"


def test_fused_fp32_state_unaffected():
    rng = np.random.default_rng(909)
    build = fused_case(int(rng.integers(1 << 30)), F32)
    plain = run_fused(build)
    seeded = run_fused(build, rounding_seed=seed(random_seed(rng)))
    for name in plain:
        assert bits(plain[name]).tobytes() == bits(seeded[name]).tobytes(), f"the seed changed {name}"


# --- the argument's checks, every entry point ----------------------------------------------------

def decode_args():
    rng = np.random.default_rng(910)
    args = qkv(rng, 2, 1, 1, 2, 64, 64)
    args.update(gates(rng, 2, 1, 2))
    return dict(args, state=pool(rng, 2, 2, 64, 64, "VK", F16), o=poisoned((2, 1, 2, 64), F32), layout="VK")


def fused_args():
    args = fused_inputs(np.random.default_rng(911), 2, 1, 1, 2, 64, 64, 2, state_dtype=F16)
    return args


ENTRIES = [(e, decode_args) for e in DECODE_ENTRIES] + [(e, fused_args) for e in FUSED_ENTRIES]


def call_expecting(entry, args, error, message):
    """entry(**args) raises `error` matching `message`; a can_implement form returns a Status
    carrying the message instead for what the C++ checks find (and raises, as decode does, for
    what the binding checks itself: a 0-d array)."""
    if entry in (gdn.can_implement, gdn.can_implement_fused) and error is ValueError:
        try:
            status = entry(**args)
        except ValueError as e:
            assert re.search(message, str(e)), str(e)
            return
        assert not status and status.code == "invalid_argument"
        assert re.search(message, status.message), status.message
    else:
        with pytest.raises(error, match=message):
            entry(**args)


@pytest.mark.parametrize("entry,valid", ENTRIES, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize(
    "value,error,message",
    [
        (np.zeros(1, np.int32), ValueError, "^rounding_seed dtype must be int64, got int32"),
        (np.zeros(1, np.uint64), ValueError, "^rounding_seed dtype must be int64, got uint64"),
        (np.zeros(1, np.float32), ValueError, "^rounding_seed dtype must be int64, got float32"),
        (np.zeros(2, np.int64), ValueError, "^rounding_seed must hold exactly one element, got shape \\[2\\]"),
        (np.zeros(0, np.int64), ValueError, "^rounding_seed must hold exactly one element, got shape \\[0\\]"),
        (np.zeros((1, 1), np.int64), ValueError, "^rounding_seed must have rank 1"),
        (np.zeros((), np.int64), ValueError, "^rounding_seed must have rank >= 1"),
        (7, TypeError, "^rounding_seed must be an int64 tensor of shape \\[1\\] on the state's device, got int "
                       "\\(7\\): .*seed \\+= 1"),
        (-(2 ** 70), TypeError, "^rounding_seed must be an int64 tensor of shape \\[1\\]"),
        (True, TypeError, "^rounding_seed must be a tensor that supports DLPack"),
        ([1], TypeError, "^rounding_seed must be a tensor that supports DLPack"),
        ("1", TypeError, "^rounding_seed must be a tensor that supports DLPack"),
    ],
    ids=lambda x: repr(x) if not isinstance(x, np.ndarray) else f"{x.dtype}{list(x.shape)}",
)
def test_bad_seed_is_refused_naming_it(entry, valid, value, error, message):
    args = valid()
    before = {n: x.copy() for n, x in args.items() if isinstance(x, np.ndarray)}
    call_expecting(entry, dict(args, rounding_seed=value), error, message)
    for n, x in before.items():
        assert args[n].tobytes() == x.tobytes(), f"a refused call wrote {n}"


@pytest.mark.parametrize("entry,valid", ENTRIES, ids=lambda x: getattr(x, "__name__", ""))
def test_seed_overlapping_a_written_tensor_is_refused(entry, valid):
    # The seed is read by the call (on CUDA, while the kernel writes): it must not share bytes
    # with anything the call writes.
    args = valid()
    o = args["o"]
    call_expecting(entry, dict(args, rounding_seed=o.reshape(-1)[2:4].view(np.int64)), ValueError,
                   "o must not overlap rounding_seed")


@pytest.mark.parametrize("entry,valid", ENTRIES, ids=lambda x: getattr(x, "__name__", ""))
def test_valid_seed_is_accepted(entry, valid):
    args = valid()
    r = entry(**args, rounding_seed=seed(3))
    if entry in (gdn.can_implement, gdn.can_implement_fused):
        assert r and r.ok, r
    else:
        assert np.isfinite(r).all()


def test_seed_is_keyword_only_everywhere():
    import inspect

    for entry in DECODE_ENTRIES + FUSED_ENTRIES:
        p = inspect.signature(entry).parameters["rounding_seed"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None, entry.__name__
