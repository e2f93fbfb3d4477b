#include "eval/documents.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <kvevict/error.hpp>

namespace kvevict::eval {
namespace {

std::uint64_t rotate_left(std::uint64_t x, int bits) { return (x << bits) | (x >> (64 - bits)); }

bool is_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
bool is_terminator(char c) { return c == '.' || c == '?' || c == '!'; }
bool is_closer(char c) { return c == '"' || c == '\'' || c == ')' || c == ']'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_letter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// Digits removed, newline runs collapsed to one "\n".
std::string clean_text(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (is_digit(c)) continue;
    if (c == '\n' && !out.empty() && out.back() == '\n') continue;
    out += c;
  }
  return out;
}

// toy_data.py split_units: SENTENCE_END = [.?!]["')\]]*(?=\s|$), units cut after each match.
std::vector<std::string> split_units(const std::string& text) {
  std::vector<std::string> units;
  std::size_t start = 0;
  std::size_t i = 0;
  while (i < text.size()) {
    if (!is_terminator(text[i])) {
      ++i;
      continue;
    }
    std::size_t end = i + 1;
    while (end < text.size() && is_closer(text[end])) ++end;
    if (end == text.size() || is_space(text[end])) {
      if (end > start) units.push_back(text.substr(start, end - start));
      start = end;
      i = end;
    } else {
      ++i;
    }
  }
  if (start < text.size()) units.push_back(text.substr(start));
  return units;
}

// Splits `total` into `parts` non-negative integers at sorted uniform cuts (toy_data.py _split).
std::vector<std::int64_t> split_total(std::int64_t total, int parts, Rng& rng) {
  std::vector<std::int64_t> cuts;
  for (int k = 0; k + 1 < parts; ++k) {
    cuts.push_back(static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(total) + 1)));
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::int64_t> sizes;
  std::int64_t previous = 0;
  for (const std::int64_t cut : cuts) {
    sizes.push_back(cut - previous);
    previous = cut;
  }
  sizes.push_back(total - previous);
  return sizes;
}

}  // namespace

// --- Random numbers ---------------------------------------------------------------------------

std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t mix_seed(std::initializer_list<std::uint64_t> values) {
  std::uint64_t seed = 0x6b76657669637421ULL;  // "kvevict!"
  for (const std::uint64_t value : values) seed = mix64(seed ^ mix64(value));
  return seed;
}

