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
// the cache grows again while decoding, as in the authors' code, so retained_limit() is unbounded
// and an engine that needs a bound wraps the policy in a SlotCap or re-compresses (not built yet;
// kvpress's DecodingPress re-compresses every `interval` tokens: issue 29).
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
  [[nodiscard]] Granularity default_granularity() const override { return Granularity::head; }
  /// Unbounded: decode tokens accumulate after the prompt is compressed.
  [[nodiscard]] std::optional<int> retained_limit() const override { return std::nullopt; }

  void on_append(SlotTable& slots, const ChunkInfo& /*chunk*/) override {
    if (forwards_ == 0) check_layout(slots.layout());
    prompt_ = forwards_ == 0;
    ++forwards_;
    if (!prompt_) return;
    votes_.assign(static_cast<std::size_t>(slots.units()), {});
    for (int unit = 0; unit < slots.units(); ++unit) {
      const int prefix = slots.live(unit) - config_.window;
      if (prefix > 0)
        votes_[static_cast<std::size_t>(unit)].assign(static_cast<std::size_t>(prefix), 0.0);
    }
  }

  /// The prompt's rows: adds the votes of its last `window` queries. Later forwards are ignored.
  void observe_attention(SlotTable& slots, int layer, const AttentionRows& rows) override {
    if (!prompt_) return;
    check_attention_rows(slots, layer, rows, name());
    const UnitLayout& layout = slots.layout();
    const int group = rows.group_size();
    if (config_.gqa == GqaLayout::repeat && group != 1) {
      throw Error(std::string(name()) + ": gqa = repeat keeps one set per query head, but the " +
                  "sequence caches " + std::to_string(rows.kv_heads()) + " KV heads for " +
                  std::to_string(rows.q_heads()) + " query heads: build it with kv_heads = " +
                  "q_heads (the KV heads repeated, as the authors' repeat_kv; G times the K/V " +
                  "memory), or use gqa = mean (one set per KV head)");
    }
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
    if (!prompt_ || context.trigger != Trigger::after_forward) return;
    prompt_ = false;
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

 private:
  static constexpr int kScore = 0;  // the pooled votes, written when the prompt is compressed

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

  void check_layout(const UnitLayout& layout) const {
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

  PromptCompressionConfig config_;
  int forwards_ = 0;
  bool prompt_ = false;                     // the current forward is the prompt
  std::vector<std::vector<double>> votes_;  // [unit][prefix index, oldest first]
  std::vector<std::vector<float>> pooled_;  // [unit][prefix index]
  std::vector<int> budgets_;                // [unit] votes kept; -1: keep everything
  KeepSet keep_;
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
