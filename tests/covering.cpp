// A pairwise covering array; see covering.h.
#include "covering.h"

#include <algorithm>
#include <iterator>
#include <random>
#include <set>
#include <tuple>

namespace gdn::test {

std::vector<std::vector<int>> covering_array(const std::vector<int>& levels,
                                             const std::function<bool(const std::vector<int>&)>& feasible,
                                             uint32_t seed) {
  using Assignment = std::vector<int>;  // -1: not chosen yet
  using Pair = std::tuple<int, int, int, int>;  // (factor, level, factor, level), first factor smaller
  const int nf = static_cast<int>(levels.size());
  std::set<Pair> uncovered;
  for (int f = 0; f < nf; ++f)
    for (int g = f + 1; g < nf; ++g)
      for (int l = 0; l < levels[f]; ++l)
        for (int m = 0; m < levels[g]; ++m) {
          Assignment a(nf, -1);
          a[f] = l;
          a[g] = m;
          if (feasible(a)) uncovered.emplace(f, l, g, m);
        }
  const auto gain = [&](const Assignment& a, int f) {
    int n = 0;
    for (int g = 0; g < nf; ++g) {
      if (g == f || a[g] < 0) continue;
      n += f < g ? uncovered.count({f, a[f], g, a[g]}) : uncovered.count({g, a[g], f, a[f]});
    }
    return n;
  };

  std::mt19937 rng(seed);
  std::vector<Assignment> rows;
  while (!uncovered.empty()) {
    Assignment best;
    int best_gain = -1;
    for (int attempt = 0; attempt < 24; ++attempt) {
      Assignment a(nf, -1);
      auto it = uncovered.begin();
      if (attempt > 0) std::advance(it, rng() % uncovered.size());
      const auto [f0, l0, g0, m0] = *it;
      a[f0] = l0;
      a[g0] = m0;
      std::vector<int> order;
      for (int f = 0; f < nf; ++f)
        if (a[f] < 0) order.push_back(f);
      std::shuffle(order.begin(), order.end(), rng);
      bool dead_end = false;
      for (int f : order) {
        int pick = -1, pick_gain = -1;
        const int start = static_cast<int>(rng() % levels[f]);
        for (int i = 0; i < levels[f]; ++i) {
          const int l = (start + i) % levels[f];
          a[f] = l;
          if (!feasible(a)) continue;
          const int gn = gain(a, f);
          if (gn > pick_gain) pick = l, pick_gain = gn;
        }
        a[f] = pick;
        if (pick < 0) {
          dead_end = true;
          break;
        }
      }
      if (dead_end) continue;
      int total = 0;
      for (int f = 0; f < nf; ++f)
        for (int g = f + 1; g < nf; ++g) total += uncovered.count({f, a[f], g, a[g]});
      if (total > best_gain) best = a, best_gain = total;
    }
    if (best_gain <= 0) {  // no completion found for this pair within the budget: drop it
      uncovered.erase(uncovered.begin());
      continue;
    }
    for (int f = 0; f < nf; ++f)
      for (int g = f + 1; g < nf; ++g) uncovered.erase({f, best[f], g, best[g]});
    rows.push_back(best);
  }
  return rows;
}

}  // namespace gdn::test
