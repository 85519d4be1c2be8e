"""A fresh adversarial corpus through the Python API on the CPU backend (numpy): random calls,
each a valid call or one defect of a kind an adversary or a careless client produces. Every
tensor of a call is a view into one backing buffer, so overlaps, interleavings and misaligned
views are real memory. For each call:

- valid: gdn.decode agrees with gdn.reference_decode (the float64 oracle) on a copy of the
  buffer, within docs/semantics.md section 5;
- invalid: ValueError or TypeError whose message names the argument, and not one byte of the
  buffer changed.

The seed is fresh each run (GDN_TEST_SEED fixes it) and printed on failure.
"""

import os
import random

import numpy as np
import pytest

import gdn

from gdn_testing import assert_matches

B, T, H, HV, K, V, P = 3, 2, 1, 2, 64, 64, 8
F32 = np.dtype(np.float32)


class Call:
    """Tensors as (offset in floats, shape, strides in floats, dtype) into one float32 buffer."""

    def __init__(self, rng):
        self.spec = {}
        self.kw = dict(layout="VK", scale=None, use_qk_l2norm=True, update_state=True)
        cursor = 16
        # Stride gaps make disjoint interleavings possible without touching any element.
        for name, shape in [("q", (B, T, H, K)), ("k", (B, T, H, K)), ("v", (B, T, HV, V)),
                            ("a", (B, T, HV)), ("b", (B, T, HV)), ("A_log", (HV,)), ("dt_bias", (HV,)),
                            ("state", (P, HV, V, K)), ("o", (B, T, HV, V))]:
            n = int(np.prod(shape))
            self.spec[name] = [cursor, shape, tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))),
                               np.float32]
            cursor += 2 * n + 256  # room for the widened variations below
        self.spec["read_slots"] = [cursor, (B,), (1,), np.int32]
        cursor += 64
        self.spec["error_count"] = [cursor, (1,), (1,), np.int32]
        cursor += 64
        # An int64 seed takes two floats; every offset here is even, so it is 8-byte aligned.
        self.spec["rounding_seed"] = [cursor, (1,), (2,), np.int64]
        cursor += 64
        self.size = cursor + 4096
        self.base = (0.5 * rng.standard_normal(self.size)).astype(np.float32)
        slots = rng.permutation(P)[:B].astype(np.int32)
        off = self.spec["read_slots"][0]
        self.base[off:off + B] = slots.view(np.float32)
        self.base[self.spec["error_count"][0]] = np.int32(0).view(np.float32)
        off = self.spec["rounding_seed"][0]
        self.base[off:off + 2] = np.array([rng.integers(-(2 ** 63), 2 ** 63 - 1, dtype=np.int64)]).view(np.float32)
        # Half the calls pass the seed (the state is fp32, which it must leave alone).
        self.seeded = bool(rng.uniform() < 0.5)
        a_log = self.spec["A_log"][0]
        self.base[a_log:a_log + HV] = np.log(rng.uniform(1, 16, HV))

    def views(self, buf, byte_shift=None):
        out = {}
        for name, (off, shape, strides, dt) in self.spec.items():
            if name in (byte_shift or {}):
                shifted = buf.view(np.uint8)[off * 4 + byte_shift[name]:]
                out[name] = np.ndarray(shape, dtype=dt, buffer=shifted, strides=tuple(4 * s for s in strides))
            else:
                # An 8-byte dtype is viewed from two floats (a view of the rest of the buffer
                # would need an even number of floats left).
                base = buf[off:off + 2] if np.dtype(dt).itemsize == 8 else buf[off:]
                out[name] = np.lib.stride_tricks.as_strided(base.view(dt), shape, tuple(4 * s for s in strides))
        return out

    def call(self, fn, t, **extra):
        kw = dict(self.kw)
        if self.seeded:
            kw["rounding_seed"] = t["rounding_seed"]
        kw.update(extra)
        return fn(t["q"], t["k"], t["v"], t["state"], t["o"], a=t["a"], b=t["b"], A_log=t["A_log"],
                  dt_bias=t["dt_bias"], read_slots=t["read_slots"], error_count=t["error_count"], **kw)


