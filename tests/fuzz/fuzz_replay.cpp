// Fuzz target: kvevict-replay/1 documents (parse_replay_text); what parses is run through its
// policy, and the result must have the replay's shape.
#include <cstddef>
#include <cstdint>
#include <kvevict/error.hpp>
#include <string>
#include <string_view>

#include "fuzz_input.hpp"
#include "replay/replay.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvevict;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  replay::Replay input;
  try {
    input = replay::parse_replay_text(text);
  } catch (const Error&) {  // ReplayError is one
    return 0;
  }
  replay::ReplayResult result;
  try {
    result = replay::run_replay(input);
  } catch (const Error&) {
    return 0;  // e.g. parameters the policy refuses
  }
  if (result.after_chunk.size() != input.chunks.size()) {
    fuzz::property_failed("the result has " + std::to_string(result.after_chunk.size()) +
                          " chunks for " + std::to_string(input.chunks.size()) + " input chunks");
  }
  for (const replay::ChunkKept& chunk : result.after_chunk) {
    if (chunk.kept.size() != static_cast<std::size_t>(input.shape.layers)) {
      fuzz::property_failed("a chunk's result does not have one entry per layer");
    }
    for (const auto& layer : chunk.kept) {
      // One list per KV head, or per query head for a policy that repeats them (gqa = repeat).
      if (layer.size() != static_cast<std::size_t>(input.shape.kv_heads) &&
          layer.size() != static_cast<std::size_t>(input.shape.q_heads)) {
        fuzz::property_failed("a layer's result does not have one list per KV or query head");
      }
      for (const auto& positions : layer) {
        for (const std::int64_t position : positions) {
          if (position < 0 || position >= input.tokens) {
            fuzz::property_failed("kept position " + std::to_string(position) +
                                  " outside [0, tokens)");
          }
        }
      }
    }
  }
  (void)replay::format_result(result);
  if (input.expected) {
    (void)replay::describe(replay::compare_results(*input.expected, result), input.chunks);
  }
  return 0;
}
