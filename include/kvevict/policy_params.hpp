// PolicyParams and PolicySpec: a policy's parameters, declared once in its header with their types,
// defaults and ranges, and read through one parser by every front end (CLI, C API, replay files,
// eval configs, benchmarks, examples).
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvevict/error.hpp"

namespace kvevict {

class Policy;

/// Numbers, integer lists and words (the value of a choice parameter, e.g. pooling=max) by name. As
/// given by a user they are untyped (a list of one entry and a number look alike);
/// PolicySpec::resolve types and checks them.
class PolicyParams {
 public:
  using Value = std::variant<double, std::vector<std::int64_t>, std::string>;

  PolicyParams& set(const std::string& key, double value) {
    values_[key] = value;
    return *this;
  }
  PolicyParams& set_list(const std::string& key, std::vector<std::int64_t> values) {
    values_[key] = std::move(values);
    return *this;
  }
  /// A word, the value of a choice parameter (ParamType::choice).
  PolicyParams& set_word(const std::string& key, std::string word) {
    values_[key] = std::move(word);
    return *this;
  }
  [[nodiscard]] bool has(const std::string& key) const { return values_.count(key) != 0; }
  [[nodiscard]] const std::map<std::string, Value>& values() const { return values_; }
  /// Sets every value of `other` (overriding).
  PolicyParams& merge(const PolicyParams& other) {
    for (const auto& [key, value] : other.values_) values_[key] = value;
    return *this;
  }

  /// An integer parameter (after resolve: present and in range, or absent and optional).
  [[nodiscard]] int get_int(const std::string& key) const {
    return static_cast<int>(std::get<double>(at(key)));
  }
  [[nodiscard]] std::optional<int> get_optional_int(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    return get_int(key);
  }
  [[nodiscard]] double get_real(const std::string& key) const { return std::get<double>(at(key)); }
  [[nodiscard]] const std::vector<std::int64_t>& get_list(const std::string& key) const {
    return std::get<std::vector<std::int64_t>>(at(key));
  }
  /// A choice parameter's word (after resolve: one of its choices).
  [[nodiscard]] const std::string& get_word(const std::string& key) const {
    return std::get<std::string>(at(key));
  }

  /// "recent=28 sinks=4" (lists as "anchor_ids=258,259"); "" when empty (numbers as number_text).
  [[nodiscard]] std::string to_string() const {
    std::string out;
    for (const auto& [key, value] : values_) {
      if (!out.empty()) out += ' ';
      out += key + "=";
      if (const auto* number = std::get_if<double>(&value)) {
        out += number_text(*number);
      } else if (const auto* word = std::get_if<std::string>(&value)) {
        out += *word;
      } else {
        const auto& list = std::get<std::vector<std::int64_t>>(value);
        for (std::size_t i = 0; i < list.size(); ++i) {
          if (i > 0) out += ',';
          out += std::to_string(list[i]);
        }
      }
    }
    return out;
  }

  /// Parses "key=value key=value ..." (whitespace-separated pairs; a value is a number, integers
  /// separated by commas, or a word of letters, digits and '_' starting with a letter). Types are
  /// checked later, by PolicySpec::resolve.
  [[nodiscard]] static PolicyParams parse(std::string_view text) {
    PolicyParams params;
    std::size_t at = 0;
    while (at < text.size()) {
      while (at < text.size() && is_space(text[at])) ++at;
      std::size_t end = at;
      while (end < text.size() && !is_space(text[end])) ++end;
      if (end > at) params.parse_pair(text.substr(at, end - at));
      at = end;
    }
    return params;
  }
  /// `number` in the shortest form that reads back exactly ("28", "0.8").
  [[nodiscard]] static std::string number_text(double number) {
    char buffer[32];
    const std::to_chars_result result = std::to_chars(buffer, buffer + sizeof buffer, number);
    return std::string(buffer, result.ptr);
  }

