// Prompt compression from an observation window: SnapKV, PyramidKV and Ada-KV. One score, one
// keep rule and one trigger; they differ only in how many tokens each cache unit keeps, which is
// an allocation (kvevict/allocation.hpp), not a re-coded policy.
//
//   snapkv     Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
//              arXiv 2404.14469; reference code FasterDecoding/SnapKV @e216ddc,
//              snapkv/monkeypatch/snapkv_utils.py::SnapKVCluster.update_kv. Allocation: uniform.
//   pyramidkv  Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
//              Funneling", arXiv 2406.02069; reference code Zefan-Cai/KVCache-Factory @c97f9d7,
//              pyramidkv/pyramidkv_utils.py::PyramidKVCluster.update_kv. Allocation: pyramid.
//   adakv      Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
//              for Efficient LLM Inference", arXiv 2407.11550; reference code FFY0/AdaKV @efe4e2e,
//              adaptive_snapkv/monkeypatch/snapkv_utils.py::AdaptiveSnapKVCluster.update_kv.
//              Allocation: adaptive.
//
// Score (score column 0): the votes of the prompt's last `window` queries. With P prompt tokens,
// w = window and N = P - w, token j < N gets v[j] = the sum over the window's queries i of A[i, j]
// (softmax rows over the whole prompt, causal inside the window), per query head. The votes are
// then pooled along positions with a `kernel`-wide window (odd kernel, r = kernel // 2): avg =
// the sum of v[j-r .. j+r] divided by `kernel`, zeros outside [0, N) (torch's avg_pool1d with zero
// padding); max = the largest in-range v. Ada-KV averages the window's rows instead of summing
// them: the same ranking, so kvevict sums for all three.
// Keep rule, per cache unit: the window [N, P) plus the k_u prefix tokens with the highest pooled
// votes (ties to the lower position). k_u, with C = capacity and b = C - w:
//   snapkv     if P > C: k = b in every unit; else nothing is evicted (the authors skip P < C, and
//              at P = C their top-k keeps all N).
//   pyramidkv  if P < C: nothing; else if P < 2b: k = b in every layer (the authors' uniform
//              branch); else layer l gets pyramid_budgets(L, b, beta, N)[l] (allocation.hpp).
//   adakv      if b > N: nothing; else the units of a layer share its U * b slots:
//              adaptive_budgets(pooled scores of its U units, b, floor) (allocation.hpp).
// Trigger: once, after the first forward (the prompt: the authors' forwards compress when the
// keys in hand are the whole sequence). Later forwards, multi-token ones included, only append:
// the cache grows again while decoding, as in the authors' code, so retained_limit() is unbounded.
//
// `interval` (default 0: the authors' one-shot form above). With interval I > 0 the cache is also
// re-compressed while decoding, as kvpress's DecodingPress does (NVIDIA/kvpress,
// presses/generation/decoding_press.py: every `compression_steps` decode steps, back to its
// target size, scored from the buffered recent queries): after the forward in which I tokens have
// been appended since the prompt or the last re-compression, every unit keeps the last `window`
// tokens plus its k_u prefix tokens with the highest pooled votes of the stream's last `window`
// queries (whichever forwards they came in; every prefix token is older than all of them, so each
// saw the whole prefix). The counter restarts at every such forward, compressing or not. k_u at a
// re-compression, b = C - w:
//   snapkv     b in every unit, if its prefix holds more.
//   pyramidkv  the schedule pyramid_budgets_within(L, b, beta) (allocation.hpp: PyramidKV's
//              arithmetic sequence, unclamped, at the largest mean whose sum fits L * b): the
//              prompt's clamp and its uniform branch depend on a prompt length, which a decoding
//              cache no longer has; per-layer budgets must not grow back to C either.
//   adakv      per layer, safeguarded_adaptive_budgets (allocation.hpp): each unit its floor
//              share, then the layer's best; the authors' one-shot mix, applied at every
//              re-compression, drifts every unit back towards b (policies/allocated.hpp says why).
// A unit then holds at most its share + window + I - 1 tokens after any forward: retained_limit()
// is C + I - 1 (snapkv) and 2b - b // beta + w + I - 1 (pyramidkv); adakv's unit share depends on
// the number of heads a layer has, which the policy learns only at the first chunk, so its limit
// stays unbounded. With I = the chunk, the cache peaks at C plus one chunk, as H2O's and TOVA's do:
// the equal-memory setting of the eval grids (docs/results.md, section 12).
// Positions: original (the authors keep the rotated keys at their positions).
//
// GQA, the `gqa` parameter (../shared/replay-format.md, "Prompt compression"):
//   repeat  (default; what all three authors' codes do by default) every KV head is expanded to
//           its G = Hq / Hkv query heads (repeat_kv) before compression and cached that way, so
//           each query head is a cache unit with its own keep-set and its own votes. In kvevict
//           this is a layout the engine sets up: build the Sequence with kv_heads = q_heads and
//           write KV head g's keys and values into each of its G query heads' units
//           (cached_kv_heads() below says how many an engine must lay out). Rows then have
//           group_size 1; rows of a smaller cache are refused with a message.
//   mean    one keep-set per KV head, its votes the mean over its G query heads, taken before
//           pooling (KVCache-Factory kv_cache_granularity="kv_head" with gqa_score_agg="mean";
//           AdaKV gqa_support with gqa_func="mean").
// The memory cost: under repeat a unit holds C tokens of ONE query head, so a layer holds Hq * C
// K/V rows against Hkv * C under mean: G times the bytes for the same capacity, and every decode
// token is stored G times too. Compression only saves memory against the uncompressed GQA cache
// of P tokens (Hkv * P rows) when C < P / G: a Llama-3-8B (G = 4) at capacity 2048 on a 4K prompt
// holds 32 * 2048 = 65,536 rows per layer under repeat, twice the 8 * 4096 = 32,768 of the full
// cache, and 16,384 under mean. With G = 1 (MHA) the two are the same.
//
// Granularity: per KV head by default (per query head under repeat). A coarser unit averages the
// votes of every query head it covers: SnapKV takes layer and token; PyramidKV needs per-layer
// units at least (head or layer: its budgets are per layer); Ada-KV needs head (its allocation is
// between the heads of a layer). Other granularities are errors at the first chunk.
//
// Paper vs code, and what kvevict follows (the authors' code, which the replay fixtures pin):
// - SnapKV: the paper's voting equation sums the window's rows and its Listing 1 is this code;
//   GQA is not discussed, the code repeats KV heads (gqa = repeat). The paper's LongBench runs use
//   window 32, max pooling, kernel 7; the code's defaults, which kvevict takes, are window 32,
//   kernel 5, avg pooling (the paper found no significant difference between the two poolings).
// - PyramidKV: the schedule is the code's (allocation.hpp): the arithmetic sequence is applied to
//   the vote budget b with the window on top of every layer, clamped to the prompt, floored step,
//   uniform below P = 2b; beta 20 as init_pyramidkv passes. No copy of the paper was at hand, so
//   its text was not compared with the code beyond its description of an arithmetic sequence.
// - Ada-KV: the layer-wide top-k and the floor mix with torch.round (halves to even, float32) are
//   the code's; `skip`, `normalize` and pyram_mode are not offered. kvpress's AdaKVPress is a
//   different variant (it masks instead of evicting) and is not followed.
// - An even kernel makes the authors' pooling return N + 1 scores and their gather fail: kvevict
//   refuses it. capacity <= window fails the authors' assert: kvevict refuses it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/allocation.hpp"
#include "kvevict/attention_scores.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/selection.hpp"

