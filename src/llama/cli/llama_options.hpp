// What `kvevict-llama`'s subcommands share: llama.cpp's own options (-t, --ngl, -c, --fa; CLI11
// takes no multi-letter short options, so -ngl and -fa are spelled --ngl and --fa) and the
// LlamaSequence built from kvevict's policy options (harness/policy_setup.hpp).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <kvevict/llama/llama_sequence.hpp>
#include <kvevict/timing.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "harness/policy_setup.hpp"
#include "llama/cli/llama_model.hpp"

namespace kvevict::llama_cli {

struct LlamaOptions {
  int threads = 1;
  int gpu_layers = 0;
  int context = 4096;
  std::string flash_attention = "auto";
};

/// -t, -ngl, -c, -fa (group "llama.cpp").
inline void add_llama_options(CLI::App& app, LlamaOptions& options) {
  const std::string group = "llama.cpp";
  app.add_option("-t,--threads", options.threads, "threads of llama_decode")
      ->group(group)
      ->capture_default_str();
  app.add_option("--ngl,--gpu-layers", options.gpu_layers,
                 "layers offloaded to a GPU (a CPU-only llama.cpp build ignores it)")
      ->group(group)
      ->capture_default_str();
  app.add_option("-c,--ctx-size", options.context,
                 "KV cells of the context: at least the policy's budget plus one chunk")
      ->group(group)
      ->capture_default_str();
  app.add_option("--fa,--flash-attn", options.flash_attention,
                 "flash attention: on, off or auto (llama.cpp's choice). Every policy runs "
                 "with it: off reads the attention rows H2O, TOVA and InfiniPot use from "
                 "llama.cpp's softmax, on has kvevict compute them (one q.K pass over the "
                 "queries the policy reads)")
      ->group(group)
      ->capture_default_str();
}

/// kvevict's policy setup (harness/policy_setup.hpp) for `model`: AnLLM's default anchor and
/// InfiniPot's catalyst come from the model's tokenizer.
[[nodiscard]] harness::PolicySetup make_setup(const harness::PolicyOptions& options,
                                              const LlamaModel& model);

/// `kvevict`'s policy line and JSON for a LlamaSequence (keys: llama.cpp stores them after RoPE;
/// kv_type: the type of llama.cpp's K and V cells).
[[nodiscard]] std::string describe_policy(const harness::PolicySetup& setup,
                                          const llama::LlamaSequence& sequence);
/// The stream report's granularity line over llama.cpp: llama.cpp's cells are per token, so the
/// default is token where kvevict's decoder takes the policy's own (per KV head for h2o, tova,
/// ...): the line says when `kvevict stream` decides differently by default.
[[nodiscard]] std::string describe_granularity(const harness::PolicySetup& setup,
                                               const llama::LlamaSequence& sequence);
[[nodiscard]] nlohmann::ordered_json policy_json(const harness::PolicySetup& setup,
                                                 const llama::LlamaSequence& sequence);

/// llama.cpp's context parameters from -t, -c, -fa, with K and V cells of `kv_type` (n_seq_max 1:
/// a LlamaSequenceSet sets its own).
[[nodiscard]] llama_context_params context_params(const LlamaOptions& options, KvType kv_type);

/// A LlamaSequence over `model` with the setup's policy (moved into it) and catalyst. The setup's
/// positions and granularity apply; --keys must be post_rope (llama.cpp stores keys rotated).
[[nodiscard]] std::unique_ptr<llama::LlamaSequence> make_llama_sequence(const LlamaModel& model,
                                                                        const LlamaOptions& options,
                                                                        harness::PolicySetup& setup,
                                                                        StageObserver* observer);

}  // namespace kvevict::llama_cli
