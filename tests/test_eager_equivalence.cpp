// The contract of the metadata-only core: over long random streams, every policy in every position
// mode, with keys stored before and after RoPE, decides exactly what the v1 core decided (the
// eager path that compacted keys and values and re-rotated every key, frozen in
// tests/support/eager/ as the oracle), and attention over the cache gives the same outputs.
//
// Both implementations see the same logical inputs: the same chunks, token ids (anchors included),
// turn starts, keys and values per token, surprisal, and attention probabilities computed once per
// (layer, query head, query, key) by original position in a fixed order, then laid out by each
// implementation's own slots. Decisions are compared as the kept original positions of every
// (layer, KV head) after every forward; attention outputs of a random query per head every few
// steps, within 1e-5.
//
// The oracle shares the production headers it had copied verbatim (RoPE, signals, positions,
// shape); its own is the eviction core: slot table, pipeline, compaction, policies. It is retired
// at the first change of what the core decides (a new position mode, a changed tie-break or
// keep rule): from then on the two are meant to differ, and the replay fixtures (the authors' code)
// and the property tests remain the contract.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <kvevict/kvevict.hpp>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "eager/evicting_cache.hpp"
#include "eager/policy_registry.hpp"
#include "support/policy_harness.hpp"

namespace {

using Matrix = kvevict::EvictingCache::Matrix;
using kvevict::PositionMode;

constexpr int kLayers = 2;
constexpr int kQueryHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kGroup = kQueryHeads / kKvHeads;
constexpr int kHeadDim = 16;
constexpr int kMaxChunk = 5;
constexpr std::int32_t kAnchor = 3;

struct PolicyCase {
  std::string name;
  std::vector<std::pair<std::string, double>> params;
  std::vector<std::int64_t> anchor_ids;  // anllm only
};

std::vector<PolicyCase> policy_cases() {
  return {
      {"full", {}, {}},
      {"window", {{"recent", 12}}, {}},
      {"streaming_llm", {{"sinks", 3}, {"recent", 9}}, {}},
      {"h2o", {{"heavy", 6}, {"recent", 6}}, {}},
      {"tova", {{"budget", 12}}, {}},
      {"tova", {{"budget", 12}, {"sinks", 2}, {"head_wise", 1}}, {}},
      {"sirllm", {{"sinks", 2}, {"entropy", 8}, {"recent", 2}, {"decay", 0.8}}, {}},
      {"sirllm", {{"sinks", 2}, {"entropy", 10}, {"shifted", 1}}, {}},
      {"random_llm", {{"sinks", 2}, {"budget", 10}, {"seed", 5}}, {}},
      {"interval_llm", {{"sinks", 2}, {"budget", 10}}, {}},
      {"anllm", {}, {kAnchor}},
      {"anllm", {{"max_slots", 12}}, {kAnchor}},
      {"infinipot", {{"pot", 14}, {"keep", 7}, {"novel", 3}}, {}},
  };
}

template <class Params>
Params params_of(const PolicyCase& c) {
  Params params;
  for (const auto& [key, value] : c.params) params.set(key, value);
  if (!c.anchor_ids.empty()) params.set_list("anchor_ids", c.anchor_ids);
  return params;
}

// A deterministic pseudo-random number in [-1, 1) from integers (the same on both sides).
double noise(std::uint64_t a, std::uint64_t b, std::uint64_t c, std::uint64_t d) {
  std::uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xC2B2AE3D27D4EB4Full;
  x ^= (c + 0x165667B19E3779F9ull) * 0x27D4EB2F165667C5ull;
  x ^= (d + 0x85EBCA77C2B2AE63ull) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<double>(x >> 11) / static_cast<double>(1ull << 52) - 1.0;
}

// Softmax over `keys` (original positions, in stream order) of the logits noise(layer, head,
// query, key) * 3, in double, so that both implementations get bit-identical probabilities.
std::vector<float> probabilities(int layer, int head, std::int64_t query,
                                 const std::vector<std::int64_t>& keys) {
  std::vector<double> logits;
  double max = -1e300;
  for (const std::int64_t key : keys) {
    logits.push_back(3.0 *
                     noise(static_cast<std::uint64_t>(layer), static_cast<std::uint64_t>(head),
                           static_cast<std::uint64_t>(query), static_cast<std::uint64_t>(key)));
    max = std::max(max, logits.back());
  }
  double sum = 0;
  for (double& v : logits) sum += v = std::exp(v - max);
  std::vector<float> out;
  for (const double v : logits) out.push_back(static_cast<float>(v / sum));
  return out;
}

// Kept original positions of head (l, g), ascending, on each side.
std::vector<std::int64_t> eager_kept(const kvevict::eager::EvictingCache<float>& cache, int l,
                                     int g) {
  const auto original = cache.store().slots().original_positions(l, g);
  return {original.begin(), original.end()};
}
std::vector<std::int64_t> new_kept(const kvevict::EvictingCache& cache, int l, int g) {
  return kvevict::test::kept_positions(cache.sequence().slots(), cache.sequence().unit_of(l, g));
}

// Attention rows of `queries` (original positions, the chunk's last ones) for layer l, laid out for
// each side: the eager side's slots are its stream order.
struct Rows {
  std::vector<float> data;
  std::vector<int> keys;
  int stride = 0;
};

// `catalyst_first`: original position of the first catalyst token (keys at or after it are the
// catalyst's own, visible causally), or -1 outside a catalyst.
Rows eager_rows(const kvevict::eager::EvictingCache<float>& cache, int l,
                const std::vector<std::int64_t>& queries) {
  Rows rows;
  for (int g = 0; g < kKvHeads; ++g) {
    rows.keys.push_back(cache.live(l, g));
    rows.stride = std::max(rows.stride, cache.live(l, g));
  }
  const auto n = static_cast<int>(queries.size());
  rows.data.assign(static_cast<std::size_t>(kQueryHeads * n * std::max(rows.stride, 1)), 0.0f);
  for (int h = 0; h < kQueryHeads; ++h) {
    const std::vector<std::int64_t> kept = eager_kept(cache, l, h / kGroup);
    for (int q = 0; q < n; ++q) {
      std::vector<std::int64_t> visible;
      for (const std::int64_t k : kept) {
        if (k <= queries[static_cast<std::size_t>(q)]) visible.push_back(k);
      }
      const std::vector<float> p =
          probabilities(l, h, queries[static_cast<std::size_t>(q)], visible);
      for (std::size_t i = 0; i < visible.size(); ++i) {
        rows.data[static_cast<std::size_t>((h * n + q) * rows.stride) + i] = p[i];
      }
    }
  }
  return rows;
}

Rows new_rows(const kvevict::EvictingCache& cache, int l,
              const std::vector<std::int64_t>& queries) {
  Rows rows;
  for (int g = 0; g < kKvHeads; ++g) {
    rows.keys.push_back(cache.sequence().slot_limit(l, g));
    rows.stride = std::max(rows.stride, cache.sequence().slot_limit(l, g));
  }
  const auto n = static_cast<int>(queries.size());
  rows.data.assign(static_cast<std::size_t>(kQueryHeads * n * std::max(rows.stride, 1)), 0.0f);
  const kvevict::SlotTable& slots = cache.sequence().slots();
  for (int h = 0; h < kQueryHeads; ++h) {
    const int unit = cache.sequence().unit_of(l, h / kGroup);
    const auto order = slots.stream_order(unit);
    for (int q = 0; q < n; ++q) {
      std::vector<std::int64_t> visible;
      std::vector<std::int32_t> visible_slots;
      for (const std::int32_t slot : order) {
        const std::int64_t k = slots.original_positions(unit)[static_cast<std::size_t>(slot)];
        if (k > queries[static_cast<std::size_t>(q)]) continue;
        visible.push_back(k);
        visible_slots.push_back(slot);
      }
      const std::vector<float> p =
          probabilities(l, h, queries[static_cast<std::size_t>(q)], visible);
      for (std::size_t i = 0; i < visible.size(); ++i) {
        rows.data[static_cast<std::size_t>((h * n + q) * rows.stride + visible_slots[i])] = p[i];
      }
    }
  }
  return rows;
}

// softmax(q . k / sqrt(d)) . v for query head h with pre-RoPE query `q` at position `position`,
// in double from each side's float keys and values.
std::vector<double> eager_attention(const kvevict::eager::EvictingCache<float>& cache, int l, int g,
                                    const std::vector<float>& q, std::int64_t position) {
  Matrix scratch;
  const auto keys = cache.attention_keys(l, g, scratch);
  const auto values = cache.values(l, g);
  std::vector<float> rotated = q;
  cache.rope().rotate(rotated.data(), position);
  std::vector<double> scores;
  for (Eigen::Index s = 0; s < keys.rows(); ++s) {
    double dot = 0;
    for (int c = 0; c < kHeadDim; ++c)
      dot += double(keys(s, c)) * rotated[static_cast<std::size_t>(c)];
    scores.push_back(dot / std::sqrt(double(kHeadDim)));
  }
  const double max = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (double& s : scores) sum += s = std::exp(s - max);
  std::vector<double> out(kHeadDim, 0.0);
  for (Eigen::Index s = 0; s < keys.rows(); ++s) {
    for (int c = 0; c < kHeadDim; ++c)
      out[static_cast<std::size_t>(c)] += scores[static_cast<std::size_t>(s)] / sum * values(s, c);
  }
  return out;
}

std::vector<double> new_attention(const kvevict::EvictingCache& cache, int l, int g,
                                  const std::vector<float>& q, std::int64_t position) {
  Matrix scratch;
  const bool post = cache.config().sequence.key_storage == kvevict::KeyStorage::post_rope;
  const auto keys = post ? cache.keys(l, g) : cache.rotated_keys(l, g, scratch);
  const auto values = cache.values(l, g);
  std::vector<double> scores(static_cast<std::size_t>(cache.sequence().slot_limit(l, g)), -1e300);
  const auto score_run = [&](int begin, int end, std::int64_t rotation) {
    std::vector<float> rotated = q;
    cache.rope().rotate(rotated.data(), position - (post ? rotation : 0));
    for (int s = begin; s < end; ++s) {
      double dot = 0;
      for (int c = 0; c < kHeadDim; ++c)
        dot += double(keys(s, c)) * rotated[static_cast<std::size_t>(c)];
      scores[static_cast<std::size_t>(s)] = dot / std::sqrt(double(kHeadDim));
    }
  };
  const int unit = cache.sequence().unit_of(l, g);
  if (post) {
    cache.sequence().slots().for_each_key_run(unit, score_run);
  } else {
    cache.sequence().slots().for_each_position_run(unit, score_run);
  }
  const double max = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (double& s : scores) sum += s = s < -1e299 ? 0.0 : std::exp(s - max);
  std::vector<double> out(kHeadDim, 0.0);
  for (std::size_t s = 0; s < scores.size(); ++s) {
    for (int c = 0; c < kHeadDim; ++c)
      out[static_cast<std::size_t>(c)] += scores[s] / sum * values(static_cast<Eigen::Index>(s), c);
  }
  return out;
}

struct Outcome {
  int steps = 0;
  std::int64_t evicted = 0;
  std::int64_t folds = 0;
  double worst_attention = 0;
};

void run(const PolicyCase& c, PositionMode mode, kvevict::KeyStorage storage, std::uint32_t seed,
         int steps, Outcome& outcome) {
  const kvevict::RopeConfig rope{kHeadDim, 0, 10000.0, kvevict::RopeLayout::half_split};
  kvevict::eager::CacheConfig eager_config;
  eager_config.shape = {kLayers, kQueryHeads, kKvHeads, kHeadDim};
  eager_config.rope =
      kvevict::eager::RopeConfig{kHeadDim, 0, 10000.0, kvevict::eager::RopeLayout::half_split};
  eager_config.position_mode = static_cast<kvevict::eager::PositionMode>(mode);
  eager_config.key_storage = static_cast<kvevict::eager::KeyStorage>(storage);
  eager_config.max_chunk = kMaxChunk;
  kvevict::eager::EvictingCache<float> eager(
      eager_config,
      kvevict::eager::make_policy(c.name, params_of<kvevict::eager::PolicyParams>(c)));
  kvevict::CacheConfig config;
  config.shape = {kLayers, kQueryHeads, kKvHeads, kHeadDim};
  config.rope = rope;
  config.sequence.position_mode = mode;
  config.sequence.key_storage = storage;
  config.sequence.max_chunk = kMaxChunk;
  config.sequence.max_pending_rotations = 4;  // small: folds happen often and are checked too
  kvevict::EvictingCache now(config,
                             kvevict::make_policy(c.name, params_of<kvevict::PolicyParams>(c)));

  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const auto random_matrix = [&](int rows) {
    Matrix m(rows, kHeadDim);
    for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
    return m;
  };
  const std::vector<std::int32_t> catalyst_ids{7, 8, 9};
  std::int64_t fed = 0;
  for (int step = 0; step < steps; ++step) {
    int n = 1 + static_cast<int>(rng() % kMaxChunk);
    const std::optional<int> room = now.sequence().pot_room();
    EXPECT_EQ(room, eager.pipeline().pot_room()) << "step " << step;
    if (room && *room > 0) n = std::min(n, *room);
    const bool turn_start = rng() % 3 == 0;
    std::vector<std::int32_t> ids;
    for (int i = 0; i < n; ++i)
      ids.push_back(rng() % 7 == 0 ? kAnchor : 100 + static_cast<std::int32_t>(rng() % 50));
    eager.begin_chunk(ids, turn_start);
    now.sequence().begin_chunk(ids, turn_start);
    for (int l = 0; l < kLayers; ++l) {
      for (int g = 0; g < kKvHeads; ++g) {
        const Matrix k = random_matrix(n);
        const Matrix v = random_matrix(n);
        eager.write_chunk(l, g, k, v);
        now.write_chunk(l, g, k, v);
      }
    }
    const bool all = now.sequence().wants(kvevict::Signal::attention_rows);
    if (all || now.sequence().wants(kvevict::Signal::last_attention_row)) {
      std::vector<std::int64_t> queries;
      for (std::int64_t p = all ? fed : fed + n - 1; p < fed + n; ++p) queries.push_back(p);
      const auto q = static_cast<int>(queries.size());
      for (int l = 0; l < kLayers; ++l) {
        const Rows a = eager_rows(eager, l, queries);
        eager.observe_attention(l, kvevict::eager::AttentionRows(a.data.data(), kQueryHeads, kGroup,
                                                                 q, a.stride, a.keys, queries[0]));
        const Rows b = new_rows(now, l, queries);
        now.sequence().observe_attention(l, b.data.data(), q, b.stride);
      }
    }
    if (now.sequence().wants(kvevict::Signal::surprisal)) {
      std::vector<float> surprisal;
      for (int i = 0; i < n; ++i)
        surprisal.push_back(
            static_cast<float>(4.0 + 4.0 * noise(9, 9, static_cast<std::uint64_t>(fed + i), 1)));
      eager.observe_surprisal(surprisal);
      now.sequence().observe_surprisal(surprisal);
    }
    eager.end_forward();
    now.sequence().end_forward();
    fed += n;
    EXPECT_EQ(now.sequence().catalyst_pending(), eager.catalyst_pending()) << "step " << step;
    if (now.sequence().catalyst_pending()) {
      eager.begin_catalyst(catalyst_ids);
      now.sequence().begin_catalyst(catalyst_ids);
      for (int l = 0; l < kLayers; ++l) {
        for (int g = 0; g < kKvHeads; ++g) {
          const Matrix k = random_matrix(3);
          const Matrix v = random_matrix(3);
          eager.write_chunk(l, g, k, v);
          now.write_chunk(l, g, k, v);
        }
      }
      const std::vector<std::int64_t> queries{fed, fed + 1, fed + 2};
      for (int l = 0; l < kLayers; ++l) {
        const Rows a = eager_rows(eager, l, queries);
        eager.observe_catalyst(l, kvevict::eager::AttentionRows(a.data.data(), kQueryHeads, kGroup,
                                                                3, a.stride, a.keys, fed));
        const Rows b = new_rows(now, l, queries);
        now.sequence().observe_catalyst(l, b.data.data(), 3, b.stride);
      }
      eager.end_catalyst();
      now.sequence().end_catalyst();
    }
    for (int l = 0; l < kLayers; ++l) {
      for (int g = 0; g < kKvHeads; ++g) {
        const std::vector<std::int64_t> expected = eager_kept(eager, l, g);
        ASSERT_EQ(new_kept(now, l, g), expected)
            << c.name << " step " << step << " head (" << l << ", " << g << ")";
        // Positions agree too (they are part of what a decision means under each mode).
        const auto eager_positions = eager.store().slots().positions(l, g);
        ASSERT_EQ(
            kvevict::test::rope_positions(now.sequence().slots(), now.sequence().unit_of(l, g)),
            std::vector<std::int64_t>(eager_positions.begin(), eager_positions.end()))
            << c.name << " step " << step;
      }
    }
    if (step % 7 != 0) continue;
    for (int l = 0; l < kLayers; ++l) {
      for (int g = 0; g < kKvHeads; ++g) {
        if (eager.live(l, g) == 0) continue;
        std::vector<float> q(kHeadDim);
        for (float& x : q) x = normal(rng);
        const auto eager_positions = eager.store().slots().positions(l, g);
        const std::int64_t position = eager_positions.back() + 1;
        const std::vector<double> a = eager_attention(eager, l, g, q, position);
        const std::vector<double> b = new_attention(now, l, g, q, position);
        for (int i = 0; i < kHeadDim; ++i) {
          outcome.worst_attention =
              std::max(outcome.worst_attention,
                       std::fabs(a[static_cast<std::size_t>(i)] - b[static_cast<std::size_t>(i)]));
        }
      }
    }
    ++outcome.steps;
  }
  outcome.evicted = now.sequence().stats().evicted_slots;
  outcome.folds = now.sequence().stats().folds;
  EXPECT_EQ(outcome.evicted, eager.pipeline().stats().evicted_slots) << c.name;
}

TEST(EagerEquivalence, EveryPolicyModeAndKeyStorageDecidesAndAttendsAsTheEagerPath) {
  const PositionMode modes[] = {PositionMode::original, PositionMode::cache_index,
                                PositionMode::reset_on_compact};
  const kvevict::KeyStorage storages[] = {kvevict::KeyStorage::pre_rope,
                                          kvevict::KeyStorage::post_rope};
  double worst = 0;
  int runs = 0;
  std::int64_t folds = 0;
  for (const PolicyCase& c : policy_cases()) {
    for (const PositionMode mode : modes) {
      for (const kvevict::KeyStorage storage : storages) {
        SCOPED_TRACE(c.name + " " + std::string(kvevict::to_string(mode)) + " " +
                     std::string(kvevict::to_string(storage)));
        Outcome outcome;
        run(c, mode, storage, 1000u + static_cast<std::uint32_t>(runs), 400, outcome);
        if (HasFatalFailure()) return;
        if (c.name != "full") {
          EXPECT_GT(outcome.evicted, 0);
        }
        EXPECT_LT(outcome.worst_attention, 1e-5);
        worst = std::max(worst, outcome.worst_attention);
        folds += outcome.folds;
        ++runs;
      }
    }
  }
  // Pending rotations were folded into stored keys along the way (max_pending_rotations = 4), so
  // the comparison covers keys rotated at append, at folds, and queries rotated per run.
  EXPECT_GT(folds, 0);
  std::printf(
      "[ measured ] %d runs of 400 steps: same decisions; worst attention difference %.3g; %lld "
      "folds\n",
      runs, worst, static_cast<long long>(folds));
}

}  // namespace
