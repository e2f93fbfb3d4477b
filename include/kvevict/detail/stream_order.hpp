// StreamOrder: the live slots of one decision unit, sorted by original position.
//
// Slots are reused as tokens come and go, so slot order says nothing about stream order; the
// policies that need it (recent windows, sinks, "the newest anchor") read it from here.
//
// The entries sit in a buffer twice the capacity, and a removal leaves a gap where the entry was.
// The next removal moves the gap to its own index, shifting the entries in between, or, when that
// is more, closes the gap by shifting its shorter side and opens a new one. Evictions that come at
// about one stream index step after step (H2O's: the candidate that just left the recent window;
// a sliding window's: the oldest non-sink) shift a few entries each, where closing the hole at
// once shifts half the unit, a read of the order from memory at every decode step.
//
// pieces() reads the entries as they lie, before and after the gap. view() is one contiguous
// span: with a gap open, a copy made at most once per change; and a removal after a view() closes
// the gap and shifts the shorter side at once, so that a unit read whole between its changes
// (SirLLM's turn rule, a user's listing) stays contiguous and is never copied. Every const member
// may run on several threads at once (view() builds its copy under a lock).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <vector>

namespace kvevict::detail {

/// A stream order as at most two contiguous pieces, oldest first: entry i is front[i] for
/// i < front.size(), else back[i - front.size()]. Valid until the next change.
struct StreamOrderPieces {
  std::span<const std::int32_t> front;
  std::span<const std::int32_t> back;

  [[nodiscard]] int size() const { return static_cast<int>(front.size() + back.size()); }
  [[nodiscard]] std::int32_t operator[](int i) const {
    const auto k = static_cast<std::size_t>(i);
    return k < front.size() ? front[k] : back[k - front.size()];
  }
};

class StreamOrder {
 public:
  /// Room for `capacity` entries (the unit's slot capacity); keeps the entries.
  void reserve(int capacity) {
    const std::size_t wanted = 2 * static_cast<std::size_t>(capacity) + 2;
    if (wanted <= buffer_.size()) return;
    std::vector<std::int32_t> grown(wanted);
    copy_entries(grown.begin());
    buffer_.swap(grown);
    head_ = 0;
    gap_ = 0;
    changed();
  }

  [[nodiscard]] int size() const { return static_cast<int>(size_); }
  [[nodiscard]] std::int32_t operator[](int i) const { return buffer_[physical(i)]; }

  /// The entries as they lie, around the removal gap.
  [[nodiscard]] StreamOrderPieces pieces() const {
    const std::int32_t* begin = buffer_.data() + head_;
    if (gap_ == 0) return {{begin, size_}, {}};
    return {{begin, gap_at_}, {begin + gap_at_ + gap_, size_ - gap_at_}};
  }

  /// The entries, oldest first, in one span: the buffer's, or with a gap open a copy of it. The
  /// next removal closes the gap instead of moving it. Valid until the next change.
  [[nodiscard]] std::span<const std::int32_t> view() const {
    viewed_.value.store(true, std::memory_order_relaxed);
    if (gap_ == 0) return {buffer_.data() + head_, size_};
    if (!copy_valid_.value.load(std::memory_order_acquire)) {
      const std::lock_guard<std::mutex> lock(copy_mutex());
      if (!copy_valid_.value.load(std::memory_order_relaxed)) {
        copy_.resize(size_);
        copy_entries(copy_.begin());
        copy_valid_.value.store(true, std::memory_order_release);
      }
    }
    return copy_;
  }

  /// The entries in one span of the buffer, the gap closed first.
  [[nodiscard]] std::span<const std::int32_t> contiguous() {
    close_gap();
    return {buffer_.data() + head_, size_};
  }

  /// Appends the newest slot (the caller keeps originals ascending).
  void push_back(std::int32_t slot) {
    changed();
    if (head_ + size_ + gap_ == buffer_.size()) {  // no room behind: the entries to the front
      close_gap();
      std::memmove(buffer_.data(), buffer_.data() + head_, size_ * sizeof(std::int32_t));
      head_ = 0;
    }
    buffer_[head_ + size_ + gap_] = slot;
    ++size_;
  }

