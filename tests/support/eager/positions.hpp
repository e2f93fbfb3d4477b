// Position modes (which RoPE position a cached key has) and key storage (before or after RoPE).
#pragma once

#include <kvevict/error.hpp>
#include <string>
#include <string_view>

namespace kvevict::eager {

/// Which RoPE position each cached token has. Every mode works with every policy.
enum class PositionMode {
  /// A token keeps the position it was fed at, for ever (H2O, TOVA). Positions grow without bound,
  /// so a model meets positions past its trained context once the stream is long enough.
  original,
  /// Positions are the token's index in its head's cache, 0..n-1, at every step (StreamingLLM,
  /// SirLLM): after an eviction the survivors slide down; a new token sits at index n.
  cache_index,
  /// InfiniPot's CR-RoPE: after each compaction the C survivors get 0..C-1 in original order and
  /// new
  /// tokens continue from C. kvevict only re-positions at compaction, so this assigns the same
  /// positions as cache_index; it is kept as its own name because it states a different intent
  /// (re-rotate once per distillation, not per step) and engines that re-position lazily differ.
  reset_on_compact,
};

/// Whether cached keys are stored before RoPE (rotated to their position at every attention, as
/// StreamingLLM and InfiniPot do) or after RoPE (rotated once at append; a compaction that moves
/// positions re-rotates the survivors by the delta). Both give the same attention scores.
enum class KeyStorage { pre_rope, post_rope };

[[nodiscard]] inline std::string_view to_string(PositionMode mode) {
  switch (mode) {
    case PositionMode::original:
      return "original";
    case PositionMode::cache_index:
      return "cache_index";
    case PositionMode::reset_on_compact:
      return "reset_on_compact";
  }
  return "?";
}

[[nodiscard]] inline std::string_view to_string(KeyStorage storage) {
  return storage == KeyStorage::pre_rope ? "pre_rope" : "post_rope";
}

/// Parses "original", "cache_index" or "reset_on_compact"; throws kvevict::Error otherwise.
[[nodiscard]] inline PositionMode parse_position_mode(std::string_view text) {
  for (PositionMode mode :
       {PositionMode::original, PositionMode::cache_index, PositionMode::reset_on_compact}) {
    if (text == to_string(mode)) return mode;
  }
  throw Error("unknown position mode '" + std::string(text) +
              "' (expected original, cache_index or reset_on_compact)");
}

/// Parses "pre_rope" or "post_rope"; throws kvevict::Error otherwise.
[[nodiscard]] inline KeyStorage parse_key_storage(std::string_view text) {
  if (text == "pre_rope") return KeyStorage::pre_rope;
  if (text == "post_rope") return KeyStorage::post_rope;
  throw Error("unknown key storage '" + std::string(text) + "' (expected pre_rope or post_rope)");
}

}  // namespace kvevict::eager
