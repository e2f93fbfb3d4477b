// K-norm and KeyDiff: keep-sets derived by hand from the papers' scores as kvpress computes them
// (policies/key_scores.hpp; ../shared/replay-format.md "Key scores"): K-norm keeps the smallest
// key norms, KeyDiff the keys least similar (cosine) to the mean of the unit-normalised cached
// keys. Every expected value is worked out in the comments from the keys the test feeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <kvevict/detail/key_directions.hpp>
#include <kvevict/engine.hpp>
#include <kvevict/error.hpp>
#include <kvevict/policies/key_scores.hpp>
#include <kvevict/policies/protection.hpp>
#include <kvevict/policy_registry.hpp>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/expect_error.hpp"
#include "support/policy_harness.hpp"

namespace {

using kvevict::KeyScoreConfig;
using kvevict::Sequence;
using kvevict::SequenceConfig;
using kvevict::test::expect_error;
using kvevict::test::kept_positions;
using kvevict::test::Positions;

using Key = std::vector<float>;

// A sequence of `layers` x `kv_heads` heads (one query head per KV head) under `policy`, fed keys
// of length head_dim: the same keys in every head unless `per_head` is given.
class KeyHarness {
 public:
  KeyHarness(std::unique_ptr<kvevict::Policy> policy, int head_dim, int layers = 1,
             int kv_heads = 1, std::optional<kvevict::Granularity> granularity = std::nullopt)
      : head_dim_(head_dim),
        sequence_(config(layers, kv_heads, head_dim, granularity), std::move(policy)) {}

  // One forward of keys.size() tokens, the same keys in every (layer, KV head).
  void feed(const std::vector<Key>& keys) {
    feed_per_head([&](int, int) { return keys; }, static_cast<int>(keys.size()));
  }
  // One forward: keys_of(layer, kv_head) gives that head's keys of the chunk.
  template <class KeysOf>
  void feed_per_head(KeysOf keys_of, int tokens) {
    sequence_.begin_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(tokens), 0));
    const SequenceConfig& c = sequence_.config();
    for (int l = 0; l < c.layers; ++l) {
      std::vector<float> rows;
      for (int g = 0; g < c.kv_heads; ++g) {
        for (const Key& key : keys_of(l, g)) rows.insert(rows.end(), key.begin(), key.end());
      }
      sequence_.observe_keys(l, rows.data(), head_dim_);
    }
    sequence_.end_forward();
  }
  [[nodiscard]] Positions kept(int l = 0, int g = 0) const {
    return kept_positions(sequence_.slots(), sequence_.unit_of(l, g));
  }
  [[nodiscard]] Sequence& sequence() { return sequence_; }

 private:
  static SequenceConfig config(int layers, int kv_heads, int head_dim,
                               std::optional<kvevict::Granularity> granularity) {
    SequenceConfig c;
    c.layers = layers;
    c.q_heads = kv_heads;
    c.kv_heads = kv_heads;
    c.head_dim = head_dim;
    c.granularity = granularity;
    c.max_chunk = 16;
    c.initial_capacity = 32;
    return c;
  }

  int head_dim_;
  Sequence sequence_;
};

std::unique_ptr<kvevict::Policy> knorm(int budget, int recent = 0, int interval = 1) {
  return kvevict::make_knorm(KeyScoreConfig{budget, recent, interval});
}
std::unique_ptr<kvevict::Policy> keydiff(int budget, int recent = 0, int interval = 1) {
  return kvevict::make_keydiff(KeyScoreConfig{budget, recent, interval});
}

TEST(KnormPolicy, KeepsTheSmallestKeyNormsAndMayDropTheNewestAtOnce) {
  KeyHarness run(knorm(/*budget=*/2), /*head_dim=*/2);
  // Norms 5, 1, 3: budget 2 keeps positions 1 (norm 1) and 2 (norm 3).
  run.feed({{3, 4}, {0, 1}, {3, 0}});
  EXPECT_EQ(run.kept(), (Positions{1, 2}));
  // Token 3 has norm 10: the largest, so the token just fed goes.
  run.feed({{6, 8}});
  EXPECT_EQ(run.kept(), (Positions{1, 2}));
  // Token 4 has norm 0.5: position 2 (norm 3) goes.
  run.feed({{0.3f, 0.4f}});
  EXPECT_EQ(run.kept(), (Positions{1, 4}));
  EXPECT_EQ(run.sequence().stats().evicted_slots, 3);
}