  /// Parses one "key=value" pair into this set (the CLI's --param).
  void parse_pair(std::string_view pair) {
    const std::size_t eq = pair.find('=');
    const std::string shown(pair.substr(0, 64));
    KVEVICT_REQUIRE(eq != std::string_view::npos && eq > 0 && eq + 1 < pair.size(),
                    "policy parameter '" + shown + "' is not key=value");
    const std::string key(pair.substr(0, eq));
    const std::string_view value = pair.substr(eq + 1);
    const auto malformed = [&] {
      return Error("policy parameter '" + key + "' has a malformed value '" +
                   std::string(value.substr(0, 64)) + "'");
    };
    if (value.find(',') == std::string_view::npos) {
      const std::optional<double> number = parse_number(value);
      if (number) {
        set(key, *number);
      } else if (is_word(value)) {
        set_word(key, std::string(value));
      } else {
        throw malformed();
      }
      return;
    }
    std::vector<std::int64_t> list;
    std::size_t begin = 0;
    for (;;) {
      const std::size_t comma = value.find(',', begin);
      const std::string_view item = value.substr(begin, comma - begin);
      const std::optional<double> number = parse_number(item);
      if (!number || *number != std::floor(*number) || std::fabs(*number) > 9.0e15) {
        throw malformed();
      }
      list.push_back(static_cast<std::int64_t>(*number));
      if (comma == std::string_view::npos) break;
      begin = comma + 1;
    }
    set_list(key, std::move(list));
  }

 private:
  [[nodiscard]] const Value& at(const std::string& key) const {
    const auto it = values_.find(key);
    KVEVICT_REQUIRE(it != values_.end(), "missing parameter '" + key + "'");
    return it->second;
  }
  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
  static bool is_letter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
  // A choice's word: a letter, then letters, digits or '_' (at most 64 characters).
  static bool is_word(std::string_view text) {
    if (text.empty() || text.size() > 64 || !is_letter(text.front())) return false;
    for (const char c : text) {
      if (!is_letter(c) && !(c >= '0' && c <= '9') && c != '_') return false;
    }
    return true;
  }
  // A finite decimal number, the whole of `text` but surrounding blanks.
  static std::optional<double> parse_number(std::string_view text) {
    while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
    while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
    if (text.empty() || text.size() > 64) return std::nullopt;
    const std::string copy(text);
    char* end = nullptr;
    const double number = std::strtod(copy.c_str(), &end);
    if (end != copy.c_str() + copy.size() || !std::isfinite(number)) return std::nullopt;
    return number;
  }
  std::map<std::string, Value> values_;
};

/// Largest slot count a parameter may name (SlotTable::kMaxCapacity).
inline constexpr double kMaxSlotsParam = double(std::int64_t{1} << 28);

/// The part of a `--budget` left once `sinks` protected first tokens are counted against it; an
/// error when nothing is left.
[[nodiscard]] inline int budget_after_sinks(int budget, int sinks) {
  KVEVICT_REQUIRE(sinks >= 0, "sinks must be >= 0, got " + std::to_string(sinks));
  KVEVICT_REQUIRE(budget > sinks, "budget " + std::to_string(budget) +
                                      " leaves no room beside the " + std::to_string(sinks) +
                                      " protected sinks: the budget must be larger than the sinks "
                                      "(at least " +
                                      std::to_string(std::int64_t{sinks} + 1) + ")");
  return budget - sinks;
}

/// What a parameter holds.
enum class ParamType : std::uint8_t {
  integer,       ///< a whole number in [min, max]
  real,          ///< a finite number in [min, max]
  integer_list,  ///< integers, each in [min, max]; one number is a list of one
  choice,        ///< one word of `choices`; a default_value is the index of the default choice
};

/// One parameter of a policy: its name, type, range and default.
struct ParamSpec {
  std::string_view name;
  ParamType type = ParamType::integer;
  std::string_view help;
  /// Used when the parameter is absent. Absent and without default: required, unless `optional`.
  std::optional<double> default_value = std::nullopt;
  double min = 0;
  double max = std::numeric_limits<std::int32_t>::max();
  /// May be absent with no default (the policy derives it, e.g. InfiniPot's novel = keep / 2).
  bool optional = false;
  /// ParamType::choice: the words it accepts.
  std::span<const std::string_view> choices = {};
};

/// A policy as the registry knows it: name, paper, parameters, what `--budget N` means, and how to
/// build it from resolved parameters.
struct PolicySpec {
  std::string_view name;
  std::string_view summary;  ///< one line: paper and rule
  std::span<const ParamSpec> params;
  /// The parameters `--budget N` stands for, with `sinks` protected first tokens where the policy
  /// has sinks; nullptr when the policy has no budget (full). Throws for budgets it cannot honour.
  PolicyParams (*budget)(int budget, int sinks) = nullptr;
  /// Builds the policy from parameters resolve() accepted.
  std::unique_ptr<Policy> (*make)(const PolicyParams& params) = nullptr;