namespace kvevict {

enum class Pooling : std::uint8_t { avg, max };
enum class GqaLayout : std::uint8_t { repeat, mean };

struct PromptCompressionConfig {
  /// C, the window included: per unit (snapkv), the per-layer mean (pyramidkv), the per-unit mean
  /// (adakv); > window.
  int capacity = 0;
  int window = 32;  ///< w >= 1: the last w prompt tokens vote and are always kept
  int kernel = 5;   ///< pooling width, odd >= 1
  Pooling pooling = Pooling::avg;
  GqaLayout gqa = GqaLayout::repeat;
  Allocation allocation = Allocation::uniform;
  int beta = 20;       ///< pyramid: lo = b // beta (>= 1)
  double floor = 0.2;  ///< adaptive: floor_alpha in [0, 1]
  /// > 0: re-compress every `interval` tokens after the prompt (kvpress's DecodingPress); 0: once.
  int interval = 0;
};

/// Pooled votes, as the authors pool them (see the header comment): `votes` has N entries.
[[nodiscard]] inline std::vector<float> pool_votes(std::span<const double> votes, int kernel,
                                                   Pooling pooling) {
  KVEVICT_REQUIRE(kernel >= 1 && kernel % 2 == 1,
                  "pool_votes: kernel must be odd and positive, got " + std::to_string(kernel));
  const int n = static_cast<int>(votes.size());
  const int r = kernel / 2;
  std::vector<float> pooled(votes.size());
  for (int j = 0; j < n; ++j) {
    const int first = std::max(j - r, 0);
    const int last = std::min(j + r, n - 1);
    double value = pooling == Pooling::max ? votes[static_cast<std::size_t>(first)] : 0.0;
    for (int i = first; i <= last; ++i) {
      const double v = votes[static_cast<std::size_t>(i)];
      value = pooling == Pooling::max ? std::max(value, v) : value + v;
    }
    // avg_pool1d with zero padding: the zeros count, so the divisor is always the kernel.
    if (pooling == Pooling::avg) value /= kernel;
    pooled[static_cast<std::size_t>(j)] = static_cast<float>(value);
  }
  return pooled;
}

class PromptCompressionPolicy final : public Policy {
 public:
  explicit PromptCompressionPolicy(const PromptCompressionConfig& config) : config_(config) {
    const std::string who(name());
    KVEVICT_REQUIRE(config.window >= 1,
                    who +
                        ": window must be at least 1 (the prompt's last `window` queries vote), "
                        "got " +
                        std::to_string(config.window));
    KVEVICT_REQUIRE(config.capacity > config.window,
                    who + ": capacity " + std::to_string(config.capacity) +
                        " must be larger than window " + std::to_string(config.window) +
                        " (the window is kept inside the capacity; the authors assert capacity - "
                        "window > 0)");
    KVEVICT_REQUIRE(config.kernel >= 1 && config.kernel % 2 == 1,
                    who + ": kernel must be odd, got " + std::to_string(config.kernel) +
                        " (with an even kernel the authors' pooling returns one score too many "
                        "and their gather fails)");
    KVEVICT_REQUIRE(config.beta >= 1,
                    who + ": beta must be >= 1, got " + std::to_string(config.beta));
    KVEVICT_REQUIRE(std::isfinite(config.floor) && config.floor >= 0.0 && config.floor <= 1.0,
                    who + ": floor must be in [0, 1], got " + std::to_string(config.floor));
    KVEVICT_REQUIRE(config.interval >= 0,
                    who + ": interval must be >= 0 (0: compress once, after the prompt), got " +
                        std::to_string(config.interval));
  }

