// Task documents of the eval harness, built exactly like tools/toy_data.py builds the toy models'
// evaluation documents (passkey_doc with intro and echo, grocery_doc), from a held-out text.
//
// Everything random comes from Rng (xoshiro256** seeded through SplitMix64) with seeds mixed from
// (grid seed, task, document index, variant): a document depends on neither the policy, nor the
// order cells run in, nor the platform. Bounded draws use rejection sampling, never
// std::uniform_int_distribution (whose algorithm differs between standard libraries).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::eval {

/// xoshiro256** (Blackman & Vigna), its state filled by SplitMix64 from one seed.
class Rng {
 public:
  explicit Rng(std::uint64_t seed);
  std::uint64_t next();
  /// Uniform in [0, n) (n >= 1), by rejection: exact and the same everywhere.
  std::uint64_t below(std::uint64_t n);

 private:
  std::array<std::uint64_t, 4> state_{};
};

/// SplitMix64's output function: a well-mixed 64-bit value of `x`.
[[nodiscard]] std::uint64_t mix64(std::uint64_t x);
/// One seed from several values (order matters).
[[nodiscard]] std::uint64_t mix_seed(std::initializer_list<std::uint64_t> values);
/// FNV-1a of a string, for mixing names (a task's kind) into seeds.
[[nodiscard]] std::uint64_t hash_name(std::string_view name);
/// The bits of a double (a depth) for mixing into seeds.
[[nodiscard]] std::uint64_t double_bits(double value);

/// Filler prose: the text with digits removed (a key must be the only number in a document) and
/// every run of newlines collapsed to one "\n" (a blank line is the grocery task's turn separator;
/// toy_data.py joins its corpus' documents with one "\n" too), split into sentence units as
/// toy_data.py's split_units does: a unit ends after [.?!] plus closing " ' ) ] when whitespace or
/// the end follows; the whitespace starts the next unit.
class FillerText {
 public:
  explicit FillerText(std::string_view text);

  /// Exactly `bytes` bytes of consecutive prose: whole units from a random unit on, then the next
  /// unit's beginning, cut where a word ends. Cycles through the text when it is short. When no
  /// word ends exactly there, the start moves to the next unit (up to kStartTries times; then the
  /// last piece is cut mid-word).
  [[nodiscard]] std::string take(std::int64_t bytes, Rng& rng) const;

  [[nodiscard]] std::size_t units() const { return units_.size(); }
  [[nodiscard]] const std::string& unit(std::size_t index) const { return units_[index]; }

  static constexpr int kStartTries = 256;

 private:
  std::vector<std::string> units_;
};

// The passkey template (toy_data.py passkey_doc with intro and echo).
inline constexpr std::string_view kPasskeyIntro =
    "There is a pass key hidden in this text. Find it and remember it.";
inline constexpr std::string_view kPasskeyStatementPrefix = " The pass key is ";
inline constexpr std::string_view kPasskeyEcho = ". Remember it. ";
inline constexpr std::string_view kPasskeyEchoSuffix = " is the pass key.";
inline constexpr std::string_view kPasskeyQuestion = " What is the pass key?";
inline constexpr std::string_view kPasskeyAnswerPrefix = " The pass key is ";
inline constexpr int kPasskeyDigits = 5;

struct PasskeyDocument {
  std::string text;  ///< the prompt after BOS: intro, filler, key statement, filler, question
  std::string key;   ///< 5 digits, 10000-99999
  double depth = 0;
  std::int64_t filler_bytes = 0;  ///< both filler parts together
  std::int64_t before_bytes = 0;  ///< filler before the key statement: round(depth * filler)
  std::int64_t key_position = 0;  ///< token index (BOS = 0) where the key statement starts
};

/// A passkey document of exactly `length` tokens with BOS (byte-level), the key statement after
/// round(depth * filler) filler bytes. Throws kvevict::Error when `length` cannot hold the
/// template.
[[nodiscard]] PasskeyDocument make_passkey_document(const FillerText& filler, std::int64_t length,
                                                    double depth, Rng& rng);

// The grocery template (toy_data.py grocery_doc; TURN_SEP = "\n\n").
inline constexpr std::string_view kTurnSeparator = "\n\n";
inline constexpr std::string_view kGroceryListPrefix = "User: Remember my shopping list: ";
inline constexpr std::string_view kGroceryQuestion = "User: What was on my shopping list?";
inline constexpr std::string_view kGroceryAnswerPrefix = "Assistant: ";
inline constexpr std::array<std::string_view, 2> kGrocerySpeakers = {"Assistant: ", "User: "};
inline constexpr int kGroceryMaxAnswerTokens = 64;
/// toy_data.py's GROCERIES, in its order.
extern const std::array<std::string_view, 53> kGroceries;

struct GroceryDocument {
  /// The turns, each fed with turn_start: the list turn, the filler turns, the question turn and
  /// the open assistant turn ("Assistant: "). BOS precedes the first.
  std::vector<std::string> turns;
  std::vector<std::string> items;
  std::string expected_answer;                ///< "oil, salt, soap."
  [[nodiscard]] std::int64_t tokens() const;  ///< BOS + every turn's bytes
};

/// A grocery document of exactly `length` tokens with BOS, `items` distinct groceries and `turns`
/// (odd) filler turns alternating Assistant / User. Throws kvevict::Error when it cannot fit.
[[nodiscard]] GroceryDocument make_grocery_document(const FillerText& filler, std::int64_t length,
                                                    int items, int turns, Rng& rng);

/// Fraction of the key's digits the answer has at the same place (a short answer misses the
/// rest).
[[nodiscard]] double per_digit_accuracy(std::string_view answer, std::string_view key);
/// Fraction of `items` that occur in `answer` as whole words.
[[nodiscard]] double item_recall(std::string_view answer, const std::vector<std::string>& items);

}  // namespace kvevict::eval
