// kvevict::llama from an installed kvevict: H2O over llama.cpp's own KV cache. The model is
// kvevict's random-tiny.gguf, whose byte-level vocabulary ("kvevict-bytes") llama.cpp does not
// know: it is loaded with the tokenizer model overridden to "none" and fed ids. H2O at budget 32
// must leave exactly 32 cells after 200 tokens, and every logit must be finite.
#include <llama.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <kvevict/error.hpp>
#include <kvevict/llama/llama_sequence.hpp>
#include <kvevict/policy_registry.hpp>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fputs("usage: consumer_llama random-tiny.gguf\n", stderr);
    return 2;
  }
  llama_backend_init();
  llama_model_kv_override overrides[2]{};  // the empty second entry ends the list
  overrides[0].tag = LLAMA_KV_OVERRIDE_TYPE_STR;
  std::strcpy(overrides[0].key, "tokenizer.ggml.model");
  std::strcpy(overrides[0].val_str, "none");
  llama_model_params model_params = llama_model_default_params();
  model_params.kv_overrides = overrides;
  llama_model* model = llama_model_load_from_file(argv[1], model_params);
  if (model == nullptr) {
    std::fprintf(stderr, "kvevict consumer_llama FAILED: llama.cpp could not load %s\n", argv[1]);
    return 1;
  }
  int status = 0;
  try {
    llama_context_params params = llama_context_default_params();
    params.n_ctx = 256;
    params.n_threads = 1;
    kvevict::llama::LlamaSequence sequence(
        model, params, kvevict::make_policy("h2o", kvevict::budget_params("h2o", 32)));
    std::vector<std::int32_t> prompt;
    for (std::int32_t id = 0; id < 200; ++id) prompt.push_back(id % 256);
    const kvevict::llama::LlamaLogits logits = sequence.feed(prompt, /*turn_start=*/true);
    for (const float logit : logits.last()) {
      if (!std::isfinite(logit)) status = 1;
    }
    if (sequence.live_cells() != 32) status = 1;
    std::printf("kvevict consumer_llama: %d live cells of 200 tokens, logits %s: %s\n",
                sequence.live_cells(), status == 0 ? "finite" : "checked",
                status == 0 ? "OK" : "FAILED");
  } catch (const kvevict::Error& error) {
    std::fprintf(stderr, "kvevict consumer_llama FAILED: %s\n", error.what());
    status = 1;
  }
  llama_model_free(model);
  llama_backend_free();
  return status;
}
