// Addressing modes, padding and bad slots, update_state, the intermediate cache, duplicate
// detection, strides, 64-bit offsets, determinism and multi-step drift, on every backend,
// each checked against the float64 oracle and against the semantics of SPEC section 3.
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "harness.h"

namespace gdn::test {
namespace {

class Decode : public BackendTest {};

Config base(Addressing mode, int64_t B, int64_t T) {
  Config c;
  c.B = B;
  c.T = T;
  c.H = 1;
  c.HV = 2;
  c.addressing = mode;
  return c;
}

int64_t idx(const HostTensor& t, std::initializer_list<int64_t> i) { return static_cast<int64_t>(t.get(i)); }

int count_rows(const Expected& e, RowKind k) {
  int n = 0;
  for (const auto& r : e.rows) n += r.kind == k;
  return n;
}

const Addressing kPooled[] = {Addressing::kPool, Addressing::kSplit, Addressing::kPerToken,
                              Addressing::kPerTokenFromFirst, Addressing::kAccepted};

const char* mode_name(Addressing m) {
  switch (m) {
    case Addressing::kDense: return "dense";
    case Addressing::kPool: return "pool";
    case Addressing::kSplit: return "split";
    case Addressing::kPerToken: return "per-token";
    case Addressing::kPerTokenFromFirst: return "per-token (read token 0)";
    case Addressing::kAccepted: return "accepted";
  }
  return "?";
}

TEST_P(Decode, DenseRowsUseTheirOwnSlot) {
  GDN_SEED();
  Config cfg = base(Addressing::kDense, 5, 3);
  cfg.inter = InterMode::kCompact;
  run_and_compare(backend(), make_case(cfg, seed));
}

TEST_P(Decode, PoolSlotsScattered) {
  GDN_SEED();
  for (DLDataType dt : {kInt32, kInt64}) {
    SCOPED_TRACE("slots " + dtype_name(dt));
    Config cfg = base(Addressing::kPool, 8, 2);
    cfg.slot_dtype = dt;
    const Case c = make_case(cfg, seed);
    std::set<int64_t> slots;
    for (int64_t n = 0; n < cfg.B; ++n) slots.insert(idx(c[Arg::kReadSlots], {n}));
    // The harness's promise: distinct slots, slot 0 (ordinary, not a sentinel) and the top one.
    ASSERT_EQ(slots.size(), 8u);
    ASSERT_TRUE(slots.count(0) && slots.count(c.P - 1));
    ASSERT_GE(c.P, 4 * cfg.B);
    run_and_compare(backend(), c);
  }
}

TEST_P(Decode, SplitReadAndWriteSlots) {
  GDN_SEED();
  Config cfg = base(Addressing::kSplit, 6, 3);
  cfg.inter = InterMode::kCompact;
  const Case c = make_case(cfg, seed);
  const Expected e = expected_effects(c);
  std::set<int64_t> reads, writes;
  for (int64_t n = 0; n < cfg.B; ++n) {
    reads.insert(idx(c[Arg::kReadSlots], {n}));
    writes.insert(idx(c[Arg::kWriteSlots], {n}));
  }
  ASSERT_EQ(std::set<int64_t>(e.written_slots.begin(), e.written_slots.end()), writes);
  for (int64_t s : reads) ASSERT_FALSE(writes.count(s));  // read slots must come back untouched
  run_and_compare(backend(), c);
}

TEST_P(Decode, PerTokenSlots) {
  GDN_SEED();
  for (Addressing m : {Addressing::kPerToken, Addressing::kPerTokenFromFirst}) {
    SCOPED_TRACE(mode_name(m));
    Config cfg = base(m, 4, 4);
    cfg.inter = InterMode::kStrided;
    const Case c = make_case(cfg, seed);
    ASSERT_EQ(expected_effects(c).written_slots.size(), 16u);
    run_and_compare(backend(), c);
  }
}

TEST_P(Decode, AcceptedTokenContinuationEveryCount) {
  GDN_SEED();
  for (int64_t T : {4, 16}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    Config cfg = base(Addressing::kAccepted, 2 * T, T);
    cfg.inter = InterMode::kCompact;
    cfg.state_dtype = kBFloat16;
    Case c = make_case(cfg, seed + T);
    for (int64_t n = 0; n < cfg.B; ++n) c[Arg::kNumAccepted].set({n}, n % T + 1);
    run_and_compare(backend(), c);
  }
}

TEST_P(Decode, PaddingRowsAreZeroAndWriteNothing) {
  GDN_SEED();
  for (Addressing m : kPooled) {
    SCOPED_TRACE(mode_name(m));
    Config cfg = base(m, 10, 2);
    cfg.padding = true;
    cfg.inter = InterMode::kStrided;
    const Case c = make_case(cfg, seed);
    const Expected e = expected_effects(c);
    ASSERT_EQ(count_rows(e, RowKind::kPadding), 2);
    ASSERT_EQ(e.error_delta, 0);
    run_and_compare(backend(), c);
  }
}

TEST_P(Decode, AllRowsPadding) {
  GDN_SEED();
  for (Addressing m : {Addressing::kPool, Addressing::kPerTokenFromFirst}) {
    SCOPED_TRACE(mode_name(m));
    Config cfg = base(m, 4, 3);
    cfg.inter = InterMode::kCompact;
    Case c = make_case(cfg, seed);
    for (int64_t n = 0; n < cfg.B; ++n) {
      if (m == Addressing::kPool) c[Arg::kReadSlots].set({n}, -1);
      else c[Arg::kTokenSlots].set({n, 0}, -1);
    }
    ASSERT_EQ(count_rows(expected_effects(c), RowKind::kPadding), 4);
    run_and_compare(backend(), c);
  }
}

TEST_P(Decode, ReadSlotOutOfRangeIsPaddedAndCountedOnce) {
  GDN_SEED();
  Config cfg = base(Addressing::kPool, 6, 2);
  cfg.slot_dtype = kInt64;
  cfg.inter = InterMode::kCompact;
  Case c = make_case(cfg, seed);
  c[Arg::kReadSlots].set({1}, static_cast<double>(c.P));
  c[Arg::kReadSlots].set({3}, static_cast<double>(c.P + (int64_t{1} << 40)));  // would fault if used
  c[Arg::kReadSlots].set({4}, -7);  // any negative slot is padding, not an error
  const Expected e = expected_effects(c);
  ASSERT_EQ(e.error_delta, 2);
  ASSERT_EQ(count_rows(e, RowKind::kPadding), 1);
  run_and_compare(backend(), c);
}

TEST_P(Decode, WriteSlotOutOfRangeIsPaddedAndCounted) {
  GDN_SEED();
  Config cfg = base(Addressing::kSplit, 5, 2);
  Case c = make_case(cfg, seed);
  c[Arg::kWriteSlots].set({2}, static_cast<double>(c.P + 5));
  const Expected e = expected_effects(c);
  ASSERT_EQ(e.error_delta, 1);
  ASSERT_EQ(e.rows[2].kind, RowKind::kInvalid);
  run_and_compare(backend(), c);
}

TEST_P(Decode, TokenSlotOutOfRangeInvalidatesTheWholeRow) {
  GDN_SEED();
  Config cfg = base(Addressing::kPerToken, 4, 4);
  cfg.inter = InterMode::kCompact;
  Case c = make_case(cfg, seed);
  c[Arg::kTokenSlots].set({1, 2}, static_cast<double>(c.P));  // tokens 0 and 1 must not be written either
  // A padding row that also names a slot >= P is counted too (every slot a row names is
  // range-checked), and still treated as padding.
  c[Arg::kReadSlots].set({2}, -1);
  c[Arg::kTokenSlots].set({2, 3}, static_cast<double>(c.P + 1));
  c[Arg::kReadSlots].set({3}, -1);  // plain padding: not counted
  const Expected e = expected_effects(c);
  ASSERT_EQ(e.error_delta, 2);
  ASSERT_EQ(e.rows[1].kind, RowKind::kInvalid);
  ASSERT_EQ(e.rows[2].kind, RowKind::kInvalid);
  ASSERT_EQ(e.rows[3].kind, RowKind::kPadding);
  run_and_compare(backend(), c);
}

TEST_P(Decode, NegativeWriteSlotComputesOutputWithoutWriting) {
  GDN_SEED();
  {
    SCOPED_TRACE("split");
    Case c = make_case(base(Addressing::kSplit, 4, 2), seed);
    c[Arg::kWriteSlots].set({0}, -1);
    const Expected e = expected_effects(c);
    ASSERT_EQ(e.rows[0].kind, RowKind::kValid);
    ASSERT_TRUE(e.rows[0].writes.empty());
    run_and_compare(backend(), c);
  }
  {
    SCOPED_TRACE("per-token");
    Config cfg = base(Addressing::kPerToken, 3, 3);
    cfg.inter = InterMode::kCompact;
    Case c = make_case(cfg, seed);
    c[Arg::kTokenSlots].set({1, 1}, -1);
    c[Arg::kTokenSlots].set({2, 2}, -1);  // the final state of row 2 is dropped
    const Expected e = expected_effects(c);
    ASSERT_EQ(e.rows[1].writes.size(), 2u);
    run_and_compare(backend(), c);
  }
}

TEST_P(Decode, NumAcceptedOutOfRangeIsPaddedAndCounted) {
  GDN_SEED();
  Config cfg = base(Addressing::kAccepted, 6, 4);
  cfg.inter = InterMode::kCompact;
  Case c = make_case(cfg, seed);
  c[Arg::kNumAccepted].set({0}, 0);
  c[Arg::kNumAccepted].set({1}, 5);
  c[Arg::kNumAccepted].set({2}, -1);
  c[Arg::kNumAccepted].set({3}, 4);
  const Expected e = expected_effects(c);
  ASSERT_EQ(e.error_delta, 3);
  run_and_compare(backend(), c);
}

TEST_P(Decode, UpdateStateFalseLeavesThePoolBitIdentical) {
  GDN_SEED();
  for (InterMode im : {InterMode::kNone, InterMode::kStrided}) {
    for (Addressing m : {Addressing::kDense, Addressing::kSplit, Addressing::kPerToken}) {
      SCOPED_TRACE(std::string(mode_name(m)) + (im == InterMode::kNone ? "" : " with inter"));
      Config cfg = base(m, 4, 3);
      cfg.update_state = false;
      cfg.inter = im;
      cfg.state_dtype = kBFloat16;
      const Case before = make_case(cfg, seed);
      ASSERT_TRUE(expected_effects(before).written_slots.empty());
      Case got = before.clone();
      ASSERT_TRUE(run_decode(backend(), got).ok());
      EXPECT_TRUE(got[Arg::kState].storage->same_bytes(*before[Arg::kState].storage));
      run_and_compare(backend(), before);
    }
  }
}

TEST_P(Decode, StridedIntermediateCache) {
  GDN_SEED();
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    Config cfg = base(Addressing::kPerToken, 3, 8);
    cfg.layout = layout;
    cfg.V = 128;
    cfg.state_dtype = kBFloat16;
    cfg.inter = InterMode::kStrided;
    cfg.strides = StrideMode::kOdd;
    run_and_compare(backend(), make_case(cfg, seed));
  }
}

TEST_P(Decode, CheckDuplicateWritesCountsRows) {
  GDN_SEED();
  for (bool check : {true, false}) {
    SCOPED_TRACE(check ? "checking" : "not checking");
    Case c = make_case(base(Addressing::kSplit, 6, 2), seed);
    c.check_duplicate_writes = check;
    // A slot no row reads (so outputs stay defined) and row 5 does not write.
    std::set<int64_t> taken = {idx(c[Arg::kWriteSlots], {5})};
    for (int64_t n = 0; n < 6; ++n) taken.insert(idx(c[Arg::kReadSlots], {n}));
    int64_t shared = 0;
    while (taken.count(shared)) ++shared;
    for (int64_t n : {0, 1, 2}) c[Arg::kWriteSlots].set({n}, static_cast<double>(shared));
    for (int64_t n : {3, 4}) c[Arg::kWriteSlots].set({n}, -1);  // not written: not duplicates
    const Expected e = expected_effects(c);
    ASSERT_EQ(e.error_delta, check ? 3 : 0);
    run_and_compare(backend(), c);
  }
  {
    SCOPED_TRACE("per-token");
    Case c = make_case(base(Addressing::kPerToken, 3, 2), seed + 1);
    c.check_duplicate_writes = true;
    c[Arg::kTokenSlots].set({1, 0}, c[Arg::kTokenSlots].get({0, 1}));
    ASSERT_EQ(expected_effects(c).error_delta, 2);
    run_and_compare(backend(), c);
  }
  {
    SCOPED_TRACE("update_state=false writes nothing, so nothing is duplicated");
    Config cfg = base(Addressing::kSplit, 3, 1);
    cfg.update_state = false;
    Case c = make_case(cfg, seed + 2);
    c.check_duplicate_writes = true;
    c[Arg::kWriteSlots].set({1}, c[Arg::kWriteSlots].get({0}));
    ASSERT_EQ(expected_effects(c).error_delta, 0);
    run_and_compare(backend(), c);
  }
}

TEST_P(Decode, ErrorCountIsOptional) {
  GDN_SEED();
  Config cfg = base(Addressing::kPool, 4, 2);
  cfg.error_count = false;
  Case c = make_case(cfg, seed);
  c[Arg::kReadSlots].set({2}, static_cast<double>(c.P + 3));
  run_and_compare(backend(), c);
}

TEST_P(Decode, PackedAndPaddedLayouts) {
  GDN_SEED();
  for (StrideMode sm : {StrideMode::kPage, StrideMode::kOdd}) {
    for (Addressing m : {Addressing::kDense, Addressing::kPool, Addressing::kAccepted}) {
      for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
        SCOPED_TRACE(std::string(mode_name(m)) + (sm == StrideMode::kPage ? " page" : " odd") +
                     (layout == StateLayout::kVK ? " VK" : " KV"));
        Config cfg = base(m, 3, 2);
        cfg.strides = sm;
        cfg.layout = layout;
        cfg.inter = InterMode::kStrided;
        cfg.state_dtype = kFloat16;
        cfg.out_dtype = kBFloat16;
        run_and_compare(backend(), make_case(cfg, seed));
      }
    }
  }
}

