// Stream scoring, shared by `kvevict stream` and the eval harness's stream_bpb task: tokens fed
// through a decoder and scored by the model's prediction of each, bits per token summed overall and
// per window of positions, turned into bits per byte and perplexity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <kvevict/model/decoder.hpp>
#include <span>
#include <vector>

namespace kvevict::harness {

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

/// Feeds a stream through `decoder` and scores it. Token t is predicted by the logits of position
/// t - 1: within a forward those are row k - 1 of its logits; the first token of a forward uses
/// the last row of the previous forward (the context as it stood then, before that forward's
/// eviction). The stream's first token (BOS where there is one) has no prediction and is not
/// scored, nor is any `unscored` token (an inserted anchor: fed and given a position, not scored).
class StreamScorer {
 public:
  /// Feeds any number of tokens (the first starting a turn or not) to a model and returns the
  /// logits of every one, [tokens, vocab] row-major: the engine a StreamScorer scores.
  using Forward =
      std::function<std::span<const float>(std::span<const std::int32_t> tokens, bool turn_start)>;

  /// `token_bytes[id]`: the bytes of token id's text. `unscored` = -1 for none.
  StreamScorer(model::Decoder& decoder, std::int64_t window, std::vector<std::uint32_t> token_bytes,
               std::int32_t unscored);
  /// The same over another engine (kvevict-llama's llama.cpp) with `vocab` tokens.
  StreamScorer(Forward forward, int vocab, std::int64_t window,
               std::vector<std::uint32_t> token_bytes, std::int32_t unscored);

  /// Feeds `tokens` (any number: Decoder::feed splits them) and scores them.
  void feed(std::span<const std::int32_t> tokens, bool turn_start);

  [[nodiscard]] const WindowedLoss& loss() const { return loss_; }
  /// Tokens fed, scored or not.
  [[nodiscard]] std::int64_t tokens_fed() const { return next_position_; }
  /// Text bytes of the tokens fed.
  [[nodiscard]] std::uint64_t bytes_fed() const { return bytes_fed_; }

 private:
  Forward forward_;
  std::size_t vocab_;
  std::vector<std::uint32_t> token_bytes_;
  std::int32_t unscored_;
  WindowedLoss loss_;
  std::vector<float> previous_logits_;
  std::int64_t next_position_ = 0;
  std::uint64_t bytes_fed_ = 0;
};

/// The bytes of every token's text under `tokenizer` (for StreamScorer).
[[nodiscard]] std::vector<std::uint32_t> token_byte_counts(const model::Tokenizer& tokenizer,
                                                           int vocab_size);

}  // namespace kvevict::harness
