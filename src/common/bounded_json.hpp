// JSON from files kvevict does not control (config.json, safetensors headers, eval configs,
// replays): a parse with a nesting limit, and bounded previews of values for error messages.
//
// nlohmann's parser is iterative and its destructor flattens nested values onto a heap stack, but
// dump(), copies and comparisons recurse once per nesting level: describing an array nested
// 100,000 deep overflows the stack. The parse below refuses such documents up front, and
// json_preview never recurses and never writes more than a few dozen bytes, whatever it is given.
// Private to kvevict's compiled parts (model loaders, eval, replay); header-only so that each of
// them can include it without a link dependency.
#pragma once

#include <cstddef>
#include <kvevict/error.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::common {

/// Arrays and objects nested deeper than this are refused when parsing. Every format kvevict reads
/// needs at most 7 levels (a replay's expected.after_chunk[k].kept[l][g]); 64 leaves room for
/// metadata other tools add, and keeps any later recursion over the value shallow.
inline constexpr int kMaxJsonNesting = 64;

/// What a preview shows at most: bytes of text, and levels of arrays and objects (deeper ones
/// show as [...] or {...}).
inline constexpr std::size_t kPreviewBytes = 60;
inline constexpr int kPreviewDepth = 3;

/// Parses `text` as `Json` (nlohmann::json or ordered_json). Invalid JSON throws Json's
/// parse_error as Json::parse does; nesting deeper than `max_nesting` throws ErrorType naming
/// `what` ("safetensors: config.json nests arrays and objects deeper than 64 levels").
template <class Json, class ErrorType = Error>
[[nodiscard]] Json parse_json_bounded(std::string_view text, std::string_view what,
                                      bool ignore_comments = false,
                                      int max_nesting = kMaxJsonNesting) {
  // The callback sees each array or object start with the number of containers around it.
  const typename Json::parser_callback_t limit_nesting = [&](int depth,
                                                             typename Json::parse_event_t event,
                                                             Json&) {
    if ((event == Json::parse_event_t::array_start || event == Json::parse_event_t::object_start) &&
        depth >= max_nesting) {
      throw ErrorType(std::string(what) + " nests arrays and objects deeper than " +
                      std::to_string(max_nesting) + " levels");
    }
    return true;
  };
  return Json::parse(text.begin(), text.end(), limit_nesting, /*allow_exceptions=*/true,
                     ignore_comments);
}

namespace detail {

/// `text` as a JSON string literal, at most `max_bytes` of it (a preview needs only the head).
template <class Json>
std::string quoted_head(const typename Json::string_t& text, std::size_t max_bytes) {
  const Json head = text.size() > max_bytes ? text.substr(0, max_bytes) : text;
  // replace: a cut through a UTF-8 sequence (or invalid input) becomes U+FFFD, not an exception.
  return head.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace detail

/// A short rendering of `value` for error messages: compact JSON, arrays and objects shown to
/// `max_depth` levels, the whole cut after `max_bytes` bytes (at a UTF-8 boundary) with "...".
/// Iterative, and O(max_bytes) work whatever the value's size or depth.
template <class Json>
[[nodiscard]] std::string json_preview(const Json& value, std::size_t max_bytes = kPreviewBytes,
                                       int max_depth = kPreviewDepth) {
  struct Frame {
    const Json* container;
    typename Json::const_iterator next;
  };
  std::vector<Frame> open;
  std::string out;
  const auto full = [&] { return out.size() > max_bytes; };
  // Writes a scalar, or opens a container (a new frame) while the depth allows.
  const auto write = [&](const Json& item) {
    if (item.is_array() || item.is_object()) {
      const bool array = item.is_array();
      if (item.empty()) {
        out += array ? "[]" : "{}";
      } else if (static_cast<int>(open.size()) >= max_depth) {
        out += array ? "[...]" : "{...}";
      } else {
        out += array ? '[' : '{';
        open.push_back(Frame{&item, item.cbegin()});
      }
    } else if (item.is_string()) {
      out += detail::quoted_head<Json>(item.template get_ref<const typename Json::string_t&>(),
                                       max_bytes);
    } else {  // numbers, booleans, null, binary: dump() does not recurse for these
      out += item.dump(-1, ' ', false, Json::error_handler_t::replace);
    }
  };
  write(value);
  while (!open.empty() && !full()) {
    Frame& frame = open.back();
    const bool array = frame.container->is_array();
    if (frame.next == frame.container->cend()) {
      out += array ? ']' : '}';
      open.pop_back();
      continue;
    }
    if (frame.next != frame.container->cbegin()) out += ',';
    const typename Json::const_iterator item = frame.next++;
    if (!array) {
      out += detail::quoted_head<Json>(item.key(), max_bytes);
      out += ':';
    }
    write(*item);  // may open a frame: `frame` is not used after this
  }
  if (full()) {
    std::size_t cut = max_bytes;
    while (cut > 0 && (static_cast<unsigned char>(out[cut]) & 0xC0) == 0x80) --cut;
    out.resize(cut);
    out += "...";
  }
  return out;
}

}  // namespace kvevict::common