  [[nodiscard]] const PromptCompressionConfig& config() const { return config_; }
  [[nodiscard]] std::string_view name() const override {
    switch (config_.allocation) {
      case Allocation::uniform:
        return "snapkv";
      case Allocation::pyramid:
        return "pyramidkv";
      case Allocation::adaptive:
        return "adakv";
    }
    return "?";
  }
  [[nodiscard]] SignalSet signals() const override { return {Signal::attention_rows}; }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] bool uneven_shares() const override {
    return config_.allocation != Allocation::uniform;
  }
  [[nodiscard]] Granularity default_granularity() const override { return Granularity::head; }
  /// Unbounded without an interval (decode tokens accumulate after the prompt is compressed); with
  /// one, the share + window + interval - 1 (see the header comment; adakv: unbounded).
  [[nodiscard]] std::optional<int> retained_limit() const override {
    if (config_.interval == 0) return std::nullopt;
    const std::int64_t b = config_.capacity - config_.window;
    const std::int64_t tail = std::int64_t{config_.interval} - 1;
    switch (config_.allocation) {
      case Allocation::uniform:
        return checked_int(config_.capacity + tail, "snapkv: retained limit");
      case Allocation::pyramid:
        return checked_int(2 * b - b / config_.beta + config_.window + tail,
                           "pyramidkv: retained limit");
      case Allocation::adaptive:
        return std::nullopt;
    }
    return std::nullopt;
  }

