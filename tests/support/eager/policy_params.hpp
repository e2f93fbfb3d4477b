// PolicyParams: named numeric parameters of a policy, as read from a CLI, a replay file or a
// config.
#pragma once

#include <cmath>
#include <cstdint>
#include <kvevict/error.hpp>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::eager {

/// Numbers and integer lists by name. Readers record which keys they used, so that a misspelt
/// parameter is reported (check_all_used) instead of silently ignored.
class PolicyParams {
 public:
  PolicyParams& set(const std::string& key, double value) {
    numbers_[key] = value;
    return *this;
  }
  PolicyParams& set_list(const std::string& key, std::vector<std::int64_t> values) {
    lists_[key] = std::move(values);
    return *this;
  }
  [[nodiscard]] bool has(const std::string& key) const {
    return numbers_.count(key) != 0 || lists_.count(key) != 0;
  }

  /// An integer parameter; `fallback` when absent (error if absent and no fallback).
  [[nodiscard]] int get_int(const std::string& key,
                            std::optional<int> fallback = std::nullopt) const {
    used_.insert(key);
    const auto it = numbers_.find(key);
    if (it == numbers_.end()) {
      KVEVICT_REQUIRE(fallback.has_value(), "missing parameter '" + key + "'");
      return *fallback;
    }
    const double value = it->second;
    KVEVICT_REQUIRE(std::isfinite(value) && value == std::floor(value) &&
                        std::fabs(value) <= std::numeric_limits<int>::max(),
                    "parameter '" + key + "' must be an integer, got " + std::to_string(value));
    return static_cast<int>(value);
  }

  /// A real parameter; `fallback` when absent. NaN and infinities are rejected.
  [[nodiscard]] double get_double(const std::string& key,
                                  std::optional<double> fallback = std::nullopt) const {
    used_.insert(key);
    const auto it = numbers_.find(key);
    if (it == numbers_.end()) {
      KVEVICT_REQUIRE(fallback.has_value(), "missing parameter '" + key + "'");
      return *fallback;
    }
    KVEVICT_REQUIRE(std::isfinite(it->second), "parameter '" + key + "' must be finite");
    return it->second;
  }

  /// An integer list parameter; `fallback` when absent.
  [[nodiscard]] std::vector<std::int64_t> get_list(
      const std::string& key,
      std::optional<std::vector<std::int64_t>> fallback = std::nullopt) const {
    used_.insert(key);
    const auto it = lists_.find(key);
    if (it == lists_.end()) {
      KVEVICT_REQUIRE(fallback.has_value(), "missing parameter '" + key + "'");
      return *fallback;
    }
    return it->second;
  }

  /// Throws if a parameter was given that no reader asked for.
  void check_all_used(std::string_view policy) const {
    for (const auto& [key, value] : numbers_) check_used(policy, key);
    for (const auto& [key, value] : lists_) check_used(policy, key);
  }

 private:
  void check_used(std::string_view policy, const std::string& key) const {
    KVEVICT_REQUIRE(used_.count(key) != 0,
                    "unknown parameter '" + key + "' for policy '" + std::string(policy) + "'");
  }

  std::map<std::string, double> numbers_;
  std::map<std::string, std::vector<std::int64_t>> lists_;
  mutable std::set<std::string> used_;
};

}  // namespace kvevict::eager
