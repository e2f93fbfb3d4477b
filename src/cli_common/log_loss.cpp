#include "cli_common/log_loss.hpp"

#include <algorithm>
#include <cmath>
#include <kvevict/error.hpp>
#include <limits>
#include <numbers>
#include <string>

namespace kvevict::cli {

double surprisal_bits(std::span<const float> logits, std::int32_t token) {
  KVEVICT_REQUIRE(token >= 0 && static_cast<std::size_t>(token) < logits.size(),
                  "surprisal_bits: token " + std::to_string(token) + " outside the vocabulary");
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (const float logit : logits) sum += std::exp(static_cast<double>(logit) - max);
  const double nats = std::log(sum) + max - static_cast<double>(logits[token]);
  KVEVICT_REQUIRE(!std::isnan(nats), "the model produced NaN logits");
  return nats / std::numbers::ln2;
}

double LossTotals::bits_per_byte() const {
  return bytes > 0 ? bits / static_cast<double>(bytes) : std::numeric_limits<double>::quiet_NaN();
}

double LossTotals::perplexity() const {
  return tokens > 0 ? std::exp2(bits / static_cast<double>(tokens))
                    : std::numeric_limits<double>::quiet_NaN();
}

WindowedLoss::WindowedLoss(std::int64_t window) : window_(window) {
  KVEVICT_REQUIRE(window > 0, "WindowedLoss: window must be positive");
}

void WindowedLoss::add(std::int64_t position, double bits, std::size_t bytes) {
  KVEVICT_REQUIRE(position >= 0, "WindowedLoss: negative position");
  const std::int64_t index = position / window_;
  KVEVICT_REQUIRE(windows_.empty() || index >= static_cast<std::int64_t>(windows_.size()) - 1,
                  "WindowedLoss: positions must not decrease");
  while (static_cast<std::int64_t>(windows_.size()) <= index) {
    windows_.push_back(LossWindow{static_cast<std::int64_t>(windows_.size()) * window_, {}});
  }
  for (LossTotals* totals : {&overall_, &windows_.back().totals}) {
    totals->tokens += 1;
    totals->bits += bits;
    totals->bytes += bytes;
  }
}

}  // namespace kvevict::cli
