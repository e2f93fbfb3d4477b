#include "harness/text_stream.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <kvevict/error.hpp>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "harness/anchor_inserter.hpp"
#include "harness/report.hpp"
#include "harness/text_pieces.hpp"

namespace kvevict::harness {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point begin, Clock::time_point end) {
  return std::chrono::duration<double>(end - begin).count();
}

// Progress on stderr, only when asked and stderr is a terminal: every 1% of the input or every 2
// seconds.
class Progress {
 public:
  Progress(bool wanted, std::uint64_t expected_bytes, Clock::time_point start)
      : enabled_(wanted && stderr_is_terminal()), expected_bytes_(expected_bytes), start_(start) {}

  void update(const StreamScorer& scorer) {
    if (!enabled_) return;
    const Clock::time_point now = Clock::now();
    const std::uint64_t bytes = scorer.bytes_fed();
    const std::uint64_t step = std::max<std::uint64_t>(expected_bytes_ / 100, 1);
    if (bytes < last_bytes_ + step && seconds_between(last_draw_, now) < 2.0) return;
    last_bytes_ = bytes;
    last_draw_ = now;
    const double elapsed = seconds_between(start_, now);
    const std::string share =
        expected_bytes_ > 0 ? fmt::format("{:3.0f}% ", 100.0 * static_cast<double>(bytes) /
                                                           static_cast<double>(expected_bytes_))
                            : std::string();
    const std::int64_t tokens = scorer.tokens_fed();
    std::cerr << fmt::format("\r{}{} streamed, {} tokens, {:.4f} bits/byte, {:.0f} tokens/s   ",
                             share, format_bytes(bytes), tokens,
                             scorer.loss().overall().bits_per_byte(),
                             elapsed > 0 ? static_cast<double>(tokens) / elapsed : 0.0)
              << std::flush;
    drawn_ = true;
  }
  void finish() {
    if (drawn_) std::cerr << "\r\033[K" << std::flush;  // erase the progress line
  }

 private:
  bool enabled_;
  std::uint64_t expected_bytes_;
  Clock::time_point start_;
  Clock::time_point last_draw_{};
  std::uint64_t last_bytes_ = 0;
  bool drawn_ = false;
};

// Feeds tokens through the scorer in chunks of exactly `chunk` tokens (a turn start flushes the
// partial chunk before it), reporting progress after each.
class ChunkedStream {
 public:
  ChunkedStream(StreamScorer& scorer, int chunk, Progress& progress)
      : scorer_(scorer), chunk_(chunk), progress_(progress) {
    pending_.reserve(static_cast<std::size_t>(chunk_));
  }

  void add(std::span<const std::int32_t> tokens, bool turn_start) {
    if (turn_start) {
      flush();
      pending_turn_start_ = true;
    }
    for (const std::int32_t token : tokens) {
      pending_.push_back(token);
      if (static_cast<int>(pending_.size()) == chunk_) flush();
    }
  }

  void flush() {
    if (pending_.empty()) return;
    scorer_.feed(pending_, pending_turn_start_);
    pending_.clear();
    pending_turn_start_ = false;
    progress_.update(scorer_);
  }

 private:
  StreamScorer& scorer_;
  int chunk_;
  Progress& progress_;
  std::vector<std::int32_t> pending_;
  bool pending_turn_start_ = false;
};

}  // namespace

TextStreamResult stream_text(const TextStreamOptions& options, const model::Tokenizer& tokenizer,
                             StreamScorer& scorer, int chunk) {
  const bool sentencepiece = tokenizer.kind == model::Tokenizer::Kind::sentencepiece;
  const PieceEncoder encoder{
      .encode = [&tokenizer](std::string_view text,
                             bool add_bos) { return tokenizer.encode(text, add_bos); },
      .cut_before_space = sentencepiece,
      .drop_cut_space = sentencepiece};
  std::optional<AnchorInserter> anchors;
  if (options.insert_anchors) anchors = AnchorInserter::for_tokenizer(tokenizer);
  return stream_text(options, encoder, std::move(anchors), scorer, chunk);
}

TextStreamResult stream_text(const TextStreamOptions& options, const PieceEncoder& encoder,
                             std::optional<AnchorInserter> anchors, StreamScorer& scorer,
                             int chunk) {
  KVEVICT_REQUIRE(!options.insert_anchors || anchors.has_value(),
                  "stream_text: anchors were asked for without an AnchorInserter");
  if (!options.insert_anchors) anchors.reset();
  TextPieces pieces(options.input, TextPiecesOptions{.turn_separator = options.turn_separator,
                                                     .cut_before_space = encoder.cut_before_space,
                                                     .limit_bytes = options.limit_bytes});

  const Clock::time_point start = Clock::now();
  Progress progress(options.progress, pieces.expected_bytes(), start);
  ChunkedStream stream(scorer, chunk, progress);
  TextStreamResult result;
  TextPiece piece;
  std::vector<std::int32_t> anchored;
  bool first = true;
  while (pieces.next(piece)) {
    // A piece cut before a space: SentencePiece encodes it without the space (its dummy prefix
    // stands for it), byte-level BPE with it.
    const std::string_view text = piece.space_cut && encoder.drop_cut_space
                                      ? std::string_view(piece.text).substr(1)
                                      : std::string_view(piece.text);
    const std::vector<std::int32_t> tokens = encoder.encode(text, /*add_bos=*/first);
    first = false;
    if (piece.turn_start) ++result.turns;
    if (anchors) {
      anchored.clear();
      anchors->push(tokens, anchored);
      stream.add(anchored, piece.turn_start);
    } else {
      stream.add(tokens, piece.turn_start);
    }
  }
  if (anchors) {  // the end of the text is a sentence end
    anchored.clear();
    anchors->finish(anchored);
    stream.add(anchored, /*turn_start=*/false);
  }
  stream.flush();
  progress.finish();
  result.seconds = seconds_between(start, Clock::now());
  result.input_bytes = pieces.bytes_read();
  result.anchors = anchors ? anchors->inserted() : 0;

  if (result.input_bytes == 0) throw Error(fmt::format("input '{}' is empty", options.input));
  if (scorer.loss().overall().tokens == 0) {
    throw Error(fmt::format("input '{}' holds a single token: nothing to score", options.input));
  }
  return result;
}

