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

  /// Index of the entry whose original position is `original` (binary search over `originals`,
  /// indexed by slot), or -1 when no live entry has it.
  [[nodiscard]] int find(std::int64_t original, const std::int64_t* originals) const {
    const std::span<const std::int32_t> entries = view();
    const auto it = std::lower_bound(
        entries.begin(), entries.end(), original,
        [originals](std::int32_t slot, std::int64_t value) { return originals[slot] < value; });
    if (it == entries.end() || originals[*it] != original) return -1;
    return static_cast<int>(it - entries.begin());
  }

 private:
  std::vector<std::int32_t> buffer_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

}  // namespace kvevict::detail
