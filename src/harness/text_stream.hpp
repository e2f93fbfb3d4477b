// Streaming a text file through a StreamScorer, shared by `kvevict stream` and `kvevict compare`:
// the file read in blocks and cut into pieces (turns, SentencePiece space cuts), each piece
// tokenized, anchors inserted when asked, and the tokens fed in chunks of exactly the decoder's
// chunk size (a turn start flushes the partial chunk before it). Memory is constant in the text's
// length.
#pragma once

#include <cstdint>
#include <functional>
#include <kvevict/model/model.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "harness/anchor_inserter.hpp"
#include "harness/log_loss.hpp"
#include "harness/report.hpp"

namespace kvevict::harness {

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

/// The input options of `kvevict stream`, `kvevict compare` and `kvevict-llama stream`, as given
/// (src/cli/options.hpp registers them once for the three).
struct StreamInputOptions {
  std::string input;             ///< -i/--input: a file, or "-" for stdin
  std::string turn_separator;    ///< --turn-separator, escaped as given (see unescape)
  std::int64_t limit_bytes = 0;  ///< --limit-bytes: 0 = all
};

/// What `input` asks of stream_text: the separator unescaped, the limit checked (an error naming
/// --limit-bytes when negative). Anchors and progress are left to the command.
[[nodiscard]] TextStreamOptions text_stream_options(const StreamInputOptions& input);

/// Streams `options.input` through `scorer` (tokenized with `tokenizer`, fed `chunk` tokens at a
/// time). Throws kvevict::Error for an empty input or one that holds a single token.
TextStreamResult stream_text(const TextStreamOptions& options, const model::Tokenizer& tokenizer,
                             StreamScorer& scorer, int chunk);

/// How a vocabulary kvevict does not hold (an engine's tokenizer) encodes the text's pieces.
struct PieceEncoder {
  /// Tokens of `text`, BOS first when `add_bos` (only the first piece asks).
  std::function<std::vector<std::int32_t>(std::string_view text, bool add_bos)> encode;
  /// Cut the text only before a space (TextPiecesOptions::cut_before_space).
  bool cut_before_space = false;
  /// Encode a piece cut before a space without that space (SentencePiece, whose dummy prefix
  /// stands for it); else with it (byte-level BPE, whose tokens carry their leading space).
  bool drop_cut_space = false;
};

/// stream_text with the engine's encoder; `anchors` (options.insert_anchors) must be given when
/// anchors are asked for.
TextStreamResult stream_text(const TextStreamOptions& options, const PieceEncoder& encoder,
                             std::optional<AnchorInserter> anchors, StreamScorer& scorer,
                             int chunk);

/// "\n", "\t", "\r" and "\\" in a separator given on the command line.
[[nodiscard]] std::string unescape(std::string_view text);

/// What `stream`'s report says about the run besides the loss and the cache.
struct StreamReportHeader {
  std::string model;
  std::string input;
  bool turns = false;  ///< a turn separator was given: report the turns
  bool insert_anchors = false;
  std::string policy_description;  ///< the text report's policy line
  std::string granularity;         ///< the text report's granularity line (describe_granularity)
  nlohmann::ordered_json policy;   ///< the JSON report's "policy"
};

/// The report of `kvevict stream` and `kvevict-llama stream` on stdout: text, or one JSON object.
void print_stream_report(bool json, const StreamReportHeader& header, const WindowedLoss& loss,
                         const TextStreamResult& streamed, const CacheReport& report);

}  // namespace kvevict::harness
