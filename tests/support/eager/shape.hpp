// CacheShape: the geometry of one sequence's KV cache (layers x KV heads x head_dim).
#pragma once

#include <kvevict/error.hpp>
#include <string>

namespace kvevict::eager {

/// Geometry of a decoder's KV cache. Query head `h` reads KV head `h / group_size()` (GQA);
/// `q_heads == kv_heads` is multi-head attention, `kv_heads == 1` multi-query attention.
struct CacheShape {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;

  /// Query heads per KV head.
  [[nodiscard]] int group_size() const { return q_heads / kv_heads; }
  /// The KV head that query head `q_head` reads.
  [[nodiscard]] int kv_head_of(int q_head) const { return q_head / group_size(); }
  /// Number of (layer, KV head) caches.
  [[nodiscard]] int head_caches() const { return layers * kv_heads; }

  /// Throws kvevict::Error unless every dimension is positive and q_heads % kv_heads == 0.
  void validate() const {
    KVEVICT_REQUIRE(layers > 0,
                    "CacheShape: layers must be positive, got " + std::to_string(layers));
    KVEVICT_REQUIRE(q_heads > 0,
                    "CacheShape: q_heads must be positive, got " + std::to_string(q_heads));
    KVEVICT_REQUIRE(kv_heads > 0,
                    "CacheShape: kv_heads must be positive, got " + std::to_string(kv_heads));
    KVEVICT_REQUIRE(head_dim > 0,
                    "CacheShape: head_dim must be positive, got " + std::to_string(head_dim));
    KVEVICT_REQUIRE(q_heads % kv_heads == 0, "CacheShape: q_heads (" + std::to_string(q_heads) +
                                                 ") is not a multiple of kv_heads (" +
                                                 std::to_string(kv_heads) + ")");
  }
};

}  // namespace kvevict::eager
