// Shared by the fuzz targets in tests/fuzz and by the tests that read their regression inputs:
// how one fuzz input holds two files, and what a target does when a property fails.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::fuzz {

/// A fuzz input that holds two files (config.json and model.safetensors; tokenizer.bin and a
/// llama2.c checkpoint): a little-endian u32 length N, N bytes of the first file (fewer when the
/// input ends sooner), the rest the second.
struct TwoFiles {
  std::span<const std::byte> first;
  std::span<const std::byte> second;
};

inline TwoFiles split_two(std::span<const std::byte> input) {
  if (input.size() < 4) return {{}, input};
  std::uint32_t length = 0;
  std::memcpy(&length, input.data(), 4);  // the targets run on little-endian machines only
  const std::span<const std::byte> rest = input.subspan(4);
  const std::size_t first = length < rest.size() ? length : rest.size();
  return {rest.first(first), rest.subspan(first)};
}

inline std::vector<std::byte> join_two(std::span<const std::byte> first,
                                       std::span<const std::byte> second) {
  std::vector<std::byte> input(4 + first.size() + second.size());
  const auto length = static_cast<std::uint32_t>(first.size());
  std::memcpy(input.data(), &length, 4);
  std::copy(first.begin(), first.end(), input.begin() + 4);
  std::copy(second.begin(), second.end(),
            input.begin() + 4 + static_cast<std::ptrdiff_t>(first.size()));
  return input;
}

inline std::string_view as_text(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

inline std::span<const std::byte> as_bytes(std::string_view text) {
  return {reinterpret_cast<const std::byte*>(text.data()), text.size()};
}

/// A property the target checks does not hold: report it and abort, which libFuzzer (and the
/// corpus runner) records as a crash with the input that caused it.
[[noreturn]] inline void property_failed(const std::string& message) {
  std::fprintf(stderr, "kvevict fuzz: property failed: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace kvevict::fuzz
