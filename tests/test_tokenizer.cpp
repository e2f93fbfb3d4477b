// Tokenizer: byte-level round trips (including multi-byte UTF-8), SentencePiece-style BPE on a
// hand-built vocabulary whose merges are worked out by hand below, byte fallback, <unk>, and the
// decoding of specials.
#include <gtest/gtest.h>

#include <cstdint>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <string>
#include <vector>

#include "model/model_io.hpp"

namespace {

using kvevict::Error;
using kvevict::model::Tokenizer;
using Ids = std::vector<std::int32_t>;

const std::string kSpace = "\xe2\x96\x81";  // "▁"

Tokenizer byte_tokenizer(int vocab_size) {
  Tokenizer tokenizer;
  tokenizer.kind = Tokenizer::Kind::byte_level;
  tokenizer.bos_id = 256;
  tokenizer.eos_id = 257;
  tokenizer.anchor_id = 258;
  tokenizer.vocab_size = vocab_size;
  return tokenizer;
}

std::string decode_all(const Tokenizer& tokenizer, const Ids& ids) {
  std::string text;
  for (const std::int32_t id : ids) text += tokenizer.decode(id);
  return text;
}

// A Llama-style vocabulary small enough to run BPE by hand. Scores are merge priorities (higher
// merges first); the single characters' scores never matter because characters are the start.
//   id  piece     score  type
//    0  <unk>        0   unknown
//    1  <s>          0   control (BOS)
//    2  </s>         0   control (EOS)
//    3  <0x0A>       0   byte
//    4  <0xC3>       0   byte
//    5  <0xA9>       0   byte
//    6  ▁           -1
//  7-13 h e l o w r d  -2
//   14  ll          -3
//   15  he          -4
//   16  llo         -5
//   17  ▁he         -6
//   18  ▁hello      -7
//   19  or          -8
//   20  ▁w          -9
//   21  ▁wor       -10
//   22  ld         -11
//   23  ▁world     -12
// 24-26 a b c        -2
//   27  ab          -5
//   28  bc          -1
//   29  <AC>         0   user-defined (the AnLLM anchor)
Tokenizer llama_like() {
  Tokenizer tokenizer;
  tokenizer.kind = Tokenizer::Kind::sentencepiece;
  tokenizer.pieces = {"<unk>",
                      "<s>",
                      "</s>",
                      "<0x0A>",
                      "<0xC3>",
                      "<0xA9>",
                      kSpace,
                      "h",
                      "e",
                      "l",
                      "o",
                      "w",
                      "r",
                      "d",
                      "ll",
                      "he",
                      "llo",
                      kSpace + "he",
                      kSpace + "hello",
                      "or",
                      kSpace + "w",
                      kSpace + "wor",
                      "ld",
                      kSpace + "world",
                      "a",
                      "b",
                      "c",
                      "ab",
                      "bc",
                      "<AC>"};
  tokenizer.scores = {0,  0,  0,  0,  0,  0,  -1,  -2,  -2,  -2, -2, -2, -2, -2, -3,
                      -4, -5, -6, -7, -8, -9, -10, -11, -12, -2, -2, -2, -5, -1, 0};
  tokenizer.types = {2, 3, 3, 6, 6, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4};
  tokenizer.bos_id = 1;
  tokenizer.eos_id = 2;
  tokenizer.anchor_id = 29;
  tokenizer.vocab_size = 32;  // two padding rows beyond the pieces
  return tokenizer;
}

// --- Byte level ---------------------------------------------------------------------------------

TEST(ByteTokenizer, RoundTripsAnyUtf8) {
  const Tokenizer tokenizer = byte_tokenizer(260);
  // ASCII, Latin-1 range (2 bytes), CJK (3 bytes), an emoji (4 bytes), a NUL and a stray byte.
  const std::string text = std::string("h\xc3\xa9llo \xe4\xb8\x96 \xf0\x9f\x99\x82\n", 16) +
                           std::string(1, '\0') + "\xff";
  const Ids ids = tokenizer.encode(text, /*add_bos=*/false);
  ASSERT_EQ(ids.size(), text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    EXPECT_EQ(ids[i], static_cast<unsigned char>(text[i]));
  }
  EXPECT_EQ(decode_all(tokenizer, ids), text);
}

TEST(ByteTokenizer, BosAndSpecialsDecodeToNothing) {
  const Tokenizer tokenizer = byte_tokenizer(260);
  EXPECT_EQ(tokenizer.encode("hi", true), (Ids{256, 'h', 'i'}));
  EXPECT_EQ(tokenizer.encode("", true), (Ids{256}));
  EXPECT_EQ(tokenizer.encode("", false), Ids{});
  for (const std::int32_t special : {256, 257, 258, 259}) {
    EXPECT_EQ(tokenizer.decode(special), "") << special;
  }
  EXPECT_THROW((void)tokenizer.decode(260), Error);
  EXPECT_THROW((void)tokenizer.decode(-1), Error);
  // No BOS in the vocabulary: add_bos adds nothing.
  Tokenizer no_bos = tokenizer;
  no_bos.bos_id = -1;
  EXPECT_EQ(no_bos.encode("a", true), (Ids{'a'}));
}

TEST(ByteTokenizer, BytesOutsideASmallVocabularyAreAnError) {
  const Tokenizer tokenizer = byte_tokenizer(128);
  EXPECT_EQ(tokenizer.encode("ok", false), (Ids{'o', 'k'}));
  try {
    (void)tokenizer.encode("\xc3\xa9", false);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("byte 195 has no token"), std::string::npos)
        << error.what();
  }
}

