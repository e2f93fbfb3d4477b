#include "llama/cli/llama_options.hpp"

#include <fmt/format.h>

#include <kvevict/error.hpp>
#include <kvevict/policies/infinipot.hpp>
#include <utility>

namespace kvevict::llama_cli {
namespace {

ggml_type ggml_cell_type(KvType type) {
  switch (type) {
    case KvType::f32:
      return GGML_TYPE_F32;
    case KvType::f16:
      return GGML_TYPE_F16;
    case KvType::bf16:
      return GGML_TYPE_BF16;
    case KvType::q8_0:
      return GGML_TYPE_Q8_0;
  }
  throw Error("unknown K/V type");
}

}  // namespace

harness::PolicySetup make_setup(const harness::PolicyOptions& options, const LlamaModel& model) {
  // llama.cpp's cells are shared by every layer and KV head: one keep-set, so only a token budget
  // applies (--budget, or --budget-bytes as the --budget it holds per head).
  if (options.allocation != "uniform") {
    throw Error("--allocation " + options.allocation +
                ": llama.cpp's cells are shared by every layer and KV head (one keep-set per "
                "token), so a per-layer or per-head split has no memory to free there; only "
                "uniform applies (kvevict's own decoder takes pyramid and adaptive)");
  }
  // The setup reads only the model's tokenizer and shape (--kv-type checks the head size); a
  // vocabulary kvevict does not hold gets a byte-level stand-in without an anchor (AnLLM then asks
  // for --param anchor_ids) and llama.cpp tokenizes the catalyst.
  kvevict::model::Model stand_in;
  if (const kvevict::model::Tokenizer* tokenizer = model.kvevict_tokenizer()) {
    stand_in.tokenizer = *tokenizer;
  }
  stand_in.config.dim = llama_model_n_embd(model.get());
  stand_in.config.heads = llama_model_n_head(model.get());
  stand_in.config.kv_heads = llama_model_n_head_kv(model.get());
  stand_in.config.layers = llama_model_n_layer(model.get());
  stand_in.config.vocab_size = model.vocab_size();
  harness::PolicySetup setup = harness::make_policy_setup(options, stand_in);
  if (setup.catalyst && model.kvevict_tokenizer() == nullptr) {
    setup.catalyst = model.encode(
        options.catalyst.value_or(std::string(kInfiniPotGeneralCatalystPrompt)), false);
  }
  return setup;
}

std::string describe_policy(const harness::PolicySetup& setup,
                            const llama::LlamaSequence& sequence) {
  const std::string params = setup.params.to_string();
  return fmt::format("{}{}, positions {}, granularity {}, keys post_rope (llama.cpp), chunk {}{}",
                     setup.name, params.empty() ? std::string() : " (" + params + ")",
                     to_string(sequence.sequence().position_mode()),
                     to_string(sequence.sequence().granularity()), sequence.max_chunk(),
                     harness::describe_kv_type(setup.decoder_options.kv_type));
}

std::string describe_granularity(const harness::PolicySetup& setup,
                                 const llama::LlamaSequence& sequence) {
  const Granularity used = sequence.sequence().granularity();
  const std::string head = fmt::format("{}: {}", to_string(used), harness::keep_set_text(used));
  if (setup.decoder_options.granularity) return head + " (--granularity)";
  const Granularity kvevict_default = sequence.sequence().policy().default_granularity();
  if (kvevict_default == used) {
    return fmt::format(
        "{}, as llama.cpp's cells are ({}'s default too: kvevict stream decides "
        "the same)",
        head, setup.name);
  }
  return fmt::format(
      "{}, as llama.cpp's cells are; kvevict stream decides at {}'s default, {} ({}), so the "
      "decisions differ: --granularity token on both makes them agree",
      head, setup.name, to_string(kvevict_default), harness::keep_set_text(kvevict_default));
}

nlohmann::ordered_json policy_json(const harness::PolicySetup& setup,
                                   const llama::LlamaSequence& sequence) {
  nlohmann::ordered_json json;
  json["name"] = setup.name;
  json["params"] = harness::params_json(setup.params);
  json["positions"] = std::string(to_string(sequence.sequence().position_mode()));
  json["granularity"] = std::string(to_string(sequence.sequence().granularity()));
  json["keys"] = "post_rope";
  json["kv_type"] = std::string(to_string(setup.decoder_options.kv_type));  // llama.cpp's cells
  json["chunk"] = sequence.max_chunk();
  if (setup.catalyst) json["catalyst_tokens"] = setup.catalyst->size();
  return json;
}

llama_context_params context_params(const LlamaOptions& options, KvType kv_type) {
  if (options.threads < 1) throw Error("--threads must be at least 1");
  if (options.context < 1) throw Error("--ctx-size must be at least 1");
  llama_context_params params = llama_context_default_params();
  params.n_ctx = static_cast<std::uint32_t>(options.context);
  params.n_threads = options.threads;
  params.n_threads_batch = options.threads;
  params.n_seq_max = 1;
  params.no_perf = true;
  if (options.flash_attention == "on") {
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  } else if (options.flash_attention == "off") {
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  } else if (options.flash_attention == "auto") {
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
  } else {
    throw Error("--flash-attn must be on, off or auto, got '" + options.flash_attention + "'");
  }
  // --kv-type is the type of llama.cpp's cells, f32 by default as kvevict's own cache (llama.cpp's
  // default f16 alone moves bits/byte by about 1e-4 relative): the same flags, the same cache.
  params.type_k = ggml_cell_type(kv_type);
  params.type_v = params.type_k;
  return params;
}

std::unique_ptr<llama::LlamaSequence> make_llama_sequence(const LlamaModel& model,
                                                          const LlamaOptions& options,
                                                          harness::PolicySetup& setup,
                                                          StageObserver* observer) {
  if (setup.decoder_options.key_storage != KeyStorage::post_rope) {
    throw Error("--keys: llama.cpp stores keys after RoPE (post_rope) and re-rotates them itself");
  }
  const llama_context_params params = context_params(options, setup.decoder_options.kv_type);
  llama::LlamaSequenceOptions sequence_options;
  sequence_options.position_mode = setup.decoder_options.position_mode;
  sequence_options.granularity = setup.decoder_options.granularity;
  sequence_options.max_chunk = setup.decoder_options.max_chunk;
  sequence_options.catalyst = setup.catalyst;
  sequence_options.observer = observer;
  KVEVICT_REQUIRE(setup.policy != nullptr, "make_llama_sequence: the setup's policy was used");
  return std::make_unique<llama::LlamaSequence>(model.get(), params, std::move(setup.policy),
                                                std::move(sequence_options));
}

}  // namespace kvevict::llama_cli