  void check_sequence(const UnitLayout& layout, int group_size) const override {
    if (config_.gqa == GqaLayout::repeat && group_size != 1) {
      throw Error(std::string(name()) + ": gqa = repeat keeps one set per query head, but the " +
                  "sequence caches " + std::to_string(layout.kv_heads()) + " KV heads for " +
                  std::to_string(layout.kv_heads() * group_size) + " query heads: build it " +
                  "with kv_heads = q_heads (the KV heads repeated, as the authors' repeat_kv; " +
                  "G times the K/V memory), or use gqa = mean (one set per KV head)");
    }
    const Granularity::Kind kind = layout.granularity().kind();
    if (config_.allocation == Allocation::pyramid) {
      KVEVICT_REQUIRE(kind == Granularity::Kind::head || kind == Granularity::Kind::layer,
                      "pyramidkv: its budgets are per layer, so it needs granularity head or "
                      "layer, not " +
                          to_string(layout.granularity()));
      KVEVICT_REQUIRE(layout.layers() >= 2,
                      "pyramidkv: needs at least 2 layers (the authors' step divides by layers - "
                      "1), got " +
                          std::to_string(layout.layers()));
    }
    if (config_.allocation == Allocation::adaptive) {
      KVEVICT_REQUIRE(kind == Granularity::Kind::head,
                      "adakv: the heads of a layer share its budget, so it needs granularity "
                      "head, not " +
                          to_string(layout.granularity()));
    }
  }

  void on_append(SlotTable& slots, const ChunkInfo& chunk) override {
    prompt_ = forwards_ == 0;
    ++forwards_;
    if (config_.interval > 0) start_recent_queries(slots, chunk.size());
    if (!prompt_) return;
    votes_.assign(static_cast<std::size_t>(slots.units()), {});
    for (int unit = 0; unit < slots.units(); ++unit) {
      const int prefix = slots.live(unit) - config_.window;
      if (prefix > 0)
        votes_[static_cast<std::size_t>(unit)].assign(static_cast<std::size_t>(prefix), 0.0);
    }
  }

  /// The recent queries' votes follow their tokens (the prompt's votes are by stream index).
  void move_slots(int unit, std::span<const SlotMove> moves) override {
    if (recent_.empty()) return;
    for (std::vector<double>& votes : recent_[static_cast<std::size_t>(unit)]) {
      for (const SlotMove& move : moves) {
        const auto from = static_cast<std::size_t>(move.from);
        const auto to = static_cast<std::size_t>(move.to);
        // A query older than the moved token holds no vote for it (to < from).
        if (to < votes.size()) votes[to] = from < votes.size() ? votes[from] : 0.0;
      }
    }
  }