// --- SentencePiece BPE -------------------------------------------------------------------------

// "hello world" is normalised to "▁hello▁world" (dummy prefix, spaces -> ▁) and split into 12
// characters: ▁ h e l l o ▁ w o r l d. Adjacent pairs that are pieces, with their scores:
// he -4, ll -3, or -8, ▁w -9, ld -11. The best pair is merged each round, and new pairs formed
// with the merged symbol are added:
//   1. ll  (-3)  ▁ h e [ll] o ▁ w o r l d        new: llo -5   (ell is no piece)
//   2. he  (-4)  ▁ [he] ll o ...                  new: ▁he -6   (hell is no piece)
//   3. llo (-5)  ▁ he [llo] ▁ w o r l d           new: none     (hello is no piece)
//   4. ▁he (-6)  [▁he] llo ...                    new: ▁hello -7
//   5. ▁hello (-7)  [▁hello] ▁ w o r l d          new: none
//   6. or  (-8)  ... ▁ w [or] l d                 new: none     (wor, orl are no pieces)
//   7. ▁w  (-9)  ... [▁w] or l d                  new: ▁wor -10
//   8. ▁wor (-10) ... [▁wor] l d                  new: none
//   9. ld  (-11) ... ▁wor [ld]                    new: ▁world -12
//  10. ▁world (-12)  [▁hello] [▁world]
TEST(SentencePiece, HandWorkedMergesForHelloWorld) {
  const Tokenizer tokenizer = llama_like();
  EXPECT_EQ(tokenizer.encode("hello world", /*add_bos=*/true), (Ids{1, 18, 23}));
  EXPECT_EQ(tokenizer.encode("hello world", /*add_bos=*/false), (Ids{18, 23}));
  EXPECT_EQ(decode_all(tokenizer, {1, 18, 23, 2}), " hello world");
}

// "abc" -> ▁ a b c. Pairs: ab (-5) and bc (-1): the higher score wins although ab is further
// left, giving ▁ a [bc]; then "abc" and "▁a" are no pieces.
TEST(SentencePiece, HigherScoreBeatsLeftmost) {
  EXPECT_EQ(llama_like().encode("abc", false), (Ids{6, 24, 28}));
}

// "lll" -> ▁ l l l. Both pairs are "ll" (-3): the leftmost merges first, ▁ [ll] l; then "lll" and
// "▁ll" are no pieces. (Merging the right pair first would give ▁ l ll = 6 9 14.)
TEST(SentencePiece, EqualScoresMergeLeftmostFirst) {
  EXPECT_EQ(llama_like().encode("lll", false), (Ids{6, 14, 9}));
}

// "a  b" -> "▁a▁▁b": every space is its own ▁ (no pair of them is a piece).
TEST(SentencePiece, EverySpaceBecomesAPieceBoundary) {
  EXPECT_EQ(llama_like().encode("a  b", false), (Ids{6, 24, 6, 6, 25}));
  EXPECT_EQ(decode_all(llama_like(), {6, 24, 6, 6, 25}), " a  b");
}

// "é!\n" -> ▁ é ! \n. "é" (C3 A9) is no piece: it falls back to its byte pieces <0xC3> <0xA9>.
// "!" has neither a piece nor a byte piece: <unk>. "\n" has the byte piece <0x0A>.
TEST(SentencePiece, ByteFallbackThenUnknown) {
  const Tokenizer tokenizer = llama_like();
  EXPECT_EQ(tokenizer.encode("\xc3\xa9!\n", false), (Ids{6, 4, 5, 0, 3}));
  EXPECT_EQ(tokenizer.decode(4) + tokenizer.decode(5), "\xc3\xa9");
  EXPECT_EQ(tokenizer.decode(3), "\n");
  // Without <unk> a character with no piece and no byte piece cannot be encoded.
  Tokenizer no_unknown = tokenizer;
  no_unknown.types[0] = 1;
  no_unknown.pieces[0] = "x";
  EXPECT_THROW((void)no_unknown.encode("!", false), Error);
}

