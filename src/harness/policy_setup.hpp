// Policy selection shared by the `kvevict` subcommands that run the reference decoder (generate,
// stream, eval): --policy / --budget / --sinks / --param / --positions / --granularity / --keys /
// --chunk / --catalyst become a kvevict::Policy plus the decoder's options. Parameters are typed
// and checked by the policy's spec (kvevict/policy_registry.hpp); this file only maps options.
//
// Nothing here depends on CLI11 (the programs register the flags: src/cli/options.hpp), so tests
// call it directly.
// Every problem is a kvevict::Error whose message names the option at fault.
#pragma once

#include <cstdint>
#include <kvevict/granularity.hpp>
#include <kvevict/kv_type.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/policy_params.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kvevict::harness {

inline constexpr int kDefaultSinks = 4;
inline constexpr int kDefaultChunk = 64;
/// Largest --chunk: the decoder keeps [chunk, vocab] logits when every row is asked for, so an
/// absurd chunk is an absurd allocation.
inline constexpr int kMaxChunk = 1 << 16;

/// The policy options as given on the command line.
struct PolicyOptions {
  std::string policy = "full";
  std::optional<int> budget;  ///< --budget N: mapped to the policy's natural parameters
  /// --budget-bytes B: the sequence's keys and values in --kv-type, at most B bytes (instead of
  /// --budget): the policy gets the --budget N that B holds per KV head, and under pyramid or
  /// adaptive the split honours B itself.
  std::optional<std::int64_t> budget_bytes;
  std::string allocation = "uniform";  ///< --allocation uniform|pyramid|adaptive
  int pyramid_beta = 20;               ///< --pyramid-beta
  double adaptive_floor = 0.2;         ///< --adaptive-floor
  int sinks = kDefaultSinks;  ///< --sinks S: protected first tokens (with --budget, and as `sinks`)
  bool sinks_given = false;
  std::vector<std::string> params;  ///< --param key=value, applied last (they override)
  std::string positions;            ///< empty = the policy's own position mode
  std::string granularity;          ///< empty = the policy's own granularity
  std::string keys = "post_rope";
  std::string kv_type = "f32";  ///< --kv-type: how the cache stores keys and values
  int chunk = kDefaultChunk;
  std::optional<std::string> catalyst;  ///< InfiniPot's catalyst prompt; nullopt = the paper's
  /// --decode-activations: model::DecoderOptions::decode_activations (kvevict's decoder only)
  std::string decode_activations = "f32";
};

/// -t/--threads of kvevict's decoder (model::DecoderOptions::threads, set by the commands on the
/// setup's decoder options): an error naming the option unless in [1, 1024].
void check_threads(int threads);

/// The parameters as given: the --budget mapping, then --sinks, then every --param (untyped:
/// PolicySpec::resolve types them). With a tokenizer, AnLLM's anchor_ids default to the
/// tokenizer's anchor token (an error when it has none and none were given); without one that
/// default is left open.
[[nodiscard]] PolicyParams resolve_params(const PolicyOptions& options,
                                          const model::Tokenizer* tokenizer);

/// Checks everything that does not need the model (names, sizes, the budget mapping, parameter
/// types and ranges, and the policy's own validation where it can already be built), so that a
/// bad option fails before a large model is loaded.
void validate_policy_options(const PolicyOptions& options);

/// The --budget N that --budget-bytes B holds per KV head of a model of `layers` x `kv_heads`
/// heads of `head_dim` in `kv_type`: B // (layers * kv_heads * 2 * row bytes); an error naming B
/// and the smallest byte budget when that is 0.
[[nodiscard]] int budget_from_bytes(std::int64_t bytes, int layers, int kv_heads, int head_dim,
                                    KvType kv_type);

/// A configured policy, ready to become a decoder.
struct PolicySetup {
  std::string name;
  PolicyParams params;  ///< as resolved by the policy's spec (defaults filled in)
  std::unique_ptr<Policy> policy;
  model::DecoderOptions decoder_options;
  /// Catalyst prompt tokens for a policy that runs one (InfiniPot); nullopt otherwise.
  std::optional<std::vector<std::int32_t>> catalyst;
  /// --budget-bytes, when given (the policy's params hold the --budget it amounts to per head).
  std::optional<std::int64_t> budget_bytes;
};

[[nodiscard]] PolicySetup make_policy_setup(const PolicyOptions& options,
                                            const model::Model& model);

/// A decoder over `model` (which must outlive it) with the setup's policy and catalyst. The setup's
/// policy is moved into the decoder.
[[nodiscard]] std::unique_ptr<model::Decoder> make_decoder(const model::Model& model,
                                                           PolicySetup& setup);

/// Whether `policy` evicts only before a turn (SirLLM, RandomLLM, IntervalLLM): fed as one turn, it
/// never evicts.
[[nodiscard]] bool evicts_only_before_turns(const Policy& policy);
/// Warns (stderr) when `policy` evicts only before a turn and the input has no turns.
void warn_if_single_turn(const Policy& policy, bool input_has_turns);

/// Warns (stderr) when feeding `tokens` tokens through `decoder` puts keys further behind a query
/// than the model's trained context (config.context_length; 0 = unknown, no warning): RoPE models
/// predict worse at distances they were not trained on.
void warn_if_past_context(const model::Decoder& decoder, const model::ModelConfig& config,
                          std::int64_t tokens);

/// {"recent": 28, "sinks": 4, "anchor_ids": [258]}: integers as JSON integers.
[[nodiscard]] nlohmann::ordered_json params_json(const PolicyParams& params);

/// The policy line's K/V type: ", kv q8_0", nothing for f32 (both executables' policy lines).
[[nodiscard]] std::string describe_kv_type(KvType type);

/// "streaming_llm (recent=28 sinks=4), positions cache_index, granularity token, keys post_rope,
/// chunk 64" (and describe_kv_type's ", kv q8_0", and ", decode activations q8_0" when not f32).
[[nodiscard]] std::string describe_policy(const PolicySetup& setup, const model::Decoder& decoder);
/// What one keep-set covers at `granularity`: "one keep-set per KV head", "per layer", "for the
/// whole model, per token", "... in blocks of B tokens".
[[nodiscard]] std::string keep_set_text(Granularity granularity);

/// The stream report's granularity line for kvevict's decoder: the granularity, what a keep-set
/// covers and where it came from (--granularity, or the policy's default, with how kvevict-llama,
/// whose cells are per token, decides by default).
[[nodiscard]] std::string describe_granularity(const PolicySetup& setup,
                                               const model::Decoder& decoder);

/// {"name", "params", "positions", "granularity", "keys", "kv_type", "decode_activations", "chunk",
/// "allocation" (when not uniform), "budget_bytes" (when given), "catalyst_tokens" (when it has
/// one)}.
[[nodiscard]] nlohmann::ordered_json policy_json(const PolicySetup& setup,
                                                 const model::Decoder& decoder);

}  // namespace kvevict::harness
