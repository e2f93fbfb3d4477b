// Streaming a text file through a StreamScorer, shared by `kvevict stream` and `kvevict compare`:
// the file read in blocks and cut into pieces (turns, SentencePiece space cuts), each piece
// tokenized, anchors inserted when asked, and the tokens fed in chunks of exactly the decoder's
// chunk size (a turn start flushes the partial chunk before it). Memory is constant in the text's
// length.
#pragma once

#include <cstdint>
#include <kvevict/model/model.hpp>
#include <string>

#include "cli_common/log_loss.hpp"

namespace kvevict::cli {

struct TextStreamOptions {
  std::string input;              ///< a file, or "-" for stdin
  std::string turn_separator;     ///< already unescaped; empty: one turn
  bool insert_anchors = false;    ///< <AC> after every sentence end and the text's end (AnLLM)
  std::uint64_t limit_bytes = 0;  ///< read at most this many bytes; 0 = all
  bool progress = false;          ///< draw a progress line on stderr (when it is a terminal)
};

struct TextStreamResult {
  std::uint64_t input_bytes = 0;
  std::int64_t turns = 0;    ///< pieces that started a turn (0 without a separator)
  std::int64_t anchors = 0;  ///< anchors inserted
  double seconds = 0;        ///< wall time of the stream
};

/// Streams `options.input` through `scorer` (tokenized with `tokenizer`, fed `chunk` tokens at a
/// time). Throws kvevict::Error for an empty input or one that holds a single token.
TextStreamResult stream_text(const TextStreamOptions& options, const model::Tokenizer& tokenizer,
                             StreamScorer& scorer, int chunk);

}  // namespace kvevict::cli
