// Fuzz target: GGUF model files (load_gguf); on what loads, the tokenizer and the GGUF writer.
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
  model::Model model;
  try {
    model = model::load_gguf(std::span(reinterpret_cast<const std::byte*>(data), size));
  } catch (const Error&) {
    return 0;  // the one way a hostile file may fail
  }
  fuzz::check_tokenizer(model.tokenizer);
  fuzz::check_round_trip(
      model, [](const model::Model& m) { return model::serialize_gguf(m); },
      [](const std::vector<std::byte>& file) { return model::load_gguf(file); },
      /*with_tokenizer=*/true);
  return 0;
}