TEST_P(Decode, SoftplusAboveThresholdUsesTheArgument) {
  GDN_SEED();
  Config cfg = base(Addressing::kPool, 2, 3);
  Case c = make_case(cfg, seed);
  // softplus(1000) must be 1000, not exp(1000) = inf: with A_log = log(1e-3), g = exp(-1).
  c[Arg::kDtBias].set({0}, 0.0);
  c[Arg::kALog].set({0}, std::log(1e-3));
  c[Arg::kA].set({0, 0, 0}, 1000.0);
  c[Arg::kA].set({1, 1, 0}, 60.0);
  c[Arg::kA].set({1, 2, 1}, -1000.0);  // softplus ~ 0: no decay
  run_and_compare(backend(), c);
}

TEST_P(Decode, RawKeysWithoutL2Norm) {
  GDN_SEED();
  for (GateForm gates : {GateForm::kRaw, GateForm::kPrecomputed}) {
    Config cfg = base(Addressing::kPool, 4, 1);
    cfg.l2norm = false;
    cfg.normalize_keys_without_l2norm = false;
    cfg.gates = gates;
    cfg.scale = 0.05f;
    run_and_compare(backend(), make_case(cfg, seed));
  }
}

TEST_P(Decode, EmptyBatchIsANoOp) {
  GDN_SEED();
  const Case before = make_case(base(Addressing::kPool, 0, 2), seed);
  Case got = before.clone();
  const Status st = run_decode(backend(), got);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(same_bits(before, got));
}