def place(c, name, other, delta=0):
    """Moves tensor `name` onto `other`'s memory (+delta floats): an overlap."""
    c.spec[name][0] = c.spec[other][0] + delta


def seed(c, index=None, value=None):
    """Passes the seed, with spec entry `index` (1 shape, 2 strides, 3 dtype) set to `value`."""
    c.seeded = True
    if index is not None:
        c.spec["rounding_seed"][index] = value


# Defects: (kind, the argument the message must name, mutation). A mutation may return extra
# call arguments or byte shifts.
def defects():
    d = [
        ("o over q", "q", lambda c: place(c, "o", "q", 3)),
        ("o over a gate", "a", lambda c: place(c, "a", "o", 5)),
        ("o over dt_bias", "dt_bias", lambda c: place(c, "dt_bias", "o", 1)),
        ("error_count in o", "error_count", lambda c: place(c, "error_count", "o", 7)),
        ("error_count in the pool", "error_count", lambda c: place(c, "error_count", "state", 4099)),
        ("read_slots in o", "read_slots", lambda c: place(c, "read_slots", "o", 2)),
        ("o over the state", "state", lambda c: place(c, "o", "state", 100)),
        ("o rows alias", "o", lambda c: c.spec["o"].__setitem__(2, (T * HV * V, HV * V, 0, 1))),
        ("state slots alias", "state", lambda c: c.spec["state"].__setitem__(2, (0, V * K, K, 1))),
        ("huge stride", "q", lambda c: c.spec["q"].__setitem__(2, (2 ** 59, H * K, K, 1))),
        ("misaligned q", "q", lambda c: {"__shift": {"q": 1}}),
        ("misaligned state", "state", lambda c: {"__shift": {"state": 2}}),
        ("layout missing", "layout", lambda c: {"layout": None}),
        ("layout unknown", "layout", lambda c: {"layout": "vk"}),
        ("flag None", "update_state", lambda c: {"update_state": None}),
        ("flag string", "use_qk_l2norm", lambda c: {"use_qk_l2norm": "no"}),
        ("flag int", "check_duplicate_writes", lambda c: {"check_duplicate_writes": 1}),
        ("scale string", "scale", lambda c: {"scale": "0.1"}),
        ("scale NaN", "scale", lambda c: {"scale": float("nan")}),
        ("stream float", "stream", lambda c: {"stream": 0.0}),
        ("stream string", "stream", lambda c: {"stream": "0"}),
        ("stream bool", "stream", lambda c: {"stream": True}),
        ("q not a tensor", "q", lambda c: {"__replace": ("q", [1.0, 2.0])}),
        ("q complex", "q", lambda c: {"__replace": ("q", np.zeros((B, T, H, K), np.complex64))}),
        ("q float64", "q", lambda c: {"__replace": ("q", np.zeros((B, T, H, K), np.float64))}),
        ("o wrong shape", "o", lambda c: c.spec["o"].__setitem__(1, (B, T, HV, V // 2))),
        ("seed int32", "rounding_seed", lambda c: seed(c, 3, np.int32)),
        ("seed float32", "rounding_seed", lambda c: seed(c, 3, np.float32)),
        ("seed uint64", "rounding_seed", lambda c: seed(c, 3, np.uint64)),
        ("seed of two elements", "rounding_seed", lambda c: seed(c, 1, (2,))),
        ("seed of rank 2", "rounding_seed", lambda c: seed(c, 1, (1, 1)) or seed(c, 2, (2, 2))),
        ("seed a Python int", "rounding_seed", lambda c: {"rounding_seed": 12345}),
        ("seed a list", "rounding_seed", lambda c: {"rounding_seed": [1]}),
        ("seed in o", "rounding_seed", lambda c: seed(c) or place(c, "rounding_seed", "o", 6)),
        ("seed in the pool", "rounding_seed", lambda c: seed(c) or place(c, "rounding_seed", "state", 2048)),
        ("misaligned seed", "rounding_seed", lambda c: seed(c) or {"__shift": {"rounding_seed": 4}}),
    ]
    return d


# Valid variations that must be accepted and computed right.
def variations():
    return [
        ("plain", lambda c: None),
        ("q reversed along K", lambda c: (c.spec["q"].__setitem__(2, (T * H * K, H * K, K, -1)),
                                          c.spec["q"].__setitem__(0, c.spec["q"][0] + K - 1))),
        ("v innermost stride 2", lambda c: c.spec["v"].__setitem__(2, (T * HV * V * 2, HV * V * 2, V * 2, 2))),
        ("o interleaved with v", lambda c: (c.spec["v"].__setitem__(2, (T * HV * 2 * V, HV * 2 * V, 2 * V, 1)),
                                            c.spec["o"].__setitem__(2, (T * HV * 2 * V, HV * 2 * V, 2 * V, 1)),
                                            c.spec["o"].__setitem__(0, c.spec["v"][0] + V))),
        ("error_count in o's padding", lambda c: (
            c.spec["o"].__setitem__(2, (T * HV * (V + 8), HV * (V + 8), V + 8, 1)),
            c.spec["error_count"].__setitem__(0, c.spec["o"][0] + V))),
        ("seeded", lambda c: seed(c)),
        ("seed in o's padding", lambda c: (
            seed(c), c.spec["o"].__setitem__(2, (T * HV * (V + 8), HV * (V + 8), V + 8, 1)),
            c.spec["rounding_seed"].__setitem__(0, c.spec["o"][0] + V + 2))),
    ]


def names_argument(msg, arg):
    return arg in msg


@pytest.mark.parametrize("chunk", range(4))
def test_fresh_corpus(chunk):
    seed = int(os.environ.get("GDN_TEST_SEED", random.SystemRandom().randrange(1 << 30))) + chunk
    rng = np.random.default_rng(seed)
    problems = []
    for i in range(60):
        c = Call(rng)
        if rng.uniform() < 0.5:
            kind, mutate = variations()[rng.integers(len(variations()))]
            mutate(c)
            if c.spec["o"][1] != (B, T, HV, V):
                continue
            bufs = [c.base.copy(), c.base.copy()]
            got_t, want_t = c.views(bufs[0]), c.views(bufs[1])
            for t in (got_t, want_t):
                t["o"][...] = np.nan
            try:
                c.call(gdn.decode, got_t)
                c.call(gdn.reference_decode, want_t)
            except (ValueError, TypeError) as e:
                problems.append(f"valid call '{kind}' refused: {e}")
                continue
            try:
                assert_matches(np.ascontiguousarray(got_t["o"]), np.ascontiguousarray(want_t["o"]), "o")
                assert_matches(np.ascontiguousarray(got_t["state"]), np.ascontiguousarray(want_t["state"]), "state")
            except AssertionError as e:
                problems.append(f"valid call '{kind}' wrong: {e}")
        else:
            kind, arg, mutate = defects()[rng.integers(len(defects()))]
            extra = mutate(c) or {}
            shift = extra.pop("__shift", None)
            replace = extra.pop("__replace", None)
            buf = c.base.copy()
            before = buf.copy()
            t = c.views(buf, shift)
            if replace:
                t[replace[0]] = replace[1]
            try:
                c.call(gdn.decode, t, **extra)
                problems.append(f"bad call '{kind}' accepted")
            except (ValueError, TypeError) as e:
                if not names_argument(str(e), arg):
                    problems.append(f"bad call '{kind}': message does not name {arg}: {e}")
            except Exception as e:  # noqa: BLE001 - the wrong type is what is being counted
                problems.append(f"bad call '{kind}': {type(e).__name__} instead of ValueError/TypeError: {e}")
            if not np.array_equal(buf.view(np.uint32), before.view(np.uint32)):
                problems.append(f"bad call '{kind}' wrote memory")
    assert not problems, f"seed {seed}: " + "; ".join(problems[:10])
