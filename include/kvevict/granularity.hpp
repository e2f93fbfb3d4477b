// Granularity: how many independent keep-sets a sequence has, and which (layer, KV head) uses
// which.
//
// A decision unit is one keep-set with its own slots and slot metadata. Per KV head (the papers'
// default for H2O and InfiniPot) every (layer, KV head) is a unit; per layer the KV heads of a
// layer share one (TOVA); per token the whole model shares one (StreamingLLM, SirLLM, AnLLM, and
// every engine whose cache cells are shared by all layers and heads, such as llama.cpp). Heads of
// one unit hold the same tokens in the same slots, so an engine can lay their K/V out token-major.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"

namespace kvevict {

enum class Granularity : std::uint8_t {
  head,   ///< one keep-set per (layer, KV head)
  layer,  ///< one keep-set per layer, shared by its KV heads
  token,  ///< one keep-set for the whole sequence
};

[[nodiscard]] inline std::string_view to_string(Granularity granularity) {
  switch (granularity) {
    case Granularity::head:
      return "head";
    case Granularity::layer:
      return "layer";
    case Granularity::token:
      return "token";
  }
  return "?";
}

/// Parses "head", "layer" or "token"; throws kvevict::Error otherwise.
[[nodiscard]] inline Granularity parse_granularity(std::string_view text) {
  for (Granularity g : {Granularity::head, Granularity::layer, Granularity::token}) {
    if (text == to_string(g)) return g;
  }
  throw Error("unknown granularity '" + std::string(text) + "' (expected head, layer or token)");
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

  /// Number of units.
  [[nodiscard]] int units() const {
    switch (granularity_) {
      case Granularity::head:
        return heads();
      case Granularity::layer:
        return layers_;
      case Granularity::token:
        return 1;
    }
    return 0;
  }
  /// The unit of head (layer, kv_head).
  [[nodiscard]] int unit_of(int layer, int kv_head) const {
    switch (granularity_) {
      case Granularity::head:
        return layer * kv_heads_ + kv_head;
      case Granularity::layer:
        return layer;
      case Granularity::token:
        return 0;
    }
    return 0;
  }
  /// How many (layer, KV head) pairs share each unit.
  [[nodiscard]] int heads_per_unit() const { return heads() / units(); }
  /// How many layers contribute to each unit (1 unless per token).
  [[nodiscard]] int layers_per_unit() const {
    return granularity_ == Granularity::token ? layers_ : 1;
  }

 private:
  int layers_ = 0;
  int kv_heads_ = 0;
  Granularity granularity_ = Granularity::head;
};

}  // namespace kvevict