// Inputs take any innermost stride (SPEC section 1): q reversed along K, k at stride 3, v at
// stride 8 (transformers' view into its conv buffer). The values are those drawn for the
// case, copied into the strided views, so the comparison is against the same numbers.
TEST_P(Decode, InputsWithAnyInnermostStride) {
  GDN_SEED();
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    for (int64_t T : {1, 3}) {
      SCOPED_TRACE(std::string(layout == StateLayout::kVK ? "VK" : "KV") + " T=" + std::to_string(T));
      Config cfg = base(Addressing::kPool, 3, T);
      cfg.layout = layout;
      cfg.state_dtype = kBFloat16;
      Case c = make_case(cfg, seed);
      uint64_t sseed = seed;
      const auto restride = [&](Arg a, int64_t inner) {
        const HostTensor src = c[a];
        const int64_t last = src.shape[3], row = last * std::abs(inner) + 5;
        const std::vector<int64_t> strides = {src.shape[1] * src.shape[2] * row, src.shape[2] * row, row, inner};
        const int64_t lead = inner < 0 ? (last - 1) * -inner : 0;
        auto st = Storage::heap(static_cast<size_t>(lead + src.shape[0] * strides[0]) * dtype_size(src.dtype),
                                ++sseed);
        HostTensor t = view_into(st, lead, src.dtype, src.shape, strides);
        src.for_each([&](const int64_t* idx) { t.set_bits(idx, src.bits(idx)); });
        c[a] = t;
      };
      restride(Arg::kQ, -1);
      restride(Arg::kK, 3);
      restride(Arg::kV, 8);
      run_and_compare(backend(), c);
    }
  }
}

