#include "harness/sampling.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <kvevict/error.hpp>

namespace kvevict::harness {

void validate_sampling(const SamplingOptions& options) {
  if (!std::isfinite(options.temperature) || options.temperature < 0.0) {
    throw Error(
        fmt::format("--temperature must be >= 0 (0 = greedy), got {}", options.temperature));
  }
  if (options.top_k < 0) {
    throw Error(fmt::format("--top-k must be >= 0 (0 = no cut), got {}", options.top_k));
  }
  if (!(options.top_p > 0.0 && options.top_p <= 1.0)) {
    throw Error(fmt::format("--top-p must be in (0, 1], got {}", options.top_p));
  }
}

double uniform_unit(std::mt19937_64& engine) {
  // 53 random bits scaled by 2^-53: every value is exact and below 1.
  return static_cast<double>(engine() >> 11) * 0x1.0p-53;
}

std::int32_t argmax(std::span<const float> logits) {
  KVEVICT_REQUIRE(!logits.empty(), "argmax: no logits");
  std::size_t best = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    KVEVICT_REQUIRE(!std::isnan(logits[i]), "the model produced a NaN logit");
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<std::int32_t>(best);
}

Sampler::Sampler(const SamplingOptions& options) : options_(options), engine_(options.seed) {
  validate_sampling(options_);
}

std::int32_t Sampler::sample(std::span<const float> logits) {
  const std::int32_t best = argmax(logits);  // also rejects NaN
  if (options_.temperature == 0.0) return best;

  const double max = logits[static_cast<std::size_t>(best)];
  candidates_.clear();
  double total = 0.0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const double weight = std::exp((static_cast<double>(logits[i]) - max) / options_.temperature);
    candidates_.push_back(Candidate{weight, static_cast<std::int32_t>(i)});
    total += weight;
  }
  std::size_t kept = candidates_.size();
  if (options_.top_k > 0 || options_.top_p < 1.0) {
    std::sort(candidates_.begin(), candidates_.end(), [](const Candidate& a, const Candidate& b) {
      return a.weight > b.weight || (a.weight == b.weight && a.id < b.id);
    });
    if (options_.top_k > 0) {
      kept = std::min(kept, static_cast<std::size_t>(options_.top_k));
      total = 0.0;
      for (std::size_t i = 0; i < kept; ++i) total += candidates_[i].weight;
    }
    if (options_.top_p < 1.0) {
      const double mass = options_.top_p * total;
      const std::size_t limit = kept;
      double cumulative = 0.0;
      kept = 0;
      while (kept < limit) {
        cumulative += candidates_[kept++].weight;
        if (cumulative >= mass) break;
      }
      total = cumulative;
    }
  }
  const double target = uniform_unit(engine_) * total;
  double cumulative = 0.0;
  for (std::size_t i = 0; i < kept; ++i) {
    cumulative += candidates_[i].weight;
    if (target < cumulative) return candidates_[i].id;
  }
  return candidates_[kept - 1].id;  // only reached through rounding in the last addition
}

}  // namespace kvevict::harness
