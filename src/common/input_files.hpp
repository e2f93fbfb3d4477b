// Opening files named by a user (models, eval configs, replays): one check that the path is a
// regular file before anything opens it. Opening a FIFO for reading blocks until a writer appears,
// and reading a directory fails deep inside the stream library ("basic_filebuf::underflow"), so
// both are refused here with the path in the message. Private to kvevict's compiled parts;
// header-only so that the model library, eval and replay share it without a link dependency.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <kvevict/error.hpp>
#include <string>
#include <string_view>
#include <system_error>

namespace kvevict::common {

namespace detail {

inline std::string_view file_type_name(std::filesystem::file_type type) {
  switch (type) {
    case std::filesystem::file_type::directory:
      return "a directory";
    case std::filesystem::file_type::fifo:
      return "a FIFO";
    case std::filesystem::file_type::socket:
      return "a socket";
    case std::filesystem::file_type::block:
      return "a block device";
    case std::filesystem::file_type::character:
      return "a character device";
    default:
      return "not a file";
  }
}

}  // namespace detail

/// Throws ErrorType "cannot open <what> '<path>': it does not exist" (or "...: it is a FIFO, not
/// a regular file") unless `path`, after following symbolic links, is a regular file. `what` names
/// the role ("model file", "eval config").
template <class ErrorType = Error>
void require_regular_file(const std::filesystem::path& path, std::string_view what) {
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(path, error);
  if (status.type() == std::filesystem::file_type::regular) return;
  const std::string cannot = "cannot open " + std::string(what) + " '" + path.string() + "': ";
  if (status.type() == std::filesystem::file_type::not_found) {
    throw ErrorType(cannot + "it does not exist");
  }
  if (error) throw ErrorType(cannot + error.message());
  throw ErrorType(cannot + "it is " + std::string(detail::file_type_name(status.type())) +
                  ", not a regular file");
}

/// The whole of a regular file of at most `max_bytes` bytes, as text. Throws ErrorType naming
/// `what` and the path when it is not a regular file, is larger, or cannot be read.
template <class ErrorType = Error>
[[nodiscard]] std::string read_regular_file(const std::filesystem::path& path,
                                            std::string_view what, std::uintmax_t max_bytes) {
  require_regular_file<ErrorType>(path, what);
  const std::string named = std::string(what) + " '" + path.string() + "'";
  std::error_code error;
  const std::uintmax_t size = std::filesystem::file_size(path, error);
  if (error) throw ErrorType(named + " cannot be sized: " + error.message());
  if (size > max_bytes) {
    throw ErrorType(named + " is " + std::to_string(size) + " bytes, more than the limit of " +
                    std::to_string(max_bytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ErrorType("cannot open " + named);
  // Exactly the size found above: a file that changes meanwhile is an error, never a larger read.
  std::string text(static_cast<std::size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (in.bad()) throw ErrorType("error while reading " + named);
  if (static_cast<std::uintmax_t>(in.gcount()) != size ||
      in.peek() != std::ifstream::traits_type::eof()) {
    throw ErrorType(named + " changed while it was read");
  }
  return text;
}

}  // namespace kvevict::common
