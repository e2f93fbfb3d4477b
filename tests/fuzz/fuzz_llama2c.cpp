// Fuzz target: llama2.c checkpoints with an optional tokenizer.bin (fuzz_input.hpp's two files:
// tokenizer.bin first, empty for the byte-level fallback); on what loads, the tokenizer and the
// checkpoint writer.
#include <cstddef>
#include <cstdint>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <span>
#include <vector>

#include "fuzz_input.hpp"
#include "fuzz_model_checks.hpp"
#include "model/model_io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvevict;
  const fuzz::TwoFiles files =
      fuzz::split_two(std::span(reinterpret_cast<const std::byte*>(data), size));
  model::Model model;
  try {
    model = model::load_llama2c(files.second, files.first);
  } catch (const Error&) {
    return 0;
  }
  fuzz::check_tokenizer(model.tokenizer);
  // tokenizer.bin is a separate file with its own writer: the checkpoint round-trips alone.
  fuzz::check_round_trip(
      model, [](const model::Model& m) { return model::serialize_llama2c(m); },
      [](const std::vector<std::byte>& file) { return model::load_llama2c(file); },
      /*with_tokenizer=*/false);
  return 0;
}