// Zero-size tensors are valid whatever their strides (numpy hands B = 0 arrays with strides
// that are not row-major), innermost ones included.
TEST_P(Decode, EmptyTensorsWithAnyStrides) {
  GDN_SEED();
  for (Addressing m : {Addressing::kDense, Addressing::kPool}) {
    SCOPED_TRACE(mode_name(m));
    Config cfg = base(m, 0, 2);
    cfg.inter = InterMode::kCompact;
    const Case before = make_case(cfg, seed);
    Case got = before.clone();
    const Status st = run_decode(backend(), got, [](DecodeArgs& a) {
      for (int i = 0; i < kNumArgs; ++i) {
        TensorView& v = arg_view(a, static_cast<Arg>(i));
        bool empty = false;
        for (int d = 0; d < v.ndim; ++d) empty = empty || v.shape[d] == 0;
        if (!empty) continue;
        for (int d = 0; d < v.ndim; ++d) v.strides[d] = d % 2 == 0 ? 0 : 7;
      }
    });
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_TRUE(same_bits(before, got));
  }
}

// Written views interleaved with other views of one buffer are disjoint and accepted: o and v
// as the two halves of each head's row of one buffer, error_count in o's padding.
TEST_P(Decode, InterleavedWrittenViewsAreAccepted) {
  GDN_SEED();
  Config cfg = base(Addressing::kPool, 3, 2);
  cfg.out_dtype = cfg.input_dtype;
  Case c = make_case(cfg, seed);
  const HostTensor v = c[Arg::kV];
  const int64_t B = cfg.B, T = cfg.T, HV = cfg.HV, V = cfg.V, row = 2 * V + 16;
  auto st = Storage::heap(static_cast<size_t>(B * T * HV * row) * dtype_size(cfg.input_dtype), seed + 1);
  const std::vector<int64_t> strides = {T * HV * row, HV * row, row, 1};
  HostTensor vi = view_into(st, 0, cfg.input_dtype, {B, T, HV, V}, strides);
  v.for_each([&](const int64_t* idx) { vi.set_bits(idx, v.bits(idx)); });
  c[Arg::kV] = vi;
  c[Arg::kO] = view_into(st, V, cfg.out_dtype, {B, T, HV, V}, strides);
  poison(c[Arg::kO]);
  // Bytes [4V, 4V + 4): the padding after head 0's o of row 0, token 0.
  c[Arg::kErrorCount] = view_into(st, V, kInt32, {1}, {1});
  c[Arg::kErrorCount].set({0}, 3);
  ASSERT_TRUE(can_implement(c.args()).ok()) << can_implement(c.args()).message();
  run_and_compare(backend(), c);
}