std::string unescape(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\' || i + 1 == text.size()) {
      out += text[i];
      continue;
    }
    const char next = text[++i];
    switch (next) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case '\\':
        out += '\\';
        break;
      default:
        out += '\\';
        out += next;
    }
  }
  return out;
}

TextStreamOptions text_stream_options(const StreamInputOptions& input) {
  if (input.limit_bytes < 0) {
    throw Error(fmt::format("--limit-bytes must be >= 0 (0 = all), got {}", input.limit_bytes));
  }
  return TextStreamOptions{.input = input.input,
                           .turn_separator = unescape(input.turn_separator),
                           .limit_bytes = static_cast<std::uint64_t>(input.limit_bytes)};
}

namespace {

// A JSON number, or null for NaN (no bytes or tokens to divide by).
nlohmann::ordered_json number_or_null(double value) {
  return std::isfinite(value) ? nlohmann::ordered_json(value) : nlohmann::ordered_json(nullptr);
}

// Adds the totals' fields to `json`.
void add_totals(nlohmann::ordered_json& json, const LossTotals& totals) {
  json["tokens"] = totals.tokens;
  json["bytes"] = totals.bytes;
  json["bits"] = totals.bits;
  json["bits_per_byte"] = number_or_null(totals.bits_per_byte());
  json["perplexity"] = number_or_null(totals.perplexity());
}

void print_text_report(const StreamReportHeader& header, const WindowedLoss& loss,
                       const TextStreamResult& streamed, const CacheReport& report) {
  const LossTotals& overall = loss.overall();
  std::string out;
  out += fmt::format("input          {} ({} bytes)\n", header.input, streamed.input_bytes);
  out += fmt::format("policy         {}\n", header.policy_description);
  if (!header.granularity.empty()) {
    out += fmt::format("granularity    {}\n", header.granularity);
  }
  if (header.turns) out += fmt::format("turns          {}\n", streamed.turns);
  if (header.insert_anchors) {
    out += fmt::format("anchors        {} inserted (fed, not scored)\n", streamed.anchors);
  }
  out += fmt::format("tokens scored  {} ({} bytes)\n", overall.tokens, overall.bytes);
  out += fmt::format("bits per byte  {:.4f}\n", overall.bits_per_byte());
  out += fmt::format("perplexity     {:.4f} per token\n", overall.perplexity());
  out += fmt::format("windows of {} positions:\n", loss.window());
  out += fmt::format("  {:>23}  {:>10}  {:>10}  {:>10}\n", "positions", "tokens", "bits/byte",
                     "perplexity");
  for (const LossWindow& window : loss.windows()) {
    const std::string positions =
        fmt::format("{}-{}", window.first_position, window.first_position + loss.window() - 1);
    out += fmt::format("  {:>23}  {:>10}  {:>10.4f}  {:>10.4f}\n", positions, window.totals.tokens,
                       window.totals.bits_per_byte(), window.totals.perplexity());
  }
  out += format_cache_report(report) + '\n';
  std::cout << out << std::flush;
}

}  // namespace

void print_stream_report(bool json_output, const StreamReportHeader& header,
                         const WindowedLoss& loss, const TextStreamResult& streamed,
                         const CacheReport& report) {
  if (!json_output) {
    print_text_report(header, loss, streamed, report);
    return;
  }
  nlohmann::ordered_json json;
  json["model"] = header.model;
  json["input"] = header.input;
  json["input_bytes"] = streamed.input_bytes;
  json["policy"] = header.policy;
  if (header.turns) json["turns"] = streamed.turns;
  if (header.insert_anchors) json["anchors"] = streamed.anchors;
  add_totals(json, loss.overall());
  json["window"] = loss.window();
  json["windows"] = nlohmann::ordered_json::array();
  for (const LossWindow& window : loss.windows()) {
    nlohmann::ordered_json entry;
    entry["first_position"] = window.first_position;
    add_totals(entry, window.totals);
    json["windows"].push_back(std::move(entry));
  }
  json["cache"] = to_json(report);
  std::cout << dump_json(json) << '\n' << std::flush;
  if (!std::cout) throw Error("error while writing to stdout");
}

}  // namespace kvevict::harness
