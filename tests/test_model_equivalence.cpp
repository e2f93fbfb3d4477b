// One model written in every format loads back to the same logits through the decoder.
//
// GGUF and llama2.c store Q/K rows for interleaved RoPE, safetensors for half-split RoPE; the
// writers permute the rows and the loaders set the layout. If either side were wrong, the
// attention scores, and so the logits, would differ from the second position on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policy_registry.hpp>
#include <string>
#include <vector>

#include "model/model_io.hpp"

namespace {

using namespace kvevict::model;

ModelConfig small_config(bool tied) {
  ModelConfig config;
  config.dim = 64;
  config.hidden_dim = 160;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.vocab_size = 259;
  config.context_length = 128;
  config.rope_theta = 10000.0;  // llama2.c hard-codes theta and eps
  config.norm_eps = 1e-5f;
  config.tied_embeddings = tied;
  return config;
}

// Logits of every position of `tokens`, fed in chunks of 7 under `policy`.
std::vector<float> all_logits(const Model& model, const std::string& policy,
                              const kvevict::PolicyParams& params,
                              const std::vector<std::int32_t>& tokens) {
  Decoder decoder(model, kvevict::make_policy(policy, params));
  const ForwardResult result = decoder.feed(tokens, ForwardRequest{false, true}, 7);
  return {result.logits.begin(), result.logits.end()};
}

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double scale = 0;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::fabs(a[i])));
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return worst / scale;
}

class FormatEquivalence : public ::testing::TestWithParam<bool> {};

TEST_P(FormatEquivalence, SameLogitsFromEveryFormat) {
  const Model original = make_random_model(small_config(GetParam()), 11);
  const SafetensorsFiles safetensors = serialize_safetensors(original);
  const std::vector<std::byte> gguf = serialize_gguf(original);
  const std::vector<std::byte> llama2c = serialize_llama2c(original);
  const Model from_safetensors = load_safetensors(safetensors.tensors, safetensors.config_json);
  const Model from_gguf = load_gguf(gguf);
  const Model from_llama2c = load_llama2c(llama2c);
  ASSERT_EQ(from_safetensors.config.rope_layout, kvevict::RopeLayout::half_split);
  ASSERT_EQ(from_gguf.config.rope_layout, kvevict::RopeLayout::interleaved);
  ASSERT_EQ(from_llama2c.config.rope_layout, kvevict::RopeLayout::interleaved);

  std::vector<std::int32_t> tokens;
  for (int i = 0; i < 60; ++i) tokens.push_back(static_cast<std::int32_t>((i * 37 + 5) % 256));
  // Full cache, and a bounded policy that evicts and re-positions (cache_index) throughout.
  const std::vector<std::pair<std::string, kvevict::PolicyParams>> policies{
      {"full", kvevict::PolicyParams()},
      {"streaming_llm", kvevict::PolicyParams().set("sinks", 2).set("recent", 14)}};
  for (const auto& [policy, params] : policies) {
    const std::vector<float> reference = all_logits(original, policy, params, tokens);
    // Re-laying the Q/K rows changes which products are summed in which order only inside RoPE
    // pairs, so the formats agree to float rounding.
    EXPECT_LT(
        max_relative_difference(reference, all_logits(from_safetensors, policy, params, tokens)),
        1e-5)
        << policy;
    EXPECT_LT(max_relative_difference(reference, all_logits(from_gguf, policy, params, tokens)),
              1e-5)
        << policy;
    EXPECT_LT(max_relative_difference(reference, all_logits(from_llama2c, policy, params, tokens)),
              1e-5)
        << policy;
  }
}

INSTANTIATE_TEST_SUITE_P(Embeddings, FormatEquivalence, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "tied" : "untied");
                         });

// A layout mix-up is not silent: the same weights read with the other RoPE layout give different
// logits (the test above would catch a writer that forgot to permute).
TEST(FormatEquivalence, WrongLayoutChangesTheLogits) {
  const Model original = make_random_model(small_config(false), 11);
  const std::vector<std::byte> gguf = serialize_gguf(original);
  Model misread = load_gguf(gguf);
  misread.config.rope_layout = kvevict::RopeLayout::half_split;  // as if the permutation were lost
  std::vector<std::int32_t> tokens{1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_GT(max_relative_difference(all_logits(original, "full", kvevict::PolicyParams(), tokens),
                                    all_logits(misread, "full", kvevict::PolicyParams(), tokens)),
            1e-3);
}

}  // namespace
