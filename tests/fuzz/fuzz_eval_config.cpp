// Fuzz target: `kvevict eval` grid configs (parse_eval_config_text, JSON with comments); what
// parses is enumerated into cells and serialised as results record it.
#include <cstddef>
#include <cstdint>
#include <kvevict/error.hpp>
#include <string_view>

#include "eval/config.hpp"
#include "eval/grid.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvevict;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  eval::EvalConfig config;
  try {
    config = eval::parse_eval_config_text(text, "fuzz.json");
  } catch (const Error&) {
    return 0;
  }
  try {
    (void)eval::enumerate_cells(config);
  } catch (const Error&) {  // e.g. two labels with one cell file name
  }
  (void)eval::to_json(config).dump();
  return 0;
}
