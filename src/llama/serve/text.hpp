// Text of a generation as a server sends it: stop strings and whole UTF-8 characters.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::llama_serve {

/// Where the first of `stops` begins in `text`, searching only matches that end after `searched`
/// (the bytes already searched); nullopt when none occurs.
[[nodiscard]] std::optional<std::size_t> find_stop(std::string_view text,
                                                   const std::vector<std::string>& stops,
                                                   std::size_t searched);

/// How much of `text` may be sent (from `sent`) while generation goes on: not the bytes that could
/// begin a stop string (a later token may complete it), nor an incomplete UTF-8 character at the
/// end (a byte-level token may be half of one).
[[nodiscard]] std::size_t emittable(std::string_view text, std::size_t sent,
                                    const std::vector<std::string>& stops);

}  // namespace kvevict::llama_serve