  /// Removes entry i: moves the gap there, or shifts the shorter side (see above).
  void erase(int i) {
    changed();
    const auto k = static_cast<std::size_t>(i);
    // Entries that moving the gap to k shifts: (k, gap_at_) behind it, or [gap_at_, k) in front.
    const std::size_t shifted = k < gap_at_ ? gap_at_ - k - 1 : k - gap_at_;
    if (viewed_.value.exchange(false, std::memory_order_relaxed)) {
      close_gap();
      shift_shorter_side(k);
    } else {
      if (gap_ != 0 && shifted > std::min(gap_at_, size_ - gap_at_)) close_gap();
      std::int32_t* begin = buffer_.data() + head_;
      if (gap_ != 0 && k < gap_at_) {
        std::memmove(begin + k + 1 + gap_, begin + k + 1, shifted * sizeof(std::int32_t));
      } else if (gap_ != 0) {
        std::memmove(begin + gap_at_, begin + gap_at_ + gap_, shifted * sizeof(std::int32_t));
      }
      gap_at_ = k;  // entry k's place joins the gap (or is a new one)
      ++gap_;
    }
    --size_;
    if (gap_ != 0 && gap_at_ == 0) {  // a gap in front is the buffer's own room in front
      head_ += gap_;
      gap_ = 0;
    } else if (gap_at_ == size_) {  // and one behind, its room behind
      gap_ = 0;
    }
  }

  /// Entry i becomes `slot` (the same token, moved to another slot).
  void replace(int i, std::int32_t slot) {
    changed();
    buffer_[physical(i)] = slot;
  }

  /// Removes the newest `count` entries.
  void pop_back(int count) {
    changed();
    size_ -= static_cast<std::size_t>(count);
    if (gap_at_ >= size_) gap_ = 0;  // every entry behind the gap went
  }

  /// Index of the entry whose original position is `original` (binary search over `originals`,
  /// indexed by slot), or -1 when no live entry has it.
  [[nodiscard]] int find(std::int64_t original, const std::int64_t* originals) const {
    const StreamOrderPieces now = pieces();
    const bool in_front = now.back.empty() || original <= originals[now.front.back()];
    const std::span<const std::int32_t> piece = in_front ? now.front : now.back;
    const auto it = std::lower_bound(
        piece.begin(), piece.end(), original,
        [originals](std::int32_t slot, std::int64_t value) { return originals[slot] < value; });
    if (it == piece.end() || originals[*it] != original) return -1;
    return static_cast<int>(it - piece.begin()) + (in_front ? 0 : static_cast<int>(gap_at_));
  }

 private:
  // An atomic flag that copies (StreamOrder is a value; its const members run on many threads).
  struct Flag {
    std::atomic<bool> value{false};
    Flag() = default;
    Flag(const Flag& other) noexcept : value(other.value.load(std::memory_order_relaxed)) {}
    Flag& operator=(const Flag& other) noexcept {
      value.store(other.value.load(std::memory_order_relaxed), std::memory_order_relaxed);
      return *this;
    }
  };

  [[nodiscard]] std::size_t physical(int i) const {
    const auto k = static_cast<std::size_t>(i);
    return head_ + k + (k >= gap_at_ ? gap_ : 0);
  }

  // Writes the entries, oldest first, from `out` on.
  template <class Out>
  void copy_entries(Out out) const {
    const StreamOrderPieces now = pieces();
    std::copy(now.back.begin(), now.back.end(), std::copy(now.front.begin(), now.front.end(), out));
  }

  // After any change: the copy is stale.
  void changed() { copy_valid_.value.store(false, std::memory_order_relaxed); }

  void close_gap() {
    if (gap_ == 0) return;
    std::int32_t* begin = buffer_.data() + head_;
    if (gap_at_ <= size_ - gap_at_) {
      std::memmove(begin + gap_, begin, gap_at_ * sizeof(std::int32_t));
      head_ += gap_;
    } else {
      std::memmove(begin + gap_at_, begin + gap_at_ + gap_,
                   (size_ - gap_at_) * sizeof(std::int32_t));
    }
    gap_ = 0;
  }

  // Removes entry k of a gapless order, shifting the shorter side.
  void shift_shorter_side(std::size_t k) {
    std::int32_t* begin = buffer_.data() + head_;
    if (k < size_ / 2) {
      std::memmove(begin + 1, begin, k * sizeof(std::int32_t));
      ++head_;
    } else {
      std::memmove(begin + k, begin + k + 1, (size_ - k - 1) * sizeof(std::int32_t));
    }
  }

  static std::mutex& copy_mutex() {
    static std::mutex mutex;
    return mutex;
  }

  // The bounds first: with the buffer's address, what pieces() reads, in one cache line.
  std::size_t head_ = 0;    // buffer index of entry 0
  std::size_t size_ = 0;    // entries
  std::size_t gap_at_ = 0;  // with a gap: entries [0, gap_at_) lie before it, 0 < gap_at_ < size_
  std::size_t gap_ = 0;     // the gap's length, 0 for none
  std::vector<std::int32_t> buffer_;
  mutable Flag viewed_;                     // view() was called since the last removal
  mutable std::vector<std::int32_t> copy_;  // view()'s, with a gap open
  mutable Flag copy_valid_;
};

}  // namespace kvevict::detail