TEST_P(Decode, BitIdenticalRunToRun) {
  GDN_SEED();
  Config cfg = base(Addressing::kPerToken, 16, 4);
  cfg.H = 2;
  cfg.HV = 8;
  cfg.K = 128;
  cfg.state_dtype = kBFloat16;
  cfg.out_dtype = kBFloat16;
  cfg.inter = InterMode::kCompact;
  const Case before = make_case(cfg, seed);
  Case first = before.clone(), second = before.clone();
  ASSERT_TRUE(run_decode(backend(), first).ok());
  ASSERT_TRUE(run_decode(backend(), second).ok());
  EXPECT_FALSE(same_bits(before, first)) << "the call wrote nothing";
  EXPECT_TRUE(same_bits(first, second));
}

// 256 decode steps with the state fed back; each result is checked against the oracle's
// own trajectory, within SPEC's many-step bounds.
TEST_P(Decode, MultiStepDrift) {
  GDN_SEED();
  for (DLDataType dt : {kFloat32, kBFloat16, kFloat16}) {
    for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
      SCOPED_TRACE("state " + dtype_name(dt) + (layout == StateLayout::kVK ? " VK" : " KV"));
      Config cfg = base(Addressing::kPool, 3, 1);
      cfg.state_dtype = dt;
      cfg.out_dtype = dt;  // the bound for o is that of its own storage dtype
      cfg.layout = layout;
      Case want = make_case(cfg, seed);
      Case got = want.clone();
      const Tolerance tol = many_steps_tolerance(dt);
      for (int step = 0; step < 256; ++step) {
        if (step > 0) {
          for (Case* c : {&want, &got}) {
            fill_inputs(*c, seed + step);
            poison((*c)[Arg::kO]);
          }
        }
        const Case want_before = want.clone(), got_before = got.clone();
        ASSERT_TRUE(run_reference(want).ok());
        ASSERT_TRUE(run_decode(backend(), got).ok());
        expect_matches(want_before, want, got_before, got, tol, backend_name(backend()) + " step " + std::to_string(step));
        if (HasFailure()) return;
      }
    }
  }
}