std::uint64_t hash_name(std::string_view name) {
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  for (const char c : name) {
    hash ^= static_cast<std::uint8_t>(c);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

std::uint64_t double_bits(double value) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

Rng::Rng(std::uint64_t seed) {
  // SplitMix64: output k is mix64(seed + k * golden ratio).
  for (std::uint64_t& word : state_) {
    word = mix64(seed);
    seed += 0x9e3779b97f4a7c15ULL;
  }
}

std::uint64_t Rng::next() {
  const std::uint64_t result = rotate_left(state_[1] * 5, 7) * 9;
  const std::uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotate_left(state_[3], 45);
  return result;
}

std::uint64_t Rng::below(std::uint64_t n) {
  KVEVICT_REQUIRE(n >= 1, "Rng::below(0)");
  // Accept only draws under the largest multiple of n, so every residue is equally likely.
  const std::uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  while (true) {
    const std::uint64_t draw = next();
    if (draw < limit) return draw % n;
  }
}

// --- Filler -----------------------------------------------------------------------------------

FillerText::FillerText(std::string_view text) : units_(split_units(clean_text(text))) {
  KVEVICT_REQUIRE(!units_.empty(), "the text holds no usable prose (empty after removing digits)");
}

std::string FillerText::take(std::int64_t bytes, Rng& rng) const {
  KVEVICT_REQUIRE(bytes >= 0, "FillerText::take: negative size");
  const std::size_t first = rng.below(units_.size());
  if (bytes == 0) return {};
  // Whole units from `start` while they fit; then `room` bytes of the next one.
  const auto plan = [&](std::size_t start, std::size_t& next, std::int64_t& room) {
    std::size_t index = start;
    room = bytes;
    while (static_cast<std::int64_t>(units_[index % units_.size()].size()) <= room) {
      room -= static_cast<std::int64_t>(units_[index % units_.size()].size());
      ++index;
    }
    next = index;
  };
  std::size_t start = first;
  for (int attempt = 0; attempt < kStartTries; ++attempt) {
    const std::size_t candidate = first + static_cast<std::size_t>(attempt);
    std::size_t next = 0;
    std::int64_t room = 0;
    plan(candidate, next, room);
    const std::string& partial = units_[next % units_.size()];
    const auto cut = static_cast<std::size_t>(room);
    // The piece ends a word: it is empty, or its last byte is not whitespace and the next is.
    if (cut == 0 || (!is_space(partial[cut - 1]) && is_space(partial[cut]))) {
      start = candidate;
      break;
    }
  }
  std::string out;
  out.reserve(static_cast<std::size_t>(bytes));
  std::size_t next = 0;
  std::int64_t room = 0;
  plan(start, next, room);
  for (std::size_t index = start; index < next; ++index) out += units_[index % units_.size()];
  out.append(units_[next % units_.size()], 0, static_cast<std::size_t>(room));
  return out;
}

// --- Passkey ----------------------------------------------------------------------------------

PasskeyDocument make_passkey_document(const FillerText& filler, std::int64_t length, double depth,
                                      Rng& rng) {
  PasskeyDocument doc;
  doc.key = std::to_string(10000 + rng.below(90000));
  doc.depth = depth;
  std::string statement;
  statement.append(kPasskeyStatementPrefix).append(doc.key).append(kPasskeyEcho);
  statement.append(doc.key).append(kPasskeyEchoSuffix);
  const auto fixed =
      static_cast<std::int64_t>(1 + kPasskeyIntro.size() + statement.size() +
                                kPasskeyQuestion.size() + kPasskeyAnswerPrefix.size());
  if (length < fixed) {
    throw Error(fmt::format("a passkey document of {} tokens cannot hold the template ({} tokens)",
                            length, fixed));
  }
  doc.filler_bytes = length - fixed;
  doc.before_bytes = std::llround(depth * static_cast<double>(doc.filler_bytes));
  doc.text.reserve(static_cast<std::size_t>(length));
  doc.text.append(kPasskeyIntro);
  doc.text += filler.take(doc.before_bytes, rng);
  doc.key_position = 1 + static_cast<std::int64_t>(doc.text.size());
  doc.text += statement;
  doc.text += filler.take(doc.filler_bytes - doc.before_bytes, rng);
  doc.text.append(kPasskeyQuestion).append(kPasskeyAnswerPrefix);
  return doc;
}

// --- Grocery ----------------------------------------------------------------------------------

const std::array<std::string_view, 53> kGroceries = {
    "apples",    "bananas", "bread", "butter",    "carrots", "cheese",   "chicken",  "coffee",
    "cookies",   "corn",    "cream", "cucumbers", "eggs",    "fish",     "flour",    "garlic",
    "grapes",    "ham",     "honey", "jam",       "juice",   "lemons",   "lettuce",  "milk",
    "mushrooms", "noodles", "oats",  "oil",       "olives",  "onions",   "oranges",  "pasta",
    "peaches",   "pears",   "peas",  "pepper",    "pickles", "potatoes", "rice",     "salt",
    "sausages",  "soap",    "soup",  "spinach",   "sugar",   "tea",      "tomatoes", "tuna",
    "vinegar",   "walnuts", "water", "yogurt",    "beans"};

std::int64_t GroceryDocument::tokens() const {
  std::int64_t total = 1;  // BOS
  for (const std::string& turn : turns) total += static_cast<std::int64_t>(turn.size());
  return total;
}

GroceryDocument make_grocery_document(const FillerText& filler, std::int64_t length, int items,
                                      int turns, Rng& rng) {
  KVEVICT_REQUIRE(
      items >= 1 && items <= static_cast<int>(kGroceries.size()),
      fmt::format("grocery items must be in [1, {}], got {}", kGroceries.size(), items));
  KVEVICT_REQUIRE(turns >= 1 && turns % 2 == 1,
                  fmt::format("grocery turns must be odd and >= 1, got {}", turns));
  GroceryDocument doc;
  // A partial Fisher-Yates shuffle: `items` distinct groceries in drawn order.
  std::vector<std::size_t> order(kGroceries.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  for (int k = 0; k < items; ++k) {
    const std::size_t pick = static_cast<std::size_t>(k) + rng.below(order.size() - k);
    std::swap(order[static_cast<std::size_t>(k)], order[pick]);
    doc.items.emplace_back(kGroceries[order[static_cast<std::size_t>(k)]]);
  }
  std::string list;
  for (const std::string& item : doc.items) list += (list.empty() ? "" : ", ") + item;
  doc.expected_answer = list + ".";

  std::string first(kGroceryListPrefix);
  first.append(list).append(".").append(kTurnSeparator);
  std::string question(kGroceryQuestion);
  question.append(kTurnSeparator);
  const std::string answer_turn(kGroceryAnswerPrefix);
  std::int64_t fixed =
      1 + static_cast<std::int64_t>(first.size() + question.size() + answer_turn.size());
  for (int t = 0; t < turns; ++t) {
    fixed += static_cast<std::int64_t>(kGrocerySpeakers[t % 2].size() + kTurnSeparator.size());
  }
  if (length < fixed) {
    throw Error(fmt::format(
        "a grocery document of {} tokens cannot hold the template with {} turns ({} tokens)",
        length, turns, fixed));
  }
  const std::vector<std::int64_t> gaps = split_total(length - fixed, turns, rng);
  doc.turns.push_back(std::move(first));
  for (int t = 0; t < turns; ++t) {
    std::string turn(kGrocerySpeakers[t % 2]);
    turn += filler.take(gaps[static_cast<std::size_t>(t)], rng);
    turn.append(kTurnSeparator);
    doc.turns.push_back(std::move(turn));
  }
  doc.turns.push_back(std::move(question));
  doc.turns.push_back(answer_turn);
  return doc;
}

// --- Scoring ----------------------------------------------------------------------------------

double per_digit_accuracy(std::string_view answer, std::string_view key) {
  if (key.empty()) return 0.0;
  std::size_t correct = 0;
  for (std::size_t i = 0; i < key.size() && i < answer.size(); ++i) {
    if (answer[i] == key[i]) ++correct;
  }
  return static_cast<double>(correct) / static_cast<double>(key.size());
}

double item_recall(std::string_view answer, const std::vector<std::string>& items) {
  if (items.empty()) return 0.0;
  std::size_t found = 0;
  for (const std::string& item : items) {
    for (std::size_t at = answer.find(item); at != std::string_view::npos;
         at = answer.find(item, at + 1)) {
      const bool starts = at == 0 || !is_letter(answer[at - 1]);
      const std::size_t end = at + item.size();
      const bool ends = end == answer.size() || !is_letter(answer[end]);
      if (starts && ends) {
        ++found;
        break;
      }
    }
  }
  return static_cast<double>(found) / static_cast<double>(items.size());
}

}  // namespace kvevict::eval
