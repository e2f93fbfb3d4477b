// AnLLM anchors for `kvevict stream` / `kvevict generate --insert-anchors`: a byte-level token
// stream gets the anchor token <AC> after every sentence end, exactly where tools/toy_data.py puts
// it when it builds the toy models' training data:
//
//   SENTENCE_END = re.compile(rb"[.?!][\"')\]]*(?=\s|$)")
//
// split_units() ends a unit after each match (after any closing quotes / brackets, before the
// whitespace that follows) and at the document's end when it does not end in one; <AC> follows
// every unit. The automaton here is that regex over bytes, fed incrementally: a terminator . ? !
// followed by closers " ' ) ] is pending until the next byte decides it (whitespace: a sentence
// end; anything else: none), so a sentence end split across two blocks is found as in one block.
// \s is Python's bytes whitespace: space, \t, \n, \v, \f, \r. finish() is the document's end ($).
//
// Byte-level tokenizers only (token id = byte for 0..255). The anchor token itself passes through
// and closes the pending unit (a model that emits <AC> on its own gets no second one); other
// special tokens (BOS, EOS) pass through and leave the state as it is.
#pragma once

#include <cstdint>
#include <kvevict/model/model.hpp>
#include <span>
#include <vector>

namespace kvevict::harness {

class AnchorInserter {
 public:
  explicit AnchorInserter(std::int32_t anchor_id);

  /// The inserter for `tokenizer`; throws kvevict::Error (naming --insert-anchors) for a
  /// SentencePiece tokenizer or one without an anchor token.
  [[nodiscard]] static AnchorInserter for_tokenizer(const model::Tokenizer& tokenizer);

  /// Appends `token` to `out`, preceded by the anchor when it is whitespace closing a sentence.
  void push(std::int32_t token, std::vector<std::int32_t>& out);
  /// push() of every token, in order.
  void push(std::span<const std::int32_t> tokens, std::vector<std::int32_t>& out);
  /// The end of the document: appends the anchor when a sentence end is pending or any byte came
  /// since the last anchor (the document's end is a sentence end). The inserter starts afresh.
  void finish(std::vector<std::int32_t>& out);

  [[nodiscard]] std::int32_t anchor_id() const { return anchor_id_; }
  /// Anchors appended so far (not counting those that came in the input).
  [[nodiscard]] std::int64_t inserted() const { return inserted_; }
  /// A terminator (and closers) waits for the next byte.
  [[nodiscard]] bool pending() const { return pending_; }

  [[nodiscard]] static bool is_terminator(std::uint8_t byte) {
    return byte == '.' || byte == '?' || byte == '!';
  }
  [[nodiscard]] static bool is_closer(std::uint8_t byte) {
    return byte == '"' || byte == '\'' || byte == ')' || byte == ']';
  }
  [[nodiscard]] static bool is_space(std::uint8_t byte) {
    return byte == ' ' || (byte >= '\t' && byte <= '\r');
  }

 private:
  void emit_anchor(std::vector<std::int32_t>& out);

  std::int32_t anchor_id_;
  bool pending_ = false;    // [.?!][\"')\]]* seen, not yet followed by anything else
  bool open_unit_ = false;  // a byte came since the last anchor
  std::int64_t inserted_ = 0;
};

}  // namespace kvevict::harness