  /// The prompt's rows: adds the votes of its last `window` queries. Later forwards are ignored
  /// unless an interval is set (then every forward's last `window` rows are kept for the next
  /// re-compression).
  void observe_attention(SlotTable& slots, int layer, const AttentionRows& rows) override {
    if (!prompt_ && config_.interval == 0) return;
    check_attention_rows(slots, layer, rows, name());
    const UnitLayout& layout = slots.layout();
    const int group = rows.group_size();
    if (config_.interval > 0) record_recent_queries(slots, layer, rows);
    if (!prompt_) return;
    const int queries = rows.queries();
    if (queries < config_.window) return;  // shorter than the window: never compressed
    // The mean over the query heads a unit covers (its KV heads' groups, over its layers).
    const double weight = 1.0 / (static_cast<double>(group) * layout.heads_per_unit());
    for (int g = 0; g < layout.kv_heads(); ++g) {
      const int unit = layout.unit_of(layer, g);
      std::vector<double>& votes = votes_[static_cast<std::size_t>(unit)];
      const std::span<const std::int32_t> order = slots.stream_order(unit);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int q = queries - config_.window; q < queries; ++q) {
          const std::span<const float> row = rows.row(h, q);
          for (std::size_t j = 0; j < votes.size(); ++j) {
            const float p = row[static_cast<std::size_t>(order[j])];
            if (!std::isfinite(p)) {
              throw Error(std::string(name()) + ": attention rows of layer " +
                          std::to_string(layer) + ", query head " + std::to_string(h) +
                          " contain NaN or an infinity");
            }
            votes[j] += weight * p;
          }
        }
      }
    }
  }

  void select(const EvictionContext& context, Decision& decision) override {
    if (context.trigger != Trigger::after_forward) return;
    if (!prompt_) {
      if (config_.interval > 0 && since_ >= config_.interval) {
        since_ = 0;
        recompress(context, decision);
      }
      return;
    }
    prompt_ = false;
    since_ = 0;
    SlotTable& slots = context.slots;
    const UnitLayout& layout = slots.layout();
    const int w = config_.window;
    const int b = config_.capacity - w;
    pooled_.assign(static_cast<std::size_t>(slots.units()), {});
    budgets_.assign(static_cast<std::size_t>(slots.units()), -1);  // -1: keep everything
    for (int unit = 0; unit < slots.units(); ++unit) {
      const int prompt = slots.live(unit);
      const int prefix = prompt - w;
      if (!compresses(prompt)) continue;
      pooled_[static_cast<std::size_t>(unit)] =
          pool_votes(votes_[static_cast<std::size_t>(unit)], config_.kernel, config_.pooling);
      switch (config_.allocation) {
        case Allocation::uniform:
          budgets_[static_cast<std::size_t>(unit)] = b;
          break;
        case Allocation::pyramid:
          budgets_[static_cast<std::size_t>(unit)] =
              prompt < 2 * b
                  ? b
                  : pyramid_budgets(layout.layers(), b, config_.beta,
                                    prefix)[static_cast<std::size_t>(layer_of(layout, unit))];
          break;
        case Allocation::adaptive:
          break;  // per layer, below
      }
    }
    if (config_.allocation == Allocation::adaptive) {
      for (int layer = 0; layer < layout.layers(); ++layer) {
        const int first = layout.unit_of(layer, 0);
        const int units = layout.kv_heads();
        if (pooled_[static_cast<std::size_t>(first)].empty()) continue;
        std::vector<std::span<const float>> scores;
        for (int u = first; u < first + units; ++u)
          scores.emplace_back(pooled_[static_cast<std::size_t>(u)]);
        const std::vector<int> caps = adaptive_budgets(scores, b, config_.floor);
        for (int u = 0; u < units; ++u)
          budgets_[static_cast<std::size_t>(first + u)] = caps[static_cast<std::size_t>(u)];
      }
    }
    keep_budgets(context, decision);
  }

 private:
  static constexpr int kScore = 0;  // the pooled votes, written when the prompt is compressed

  // Each unit with a budget keeps its window and its budgets_[unit] best pooled_ votes.
  void keep_budgets(const EvictionContext& context, Decision& decision) {
    SlotTable& slots = context.slots;
    const int w = config_.window;
    for (int unit = 0; unit < slots.units(); ++unit) {
      const int k = budgets_[static_cast<std::size_t>(unit)];
      if (k < 0) continue;
      const std::span<const std::int32_t> order = slots.stream_order(unit);
      const std::vector<float>& pooled = pooled_[static_cast<std::size_t>(unit)];
      const std::span<float> score = slots.scores(unit, kScore);
      for (std::size_t j = 0; j < pooled.size(); ++j)
        score[static_cast<std::size_t>(order[j])] = pooled[j];
      keep_.begin(slots, unit, context.protection);
      keep_.keep_newest(w);
      keep_.keep_top_k(score, k);
      (void)keep_.evict_rest(decision);
    }
  }

  // The ring of the stream's last `window` queries, per unit: entry (total + q) % window holds
  // query q of a forward as votes over slot ids (the mean over the query heads the unit covers,
  // weighted as the prompt's votes). Entries this forward will write are cleared first.
  void start_recent_queries(const SlotTable& slots, int queries) {
    if (!prompt_) since_ += queries;
    const auto w = static_cast<std::int64_t>(config_.window);
    if (recent_.empty()) {
      recent_.assign(static_cast<std::size_t>(slots.units()),
                     std::vector<std::vector<double>>(static_cast<std::size_t>(w)));
    }
    recent_first_ = recent_total_;
    recent_total_ += queries;
    for (std::vector<std::vector<double>>& ring : recent_) {
      for (int q = std::max(0, queries - config_.window); q < queries; ++q)
        ring[static_cast<std::size_t>((recent_first_ + q) % w)].clear();
    }
  }

  void record_recent_queries(const SlotTable& slots, int layer, const AttentionRows& rows) {
    const UnitLayout& layout = slots.layout();
    const int group = rows.group_size();
    const double weight = 1.0 / (static_cast<double>(group) * layout.heads_per_unit());
    const int queries = rows.queries();
    const auto w = static_cast<std::int64_t>(config_.window);
    for (int g = 0; g < layout.kv_heads(); ++g) {
      std::vector<std::vector<double>>& ring =
          recent_[static_cast<std::size_t>(layout.unit_of(layer, g))];
      for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int q = std::max(0, queries - config_.window); q < queries; ++q) {
          const std::span<const float> row = rows.row(h, q);
          std::vector<double>& votes = ring[static_cast<std::size_t>((recent_first_ + q) % w)];
          if (votes.size() < row.size()) votes.resize(row.size(), 0.0);
          for (std::size_t slot = 0; slot < row.size(); ++slot) votes[slot] += weight * row[slot];
        }
      }
    }
  }

  // kvpress's decoding re-compression (header comment): votes of the ring's queries, pooled, and
  // each unit back to its share.
  void recompress(const EvictionContext& context, Decision& decision) {
    SlotTable& slots = context.slots;
    const UnitLayout& layout = slots.layout();
    const int w = config_.window;
    const int b = config_.capacity - w;
    pooled_.assign(static_cast<std::size_t>(slots.units()), {});
    budgets_.assign(static_cast<std::size_t>(slots.units()), -1);
    std::vector<double> votes;
    for (int unit = 0; unit < slots.units(); ++unit) {
      const int prefix = slots.live(unit) - w;
      if (prefix <= 0) continue;
      const std::span<const std::int32_t> order = slots.stream_order(unit);
      votes.assign(static_cast<std::size_t>(prefix), 0.0);
      for (const std::vector<double>& query : recent_[static_cast<std::size_t>(unit)]) {
        for (int j = 0; j < prefix; ++j) {
          const auto slot = static_cast<std::size_t>(order[static_cast<std::size_t>(j)]);
          if (slot < query.size()) votes[static_cast<std::size_t>(j)] += query[slot];
        }
      }
      for (const double v : votes) {
        if (!std::isfinite(v)) {
          throw Error(std::string(name()) + ": attention rows of unit " + std::to_string(unit) +
                      " contain NaN or an infinity");
        }
      }
      pooled_[static_cast<std::size_t>(unit)] = pool_votes(votes, config_.kernel, config_.pooling);
    }
    std::vector<int> shares(static_cast<std::size_t>(slots.units()), b);
    if (config_.allocation == Allocation::pyramid) {
      if (schedule_.empty()) schedule_ = pyramid_budgets_within(layout.layers(), b, config_.beta);
      for (int unit = 0; unit < slots.units(); ++unit) {
        shares[static_cast<std::size_t>(unit)] =
            schedule_[static_cast<std::size_t>(layer_of(layout, unit))];
      }
    } else if (config_.allocation == Allocation::adaptive) {
      for (int layer = 0; layer < layout.layers(); ++layer) {
        const int first = layout.unit_of(layer, 0);
        std::vector<std::span<const float>> scores;
        for (int u = first; u < first + layout.kv_heads(); ++u)
          scores.emplace_back(pooled_[static_cast<std::size_t>(u)]);
        const std::vector<int> caps = safeguarded_adaptive_budgets(scores, b, config_.floor);
        for (int u = 0; u < layout.kv_heads(); ++u)
          shares[static_cast<std::size_t>(first + u)] = caps[static_cast<std::size_t>(u)];
      }
    }
    for (int unit = 0; unit < slots.units(); ++unit) {
      const int share = shares[static_cast<std::size_t>(unit)];
      if (static_cast<int>(pooled_[static_cast<std::size_t>(unit)].size()) > share)
        budgets_[static_cast<std::size_t>(unit)] = share;
    }
    keep_budgets(context, decision);
  }

  // Whether a prompt of `prompt` tokens is compressed at all (the authors' gates).
  [[nodiscard]] bool compresses(int prompt) const {
    const int b = config_.capacity - config_.window;
    switch (config_.allocation) {
      case Allocation::uniform:
        return prompt > config_.capacity;
      case Allocation::pyramid:
        return prompt >= config_.capacity;
      case Allocation::adaptive:
        return b <= prompt - config_.window;
    }
    return false;
  }

  [[nodiscard]] static int layer_of(const UnitLayout& layout, int unit) {
    return layout.granularity() == Granularity::layer ? unit : unit / layout.kv_heads();
  }

  PromptCompressionConfig config_;
  int forwards_ = 0;
  bool prompt_ = false;                     // the current forward is the prompt
  std::vector<std::vector<double>> votes_;  // [unit][prefix index, oldest first]
  std::vector<std::vector<float>> pooled_;  // [unit][prefix index]
  std::vector<int> budgets_;                // [unit] votes kept; -1: keep everything
  KeepSet keep_;
  // interval > 0 only:
  std::int64_t since_ = 0;                                // tokens since the last (re)compression
  std::vector<std::vector<std::vector<double>>> recent_;  // [unit][ring entry][slot]
  std::int64_t recent_total_ = 0;                         // queries seen
  std::int64_t recent_first_ = 0;                         // the current forward's first query
  std::vector<int> schedule_;                             // pyramid: per-layer shares at decode
};

