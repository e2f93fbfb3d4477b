// Log-loss bookkeeping for `kvevict stream`: bits per token summed overall and per window of
// positions, turned into bits per byte and perplexity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace kvevict::cli {

/// -log2 softmax(logits)[token], the log-sum-exp accumulated in double.
[[nodiscard]] double surprisal_bits(std::span<const float> logits, std::int32_t token);

struct LossTotals {
  std::int64_t tokens = 0;  ///< tokens scored
  double bits = 0;          ///< sum of -log2 p over them
  std::uint64_t bytes = 0;  ///< bytes of their text

  /// bits / bytes; NaN without bytes.
  [[nodiscard]] double bits_per_byte() const;
  /// 2^(bits / tokens) = exp(mean negative log-likelihood); NaN without tokens.
  [[nodiscard]] double perplexity() const;
};

struct LossWindow {
  std::int64_t first_position = 0;  ///< stream positions [first_position, first_position + W)
  LossTotals totals;
};

/// Totals overall and per window of `window` stream positions (window k: [kW, (k+1)W)). Memory
/// grows by one small entry per window, never per token.
class WindowedLoss {
 public:
  explicit WindowedLoss(std::int64_t window);

  /// The token at stream `position` (positions must not decrease) cost `bits` and holds `bytes`.
  void add(std::int64_t position, double bits, std::size_t bytes);

  [[nodiscard]] std::int64_t window() const { return window_; }
  [[nodiscard]] const LossTotals& overall() const { return overall_; }
  [[nodiscard]] const std::vector<LossWindow>& windows() const { return windows_; }

 private:
  std::int64_t window_;
  LossTotals overall_;
  std::vector<LossWindow> windows_;
};

}  // namespace kvevict::cli