TEST(KnormPolicy, TheRecentWindowIsKeptInsideTheBudget) {
  // budget 3 = recent 1 + 2 by norm. Norms 2, 1, 3, 9: the newest (9) stays for being recent; of
  // the others 1 and 2 stay.
  KeyHarness run(knorm(/*budget=*/3, /*recent=*/1), /*head_dim=*/1);
  run.feed({{2}, {-1}, {3}, {9}});
  EXPECT_EQ(run.kept(), (Positions{0, 1, 3}));
  // Token 4 (norm 0): recent now; 3 (norm 9) competes and loses against 0 and 1.
  run.feed({{0}});
  EXPECT_EQ(run.kept(), (Positions{0, 1, 4}));
}

TEST(KnormPolicy, AnIntervalBringsTheUnitBackToItsBudgetOncePerIntervalTokens) {
  // Budget 2, interval 3: the forward in which the third token since the last such forward arrives
  // keeps the two smallest norms; the ones between evict nothing. At most 2 + 3 - 1 = 4 tokens
  // stay after any forward.
  KeyHarness run(knorm(/*budget=*/2, /*recent=*/0, /*interval=*/3), /*head_dim=*/1);
  EXPECT_EQ(run.sequence().policy().retained_limit(), 4);
  run.feed({{5}});
  run.feed({{1}});
  EXPECT_EQ(run.kept(), (Positions{0, 1}));
  // Third token: norms 5, 1, 3, so positions 1 and 2 stay.
  run.feed({{3}});
  EXPECT_EQ(run.kept(), (Positions{1, 2}));
  // Two more (norms 4, 0.5): nothing goes, four held.
  run.feed({{4}});
  run.feed({{0.5f}});
  EXPECT_EQ(run.kept(), (Positions{1, 2, 3, 4}));
  // The third since (norm 2): of norms 1, 3, 4, 0.5, 2 the two smallest, positions 4 and 1.
  run.feed({{2}});
  EXPECT_EQ(run.kept(), (Positions{1, 4}));
  // A chunk of four (norms 9, 0.1, 7, 8) is due at once: 0.1 (position 7) and 0.5 (position 4).
  run.feed({{9}, {0.1f}, {7}, {8}});
  EXPECT_EQ(run.kept(), (Positions{4, 7}));
  EXPECT_EQ(run.sequence().stats().evicted_slots, 1 + 3 + 4);
}

TEST(KnormPolicy, EqualNormsGoToTheLowerPosition) {
  // Norms 1, 1, 1 (a rotation of the same vector): budget 2 keeps positions 0 and 1.
  KeyHarness run(knorm(2), 2);
  run.feed({{1, 0}, {0, 1}, {0, -1}});
  EXPECT_EQ(run.kept(), (Positions{0, 1}));
}

TEST(KnormPolicy, LayerGranularityAveragesTheHeadsNorms) {
  // Two KV heads, one keep-set per layer: token scores are -(|k_g0| + |k_g1|) / 2.
  // Head 0 norms 1, 4, 2; head 1 norms 4, 0, 1: means 2.5, 2, 1.5; budget 2 keeps 1 and 2.
  // (Head 0 alone would keep 0 and 2; head 1 alone 1 and 2.)
  KeyHarness run(knorm(2), 1, /*layers=*/1, /*kv_heads=*/2, kvevict::Granularity::layer);
  run.feed_per_head(
      [](int, int g) {
        return g == 0 ? std::vector<Key>{{1}, {4}, {2}} : std::vector<Key>{{4}, {0}, {1}};
      },
      3);
  EXPECT_EQ(run.kept(0, 0), (Positions{1, 2}));
  EXPECT_EQ(run.kept(0, 1), (Positions{1, 2}));
}

