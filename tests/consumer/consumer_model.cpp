// The installed reference model: a small random Llama decoded under H2O through kvevict::model.
// H2O at budget 16 (heavy 8 + recent 8) must hold exactly 16 slots per KV head after 40 tokens,
// and every logit must be finite.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policy_registry.hpp>

int main() {
  kvevict::model::ModelConfig config;
  config.dim = 32;
  config.hidden_dim = 64;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.vocab_size = 259;
  config.context_length = 64;
  const kvevict::model::Model model = kvevict::model::make_random_model(config, /*seed=*/3);
  kvevict::model::Decoder decoder(model,
                                  kvevict::make_policy("h2o", kvevict::budget_params("h2o", 16)));
  for (std::int32_t token = 0; token < 40; ++token) {
    const kvevict::model::ForwardResult result = decoder.forward({&token, 1});
    for (const float logit : result.last()) {
      if (!std::isfinite(logit)) {
        std::puts("kvevict consumer_model FAILED: a logit is not finite");
        return 1;
      }
    }
  }
  for (int layer = 0; layer < config.layers; ++layer) {
    for (int kv_head = 0; kv_head < config.kv_heads; ++kv_head) {
      if (decoder.cache().sequence().live(layer, kv_head) != 16) {
        std::printf("kvevict consumer_model FAILED: %d live slots, expected 16\n",
                    decoder.cache().sequence().live(layer, kv_head));
        return 1;
      }
    }
  }
  std::puts("kvevict consumer_model OK");
  return 0;
}
