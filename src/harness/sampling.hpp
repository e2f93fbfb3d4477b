// Token sampling for `kvevict generate`: greedy, or temperature with top-k and nucleus (top-p)
// cuts, reproducible from a seed on every platform.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace kvevict::harness {

struct SamplingOptions {
  double temperature = 0.0;  ///< 0 = greedy (argmax)
  double top_p = 1.0;        ///< nucleus: sample among the smallest set holding this mass
  std::uint64_t seed = 1;
  int top_k = 0;  ///< sample among the k most likely tokens; 0 = no cut
};

/// Throws kvevict::Error for temperature < 0 (or not finite), top_k < 0 and top_p outside (0, 1].
void validate_sampling(const SamplingOptions& options);

/// A uniform double in [0, 1) from the top 53 bits of one draw. std::uniform_real_distribution's
/// algorithm is implementation-defined; this one gives the same numbers with every library.
[[nodiscard]] double uniform_unit(std::mt19937_64& engine);

/// Index of the largest logit; ties go to the lowest id. Throws on NaN.
[[nodiscard]] std::int32_t argmax(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options);

  /// The next token from `logits` ([vocab]). Greedy when temperature is 0. Otherwise
  /// p_i ~ exp((l_i - max) / T); with a cut the candidates are ranked by probability (ties: lower
  /// id first), top_k keeps the first k, and top_p < 1 then keeps them up to the first whose
  /// cumulative share of the kept mass reaches top_p; one uniform draw picks among the kept
  /// candidates in proportion to p_i.
  [[nodiscard]] std::int32_t sample(std::span<const float> logits);

 private:
  struct Candidate {
    double weight;
    std::int32_t id;
  };
  SamplingOptions options_;
  std::mt19937_64 engine_;
  std::vector<Candidate> candidates_;  // reused across calls
};

}  // namespace kvevict::harness