TEST(KeyDiffPolicy, KeepsTheKeysLeastSimilarToTheMeanOfTheNormalisedKeys) {
  // Keys (2-d): t0 = (10, 0), t1 = (1, 0), t2 = (0, 1). Unit vectors (1,0), (1,0), (0,1): their sum
  // s = (2, 1). cos with s: t0 and t1 2/sqrt5 = .894, t2 1/sqrt5 = .447. Budget 2: t2 stays (least
  // similar), and t0 / t1 tie: the lower position (0) stays. Had the anchor been the mean of the
  // raw keys, (11, 1) / 3, t0 and t1 would still tie; the next step tells the two apart.
  KeyHarness run(keydiff(/*budget=*/2), /*head_dim=*/2);
  run.feed({{10, 0}, {1, 0}, {0, 1}});
  EXPECT_EQ(run.kept(), (Positions{0, 2}));
  // t3 = (0, 100). Cached unit vectors: (1,0), (0,1), (0,1): s = (1, 2). cos: t0 1/sqrt5 = .447,
  // t2 and t3 2/sqrt5 = .894: t0 stays with t2 (tie with t3, lower position). The raw-key mean
  // (10, 101) / 3 would give t0 cos .099 and t2, t3 .995: the same here.
  run.feed({{0, 100}});
  EXPECT_EQ(run.kept(), (Positions{0, 2}));
  // t4 = (-1, 0). Unit vectors (1,0), (0,1), (-1,0): s = (0, 1). cos: t0 0, t2 1, t4 0: t0 and t4
  // stay (tie at 0, both kept), t2 goes. The raw-key mean (9, 1) / 3 would give t0 .994, t2 .110,
  // t4 -.994 and keep t4 and t2: the normalisation matters.
  run.feed({{-1, 0}});
  EXPECT_EQ(run.kept(), (Positions{0, 4}));
}

TEST(KeyDiffPolicy, NoEvictionNoScoringAndTheRecentWindowIsProtected) {
  KeyHarness run(keydiff(/*budget=*/3, /*recent=*/1), 2);
  run.feed({{1, 0}, {0, 1}});  // 2 <= 3: nothing evicted
  EXPECT_EQ(run.kept(), (Positions{0, 1}));
  // t2 = (1, 0), t3 = (1, 0). Sum of unit vectors over t0..t3: (3, 1). Recent t3 stays; of t0, t1,
  // t2 two stay by lowest cos: t1 (1/sqrt10 = .316) and t0 (3/sqrt10, tie with t2: lower
  // position).
  run.feed({{1, 0}, {1, 0}});
  EXPECT_EQ(run.kept(), (Positions{0, 1, 3}));
}

// KeyDiff written out as the formulas of policies/key_scores.hpp and detail/key_directions.hpp,
// with nothing kept between forwards: after each forward every unit over its budget scores every
// cached key against the anchor of the cached keys (each unit-vector component rounded to a
// multiple of 2^-32, summed) and keeps the newest `recent` plus the best others, ties to the lower
// position. The policy computes most decisions from the scores of an earlier anchor; it must keep
// exactly the same tokens.
class KeyDiffFormulas {
 public:
  KeyDiffFormulas(int units, int heads, int budget, int recent, int interval)
      : heads_(heads),
        budget_(budget),
        recent_(recent),
        interval_(interval),
        cached_(static_cast<std::size_t>(units)) {}

  // One forward: keys[unit][token][head] for the chunk's tokens, from original position `first`.
  // With an interval, units are brought back to the budget only in the forward in which
  // `interval` tokens have come since the last such forward.
  void forward(const std::vector<std::vector<std::vector<Key>>>& keys, std::int64_t first) {
    appended_ += static_cast<int>(keys.front().size());
    const bool due = appended_ >= interval_;
    if (due) appended_ = 0;
    for (std::size_t unit = 0; unit < cached_.size(); ++unit) {
      std::vector<Cached>& cached = cached_[unit];
      for (std::size_t k = 0; k < keys[unit].size(); ++k) {
        cached.push_back({first + static_cast<std::int64_t>(k), directions(keys[unit][k]), 0.0f});
      }
      if (!due || static_cast<int>(cached.size()) <= budget_) continue;
      const std::vector<double> sum = anchor(cached);
      for (Cached& token : cached) token.score = score(token.directions, sum);
      // The newest `recent` stay; of the others, the best budget - recent.
      const auto others = static_cast<std::ptrdiff_t>(cached.size()) - recent_;
      std::vector<Cached> ranked(cached.begin(), cached.begin() + others);
      std::stable_sort(ranked.begin(), ranked.end(),
                       [](const Cached& a, const Cached& b) { return a.score > b.score; });
      ranked.resize(static_cast<std::size_t>(budget_ - recent_));
      ranked.insert(ranked.end(), cached.begin() + others, cached.end());
      std::sort(ranked.begin(), ranked.end(),
                [](const Cached& a, const Cached& b) { return a.original < b.original; });
      cached = ranked;
    }
  }
  [[nodiscard]] Positions kept(int unit) const {
    Positions out;
    for (const Cached& token : cached_[static_cast<std::size_t>(unit)]) {
      out.push_back(token.original);
    }
    return out;
  }