// Element offsets beyond 2^31: a bf16 pool of 4.9 GB (fp32: 9.8 GB) of which only the named
// slots are backed, addressed with int32 slot indices (the multiply must be 64-bit).
TEST_P(Decode, SlotOffsetsBeyond2To31) {
  GDN_SEED();
  struct Variant {
    DLDataType dtype;
    StateLayout layout;
    Addressing mode;
  };
  for (const Variant& var : {Variant{kBFloat16, StateLayout::kVK, Addressing::kPool},
                             Variant{kFloat32, StateLayout::kKV, Addressing::kPerToken}}) {
    SCOPED_TRACE("state " + dtype_name(var.dtype));
    Config cfg = base(var.mode, 3, 2);
    cfg.HV = 1;
    cfg.state_dtype = var.dtype;
    cfg.layout = var.layout;
    Case c = make_case(cfg, seed);
    const int64_t P = 600000, slot_elems = 64 * 64;
    const size_t bytes = static_cast<size_t>(P * slot_elems) * dtype_size(var.dtype);
    std::string why;
    if (!device_can_allocate(backend(), bytes, &why)) GTEST_SKIP() << "pool of " << (bytes >> 20) << " MiB: " << why;
    auto pool = Storage::reserve(bytes);
    if (pool == nullptr) GTEST_SKIP() << "cannot reserve " << (bytes >> 20) << " MiB of address space";
    c[Arg::kState] = view_into(pool, 0, var.dtype, {P, 1, 64, 64}, compact_strides({P, 1, 64, 64}));
    c.P = P;
    const int64_t reads[3] = {0, 524289, P - 1};  // 524289 * 4096 > 2^31
    for (int64_t n = 0; n < 3; ++n) c[Arg::kReadSlots].set({n}, static_cast<double>(reads[n]));
    if (var.mode == Addressing::kPerToken) {
      const int64_t tok[3][2] = {{P - 2, 530000}, {1, 524290}, {599000, 7}};
      for (int64_t n = 0; n < 3; ++n)
        for (int64_t t = 0; t < 2; ++t) c[Arg::kTokenSlots].set({n, t}, static_cast<double>(tok[n][t]));
    }
    std::mt19937_64 rng(seed);
    for (int64_t s : slots_to_check(c)) fill_state_slot(c, s, rng);
    ASSERT_GT(524289 * slot_elems, int64_t{1} << 31);
    run_and_compare(backend(), c);
  }
}

// SPEC names T up to 16; a longer call must either match the oracle or be refused cleanly
// (a status naming T, nothing written), never fault or write garbage.
TEST_P(Decode, MoreThanSixteenTokens) {
  GDN_SEED();
  for (int64_t T : {17, 33}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    Config cfg = base(Addressing::kPerToken, 2, T);
    cfg.inter = InterMode::kCompact;
    const Case before = make_case(cfg, seed + T);
    Case got = before.clone();
    const Status st = run_decode(backend(), got);
    if (!st.ok()) {
      EXPECT_NE(st.code(), StatusCode::kCudaError) << st.message();
      EXPECT_NE(st.message().find("T"), std::string::npos) << st.message();
      EXPECT_TRUE(same_bits(before, got));
      continue;
    }
    run_and_compare(backend(), before);
  }
}

// Verify without the cache carries the decay of runs of tokens as one factor (CUDA VK tile
// path, src/cuda/vk.cuh "lazy decay"); a run ends before the factor falls below 2^-24. Per
// head: almost no decay and a moderate one (one run: a wrong or missing fold changes the state
// by 0.1% and by 2x), very strong decay (no token lazy) and random gates (runs of a few tokens); 16 tokens, both state dtypes, K = 64, 128, 256. B * HV = 280 keeps
// the tiles whole, so the four-rows-per-thread variant (reduce-scatter) runs at every K.
TEST_P(Decode, VerifyDecayFromNoneToTotal) {
  GDN_SEED();
  for (const DLDataType sd : {kFloat32, kBFloat16}) {
    for (const int64_t K : {64, 128, 256}) {
      SCOPED_TRACE(std::string(sd.bits == 32 ? "fp32" : "bf16") + " K=" + std::to_string(K));
      Config cfg = base(Addressing::kPool, 70, 16);
      cfg.H = 2;
      cfg.HV = 4;
      cfg.K = K;
      cfg.V = 128;
      cfg.state_dtype = sd;
      Case c = make_case(cfg, seed + sd.bits + K);
      c[Arg::kALog].set({0}, std::log(1e-4));  // g ~ 0.9999 per token
      c[Arg::kALog].set({1}, std::log(40.0));  // g ~ exp(-30)
      c[Arg::kALog].set({2}, std::log(0.05));  // g ~ 0.96
      run_and_compare(backend(), c);
    }
  }
}

