// A pairwise covering array: rows of factor levels in which every pair of levels of any two
// factors appears at least once (where a feasibility rule allows the pair), built greedily and
// deterministically. The full product of a test matrix is millions of calls; pairs catch the
// interactions single factors miss, at a cost the float64 oracle can run in seconds.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace gdn::test {

// levels[f]: the number of levels of factor f. feasible(a): whether a partial assignment
// (a[f] = -1 where not chosen yet) can still be completed into a valid case. Returns the rows
// (every entry chosen), generated from `seed`.
std::vector<std::vector<int>> covering_array(const std::vector<int>& levels,
                                             const std::function<bool(const std::vector<int>&)>& feasible,
                                             uint32_t seed);

}  // namespace gdn::test
