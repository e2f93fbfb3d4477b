// Decoder: one sequence, as a DecoderBatch of one (the forward is in decoder_batch.cpp).
#include <algorithm>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/decoder_batch.hpp>
#include <string>
#include <utility>

#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/signals.hpp"

namespace kvevict::model {
namespace {

// The batch of one's settings: the decoder's threads, RoPE table and observer.
DecoderBatchOptions batch_options(const DecoderOptions& options) {
  DecoderBatchOptions batch;
  batch.threads = options.threads;
  batch.rope_table_positions = options.rope_table_positions;
  batch.observer = options.observer;
  return batch;
}

}  // namespace

Decoder::Decoder(const Model& model, std::unique_ptr<Policy> policy, DecoderOptions options)
    : model_(model),
      options_(options),
      batch_(new DecoderBatch(model, batch_options(options), options.decode_activations,
                              /*single=*/true)) {
  (void)batch_->open_member(std::move(policy), options);
}

Decoder::~Decoder() = default;

EvictingCache& Decoder::cache() { return batch_->cache(0); }
const EvictingCache& Decoder::cache() const { return batch_->cache(0); }
const DecoderStats& Decoder::stats() const { return batch_->stats(0); }

void Decoder::check_tokens(std::span<const std::int32_t> tokens, const char* what) const {
  const int vocab = model_.config.vocab_size;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    KVEVICT_REQUIRE(tokens[i] >= 0 && tokens[i] < vocab,
                    std::string("Decoder: ") + what + " token id " + std::to_string(tokens[i]) +
                        " at index " + std::to_string(i) + " is out of range [0, " +
                        std::to_string(vocab) + ")");
  }
}

void Decoder::set_catalyst(std::vector<std::int32_t> tokens) {
  batch_->set_catalyst(0, std::move(tokens));
}

ForwardResult Decoder::forward(std::span<const std::int32_t> tokens, ForwardRequest request) {
  const int n = static_cast<int>(tokens.size());
  KVEVICT_REQUIRE(n > 0, "Decoder::forward: empty chunk (a forward needs at least one token)");
  KVEVICT_REQUIRE(n <= options_.max_chunk,
                  "Decoder::forward: chunk of " + std::to_string(n) +
                      " tokens exceeds max_chunk = " + std::to_string(options_.max_chunk) +
                      " (use feed() to split it)");
  check_tokens(tokens, "forward:");
  const DecoderFeed feed{0, tokens, request};
  batch_->step(std::span<const DecoderFeed>(&feed, 1));
  return batch_->result(0);
}

ForwardResult Decoder::feed(std::span<const std::int32_t> tokens, ForwardRequest request,
                            int chunk_size) {
  KVEVICT_REQUIRE(!tokens.empty(), "Decoder::feed: no tokens to feed");
  if (chunk_size == 0) chunk_size = options_.max_chunk;
  KVEVICT_REQUIRE(chunk_size > 0 && chunk_size <= options_.max_chunk,
                  "Decoder::feed: chunk_size " + std::to_string(chunk_size) + " outside [1, " +
                      std::to_string(options_.max_chunk) + "]");
  check_tokens(tokens, "feed:");
  const std::size_t total = tokens.size();
  const auto vocab = static_cast<std::size_t>(model_.config.vocab_size);
  const bool wants_surprisal = cache().sequence().wants(Signal::surprisal);
  if (request.all_logits) {
    feed_logits_.resize(
        checked_allocation({static_cast<std::int64_t>(total), static_cast<std::int64_t>(vocab)},
                           "Decoder::feed: logits of every token", std::int64_t{1} << 31));
  }
  if (wants_surprisal) feed_surprisal_.resize(total);

  ForwardResult last;
  std::size_t offset = 0;
  while (offset < total) {
    std::size_t n = std::min(static_cast<std::size_t>(chunk_size), total - offset);
    // Never cross a pot boundary: the pot is distilled exactly when it is full.
    const std::optional<int> room = cache().sequence().pot_room();
    if (room && *room > 0) n = std::min(n, static_cast<std::size_t>(*room));
    last = forward(tokens.subspan(offset, n),
                   ForwardRequest{request.turn_start && offset == 0, request.all_logits});
    if (request.all_logits) {
      std::copy(last.logits.begin(), last.logits.end(), feed_logits_.begin() + offset * vocab);
    }
    if (wants_surprisal) {
      std::copy(last.surprisal.begin(), last.surprisal.end(), feed_surprisal_.begin() + offset);
    }
    offset += n;
  }
  if (request.all_logits) {
    last.logits = feed_logits_;
    last.rows = static_cast<int>(total);
  }
  if (wants_surprisal) last.surprisal = feed_surprisal_;
  return last;
}

}  // namespace kvevict::model