// Verify without stored intermediate states, bf16 q/k: the CUDA chunked form (src/cuda/vk_chunk.cuh:
// products with all T tokens at once on tensor cores, a per-row triangular solve, one rank-T
// update; the KV layout on the transposed tile, an fp32 state split into three bf16 terms, an
// fp16 state into two). It takes 16-bit states in both layouts and an fp32 state in the KV
// layout (VK fp32 keeps the token loop, tested elsewhere).
// These grids are below its default threshold, so the plain run checks the token loop and
// ctest's chunk_forced.* copy (GDN_CUDA_VK_CHUNK=2) the chunked kernel: there, a mutant without
// the decay on S0 q, and one with the update's weights in one bf16 term instead of three (>1 ulp
// on ~6% of the state), both failed it on the H100. T from 2 to 16, every K, tiles of 16 to 256
// rows (B * HV from 2 to 280), packed qkv views, split and padded pools, update_state off,
// each output dtype, both gate forms; every run in each of those five layout and state pairs.
TEST_P(Decode, VerifyChunkedForm) {
  GDN_SEED();
  struct Run {
    int64_t K, V, T, B, HV;
    Addressing mode;
    DLDataType out;
    bool update;
  };
  const Run runs[] = {  // tile rows (H100 plan) in the comments
      {128, 128, 2, 40, 4, Addressing::kPool, kFloat32, true},     // 64
      {128, 128, 3, 1, 2, Addressing::kDense, kBFloat16, true},    // 32
      {128, 128, 5, 40, 4, Addressing::kSplit, kFloat32, true},    // 64, precomputed gates
      {128, 128, 8, 70, 4, Addressing::kPool, kFloat16, false},    // 128, update off
      {128, 128, 8, 70, 4, Addressing::kPool, kFloat32, true},     // 128
      {64, 128, 9, 20, 8, Addressing::kPool, kFloat32, true},      // 64
      {64, 64, 16, 3, 2, Addressing::kSplit, kFloat32, true},      // 64
      {64, 256, 6, 70, 4, Addressing::kPool, kBFloat16, true},     // 256
      {256, 256, 8, 10, 16, Addressing::kPool, kFloat32, true},    // 64
      {256, 128, 16, 1, 2, Addressing::kDense, kFloat32, true},    // 16
      {128, 256, 4, 12, 4, Addressing::kDense, kFloat32, true},    // 32
  };
  uint64_t s = seed;
  for (const StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    for (const DLDataType state : {kBFloat16, kFloat16, kFloat32}) {
      if (layout == StateLayout::kVK && state.bits == 32) continue;
      for (const Run& r : runs) {
        SCOPED_TRACE("K=" + std::to_string(r.K) + " V=" + std::to_string(r.V) + " T=" + std::to_string(r.T) +
                     " B=" + std::to_string(r.B) + " HV=" + std::to_string(r.HV) + " " + dtype_name(state) +
                     " state" +
                     (layout == StateLayout::kKV ? " KV" : " VK"));
        Config cfg = base(r.mode, r.B, r.T);
        cfg.H = r.HV / 2;
        cfg.HV = r.HV;
        cfg.K = r.K;
        cfg.V = r.V;
        cfg.state_dtype = state;
        cfg.layout = layout;
        cfg.input_dtype = kBFloat16;
        cfg.out_dtype = r.out;
        cfg.update_state = r.update;
        cfg.padding = r.mode != Addressing::kDense;
        cfg.strides = r.T % 2 == 0 ? StrideMode::kPage : StrideMode::kCompact;
        cfg.gates = r.T == 5 ? GateForm::kPrecomputed : GateForm::kRaw;
        run_and_compare(backend(), make_case(cfg, ++s));
      }
    }
  }
}

// T = 1, fp32 state, a grid of a few waves: the CUDA VK tile path's fine tiles (vk_fine_tile in
// src/cuda/decode_cuda.cu: 16 KB of state per block at one row per thread: 64 rows at K = 64,
// 32 at K = 128, 16 at K = 256). The batch makes the default 32 KB tiles (128, 64, 32 rows at
// V = 128) more than one wave of four blocks per SM on any GPU of up to 160 SMs, and the fine
// grid fits the rule's wave bound on the H100. Pool with padding, page-padded strides, fp32 and
// bf16 outputs.
TEST_P(Decode, DecodeFp32FineTiles) {
  GDN_SEED();
  for (const int64_t K : {64, 128, 256}) {
    SCOPED_TRACE("K=" + std::to_string(K));
    Config cfg = base(Addressing::kPool, K == 64 ? 24 : K == 128 ? 12 : 6, 1);
    cfg.qwen3_next_heads();
    cfg.K = K;
    cfg.padding = true;
    cfg.strides = K == 128 ? StrideMode::kPage : StrideMode::kCompact;
    cfg.out_dtype = K == 64 ? kBFloat16 : kFloat32;
    run_and_compare(backend(), make_case(cfg, seed + K));
  }
}

TEST_P(Decode, Qwen3NextDecodeShape) {
  GDN_SEED();
  Config cfg = base(Addressing::kPool, 8, 1);
  cfg.qwen3_next_heads();
  cfg.state_dtype = kBFloat16;
  cfg.out_dtype = kBFloat16;
  cfg.gate_dtype = kBFloat16;
  run_and_compare(backend(), make_case(cfg, seed));
}

