// Fuzz target: safetensors + config.json (fuzz_input.hpp's two files: config.json first). The
// container parser runs on every input; load_safetensors reads both; on what loads, the tokenizer
// and the safetensors writer.
#include <cstddef>
#include <cstdint>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <span>

#include "fuzz_input.hpp"
#include "fuzz_model_checks.hpp"
#include "model/model_io.hpp"
#include "model/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvevict;
  const fuzz::TwoFiles files =
      fuzz::split_two(std::span(reinterpret_cast<const std::byte*>(data), size));
  try {
    (void)model::safetensors::parse(files.second);
  } catch (const Error&) {
  }
  model::Model model;
  try {
    model = model::load_safetensors(files.second, fuzz::as_text(files.first));
  } catch (const Error&) {
    return 0;
  }
  fuzz::check_tokenizer(model.tokenizer);
  fuzz::check_round_trip(
      model, [](const model::Model& m) { return model::serialize_safetensors(m); },
      [](const model::SafetensorsFiles& written) {
        return model::load_safetensors(written.tensors, written.config_json);
      },
      /*with_tokenizer=*/true);
  return 0;
}