/// How many KV heads per layer an engine lays out for `policy` on a model with `q_heads` query and
/// `kv_heads` KV heads: q_heads for a prompt-compression policy with gqa = repeat (every KV head
/// repeated for each of its query heads, the authors' layout), else kv_heads.
[[nodiscard]] inline int cached_kv_heads(const Policy& policy, int q_heads, int kv_heads) {
  const Policy* inner = &policy;
  while (const auto* decorator = dynamic_cast<const PolicyDecorator*>(inner)) {
    inner = &decorator->inner();
  }
  const auto* compression = dynamic_cast<const PromptCompressionPolicy*>(inner);
  return compression != nullptr && compression->config().gqa == GqaLayout::repeat ? q_heads
                                                                                  : kv_heads;
}

namespace detail {

inline constexpr std::string_view kPoolingChoices[] = {"avg", "max"};
inline constexpr std::string_view kGqaChoices[] = {"repeat", "mean"};

[[nodiscard]] inline PromptCompressionConfig prompt_compression_config(const PolicyParams& params,
                                                                       Allocation allocation) {
  PromptCompressionConfig config;
  config.capacity = params.get_int("capacity");
  config.window = params.get_int("window");
  config.kernel = params.get_int("kernel");
  config.pooling = params.get_word("pooling") == "max" ? Pooling::max : Pooling::avg;
  config.gqa = params.get_word("gqa") == "mean" ? GqaLayout::mean : GqaLayout::repeat;
  config.allocation = allocation;
  if (allocation == Allocation::pyramid) config.beta = params.get_int("beta");
  if (allocation == Allocation::adaptive) config.floor = params.get_real("floor");
  config.interval = params.get_int("interval");
  return config;
}

// --budget N: capacity N, window half of it up to the authors' 32.
[[nodiscard]] inline PolicyParams prompt_compression_budget(int budget) {
  return PolicyParams()
      .set("capacity", budget)
      .set("window", std::max(1, std::min(32, budget / 2)));
}

}  // namespace detail

