#include "llama/serve/text.hpp"

#include <algorithm>

namespace kvevict::llama_serve {

std::optional<std::size_t> find_stop(std::string_view text, const std::vector<std::string>& stops,
                                     std::size_t searched) {
  std::optional<std::size_t> first;
  for (const std::string& stop : stops) {
    if (stop.empty() || stop.size() > text.size()) continue;
    // A match not found before must end after `searched`.
    const std::size_t from = searched >= stop.size() ? searched - stop.size() + 1 : 0;
    const std::size_t at = text.find(stop, from);
    if (at != std::string_view::npos && (!first || at < *first)) first = at;
  }
  return first;
}

std::size_t emittable(std::string_view text, std::size_t sent,
                      const std::vector<std::string>& stops) {
  std::size_t end = text.size();
  // Hold back the longest tail that is a proper prefix of a stop string.
  for (const std::string& stop : stops) {
    const std::size_t longest = std::min(stop.size() - (stop.empty() ? 0 : 1), text.size() - sent);
    for (std::size_t k = longest; k > 0; --k) {
      if (text.substr(text.size() - k) == std::string_view(stop).substr(0, k)) {
        end = std::min(end, text.size() - k);
        break;
      }
    }
  }
  // Hold back an incomplete UTF-8 character at the end: find its lead byte within 3 bytes.
  const std::size_t unsent = end > sent ? end - sent : 0;
  for (std::size_t back = 1; back <= std::min<std::size_t>(4, unsent); ++back) {
    const auto byte = static_cast<unsigned char>(text[end - back]);
    if ((byte & 0xC0) == 0x80) continue;  // a continuation byte
    std::size_t length = 1;
    if ((byte & 0xE0) == 0xC0)
      length = 2;
    else if ((byte & 0xF0) == 0xE0)
      length = 3;
    else if ((byte & 0xF8) == 0xF0)
      length = 4;
    if (length > back) end -= back;  // incomplete: wait for the rest
    break;
  }
  return std::max(end, sent);
}

}  // namespace kvevict::llama_serve