TEST(SentencePiece, SpecialsAreNeverProducedFromText) {
  const Tokenizer tokenizer = llama_like();
  // "<0x0A>" and "<AC>" typed as text are characters (no pieces for <, 0, x, A, C, >: <unk>), not
  // the byte token or the anchor.
  for (const char* text : {"<0x0A>", "<AC>", "<s>"}) {
    const Ids ids = tokenizer.encode(text, false);
    for (const std::int32_t id : ids) {
      EXPECT_NE(id, 3) << text;
      EXPECT_NE(id, 29) << text;
      EXPECT_NE(id, 1) << text;
    }
  }
}

TEST(SentencePiece, DecodeOfSpecialsBytesAndPadding) {
  const Tokenizer tokenizer = llama_like();
  EXPECT_EQ(tokenizer.decode(1), "");   // BOS: control
  EXPECT_EQ(tokenizer.decode(2), "");   // EOS: control
  EXPECT_EQ(tokenizer.decode(6), " ");  // ▁
  EXPECT_EQ(tokenizer.decode(23), " world");
  EXPECT_EQ(tokenizer.decode(29), "<AC>");  // user-defined pieces are text
  EXPECT_EQ(tokenizer.decode(30), "");      // embedding rows beyond the pieces
  EXPECT_EQ(tokenizer.decode(31), "");
  EXPECT_THROW((void)tokenizer.decode(32), Error);
  EXPECT_THROW((void)tokenizer.decode(-1), Error);
}

TEST(SentencePiece, EmptyTextHasNoDummyPrefix) {
  EXPECT_EQ(llama_like().encode("", true), (Ids{1}));
  EXPECT_EQ(llama_like().encode("", false), Ids{});
}

TEST(SentencePiece, TypesInferredWhenAbsent) {
  Tokenizer untyped = llama_like();
  untyped.types.clear();
  // BOS/EOS are control, <0xXX> pieces are bytes: same encoding and decoding as with types.
  EXPECT_EQ(untyped.encode("hello world", true), (Ids{1, 18, 23}));
  EXPECT_EQ(untyped.encode("\xc3\xa9\n", false), (Ids{6, 4, 5, 3}));
  EXPECT_EQ(untyped.decode(1), "");
  EXPECT_EQ(untyped.decode(4), "\xc3");
  EXPECT_EQ(kvevict::model::detail::infer_piece_types(untyped.pieces, 1, 2, 0)[5], 6);
}

TEST(SentencePiece, Llama2cTokenizerBinRoundTrip) {
  const Tokenizer original = llama_like();
  const auto bytes = kvevict::model::serialize_llama2c_tokenizer(original);
  const Tokenizer loaded = kvevict::model::read_llama2c_tokenizer(bytes, 30);
  EXPECT_EQ(loaded.pieces, original.pieces);  // spaces turned back into ▁
  EXPECT_EQ(loaded.scores, original.scores);
  EXPECT_EQ(loaded.encode("hello world abc lll", true),
            original.encode("hello world abc lll", true));
}

TEST(SentencePiece, LongTextIsFast) {
  // The priority-queue merge is O(n log n): 200k characters in well under a second.
  std::string text;
  for (int i = 0; i < 20000; ++i) text += "hello wor";
  const Ids ids = llama_like().encode(text, false);
  // Each repeat is ▁hello, then ▁wor followed directly by the next "hello" (no space): ▁wor h e
  // l l o -> ▁wor he llo; the last repeat ends in ▁wor.
  EXPECT_EQ(ids.front(), 18);
  EXPECT_EQ(ids.back(), 21);
  EXPECT_EQ(decode_all(llama_like(), ids), " " + text);
}

TEST(PieceHelpers, BytePieceValue) {
  using kvevict::model::detail::byte_piece_value;
  EXPECT_EQ(byte_piece_value("<0x00>"), 0);
  EXPECT_EQ(byte_piece_value("<0xFF>"), 255);
  EXPECT_EQ(byte_piece_value("<0xaB>"), 0xab);
  EXPECT_EQ(byte_piece_value("<0xG0>"), -1);
  EXPECT_EQ(byte_piece_value("<0x0>"), -1);
  EXPECT_EQ(byte_piece_value("0x41"), -1);
}

}  // namespace
