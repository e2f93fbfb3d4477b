// Policy selection shared by the `kvevict` subcommands that run the reference decoder (generate,
// stream, and later eval): --policy / --budget / --sinks / --param / --positions / --keys /
// --chunk / --catalyst become a kvevict::Policy plus the decoder's options.
//
// Nothing here depends on CLI11 (cli_options.hpp registers the flags), so tests call it directly.
// Every problem is a kvevict::Error whose message names the option at fault.
#pragma once

#include <cstdint>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/policy_params.hpp>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kvevict::cli {

inline constexpr int kDefaultSinks = 4;
inline constexpr int kDefaultChunk = 64;
/// Largest --chunk: the decoder keeps [chunk, vocab] logits, so an absurd chunk is an absurd
/// allocation.
inline constexpr int kMaxChunk = 1 << 16;

/// The policy options as given on the command line.
struct PolicyOptions {
  std::string policy = "full";
  std::optional<int> budget;  ///< --budget N: mapped to the policy's natural parameters
  int sinks = kDefaultSinks;  ///< --sinks S: protected first tokens (with --budget, and as `sinks`)
  bool sinks_given = false;
  std::vector<std::string> params;  ///< --param key=value, applied last (they override)
  std::string positions;            ///< empty = the policy's own position mode
  std::string keys = "post_rope";
  int chunk = kDefaultChunk;
  std::optional<std::string> catalyst;  ///< InfiniPot's catalyst prompt; nullopt = the paper's
};

/// A policy's parameters (numbers or integer lists) by name, printable as "key=value ...".
class ParamValues {
 public:
  using Value = std::variant<double, std::vector<std::int64_t>>;

  void set_number(const std::string& key, double value) { values_[key] = value; }
  void set_list(const std::string& key, std::vector<std::int64_t> values) {
    values_[key] = std::move(values);
  }
  [[nodiscard]] bool has(const std::string& key) const { return values_.count(key) != 0; }
  [[nodiscard]] const std::map<std::string, Value>& values() const { return values_; }

  [[nodiscard]] PolicyParams to_policy_params() const;
  /// "recent=28 sinks=4" (lists as "anchor_ids=258,259"); "" when empty.
  [[nodiscard]] std::string to_string() const;
  /// {"recent": 28, "sinks": 4, "anchor_ids": [258]}.
  [[nodiscard]] nlohmann::ordered_json to_json() const;

 private:
  std::map<std::string, Value> values_;
};

/// Names of the policies, comma-separated, for messages and --help.
[[nodiscard]] std::string policy_list();

/// What --budget N stands for in policy `policy` (`sinks` protected first tokens where the policy
/// has sinks):
///   window recent=N; streaming_llm sinks=S recent=N-S; h2o heavy=N/2 recent=N-N/2; tova budget=N;
///   sirllm sinks=S entropy=N-S; random_llm / interval_llm sinks=S budget=N-S;
///   infinipot pot=N keep=N/2 novel=N/4; anllm max_slots=N.
/// Throws for `full` (it has no budget), N < 1, and N <= S where sinks are protected.
[[nodiscard]] ParamValues budget_params(std::string_view policy, int budget, int sinks);

/// Parses one --param "key=value" into `values`. The value is a number, or a comma-separated list
/// of integers for list parameters (anchor_ids) and whenever it holds a comma.
void apply_param(ParamValues& values, std::string_view key_value);

/// The parameters the options give policy options.policy: the budget mapping, then --sinks, then
/// every --param. With a tokenizer, AnLLM's anchor_ids default to the tokenizer's anchor token
/// (an error when it has none and none were given); without one that default is left open.
[[nodiscard]] ParamValues resolve_params(const PolicyOptions& options,
                                         const model::Tokenizer* tokenizer);

/// Checks everything that does not need the model (names, sizes, the budget mapping, parameter
/// syntax, and the policy's own validation where it can already be built), so that a bad option
/// fails before a large model is loaded.
void validate_policy_options(const PolicyOptions& options);

/// A configured policy, ready to become a decoder.
struct PolicySetup {
  std::string name;
  ParamValues params;
  std::unique_ptr<Policy> policy;
  model::DecoderOptions decoder_options;
  /// Catalyst prompt tokens for a policy that runs one (InfiniPot); nullopt otherwise.
  std::optional<std::vector<std::int32_t>> catalyst;
};

[[nodiscard]] PolicySetup make_policy_setup(const PolicyOptions& options,
                                            const model::Model& model);

/// A decoder over `model` (which must outlive it) with the setup's policy and catalyst. The setup's
/// policy is moved into the decoder.
[[nodiscard]] std::unique_ptr<model::Decoder> make_decoder(const model::Model& model,
                                                           PolicySetup& setup);

/// "streaming_llm (recent=28 sinks=4), positions cache_index, keys post_rope, chunk 64".
[[nodiscard]] std::string describe_policy(const PolicySetup& setup, const model::Decoder& decoder);
/// {"name", "params", "positions", "keys", "chunk", "catalyst_tokens" (when it has one)}.
[[nodiscard]] nlohmann::ordered_json policy_json(const PolicySetup& setup,
                                                 const model::Decoder& decoder);

}  // namespace kvevict::cli
