// Granularity: how many independent keep-sets a sequence has, which (layer, KV head) uses which,
// and whether a keep-set drops single tokens or whole blocks of them.
//
// A decision unit is one keep-set with its own slots and slot metadata. Per KV head (the papers'
// default for H2O and InfiniPot) every (layer, KV head) is a unit; per layer the KV heads of a
// layer share one (TOVA); per token the whole model shares one (StreamingLLM, SirLLM, AnLLM, and
// every engine whose cache cells are shared by all layers and heads, such as llama.cpp). Heads of
// one unit hold the same tokens in the same slots, so an engine can lay their K/V out token-major.
//
// Per block of B tokens is per token with one more constraint, for paged engines (vLLM, OpenVINO
// GenAI) that free memory a page at a time: tokens are grouped by original position into blocks
// [b * B, (b + 1) * B), and a keep rule keeps or evicts a block whole (selection.hpp,
// WorstCandidates). Only policies whose keep rule has a block form accept it
// (Policy::supports_blocks); the others say so when the sequence is built.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"

namespace kvevict {

class Granularity {
 public:
  enum class Kind : std::uint8_t {
    head,   ///< one keep-set per (layer, KV head)
    layer,  ///< one keep-set per layer, shared by its KV heads
    token,  ///< one keep-set for the whole sequence
    block,  ///< one keep-set for the whole sequence, kept or evicted in blocks of block_tokens()
  };
  /// Largest block: a page far larger than any engine's (vLLM's are 16 tokens, OpenVINO's 32).
  static constexpr int kMaxBlockTokens = 1 << 16;

  static const Granularity head;
  static const Granularity layer;
  static const Granularity token;
  /// Blocks of `tokens` tokens (1 to kMaxBlockTokens).
  [[nodiscard]] static Granularity blocks(int tokens) {
    KVEVICT_REQUIRE(tokens >= 1 && tokens <= kMaxBlockTokens,
                    "granularity block: the block size must be 1 to " +
                        std::to_string(kMaxBlockTokens) + " tokens, got " + std::to_string(tokens));
    return Granularity(Kind::block, tokens);
  }

  [[nodiscard]] constexpr Kind kind() const { return kind_; }
  /// Tokens per block under Kind::block, 1 otherwise (a token is its own block).
  [[nodiscard]] constexpr int block_tokens() const { return block_tokens_; }
  /// One keep-set for the whole sequence (token or block).
  [[nodiscard]] constexpr bool whole_sequence() const {
    return kind_ == Kind::token || kind_ == Kind::block;
  }
  friend constexpr bool operator==(Granularity, Granularity) = default;

 private:
  constexpr Granularity(Kind kind, int block_tokens) : kind_(kind), block_tokens_(block_tokens) {}

  Kind kind_;
  int block_tokens_;
};

inline constexpr Granularity Granularity::head{Kind::head, 1};
inline constexpr Granularity Granularity::layer{Kind::layer, 1};
inline constexpr Granularity Granularity::token{Kind::token, 1};

/// "head", "layer", "token" or "block:B".
[[nodiscard]] inline std::string to_string(Granularity granularity) {
  switch (granularity.kind()) {
    case Granularity::Kind::head:
      return "head";
    case Granularity::Kind::layer:
      return "layer";
    case Granularity::Kind::token:
      return "token";
    case Granularity::Kind::block:
      return "block:" + std::to_string(granularity.block_tokens());
  }
  return "?";
}

/// Parses "head", "layer", "token" or "block:B" (B tokens per block); throws kvevict::Error
/// otherwise.
[[nodiscard]] inline Granularity parse_granularity(std::string_view text) {
  for (Granularity g : {Granularity::head, Granularity::layer, Granularity::token}) {
    if (text == to_string(g)) return g;
  }
  constexpr std::string_view kBlock = "block:";
  if (text.starts_with(kBlock)) {
    const std::string_view digits = text.substr(kBlock.size());
    int tokens = 0;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), tokens);
    if (error != std::errc{} || end != digits.data() + digits.size() || digits.empty()) {
      throw Error("granularity '" + std::string(text) +
                  "': the block size after 'block:' must be a whole number of tokens");
    }
    return Granularity::blocks(tokens);
  }
  throw Error("unknown granularity '" + std::string(text) +
              "' (expected head, layer, token or block:B)");
}

/// The decision units of a cache of `layers` x `kv_heads` heads at a granularity.
class UnitLayout {
 public:
  /// Largest layers * kv_heads: far above any model, small enough that per-head tables stay sane.
  static constexpr std::int64_t kMaxHeads = std::int64_t{1} << 20;

  UnitLayout() = default;
  UnitLayout(int layers, int kv_heads, Granularity granularity)
      : layers_(layers), kv_heads_(kv_heads), granularity_(granularity) {
    KVEVICT_REQUIRE(layers > 0,
                    "UnitLayout: layers must be positive, got " + std::to_string(layers));
    KVEVICT_REQUIRE(kv_heads > 0,
                    "UnitLayout: kv_heads must be positive, got " + std::to_string(kv_heads));
    (void)checked_product({layers, kv_heads}, "layers * kv_heads", kMaxHeads);
  }

  [[nodiscard]] int layers() const { return layers_; }
  [[nodiscard]] int kv_heads() const { return kv_heads_; }
  [[nodiscard]] Granularity granularity() const { return granularity_; }
  [[nodiscard]] int heads() const { return layers_ * kv_heads_; }
  /// Tokens a keep rule keeps or evicts together: block_tokens() under block, else 1.
  [[nodiscard]] int block_tokens() const { return granularity_.block_tokens(); }

  /// Number of units.
  [[nodiscard]] int units() const {
    switch (granularity_.kind()) {
      case Granularity::Kind::head:
        return heads();
      case Granularity::Kind::layer:
        return layers_;
      case Granularity::Kind::token:
      case Granularity::Kind::block:
        return 1;
    }
    return 0;
  }
  /// The unit of head (layer, kv_head).
  [[nodiscard]] int unit_of(int layer, int kv_head) const {
    switch (granularity_.kind()) {
      case Granularity::Kind::head:
        return layer * kv_heads_ + kv_head;
      case Granularity::Kind::layer:
        return layer;
      case Granularity::Kind::token:
      case Granularity::Kind::block:
        return 0;
    }
    return 0;
  }
  /// Whether (layer, kv_head) is the last head of its unit that a forward's attention reaches
  /// (layers in order, a layer's KV heads in order): after it, the unit's scores of the forward
  /// are complete.
  [[nodiscard]] bool last_head_of_unit(int layer, int kv_head) const {
    switch (granularity_.kind()) {
      case Granularity::Kind::head:
        return true;
      case Granularity::Kind::layer:
        return kv_head == kv_heads_ - 1;
      case Granularity::Kind::token:
      case Granularity::Kind::block:
        return layer == layers_ - 1 && kv_head == kv_heads_ - 1;
    }
    return false;
  }
  /// How many (layer, KV head) pairs share each unit.
  [[nodiscard]] int heads_per_unit() const { return heads() / units(); }
  /// How many layers contribute to each unit (1 unless per token or block).
  [[nodiscard]] int layers_per_unit() const { return granularity_.whole_sequence() ? layers_ : 1; }

 private:
  int layers_ = 0;
  int kv_heads_ = 0;
  Granularity granularity_ = Granularity::head;
};

}  // namespace kvevict
