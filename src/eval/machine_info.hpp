// What a benchmark result must say about where it ran: the build's git revision and type, the
// compiler, the machine, and a process's resident memory (Linux /proc; zeros elsewhere).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace kvevict::eval {

/// `git describe --always --dirty` of the source tree at build time; "unknown" without git.
[[nodiscard]] std::string git_revision();
/// CMAKE_BUILD_TYPE (or the multi-config configuration) the library was built with.
[[nodiscard]] std::string build_type();

/// {"nproc", "cpu", "compiler", "build_type", "sanitized", "git_revision"}.
[[nodiscard]] nlohmann::ordered_json machine_json();

struct ProcessMemory {
  std::uint64_t rss_bytes = 0;       ///< VmRSS: resident now
  std::uint64_t peak_rss_bytes = 0;  ///< VmHWM: largest resident size since the reset
};

/// This process's VmRSS and VmHWM from /proc/self/status (zeros where it cannot be read).
[[nodiscard]] ProcessMemory process_memory();
/// Resets VmHWM to the current RSS (writes 5 to /proc/self/clear_refs), so that a forked child's
/// peak counts only its own work and not its parent's. Returns whether the kernel accepted it.
bool reset_peak_rss();

}  // namespace kvevict::eval
