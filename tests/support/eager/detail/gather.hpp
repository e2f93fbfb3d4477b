// In-place stable gather: the one compaction primitive behind keys, values and every slot column.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <kvevict/error.hpp>
#include <span>
#include <string>

namespace kvevict::eager::detail {

/// Throws unless `keep` is strictly ascending with every entry in [0, live).
inline void validate_keep_list(std::span<const std::int32_t> keep, int live) {
  std::int32_t previous = -1;
  for (std::int32_t slot : keep) {
    KVEVICT_REQUIRE(slot > previous && slot < live,
                    "keep-list must be strictly ascending slot indices in [0, " +
                        std::to_string(live) + "); found " + std::to_string(slot) + " after " +
                        std::to_string(previous));
    previous = slot;
  }
}

/// First index whose slot moves (keep[i] != i); everything before it is already in place.
inline std::size_t first_moved(std::span<const std::int32_t> keep) {
  std::size_t i = 0;
  while (i < keep.size() && keep[i] == static_cast<std::int32_t>(i)) ++i;
  return i;
}

/// column[i] = column[keep[i]] for every i. Safe in place because keep is ascending, so keep[i] >=
/// i and a source is never overwritten before it is read.
template <class T>
void gather_in_place(T* column, std::span<const std::int32_t> keep) {
  for (std::size_t i = first_moved(keep); i < keep.size(); ++i) column[i] = column[keep[i]];
}

/// Row-wise gather of a row-major block: row i = row keep[i], `row_elements` values per row.
/// Consecutive kept rows move as one block (one memmove per run), so a steady-state eviction that
/// drops one slot moves the rows behind it in a single call.
template <class T>
void gather_rows_in_place(T* rows, std::ptrdiff_t row_elements,
                          std::span<const std::int32_t> keep) {
  const std::size_t row_bytes = static_cast<std::size_t>(row_elements) * sizeof(T);
  std::size_t i = first_moved(keep);
  while (i < keep.size()) {
    std::size_t end = i + 1;
    while (end < keep.size() && keep[end] == keep[end - 1] + 1) ++end;
    // Destination rows [i, end) lie below their sources [keep[i], keep[i] + end - i) and may
    // overlap them (memmove); later runs read only rows past keep[end - 1], never written here.
    std::memmove(rows + static_cast<std::ptrdiff_t>(i) * row_elements,
                 rows + static_cast<std::ptrdiff_t>(keep[i]) * row_elements, (end - i) * row_bytes);
    i = end;
  }
}

}  // namespace kvevict::eager::detail