 private:
  struct Cached {
    std::int64_t original = 0;
    std::vector<std::vector<float>> directions;  // [head]
    float score = 0.0f;
  };
  static std::vector<std::vector<float>> directions(const std::vector<Key>& heads) {
    std::vector<std::vector<float>> out;
    for (const Key& key : heads) {
      double squared = 0.0;
      for (const float x : key) squared += static_cast<double>(x) * x;
      const double scale = 1.0 / std::max(std::sqrt(squared), 1e-12);
      std::vector<float>& u = out.emplace_back();
      for (const float x : key) u.push_back(static_cast<float>(x * scale));
    }
    return out;
  }
  [[nodiscard]] std::vector<double> anchor(const std::vector<Cached>& cached) const {
    const std::size_t dim = cached.front().directions.front().size();
    std::vector<std::int64_t> fixed(static_cast<std::size_t>(heads_) * dim, 0);
    for (const Cached& token : cached) {
      for (int h = 0; h < heads_; ++h) {
        for (std::size_t d = 0; d < dim; ++d) {
          fixed[static_cast<std::size_t>(h) * dim + d] += std::llround(
              static_cast<double>(token.directions[static_cast<std::size_t>(h)][d]) * 0x1p32);
        }
      }
    }
    std::vector<double> sum;
    for (const std::int64_t x : fixed) sum.push_back(static_cast<double>(x) / 0x1p32);
    return sum;
  }
  [[nodiscard]] float score(const std::vector<std::vector<float>>& u,
                            const std::vector<double>& sum) const {
    const std::size_t dim = u.front().size();
    double total = 0.0;
    for (int h = 0; h < heads_; ++h) {
      double norm = 0.0;
      double lane[8] = {};  // lane l sums d = l, l + 8, ...
      for (std::size_t d = 0; d < dim; ++d) {
        const double s = sum[static_cast<std::size_t>(h) * dim + d];
        norm += s * s;
        const double product = static_cast<double>(u[static_cast<std::size_t>(h)][d]) * s;
        lane[d % 8] += product;
      }
      const double dot =
          ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
      const double weighted = dot * (1.0 / std::max(std::sqrt(norm), 1e-8));
      total += weighted;
    }
    return static_cast<float>(-total / heads_);
  }

  int heads_;
  int budget_;
  int recent_;
  int interval_;
  int appended_ = 0;
  std::vector<std::vector<Cached>> cached_;  // [unit] oldest first
};