TEST_P(Decode, Qwen3NextVerifyShape) {
  GDN_SEED();
  Config cfg = base(Addressing::kAccepted, 4, 4);
  cfg.qwen3_next_heads();
  cfg.state_dtype = kFloat32;
  cfg.out_dtype = kBFloat16;
  cfg.inter = InterMode::kCompact;
  cfg.strides = StrideMode::kPage;
  run_and_compare(backend(), make_case(cfg, seed));
}

// Several kernels (layouts, state dtypes, T) in one process, in an order where a later one
// needs more shared memory than the first: ctest runs each test in its own process, so a
// per-process launch setting shared between kernels by mistake (as the large-shared-memory
// opt-in once was) only shows up when one test launches several.
TEST_P(Decode, ManyKernelsInOneProcess) {
  GDN_SEED();
  const struct { StateLayout layout; DLDataType state; int64_t T; } runs[] = {
      {StateLayout::kVK, kFloat32, 1}, {StateLayout::kKV, kBFloat16, 1}, {StateLayout::kKV, kBFloat16, 4},
      {StateLayout::kKV, kFloat16, 4}, {StateLayout::kVK, kBFloat16, 8}, {StateLayout::kKV, kFloat32, 16}};
  uint64_t s = seed;
  for (const auto& r : runs) {
    Config cfg = base(Addressing::kPool, 3, r.T);
    cfg.K = cfg.V = 128;
    cfg.layout = r.layout;
    cfg.state_dtype = r.state;
    run_and_compare(backend(), make_case(cfg, ++s));
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, Decode, ::testing::Values(Backend::kCpu),
                         [](const auto&) { return std::string("cpu"); });
#if defined(GDN_WITH_CUDA)
INSTANTIATE_TEST_SUITE_P(Cuda, Decode, ::testing::Values(Backend::kCuda),
                         [](const auto&) { return std::string("cuda"); });
#endif

// ---------------------------------------------------------------------------------------
// The public view helpers.
// ---------------------------------------------------------------------------------------
TEST(TensorApi, MakeViewFillsCompactStrides) {
  float buf[24];
  const TensorView v = make_view(buf, kFloat32, kCpu, {2, 3, 4});
  ASSERT_EQ(v.ndim, 3);
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.strides[1], 4);
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_EQ(v.numel(), 24);
  const TensorView w = make_view(buf, kFloat32, kCpu, {2, 3}, {1, 2});
  EXPECT_EQ(w.strides[0], 1);
  EXPECT_EQ(w.strides[1], 2);
  EXPECT_FALSE(make_view(buf, kFloat32, kCpu, {1, 1, 1, 1, 1, 1}).defined());
  EXPECT_FALSE(make_view(buf, kFloat32, kCpu, {2, 3}, {1}).defined());
}

TEST(TensorApi, FromDlpackAppliesByteOffsetAndCompactStrides) {
  float buf[16] = {};
  int64_t shape[2] = {2, 4};
  DLTensor t{};
  t.data = buf;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 2;
  t.dtype = kFloat32;
  t.shape = shape;
  t.strides = nullptr;
  t.byte_offset = 8;
  const TensorView v = from_dlpack(t);
  EXPECT_EQ(v.data, static_cast<void*>(buf + 2));
  EXPECT_EQ(v.strides[0], 4);
  EXPECT_EQ(v.strides[1], 1);
  int64_t strides[2] = {1, 2};
  t.strides = strides;
  EXPECT_EQ(from_dlpack(t).strides[1], 2);
}

#if !defined(GDN_WITH_CUDA)
TEST(CpuOnlyBuild, CudaTensorsAreNotSupported) {
  const Case before = make_case(base(Addressing::kPool, 2, 1), test_seed());
  Case c = before.clone();
  DecodeArgs args = c.args();
  for (int i = 0; i < kNumArgs; ++i) {
    TensorView& v = arg_view(args, static_cast<Arg>(i));
    if (v.defined()) v.device = cuda_device(0);
  }
  EXPECT_FALSE(cuda_available());
  const Status st = decode(args);
  EXPECT_EQ(st.code(), StatusCode::kNotSupported) << st.message();
  // can_implement promises decode's status without running it.
  EXPECT_EQ(can_implement(args).code(), st.code()) << can_implement(args).message();
  EXPECT_NE(st.message().find("CUDA"), std::string::npos) << st.message();
  EXPECT_TRUE(same_bits(before, c));
}
#endif

}  // namespace
}  // namespace gdn::test