  /// "avg, max": the words a choice parameter accepts.
  [[nodiscard]] static std::string choices_text(const ParamSpec& param) {
    std::string text;
    for (const std::string_view choice : param.choices) {
      if (!text.empty()) text += ", ";
      text += choice;
    }
    return text;
  }

  [[nodiscard]] const ParamSpec* find(std::string_view key) const {
    for (const ParamSpec& param : params) {
      if (param.name == key) return &param;
    }
    return nullptr;
  }

  /// Types and checks `given` against the spec: unknown keys, missing required parameters, types
  /// and ranges are errors naming the parameter; defaults fill absent parameters.
  [[nodiscard]] PolicyParams resolve(const PolicyParams& given) const {
    PolicyParams resolved;
    for (const auto& [key, value] : given.values()) {
      const ParamSpec* param = find(key);
      if (param == nullptr) {
        std::string known;
        for (const ParamSpec& p : params) known.append(" ").append(p.name);
        throw Error("unknown parameter '" + key + "' for policy '" + std::string(name) + "'" +
                    (known.empty() ? std::string(" (it takes none)") : " (known:" + known + ")"));
      }
      check(*param, value, resolved);
    }
    for (const ParamSpec& param : params) {
      const std::string key(param.name);
      if (resolved.has(key)) continue;
      if (param.default_value) {
        if (param.type == ParamType::integer_list) {
          resolved.set_list(key, {static_cast<std::int64_t>(*param.default_value)});
        } else if (param.type == ParamType::choice) {
          resolved.set_word(
              key, std::string(param.choices[static_cast<std::size_t>(*param.default_value)]));
        } else {
          resolved.set(key, *param.default_value);
        }
      } else if (!param.optional) {
        throw Error("policy '" + std::string(name) + "': missing parameter '" + key + "' (" +
                    std::string(param.help) + ")");
      }
    }
    return resolved;
  }

 private:
  void check(const ParamSpec& param, const PolicyParams::Value& value,
             PolicyParams& resolved) const {
    const std::string key(param.name);
    const std::string where = "policy '" + std::string(name) + "': parameter '" + key + "'";
    const auto in_range = [&](double number) {
      if (!(number >= param.min && number <= param.max)) {
        throw Error(where + " must be in [" + PolicyParams::number_text(param.min) + ", " +
                    PolicyParams::number_text(param.max) + "], got " +
                    PolicyParams::number_text(number));
      }
    };
    const auto* word = std::get_if<std::string>(&value);
    if (param.type == ParamType::choice) {
      const auto chosen = [&]() -> std::optional<std::string_view> {
        if (word == nullptr) return std::nullopt;
        for (const std::string_view choice : param.choices) {
          if (choice == *word) return choice;
        }
        return std::nullopt;
      }();
      if (!chosen) {
        throw Error(where + " must be one of " + choices_text(param) + ", got " +
                    (word != nullptr ? "'" + word->substr(0, 64) + "'"
                     : std::holds_alternative<double>(value)
                         ? PolicyParams::number_text(std::get<double>(value))
                         : std::string("a list")));
      }
      resolved.set_word(key, std::string(*chosen));
      return;
    }
    if (word != nullptr) {
      throw Error(where + " has a malformed value '" + word->substr(0, 64) + "' (" +
                  (param.type == ParamType::integer_list ? "integers" : "a number") + " expected)");
    }
    if (param.type == ParamType::integer_list) {
      std::vector<std::int64_t> list;
      if (const auto* number = std::get_if<double>(&value)) {
        KVEVICT_REQUIRE(*number == std::floor(*number), where + " takes integers");
        list.push_back(static_cast<std::int64_t>(*number));
      } else {
        list = std::get<std::vector<std::int64_t>>(value);
      }
      KVEVICT_REQUIRE(!list.empty(), where + " needs at least one value");
      for (const std::int64_t item : list) in_range(static_cast<double>(item));
      resolved.set_list(key, std::move(list));
      return;
    }
    const auto* number = std::get_if<double>(&value);
    KVEVICT_REQUIRE(number != nullptr, where + " takes one number, not a list");
    KVEVICT_REQUIRE(std::isfinite(*number), where + " must be finite");
    if (param.type == ParamType::integer) {
      KVEVICT_REQUIRE(*number == std::floor(*number),
                      where + " must be an integer, got " + PolicyParams::number_text(*number));
    }
    in_range(*number);
    resolved.set(key, *number);
  }
};

}  // namespace kvevict
