// The replay simulator: drives a policy through kvevict's own Sequence with the synthetic attention
// oracle of docs/replay-format.md ("Simulated forward") and records the kept original positions.
// Results stay per (layer, KV head): a head reports its decision unit's tokens.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvevict/engine.hpp"
#include "kvevict/policy_registry.hpp"
#include "kvevict/signals.hpp"
#include "kvevict/slot_table.hpp"
#include "replay/replay.hpp"

namespace kvevict::replay {
namespace {

// Checks the invariants parse_replay establishes, so that a hand-built Replay cannot index out of
// bounds.
void check_consistent(const Replay& replay) {
  const ReplayShape& shape = replay.shape;
  KVEVICT_REQUIRE(shape.layers > 0 && shape.q_heads > 0 && shape.kv_heads > 0 &&
                      shape.q_heads % shape.kv_heads == 0,
                  "replay: invalid shape");
  KVEVICT_REQUIRE(replay.tokens > 0 && replay.tokens <= kMaxTokens, "replay: invalid token count");
  std::int64_t covered = 0;
  for (int size : replay.chunks) {
    KVEVICT_REQUIRE(size > 0, "replay: chunk sizes must be positive");
    covered += size;
  }
  KVEVICT_REQUIRE(covered == replay.tokens, "replay: chunk sizes do not sum to tokens");
  const auto t = static_cast<std::size_t>(replay.tokens);
  const auto layer_heads = static_cast<std::size_t>(shape.layers) * shape.q_heads;
  KVEVICT_REQUIRE(replay.logits.size() == layer_heads * t * t,
                  "replay: logits do not have [layers][q_heads][tokens][tokens] entries");
  KVEVICT_REQUIRE(!replay.surprisal || replay.surprisal->size() == t,
                  "replay: surprisal needs one value per token");
  KVEVICT_REQUIRE(!replay.token_ids || replay.token_ids->size() == t,
                  "replay: token_ids needs one id per token");
  if (replay.catalyst) {
    const auto p = static_cast<std::size_t>(replay.catalyst->length);
    KVEVICT_REQUIRE(
        replay.catalyst->length > 0 && replay.catalyst->logits.size() == layer_heads * p * (t + p),
        "replay: catalyst logits do not have [layers][q_heads][P][tokens + P] entries");
  }
  KVEVICT_REQUIRE(!replay.keys || (shape.head_dim > 0 &&
                                   replay.keys->size() == static_cast<std::size_t>(shape.layers) *
                                                              shape.kv_heads * t * shape.head_dim),
                  "replay: keys do not have [layers][kv_heads][tokens][head_dim] entries");
}

// ---------------------------------------------------------------------------------------------
// Simulated forward (replay-format.md, "Simulated forward")
// ---------------------------------------------------------------------------------------------

// Writes into `row` the softmax, computed in double, of logit(s) over the slots s < keys with
// allowed(s); the other slots get probability 0.
template <class AllowedFn, class LogitFn>
void softmax_row(int keys, AllowedFn allowed, LogitFn logit, std::span<float> row,
                 std::vector<double>& scratch) {
  scratch.resize(static_cast<std::size_t>(keys));
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int s = 0; s < keys; ++s) {
    if (!allowed(s)) continue;
    scratch[static_cast<std::size_t>(s)] = logit(s);
    max_logit = std::max(max_logit, scratch[static_cast<std::size_t>(s)]);
  }
  double sum = 0.0;
  for (int s = 0; s < keys; ++s) {
    if (!allowed(s)) continue;
    double& value = scratch[static_cast<std::size_t>(s)];
    value = std::exp(value - max_logit);
    sum += value;
  }
  for (int s = 0; s < keys; ++s) {
    row[static_cast<std::size_t>(s)] =
        allowed(s) ? static_cast<float>(scratch[static_cast<std::size_t>(s)] / sum) : 0.0f;
  }
}

class Simulator {
 public:
  Simulator(const Replay& replay, std::unique_ptr<Policy> policy)
      : replay_(replay),
        cache_kv_heads_(
            cached_kv_heads(*checked(policy), replay.shape.q_heads, replay.shape.kv_heads)),
        sequence_(sequence_config(replay, cache_kv_heads_), std::move(policy)) {
    const std::string policy_name(sequence_.policy().name());
    if (sequence_.wants(Signal::surprisal) && !replay.surprisal) {
      throw ReplayError("policy '" + policy_name +
                        "' observes surprisal, but the replay has no \"surprisal\"");
    }
    if (sequence_.wants(Signal::token_ids) && !replay.token_ids) {
      throw ReplayError("policy '" + policy_name +
                        "' reads token ids, but the replay has no \"token_ids\"");
    }
    if (sequence_.wants(Signal::keys) && cache_kv_heads_ != replay.shape.kv_heads) {
      throw ReplayError("policy '" + policy_name +
                        "' reads the keys but repeats the KV heads: the replay's keys are per KV "
                        "head");
    }
    if (sequence_.wants(Signal::keys) && !replay.keys) {
      throw ReplayError("policy '" + policy_name +
                        "' reads the keys, but the replay has no \"keys\"");
    }
    if (sequence_.wants(Signal::catalyst_attention) && !replay.catalyst) {
      throw ReplayError("policy '" + policy_name +
                        "' observes catalyst attention, but the replay has no \"catalyst\"");
    }
    if (!replay.token_ids) zero_ids_.assign(static_cast<std::size_t>(replay.tokens), 0);
    if (replay.catalyst) catalyst_ids_.assign(static_cast<std::size_t>(replay.catalyst->length), 0);
  }

