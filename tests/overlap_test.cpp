// The exact overlap tests (src/overlap.h) against brute force: random small strided views,
// positive, negative and zero strides, several element sizes, every byte enumerated.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <string>

#include "overlap.h"

namespace gdn::detail {
namespace {

// A view of `itemsize`-byte elements at byte address `base` (an invented address: nothing is
// dereferenced).
TensorView fake_view(uint64_t base, int64_t itemsize, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> strides) {
  const DLDataType dt{kDLUInt, static_cast<uint8_t>(itemsize * 8), 1};
  return make_view(reinterpret_cast<void*>(base), dt, kCpu, shape, strides);
}

// Every byte of every element, and whether two elements share one.
std::set<uint64_t> bytes_of(const TensorView& v, int64_t itemsize, bool* self_overlap) {
  std::set<uint64_t> all;
  *self_overlap = false;
  int64_t idx[kMaxRank] = {};
  int64_t total = 1;
  for (int d = 0; d < v.ndim; ++d) total *= v.shape[d];
  for (int64_t e = 0; e < total; ++e) {
    int64_t rem = e, off = 0;
    for (int d = v.ndim - 1; d >= 0; --d) {
      idx[d] = rem % v.shape[d];
      rem /= v.shape[d];
      off += idx[d] * v.strides[d];
    }
    for (int64_t b = 0; b < itemsize; ++b) {
      const uint64_t addr = reinterpret_cast<uintptr_t>(v.data) + off * itemsize + b;
      if (!all.insert(addr).second) *self_overlap = true;
    }
  }
  return all;
}

TensorView random_view(std::mt19937_64& rng, int64_t itemsize) {
  // Shapes 1..4 with an occasional empty dim; bases close together so that footprints meet.
  std::uniform_int_distribution<int> rank_d(1, 3), shape_d(0, 12), stride_d(-9, 9);
  std::uniform_int_distribution<uint64_t> base_d(0, 24);
  TensorView v;
  v.ndim = rank_d(rng);
  v.data = reinterpret_cast<void*>((1000 + base_d(rng)) * itemsize);
  v.dtype = DLDataType{kDLUInt, static_cast<uint8_t>(itemsize * 8), 1};
  for (int d = 0; d < v.ndim; ++d) {
    const int sh = shape_d(rng);
    v.shape[d] = sh == 0 ? 0 : 1 + sh % 4;
    v.strides[d] = stride_d(rng);
  }
  return v;
}

TEST(Overlap, MatchesBruteForceOnRandomViews) {
  std::mt19937_64 rng(12345);
  int cross_yes = 0, self_yes = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const int64_t is_x = int64_t{1} << (iter % 3), is_y = int64_t{1} << ((iter / 3) % 3);
    const TensorView x = random_view(rng, is_x), y = random_view(rng, is_y);
    bool sx = false, sy = false;
    const std::set<uint64_t> bx = bytes_of(x, is_x, &sx), by = bytes_of(y, is_y, &sy);
    bool common = false;
    for (uint64_t b : bx) common = common || by.count(b) != 0;
    Footprint fx, fy;
    ASSERT_TRUE(footprint(x, is_x, &fx));
    ASSERT_TRUE(footprint(y, is_y, &fy));
    const Overlap o = overlaps(fx, fy);
    ASSERT_NE(o, Overlap::kTooHard) << "iteration " << iter;
    ASSERT_EQ(o == Overlap::kYes, common) << "iteration " << iter;
    const Overlap s = self_overlaps(fx);
    ASSERT_NE(s, Overlap::kTooHard) << "iteration " << iter;
    ASSERT_EQ(s == Overlap::kYes, sx) << "iteration " << iter;
    cross_yes += common;
    self_yes += sx;
  }
  // Both answers occur often enough that the comparison means something.
  EXPECT_GT(cross_yes, 1000);
  EXPECT_LT(cross_yes, 18000);
  EXPECT_GT(self_yes, 2000);
  EXPECT_LT(self_yes, 18000);
}

TEST(Overlap, InterleavedPoolsAreDisjoint) {
  // vLLM's hybrid cache: per slot one page holding a conv state [D, L] (bf16) and then the
  // recurrent state [HV, V, K] (fp32), the two pools strided views of one buffer.
  const int64_t P = 64, D = 8192, L = 3, HV = 32, V = 128, K = 128;
  const int64_t conv_bytes = D * L * 2, page = conv_bytes + HV * V * K * 4;
  const uint64_t base = uint64_t{1} << 40;
  const TensorView conv = fake_view(base, 2, {P, D, L}, {page / 2, 1, D});  // [P, L, D] memory, transposed
  const TensorView ssm = fake_view(base + conv_bytes, 4, {P, HV, V, K}, {page / 4, V * K, K, 1});
  Footprint fc, fs;
  ASSERT_TRUE(footprint(conv, 2, &fc));
  ASSERT_TRUE(footprint(ssm, 4, &fs));
  EXPECT_EQ(overlaps(fc, fs), Overlap::kNo);
  EXPECT_EQ(self_overlaps(fc), Overlap::kNo);
  EXPECT_EQ(self_overlaps(fs), Overlap::kNo);
  // One element more in the conv state's last dim reaches into the recurrent state.
  const TensorView conv_big = fake_view(base, 2, {P, D + 1, L}, {page / 2, 1, D + 1});
  Footprint fb;
  ASSERT_TRUE(footprint(conv_big, 2, &fb));
  EXPECT_EQ(overlaps(fb, fs), Overlap::kYes);
}

TEST(Overlap, PackedProjectionSlicesAreDisjoint) {
  // q | k | v | z of one [B, T, 2*H*K + 2*HV*V] bf16 buffer: o written into the z part of
  // another such buffer does not touch its q part, but the v part does overlap its own span.
  const int64_t B = 256, T = 4, H = 16, HV = 32, K = 128, V = 128;
  const int64_t row = 2 * H * K + 2 * HV * V;
  const uint64_t base = uint64_t{1} << 36;
  const TensorView q = fake_view(base, 2, {B, T, H, K}, {T * row, row, K, 1});
  const TensorView z = fake_view(base + 2 * (2 * H * K + HV * V), 2, {B, T, HV, V}, {T * row, row, V, 1});
  const TensorView v = fake_view(base + 2 * (2 * H * K), 2, {B, T, HV, V}, {T * row, row, V, 1});
  Footprint fq, fz, fv;
  ASSERT_TRUE(footprint(q, 2, &fq));
  ASSERT_TRUE(footprint(z, 2, &fz));
  ASSERT_TRUE(footprint(v, 2, &fv));
  EXPECT_EQ(overlaps(fz, fq), Overlap::kNo);
  EXPECT_EQ(overlaps(fz, fv), Overlap::kNo);
  const TensorView v_wide = fake_view(base + 2 * (2 * H * K), 2, {B, T, HV, V + 1}, {T * row, row, V, 1});
  Footprint fw;
  ASSERT_TRUE(footprint(v_wide, 2, &fw));
  EXPECT_EQ(overlaps(fz, fw), Overlap::kYes);
  EXPECT_EQ(self_overlaps(fw), Overlap::kYes);  // V + 1 elements per head, heads V apart
}

TEST(Overlap, UnrepresentableRangesAreRefused) {
  const TensorView huge = fake_view(4096, 4, {3, 2}, {INT64_MAX / 2, 1});
  Footprint f;
  EXPECT_FALSE(footprint(huge, 4, &f));
  const TensorView below_zero = fake_view(64, 4, {100}, {-1});
  EXPECT_FALSE(footprint(below_zero, 4, &f));
  // Representable in 64 bits, but past any address space (2^57 bytes).
  const TensorView far = fake_view(4096, 4, {3, 2}, {int64_t{1} << 56, 1});
  EXPECT_FALSE(footprint(far, 4, &f));
  const TensorView empty = fake_view(0, 4, {0, 5}, {INT64_MAX, -3});
  ASSERT_TRUE(footprint(empty, 4, &f));
  EXPECT_TRUE(f.empty);
}

}  // namespace
}  // namespace gdn::detail
