// MersenneTwister64: the generator of std::mt19937_64, its outputs made a block at a time.
//
// Same parameters, same seeding and so the same output sequence as std::mt19937_64 (the C++
// standard fixes it, [rand.predef]: the 10000th output of a default-seeded engine is
// 9981545732273789042). A call returns the next output of a block of 312; the block is remade
// (twisted, then tempered) by plain loops over the state that compilers vectorise, where
// libstdc++ tempers each output in its call. RandomLLM draws one output per history token it
// keeps, thousands per decision.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace kvevict::detail {

class MersenneTwister64 {
 public:
  using result_type = std::uint64_t;

  /// Seeded as std::mt19937_64(seed).
  explicit MersenneTwister64(std::uint64_t seed) {
    state_[0] = seed;
    for (std::size_t i = 1; i < kWords; ++i) {
      state_[i] = kSeedMultiplier * (state_[i - 1] ^ (state_[i - 1] >> 62)) + i;
    }
  }

  /// The next output.
  result_type operator()() {
    if (next_ == kWords) refill();
    return block_[next_++];
  }

 private:
  static constexpr std::size_t kWords = 312;  // n: the state, 312 words of 64 bits
  static constexpr std::size_t kShift = 156;  // m: the word each twist mixes in
  static constexpr std::uint64_t kSeedMultiplier = 6364136223846793005ULL;

  // New word i of the state from words i (its upper bit), i + 1 (its lower 31) and i + m.
  static std::uint64_t twist(std::uint64_t upper, std::uint64_t lower, std::uint64_t mixed) {
    const std::uint64_t y = (upper & 0xFFFFFFFF80000000ULL) | (lower & 0x7FFFFFFFULL);
    return mixed ^ (y >> 1) ^ ((std::uint64_t{0} - (y & 1)) & 0xB5026F5AA96619E9ULL);
  }

  // The next 312 words of the state, then their tempered outputs. Word i is rewritten from words
  // i + 1 (not rewritten yet) and i + m (or i + m - n, rewritten earlier in this pass), so
  // consecutive words can be rewritten together: the loops vectorise.
  void refill() {
    std::uint64_t* const s = state_.data();
    for (std::size_t i = 0; i < kWords - kShift; ++i) s[i] = twist(s[i], s[i + 1], s[i + kShift]);
    for (std::size_t i = kWords - kShift; i < kWords - 1; ++i) {
      s[i] = twist(s[i], s[i + 1], s[i - (kWords - kShift)]);
    }
    s[kWords - 1] = twist(s[kWords - 1], s[0], s[kShift - 1]);
    for (std::size_t i = 0; i < kWords; ++i) {
      std::uint64_t y = s[i];
      y ^= (y >> 29) & 0x5555555555555555ULL;
      y ^= (y << 17) & 0x71D67FFFEDA60000ULL;
      y ^= (y << 37) & 0xFFF7EEE000000000ULL;
      y ^= y >> 43;
      block_[i] = y;
    }
    next_ = 0;
  }

  std::array<std::uint64_t, kWords> state_{};
  std::array<std::uint64_t, kWords> block_{};  // the tempered outputs of the current state
  std::size_t next_ = kWords;                  // index of the next output in block_
};

}  // namespace kvevict::detail
