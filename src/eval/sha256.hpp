// SHA-256 (FIPS 180-4), for the eval harness's model and text checksums: results record which
// exact model file produced them. Streaming: update() any number of times, then hex_digest().
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace kvevict::eval {

class Sha256 {
 public:
  Sha256();

  void update(std::span<const std::byte> bytes);
  void update(std::string_view text);
  /// The digest of everything given so far (the object is finished: update() is an error after).
  [[nodiscard]] std::array<std::uint8_t, 32> digest();
  /// digest() as 64 lowercase hex digits.
  [[nodiscard]] std::string hex_digest();

 private:
  void compress(const std::uint8_t* block);

  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

/// SHA-256 of `text` as hex.
[[nodiscard]] std::string sha256_hex(std::string_view text);
/// SHA-256 of a file's bytes as hex, read in 64 KiB blocks; kvevict::Error if it cannot be read.
[[nodiscard]] std::string sha256_file(const std::filesystem::path& path);

}  // namespace kvevict::eval
