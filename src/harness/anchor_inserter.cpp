#include "harness/anchor_inserter.hpp"

#include <kvevict/error.hpp>

namespace kvevict::harness {

AnchorInserter::AnchorInserter(std::int32_t anchor_id) : anchor_id_(anchor_id) {}

AnchorInserter AnchorInserter::for_tokenizer(const model::Tokenizer& tokenizer) {
  if (tokenizer.kind != model::Tokenizer::Kind::byte_level) {
    throw Error(
        "--insert-anchors needs a byte-level tokenizer (the toy models'); this model's tokenizer "
        "is SentencePiece");
  }
  if (tokenizer.anchor_id < 0) {
    throw Error(
        "--insert-anchors needs a model whose tokenizer has an <AC> anchor token; this "
        "one has none");
  }
  return AnchorInserter(tokenizer.anchor_id);
}

void AnchorInserter::emit_anchor(std::vector<std::int32_t>& out) {
  out.push_back(anchor_id_);
  ++inserted_;
  pending_ = false;
  open_unit_ = false;
}

void AnchorInserter::push(std::int32_t token, std::vector<std::int32_t>& out) {
  if (token == anchor_id_) {  // an anchor in the input closes the unit
    out.push_back(token);
    pending_ = false;
    open_unit_ = false;
    return;
  }
  if (token < 0 || token > 255) {  // BOS, EOS, other specials: transparent
    out.push_back(token);
    return;
  }
  const auto byte = static_cast<std::uint8_t>(token);
  if (pending_ && is_space(byte)) emit_anchor(out);
  if (is_terminator(byte)) {
    pending_ = true;
  } else if (!(pending_ && is_closer(byte))) {
    pending_ = false;
  }
  out.push_back(token);
  open_unit_ = true;
}

void AnchorInserter::push(std::span<const std::int32_t> tokens, std::vector<std::int32_t>& out) {
  for (const std::int32_t token : tokens) push(token, out);
}

void AnchorInserter::finish(std::vector<std::int32_t>& out) {
  if (pending_ || open_unit_) emit_anchor(out);
}

}  // namespace kvevict::harness