  ReplayResult run() {
    ReplayResult result;
    result.after_chunk.reserve(replay_.chunks.size());
    std::int64_t begin = 0;
    for (std::size_t k = 0; k < replay_.chunks.size(); ++k) {
      const std::int64_t end = begin + replay_.chunks[k];
      try {
        feed_input_chunk(begin, end);
      } catch (const Error& error) {
        throw ReplayError("chunk " + std::to_string(k) + " (positions [" + std::to_string(begin) +
                          ", " + std::to_string(end) + ")): " + error.what());
      }
      result.after_chunk.push_back(kept_now());
      begin = end;
    }
    return result;
  }

 private:
  static const std::unique_ptr<Policy>& checked(const std::unique_ptr<Policy>& policy) {
    KVEVICT_REQUIRE(policy != nullptr, "run_replay: policy is null");
    return policy;
  }
  // Every token and the catalyst fit at once: a replay is small (kMaxTokens). `cache_kv_heads`:
  // the KV heads the cache lays out, q_heads when the policy repeats them (gqa = repeat).
  static SequenceConfig sequence_config(const Replay& replay, int cache_kv_heads) {
    SequenceConfig config;
    config.layers = replay.shape.layers;
    config.q_heads = replay.shape.q_heads;
    config.kv_heads = cache_kv_heads;
    config.head_dim = replay.shape.head_dim;
    config.max_chunk = replay.tokens + (replay.catalyst ? replay.catalyst->length : 0);
    config.initial_capacity = config.max_chunk + 1;
    return config;
  }

  // One input chunk, split where the policy's pot would overflow (an engine does the same).
  void feed_input_chunk(std::int64_t begin, std::int64_t end) {
    bool turn_start = true;  // every input chunk of a replay is a turn
    while (begin < end) {
      std::int64_t size = end - begin;
      const std::optional<int> room = sequence_.pot_room();
      if (room && *room > 0 && size > *room) size = *room;
      forward(begin, begin + size, turn_start);
      turn_start = false;
      begin += size;
    }
  }

