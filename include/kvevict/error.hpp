// kvevict::Error: the one exception type the library throws for bad input or misuse.
#pragma once

#include <stdexcept>
#include <string>

namespace kvevict {

/// Thrown for invalid configurations, malformed input and API misuse. The message names the
/// problem and, where it helps, the offending value. Never thrown across the C API.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kvevict

/// Throws kvevict::Error(message) unless `condition` holds. The message expression is evaluated
/// only on failure, so checks cost nothing but the test on per-token paths.
#define KVEVICT_REQUIRE(condition, message)                         \
  do {                                                              \
    if (!(condition)) throw ::kvevict::Error(std::string(message)); \
  } while (false)
