// StreamOrder: the live slots of one decision unit, sorted by original position, with O(1) removal
// at either end and O(min(i, n - i)) removal anywhere.
//
// Slots are reused as tokens come and go, so slot order says nothing about stream order; the
// policies that need it (recent windows, sinks, "the newest anchor") read it from here. The entries
// sit in the middle of a buffer twice the capacity: removing entry i shifts whichever side of i is
// shorter, so the sliding-window policies, which always drop the oldest non-sink, shift only the
// sinks in front of it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace kvevict::detail {

class StreamOrder {
 public:
  /// Room for `capacity` entries (the unit's slot capacity); keeps the entries.
  void reserve(int capacity) {
    const std::size_t wanted = 2 * static_cast<std::size_t>(capacity) + 2;
    if (wanted <= buffer_.size()) return;
    std::vector<std::int32_t> grown(wanted);
    std::copy_n(buffer_.data() + head_, size_, grown.data());
    buffer_.swap(grown);
    head_ = 0;
  }

  [[nodiscard]] int size() const { return static_cast<int>(size_); }
  [[nodiscard]] std::int32_t operator[](int i) const { return buffer_[head_ + i]; }
  /// The entries, oldest first. Valid until the next change.
  [[nodiscard]] std::span<const std::int32_t> view() const {
    return {buffer_.data() + head_, size_};
  }

  /// Appends the newest slot (the caller keeps originals ascending).
  void push_back(std::int32_t slot) {
    if (head_ + size_ == buffer_.size()) {  // no room behind: move the entries to the front
      std::memmove(buffer_.data(), buffer_.data() + head_, size_ * sizeof(std::int32_t));
      head_ = 0;
    }
    buffer_[head_ + size_] = slot;
    ++size_;
  }

  /// Removes entry i, shifting the shorter side.
  void erase(int i) {
    const auto index = static_cast<std::size_t>(i);
    std::int32_t* begin = buffer_.data() + head_;
    if (index < size_ / 2) {
      std::memmove(begin + 1, begin, index * sizeof(std::int32_t));
      ++head_;
    } else {
      std::memmove(begin + index, begin + index + 1, (size_ - index - 1) * sizeof(std::int32_t));
    }
    --size_;
  }

  /// Entry i becomes `slot` (the same token, moved to another slot).
  void replace(int i, std::int32_t slot) { buffer_[head_ + static_cast<std::size_t>(i)] = slot; }

  /// Removes the newest `count` entries.
  void pop_back(int count) { size_ -= static_cast<std::size_t>(count); }

  /// Index of the entry whose original position is `original` (`originals` indexed by slot), or
  /// -1 when no live entry has it.
  ///
  /// At a decision the order and the originals are out of cache, so each probe of a search is a
  /// miss, and a halving search waits on about 2 log2(n) of them in a row. Originals are distinct
  /// integers rising along the order, mostly by one (evictions leave gaps), so the entry's index
  /// is bounded by its distance in originals from both ends, and a guess in proportion lands on it
  /// or near it: a few such rounds first, then halving over what is left.
  [[nodiscard]] int find(std::int64_t original, const std::int64_t* originals) const {
    const std::int32_t* entries = buffer_.data() + head_;
    std::size_t lo = 0;
    std::size_t hi = size_;  // the entry, if any, is in [lo, hi)
    for (int round = 0; round < 4 && hi - lo > 8; ++round) {
      const std::int64_t low = originals[entries[lo]];
      const std::int64_t high = originals[entries[hi - 1]];
      if (original < low || original > high) return -1;
      // Distinct integers: at most original - low entries before it, high - original after it.
      const auto first = static_cast<std::int64_t>(lo);
      const auto end = static_cast<std::int64_t>(hi);
      lo = static_cast<std::size_t>(std::max(first, end - 1 - std::min(high - original, end)));
      hi = static_cast<std::size_t>(std::min(end, first + std::min(original - low, end) + 1));
      if (hi - lo <= 8) break;
      // Where it would sit if [low, high] were evenly filled, inside the bounds.
      const double share = static_cast<double>(original - low) / static_cast<double>(high - low);
      const std::size_t at = std::clamp(
          static_cast<std::size_t>(
              first + static_cast<std::int64_t>(share * static_cast<double>(end - 1 - first))),
          lo, hi - 1);
      const std::int64_t value = originals[entries[at]];
      if (value == original) return static_cast<int>(at);
      if (value < original) {
        lo = at + 1;
      } else {
        hi = at;
      }
    }
    const auto it = std::lower_bound(
        entries + lo, entries + hi, original,
        [originals](std::int32_t slot, std::int64_t value) { return originals[slot] < value; });
    if (it == entries + hi || originals[*it] != original) return -1;
    return static_cast<int>(it - entries);
  }

 private:
  std::vector<std::int32_t> buffer_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

}  // namespace kvevict::detail