  void forward(std::int64_t begin, std::int64_t end, bool turn_start) {
    const int size = static_cast<int>(end - begin);
    const std::vector<std::int32_t>& ids = replay_.token_ids ? *replay_.token_ids : zero_ids_;
    sequence_.begin_chunk(std::span<const std::int32_t>(ids).subspan(
                              static_cast<std::size_t>(begin), static_cast<std::size_t>(size)),
                          turn_start);
    if (sequence_.wants(Signal::attention_rows)) {
      for (int l = 0; l < replay_.shape.layers; ++l) observe_forward_rows(l, begin, end);
    } else if (sequence_.wants(Signal::last_attention_row)) {
      for (int l = 0; l < replay_.shape.layers; ++l) observe_forward_rows(l, end - 1, end);
    }
    if (sequence_.wants(Signal::keys)) {
      // keys[l][g][t]: the chunk's rows of KV head g start at t = begin, a head apart.
      const ReplayShape& shape = replay_.shape;
      const auto t = static_cast<std::size_t>(replay_.tokens);
      const auto d = static_cast<std::size_t>(shape.head_dim);
      chunk_keys_.resize(static_cast<std::size_t>(shape.kv_heads) * size * d);
      for (int l = 0; l < shape.layers; ++l) {
        for (int g = 0; g < shape.kv_heads; ++g) {
          const float* first =
              replay_.keys->data() + ((static_cast<std::size_t>(l) * shape.kv_heads + g) * t +
                                      static_cast<std::size_t>(begin)) *
                                         d;
          std::copy_n(first, static_cast<std::size_t>(size) * d,
                      chunk_keys_.begin() +
                          static_cast<std::ptrdiff_t>(static_cast<std::size_t>(g) * size * d));
        }
        sequence_.observe_keys(l, chunk_keys_.data(), static_cast<std::ptrdiff_t>(d));
      }
    }
    if (sequence_.wants(Signal::surprisal)) {
      sequence_.observe_surprisal(
          std::span<const float>(*replay_.surprisal)
              .subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(size)));
    }
    sequence_.end_forward();

    if (sequence_.catalyst_pending()) {
      run_catalyst();
      if (sequence_.catalyst_pending()) {
        throw ReplayError("policy '" + std::string(sequence_.policy().name()) +
                          "' still reports a full pot after distillation");
      }
    }
  }

  // Query heads per cached KV head: the replay's group, or 1 when the policy repeats KV heads.
  int cache_group() const { return replay_.shape.q_heads / cache_kv_heads_; }

  // The largest slot limit of `layer`'s KV heads: the rows' stride.
  int count_keys(int layer) const {
    int widest = 0;
    for (int g = 0; g < cache_kv_heads_; ++g) {
      widest = std::max(widest, sequence_.slot_limit(layer, g));
    }
    return widest;
  }

  // Attention rows of queries [first_query, end) in `layer`, over the slots now in the cache.
  void observe_forward_rows(int layer, std::int64_t first_query, std::int64_t end) {
    const ReplayShape& shape = replay_.shape;
    const int queries = static_cast<int>(end - first_query);
    const int stride = count_keys(layer);
    rows_.assign(static_cast<std::size_t>(shape.q_heads) * queries * stride, 0.0f);
    for (int h = 0; h < shape.q_heads; ++h) {
      const int unit = sequence_.unit_of(layer, h / cache_group());
      const SlotTable& slots = sequence_.slots();
      const std::span<const std::int64_t> original = slots.original_positions(unit);
      for (int q = 0; q < queries; ++q) {
        const std::int64_t query = first_query + q;
        softmax_row(
            slots.slot_limit(unit),
            [&](int s) {
              return slots.is_live(unit, s) && original[static_cast<std::size_t>(s)] <= query;
            },
            [&](int s) {
              return replay_.logit(layer, h, query, original[static_cast<std::size_t>(s)]);
            },
            row_span(h, q, queries, stride), scratch_);
      }
    }
    sequence_.observe_attention(layer, rows_.data(), queries, stride);
  }