inline constexpr ParamSpec kSnapKvParams[] = {
    {"capacity", ParamType::integer, "tokens kept per unit by the compression, window included",
     std::nullopt, 2, kMaxSlotsParam},
    {"window", ParamType::integer, "the prompt's last tokens that vote, always kept", 32, 1,
     kMaxSlotsParam},
    {"kernel", ParamType::integer, "pooling width along positions (odd)", 5, 1, 1023},
    {"pooling", ParamType::choice, "how the votes are pooled along positions", 0, 0, 1, false,
     detail::kPoolingChoices},
    {"gqa", ParamType::choice,
     "repeat: one set per query head (cache kv_heads = q_heads); mean: one per KV head", 0, 0, 1,
     false, detail::kGqaChoices},
    {"interval", ParamType::integer,
     "re-compress every `interval` tokens after the prompt (kvpress's DecodingPress); 0: once", 0,
     0, kMaxSlotsParam},
};
inline constexpr ParamSpec kPyramidKvParams[] = {
    {"capacity", ParamType::integer, "mean tokens kept per layer's units, window included",
     std::nullopt, 2, kMaxSlotsParam},
    {"window", ParamType::integer, "the prompt's last tokens that vote, always kept", 32, 1,
     kMaxSlotsParam},
    {"kernel", ParamType::integer, "pooling width along positions (odd)", 5, 1, 1023},
    {"pooling", ParamType::choice, "how the votes are pooled along positions", 0, 0, 1, false,
     detail::kPoolingChoices},
    {"gqa", ParamType::choice,
     "repeat: one set per query head (cache kv_heads = q_heads); mean: one per KV head", 0, 0, 1,
     false, detail::kGqaChoices},
    {"interval", ParamType::integer,
     "re-compress every `interval` tokens after the prompt (kvpress's DecodingPress); 0: once", 0,
     0, kMaxSlotsParam},
    {"beta", ParamType::integer, "the top layer's votes: (capacity - window) // beta", 20, 1,
     kMaxSlotsParam},
};
inline constexpr ParamSpec kAdaKvParams[] = {
    {"capacity", ParamType::integer, "mean tokens kept per unit, window included", std::nullopt, 2,
     kMaxSlotsParam},
    {"window", ParamType::integer, "the prompt's last tokens that vote, always kept", 32, 1,
     kMaxSlotsParam},
    {"kernel", ParamType::integer, "pooling width along positions (odd)", 5, 1, 1023},
    {"pooling", ParamType::choice, "how the votes are pooled along positions", 0, 0, 1, false,
     detail::kPoolingChoices},
    {"gqa", ParamType::choice,
     "repeat: one set per query head (cache kv_heads = q_heads); mean: one per KV head", 0, 0, 1,
     false, detail::kGqaChoices},
    {"interval", ParamType::integer,
     "re-compress every `interval` tokens after the prompt (kvpress's DecodingPress); 0: once", 0,
     0, kMaxSlotsParam},
    {"floor", ParamType::real, "share of each unit's mean votes guaranteed (floor_alpha)", 0.2, 0.0,
     1.0},
};