// Keys drawn around a direction that turns slowly (most decisions then come from the reference
// scores), isotropic keys (the anchor moves far at every step: most decisions score every key),
// and keys from a few vectors scaled by powers of two (equal unit vectors: exact ties), some
// zero; mostly one token a forward, sometimes a few; per KV head and per layer (two heads to a
// unit), with and without a recent window; with a decision after every forward, and once per 7
// tokens (`interval`).
TEST(KeyDiffPolicy, DecidesAsIfEveryKeyWereScoredAtEveryEviction) {
  enum class Keys { turning, isotropic, few };
  for (const Keys keys : {Keys::turning, Keys::isotropic, Keys::few}) {
    for (const bool per_layer : {false, true}) {
      for (const auto& [recent, interval] : {std::pair{0, 1}, std::pair{5, 1}, std::pair{5, 7}}) {
        SCOPED_TRACE("keys " + std::to_string(static_cast<int>(keys)) + ", per layer " +
                     std::to_string(per_layer) + ", recent " + std::to_string(recent) +
                     ", interval " + std::to_string(interval));
        constexpr int kHeadDim = 8;
        constexpr int kLayers = 2;
        constexpr int kKvHeads = 2;
        constexpr int kBudget = 48;
        auto inner = std::make_unique<kvevict::KeyDiffPolicy>(kBudget - recent, interval);
        const kvevict::KeyDiffPolicy& policy = *inner;
        std::unique_ptr<kvevict::Policy> outer = std::move(inner);
        if (recent > 0) {
          outer = std::make_unique<kvevict::ProtectNewest>(std::move(outer), recent, "keydiff");
        }
        KeyHarness run(std::move(outer), kHeadDim, kLayers, kKvHeads,
                       per_layer ? kvevict::Granularity::layer : kvevict::Granularity::head);
        const int units = per_layer ? kLayers : kLayers * kKvHeads;
        const int heads = per_layer ? kKvHeads : 1;
        KeyDiffFormulas formulas(units, heads, kBudget, recent, interval);
        std::mt19937 rng(17);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::uniform_int_distribution<int> pick(0, 4);
        std::uniform_int_distribution<int> binade(-3, 3);
        std::vector<Key> pool(5, Key(kHeadDim));
        for (Key& key : pool) {
          for (float& x : key) x = normal(rng);
        }
        const auto draw = [&](std::int64_t t, int layer, int g) {
          Key key(kHeadDim);
          if (keys == Keys::few) {
            const int which = pick(rng);
            if (which == 0 && t % 3 == 0) return key;  // zero
            for (int d = 0; d < kHeadDim; ++d) {
              key[static_cast<std::size_t>(d)] = std::ldexp(
                  pool[static_cast<std::size_t>(which)][static_cast<std::size_t>(d)], binade(rng));
            }
            return key;
          }
          const double angle = static_cast<double>(t) / 150.0 + layer + 2 * g;
          for (int d = 0; d < kHeadDim; ++d) key[static_cast<std::size_t>(d)] = normal(rng);
          if (keys == Keys::turning) {
            key[0] += static_cast<float>(8.0 * std::cos(angle));
            key[1] += static_cast<float>(8.0 * std::sin(angle));
          }
          return key;
        };
        std::int64_t fed = 0;
        std::uniform_int_distribution<int> chunk_size(1, 12);
        while (fed < 900) {
          const int size = chunk_size(rng) > 10 ? 4 : 1;
          // keys[layer][g][token], and the same per unit for the formulas.
          std::vector<std::vector<std::vector<Key>>> by_head(kLayers);
          std::vector<std::vector<std::vector<Key>>> by_unit(static_cast<std::size_t>(units));
          for (int l = 0; l < kLayers; ++l) {
            by_head[static_cast<std::size_t>(l)].resize(kKvHeads);
            for (int g = 0; g < kKvHeads; ++g) {
              for (int k = 0; k < size; ++k) {
                by_head[static_cast<std::size_t>(l)][static_cast<std::size_t>(g)].push_back(
                    draw(fed + k, l, g));
              }
            }
          }
          for (int k = 0; k < size; ++k) {
            for (int l = 0; l < kLayers; ++l) {
              for (int g = 0; g < kKvHeads; ++g) {
                const int unit = per_layer ? l : l * kKvHeads + g;
                std::vector<std::vector<Key>>& tokens = by_unit[static_cast<std::size_t>(unit)];
                if (per_layer ? g == 0 : true) tokens.emplace_back();
                tokens.back().push_back(by_head[static_cast<std::size_t>(
                    l)][static_cast<std::size_t>(g)][static_cast<std::size_t>(k)]);
              }
            }
          }
          run.feed_per_head(
              [&](int l, int g) {
                return by_head[static_cast<std::size_t>(l)][static_cast<std::size_t>(g)];
              },
              size);
          formulas.forward(by_unit, fed);
          fed += size;
          for (int l = 0; l < kLayers; ++l) {
            for (int g = 0; g < kKvHeads; ++g) {
              const int unit = per_layer ? l : l * kKvHeads + g;
              ASSERT_EQ(run.kept(l, g), formulas.kept(unit)) << "after " << fed << " tokens";
              ASSERT_LE(static_cast<int>(run.kept(l, g).size()), kBudget + interval - 1);
            }
          }
        }
        // The reference decided, a good share of the decisions when the keys share a direction.
        // (With an interval each decision evicts several tokens: every key is scored.)
        if (interval == 1) {
          EXPECT_GT(policy.decisions_from_reference(), 0);
          if (keys == Keys::turning) {
            EXPECT_GT(policy.decisions_from_reference() * 3, policy.decisions());
          }
        }
      }
    }
  }
}