  // The catalyst prompt attends to the pot and to itself, then is rolled back; the policy
  // distills on end_catalyst().
  void run_catalyst() {
    if (!replay_.catalyst) {
      throw ReplayError("policy '" + std::string(sequence_.policy().name()) +
                        "' needs a catalyst prompt, but the replay has no \"catalyst\"");
    }
    const ReplayShape& shape = replay_.shape;
    const int length = replay_.catalyst->length;
    const std::int64_t first_query = sequence_.stats().tokens_fed;  // catalyst token 0's position
    sequence_.begin_catalyst(catalyst_ids_);
    const SlotTable& slots = sequence_.slots();
    for (int l = 0; l < shape.layers; ++l) {
      const int stride = count_keys(l);
      rows_.assign(static_cast<std::size_t>(shape.q_heads) * length * stride, 0.0f);
      for (int h = 0; h < shape.q_heads; ++h) {
        const int unit = sequence_.unit_of(l, h / cache_group());
        const std::span<const std::int64_t> original = slots.original_positions(unit);
        const std::span<const std::uint8_t> flags = slots.flags(unit);
        // Catalyst token k sits at original position first_query + k: column T + k.
        const auto is_catalyst = [&](int s) {
          return (flags[static_cast<std::size_t>(s)] & slot_flag::catalyst) != 0;
        };
        for (int p = 0; p < length; ++p) {
          softmax_row(
              slots.slot_limit(unit),
              [&](int s) {
                return slots.is_live(unit, s) &&
                       (!is_catalyst(s) ||
                        original[static_cast<std::size_t>(s)] - first_query <= p);
              },
              [&](int s) {
                const std::int64_t column =
                    is_catalyst(s) ? std::int64_t{replay_.tokens} +
                                         (original[static_cast<std::size_t>(s)] - first_query)
                                   : original[static_cast<std::size_t>(s)];
                return replay_.catalyst_logit(l, h, p, column);
              },
              row_span(h, p, length, stride), scratch_);
        }
      }
      sequence_.observe_catalyst(l, rows_.data(), length, stride);
    }
    sequence_.end_catalyst();
  }

  std::span<float> row_span(int q_head, int query, int queries, int stride) {
    const std::size_t offset = (static_cast<std::size_t>(q_head) * queries + query) * stride;
    return {rows_.data() + offset, static_cast<std::size_t>(stride)};
  }

  // Kept original positions of every cached (layer, KV head): its unit's, ascending. Under
  // gqa = repeat the cache has a head per query head, so a layer has q_heads lists.
  ChunkKept kept_now() const {
    const SlotTable& slots = sequence_.slots();
    ChunkKept chunk;
    chunk.kept.resize(static_cast<std::size_t>(replay_.shape.layers));
    for (int l = 0; l < replay_.shape.layers; ++l) {
      auto& layer = chunk.kept[static_cast<std::size_t>(l)];
      layer.reserve(static_cast<std::size_t>(cache_kv_heads_));
      for (int g = 0; g < cache_kv_heads_; ++g) {
        const int unit = sequence_.unit_of(l, g);
        std::vector<std::int64_t> positions;
        for (const std::int32_t slot : slots.stream_order(unit)) {
          positions.push_back(slots.original_positions(unit)[static_cast<std::size_t>(slot)]);
        }
        layer.push_back(std::move(positions));
      }
    }
    return chunk;
  }

  const Replay& replay_;
  int cache_kv_heads_;  // KV heads of the cache: the replay's, or q_heads under gqa = repeat
  Sequence sequence_;
  std::vector<std::int32_t> zero_ids_;      // token ids when the replay has none
  std::vector<float> chunk_keys_;           // [kv_heads][chunk][head_dim] of one layer
  std::vector<std::int32_t> catalyst_ids_;  // dummy ids of the catalyst prompt
  std::vector<float> rows_;                 // [q_heads][queries][stride] of one layer
  std::vector<double> scratch_;             // one row's logits / exponentials
};

}  // namespace

ReplayResult run_replay(const Replay& replay) {
  std::unique_ptr<Policy> policy;
  try {
    policy = make_policy(replay.policy_name, replay.policy_params);
  } catch (const Error& error) {
    throw ReplayError(std::string("policy: ") + error.what());
  }
  return run_replay(replay, std::move(policy));
}

ReplayResult run_replay(const Replay& replay, std::unique_ptr<Policy> policy) {
  check_consistent(replay);
  Simulator simulator(replay, std::move(policy));
  return simulator.run();
}

}  // namespace kvevict::replay
