#include "harness/log_loss.hpp"

#include <algorithm>
#include <cmath>
#include <kvevict/error.hpp>
#include <limits>
#include <numbers>
#include <string>
#include <utility>

namespace kvevict::harness {

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

StreamScorer::StreamScorer(model::Decoder& decoder, std::int64_t window,
                           std::vector<std::uint32_t> token_bytes, std::int32_t unscored)
    : StreamScorer(
          [&decoder](std::span<const std::int32_t> tokens, bool turn_start) {
            return decoder
                .feed(tokens, model::ForwardRequest{.turn_start = turn_start, .all_logits = true})
                .logits;
          },
          decoder.model().config.vocab_size, window, std::move(token_bytes), unscored) {}

StreamScorer::StreamScorer(Forward forward, int vocab, std::int64_t window,
                           std::vector<std::uint32_t> token_bytes, std::int32_t unscored)
    : forward_(std::move(forward)),
      vocab_(static_cast<std::size_t>(vocab)),
      token_bytes_(std::move(token_bytes)),
      unscored_(unscored),
      loss_(window),
      previous_logits_(vocab_) {
  KVEVICT_REQUIRE(token_bytes_.size() == vocab_, "StreamScorer: one byte count per token needed");
}

void StreamScorer::feed(std::span<const std::int32_t> tokens, bool turn_start) {
  if (tokens.empty()) return;
  const std::span<const float> logits = forward_(tokens, turn_start);
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    const std::int64_t position = next_position_ + static_cast<std::int64_t>(k);
    const std::int32_t token = tokens[k];
    bytes_fed_ += token_bytes_[static_cast<std::size_t>(token)];
    if (position == 0 || token == unscored_) continue;
    const std::span<const float> predicted = k == 0 ? std::span<const float>(previous_logits_)
                                                    : logits.subspan((k - 1) * vocab_, vocab_);
    loss_.add(position, surprisal_bits(predicted, token),
              token_bytes_[static_cast<std::size_t>(token)]);
  }
  const std::span<const float> last = logits.subspan((tokens.size() - 1) * vocab_, vocab_);
  std::copy(last.begin(), last.end(), previous_logits_.begin());
  next_position_ += static_cast<std::int64_t>(tokens.size());
}

std::vector<std::uint32_t> token_byte_counts(const model::Tokenizer& tokenizer, int vocab_size) {
  std::vector<std::uint32_t> bytes(static_cast<std::size_t>(vocab_size));
  for (std::size_t id = 0; id < bytes.size(); ++id) {
    bytes[id] = static_cast<std::uint32_t>(tokenizer.decode(static_cast<std::int32_t>(id)).size());
  }
  return bytes;
}

}  // namespace kvevict::harness