inline constexpr PolicySpec kSnapKvSpec{
    "snapkv",
    "SnapKV (Li et al. 2024): once, after the prompt: the window + the top pooled window votes",
    kSnapKvParams,
    [](int budget, int /*sinks*/) { return detail::prompt_compression_budget(budget); },
    [](const PolicyParams& params) -> std::unique_ptr<Policy> {
      return std::make_unique<PromptCompressionPolicy>(
          detail::prompt_compression_config(params, Allocation::uniform));
    },
};

inline constexpr PolicySpec kPyramidKvSpec{
    "pyramidkv",
    "PyramidKV (Cai et al. 2024): SnapKV's votes with per-layer budgets, lower layers more",
    kPyramidKvParams,
    [](int budget, int /*sinks*/) { return detail::prompt_compression_budget(budget); },
    [](const PolicyParams& params) -> std::unique_ptr<Policy> {
      return std::make_unique<PromptCompressionPolicy>(
          detail::prompt_compression_config(params, Allocation::pyramid));
    },
};

inline constexpr PolicySpec kAdaKvSpec{
    "adakv",
    "Ada-KV (Feng et al. 2024): SnapKV's votes, a layer's heads share its budget (top across them)",
    kAdaKvParams,
    [](int budget, int /*sinks*/) { return detail::prompt_compression_budget(budget); },
    [](const PolicyParams& params) -> std::unique_ptr<Policy> {
      return std::make_unique<PromptCompressionPolicy>(
          detail::prompt_compression_config(params, Allocation::adaptive));
    },
};

}  // namespace kvevict