// The anchor's sum rounds each unit-vector component as llround(x * 2^32); to_fixed does it
// without the call. Every binade of floats (normals and subnormals, both signs, a spread of
// mantissas), the values exactly halfway between two multiples of 2^-32, and the ends of [-1, 1]
// with a rounding's overshoot.
TEST(KeyDirections, FixedPointRoundingIsLlround) {
  const auto expect_llround = [](float x) {
    ASSERT_EQ(kvevict::detail::to_fixed(x),
              std::llround(static_cast<double>(x) * kvevict::detail::kFixedScale))
        << x;
  };
  for (std::uint32_t bits = 0; bits < 0x7f800000u; bits += 4093) {
    for (const std::uint32_t sign : {0u, 0x80000000u}) {
      float x = 0.0f;
      const std::uint32_t pattern = bits | sign;
      std::memcpy(&x, &pattern, sizeof x);
      if (std::fabs(x) <= 1.0f + 0x1p-22f) expect_llround(x);
    }
  }
  for (int k = 0; k < 64; ++k) {
    const float half = (static_cast<float>(k) + 0.5f) * 0x1p-32f;  // k + 1/2 units of 2^-32
    expect_llround(half);
    expect_llround(-half);
  }
  for (const float x : {0.0f, -0.0f, 1.0f, -1.0f, 1.0f + 0x1p-23f, -1.0f - 0x1p-23f,
                        std::numeric_limits<float>::denorm_min(), 0x1p-33f, -0x1p-33f}) {
    expect_llround(x);
  }
}

TEST(KeyScorePolicies, RegistryNamesParametersAndBudgetMapping) {
  for (const char* name : {"knorm", "keydiff"}) {
    const kvevict::PolicyParams params = kvevict::budget_params(name, 64);
    EXPECT_EQ(params.get_int("budget"), 64) << name;
    const std::unique_ptr<kvevict::Policy> policy = kvevict::make_policy(name, params);
    EXPECT_EQ(policy->name(), name);
    EXPECT_TRUE(policy->signals().contains(kvevict::Signal::keys));
    EXPECT_EQ(policy->retained_limit(), 64);
    EXPECT_TRUE(policy->score_rule().has_value());
    // kvpress's DecodingPress default: back to the budget every 10 tokens, 64 + 9 held at most;
    // no rule for an allocation to split (it decides after every forward).
    kvevict::PolicyParams every_ten = params;
    every_ten.set("interval", 10);
    const std::unique_ptr<kvevict::Policy> periodic = kvevict::make_policy(name, every_ten);
    EXPECT_EQ(periodic->retained_limit(), 73) << name;
    EXPECT_FALSE(periodic->score_rule().has_value()) << name;
  }
}

TEST(KeyScorePolicies, BadInputGetsClearErrors) {
  expect_error([] { (void)knorm(0); }, "budget must be positive");
  expect_error([] { (void)keydiff(4, 4); }, "not larger than the protected recent window");
  expect_error([] { (void)knorm(4, -1); }, "recent must be >= 0");
  expect_error([] { (void)keydiff(4, 0, 0); }, "keydiff: interval must be >= 1");
  expect_error([] { (void)knorm(std::numeric_limits<int>::max(), 0, 2); },
               "knorm: budget + interval - 1");
  // A sequence for a key-reading policy without head_dim.
  expect_error(
      [] {
        SequenceConfig c;
        c.layers = 1;
        c.q_heads = 1;
        c.kv_heads = 1;
        Sequence sequence(c, knorm(2));
      },
      "set SequenceConfig::head_dim");

  KeyHarness run(knorm(2), 2, /*layers=*/2);
  Sequence& sequence = run.sequence();
  sequence.begin_chunk(std::vector<std::int32_t>{0});
  const float nan_key[2] = {1.0f, std::numeric_limits<float>::quiet_NaN()};
  expect_error([&] { sequence.observe_keys(0, nan_key, 2); }, "NaN is not finite");
  expect_error([&] { sequence.observe_keys(0, nan_key, 1); }, "shorter than head_dim");
  expect_error([&] { sequence.observe_keys(0, nullptr, 2); }, "keys are null");
  expect_error([&] { sequence.observe_keys(2, nan_key, 2); }, "layer 2 outside [0, 2)");
  const float key[2] = {1.0f, 0.0f};
  sequence.observe_keys(0, key, 2);  // the refused calls recorded nothing: layer 0 is still open
  expect_error([&] { sequence.observe_keys(0, key, 2); }, "already observed");
  // Layer 1's keys are missing.
  expect_error([&] { sequence.end_forward(); }, "needs the keys of every layer: layer 1");
  sequence.observe_keys(1, key, 2);
  sequence.end_forward();
  expect_error([&] { sequence.observe_keys(0, key, 2); }, "no forward is open");
}

}  // namespace
