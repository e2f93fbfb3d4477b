// Checked size arithmetic: sums and products of counts (slots, heads, tokens, bytes) that fail with
// a kvevict::Error naming the quantity instead of wrapping around.
//
// Every size kvevict derives from input it does not control (a model file, a replay, a budget from
// a command line, a C API argument) goes through these, so that an absurd value is reported where
// it enters, not discovered later as an out-of-bounds index or a multi-gigabyte allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>

#include "kvevict/error.hpp"

namespace kvevict {

/// a + b for non-negative a and b, as int64. Throws if either is negative or the sum exceeds
/// `limit`; `what` names the sum in the message ("sinks + recent").
[[nodiscard]] inline std::int64_t checked_sum(
    std::initializer_list<std::int64_t> terms, std::string_view what,
    std::int64_t limit = std::numeric_limits<std::int32_t>::max()) {
  std::int64_t sum = 0;
  for (const std::int64_t term : terms) {
    if (term < 0) {
      throw Error(std::string(what) + ": negative term " + std::to_string(term));
    }
    if (term > limit - sum) {
      throw Error(std::string(what) + " exceeds the limit of " + std::to_string(limit));
    }
    sum += term;
  }
  return sum;
}

/// The product of non-negative factors, as int64. Throws if a factor is negative or the product
/// exceeds `limit` (checked before each multiplication, so nothing overflows on the way).
[[nodiscard]] inline std::int64_t checked_product(
    std::initializer_list<std::int64_t> factors, std::string_view what,
    std::int64_t limit = std::numeric_limits<std::int64_t>::max()) {
  std::int64_t product = 1;
  for (const std::int64_t factor : factors) {
    if (factor < 0) {
      throw Error(std::string(what) + ": negative factor " + std::to_string(factor));
    }
    if (factor != 0 && product > limit / factor) {
      throw Error(std::string(what) + " exceeds the limit of " + std::to_string(limit));
    }
    product *= factor;
  }
  return product;
}

/// `value` as int; throws unless it lies in [0, INT_MAX].
[[nodiscard]] inline int checked_int(std::int64_t value, std::string_view what) {
  if (value < 0 || value > std::numeric_limits<int>::max()) {
    throw Error(std::string(what) + " = " + std::to_string(value) + " is outside [0, " +
                std::to_string(std::numeric_limits<int>::max()) + "]");
  }
  return static_cast<int>(value);
}

/// A byte or element count for an allocation: the product of `factors`, at most `limit`.
[[nodiscard]] inline std::size_t checked_allocation(std::initializer_list<std::int64_t> factors,
                                                    std::string_view what, std::int64_t limit) {
  return static_cast<std::size_t>(checked_product(factors, what, limit));
}

}  // namespace kvevict
