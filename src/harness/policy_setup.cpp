#include "harness/policy_setup.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <kvevict/allocation.hpp>
#include <kvevict/error.hpp>
#include <kvevict/granularity.hpp>
#include <kvevict/kv_type.hpp>
#include <kvevict/policies/infinipot.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/positions.hpp>
#include <kvevict/signals.hpp>
#include <optional>
#include <utility>
#include <variant>

#include "harness/report.hpp"

namespace kvevict::harness {
namespace {

// The spec's parameters, resolved, with the policy named in messages and a hint for a missing
// one.
PolicyParams resolved(const PolicySpec& spec, const PolicyParams& given) {
  try {
    return spec.resolve(given);
  } catch (const Error& error) {
    const std::string message = error.what();
    const bool missing = message.find("missing parameter") != std::string::npos;
    throw Error(message + (missing ? " (give --budget N, or --param KEY=VALUE)" : ""));
  }
}

// Whether policy `spec` takes a `sinks` parameter (--sinks applies to it).
bool has_sinks(const PolicySpec& spec) { return spec.find("sinks") != nullptr; }

// The sinks --budget counts for `spec`: --sinks when the budget mapping takes them (streaming_llm,
// sirllm, random_llm, interval_llm) or they were given (tova's sinks), else none.
int sinks_in_budget(const PolicySpec& spec, const PolicyOptions& options) {
  if (!has_sinks(spec)) return 0;
  if (options.sinks_given) return options.sinks;
  // A budget one above the sinks is valid for every mapping: whether it sets "sinks" tells.
  const bool mapped = spec.budget(options.sinks + 1, options.sinks).has("sinks");
  return mapped ? options.sinks : 0;
}

// --budget N keeps the protected first tokens (sinks) inside N, and a policy needs a slot besides
// them (streaming_llm's recent, sirllm's entropy, random_llm's and interval_llm's budget, tova's
// attention-ranked slots): N must be larger than the sinks. A policy that evicts only before a turn
// also makes room for a turn's first chunk before feeding it, so it needs the sinks plus a chunk.
// The error says the smallest N that works.
void check_budget_holds_sinks(const PolicySpec& spec, const PolicyOptions& options) {
  if (!options.budget || *options.budget < 1 || spec.budget == nullptr || options.sinks < 0 ||
      options.sinks >= kMaxSlotsParam) {
    return;
  }
  const int sinks = sinks_in_budget(spec, options);
  if (sinks == 0 || *options.budget > sinks) return;
  PolicyParams smallest = spec.budget(sinks + 1, sinks);
  if (options.sinks_given) smallest.set("sinks", sinks);
  const bool per_turn = evicts_only_before_turns(*spec.make(spec.resolve(smallest)));
  const std::string rule =
      per_turn ? fmt::format(
                     "it evicts only before a turn and makes room for a turn's first chunk "
                     "first, so it needs the sinks plus one chunk (--chunk {}): --budget "
                     "{} at least (or fewer --sinks, or a smaller --chunk)",
                     options.chunk, sinks + options.chunk)
               : fmt::format(
                     "it needs at least one slot besides them: --budget {} at least (or "
                     "fewer --sinks)",
                     sinks + 1);
  throw Error(fmt::format(
      "--budget {} leaves no room beside the protected set: {} keeps its {} sinks (--sinks {}) "
      "inside the budget, and {}",
      *options.budget, spec.name, sinks, sinks, rule));
}

}  // namespace

int budget_from_bytes(std::int64_t bytes, int layers, int kv_heads, int head_dim, KvType kv_type) {
  const auto token_bytes = static_cast<std::int64_t>(2 * kv_row_bytes(kv_type, head_dim));
  const std::int64_t per_token = std::int64_t{layers} * kv_heads * token_bytes;
  const std::int64_t tokens = bytes / per_token;
  if (tokens < 1) {
    throw Error(fmt::format(
        "--budget-bytes {} is smaller than one row per head: the model's {} layers x {} KV heads "
        "hold {} bytes per token in {} (keys and values), so {} bytes at least",
        bytes, layers, kv_heads, per_token, to_string(kv_type), per_token));
  }
  return static_cast<int>(std::min(tokens, static_cast<std::int64_t>(kMaxSlotsParam)));
}

void check_threads(int threads) {
  if (threads < 1 || threads > 1024) {
    throw Error(fmt::format("--threads must be in [1, 1024], got {}", threads));
  }
}

PolicyParams resolve_params(const PolicyOptions& options, const model::Tokenizer* tokenizer) {
  PolicyParams params;
  check_budget_holds_sinks(policy_spec(options.policy), options);
  if (options.budget) params = budget_params(options.policy, *options.budget, options.sinks);
  if (options.sinks_given) params.set("sinks", options.sinks);
  for (const std::string& param : options.params) {
    try {
      params.parse_pair(param);
    } catch (const Error& error) {
      throw Error(fmt::format("--param: {}", error.what()));
    }
  }
  if (options.policy == "anllm" && !params.has("anchor_ids") && tokenizer != nullptr) {
    if (tokenizer->anchor_id < 0) {
      throw Error(
          "policy 'anllm' needs anchor token ids and the model's tokenizer has no <AC> anchor "
          "token: give --param anchor_ids=ID[,ID...]");
    }
    params.set_list("anchor_ids", {tokenizer->anchor_id});
  }
  return params;
}

void validate_policy_options(const PolicyOptions& options) {
  const PolicySpec& spec = policy_spec(options.policy);
  if (options.chunk < 1 || options.chunk > kMaxChunk) {
    throw Error(fmt::format("--chunk must be in [1, {}], got {}", kMaxChunk, options.chunk));
  }
  if (options.sinks < 0) throw Error(fmt::format("--sinks must be >= 0, got {}", options.sinks));
  if (options.budget && options.budget_bytes) {
    throw Error(fmt::format(
        "--budget {} and --budget-bytes {}: give the budget in tokens or in bytes, not both",
        *options.budget, *options.budget_bytes));
  }
  if (options.budget_bytes && *options.budget_bytes < 1) {
    throw Error(fmt::format("--budget-bytes must be positive, got {}", *options.budget_bytes));
  }
  Allocation allocation = Allocation::uniform;
  try {
    allocation = parse_allocation(options.allocation);
  } catch (const Error& error) {
    throw Error(fmt::format("--allocation: {}", error.what()));
  }
  if (!(options.adaptive_floor >= 0.0 && options.adaptive_floor <= 1.0)) {
    throw Error(fmt::format("--adaptive-floor must be in [0, 1], got {}", options.adaptive_floor));
  }
  if (options.pyramid_beta < 1) {
    throw Error(fmt::format("--pyramid-beta must be >= 1, got {}", options.pyramid_beta));
  }
  if (options.sinks_given && !has_sinks(spec)) {
    throw Error(
        fmt::format("--sinks does not apply to policy '{}' (it has no sinks)", options.policy));
  }
  try {
    if (!options.positions.empty()) (void)parse_position_mode(options.positions);
  } catch (const Error& error) {
    throw Error(fmt::format("--positions: {}", error.what()));
  }
  try {
    if (!options.granularity.empty()) (void)parse_granularity(options.granularity);
  } catch (const Error& error) {
    throw Error(fmt::format("--granularity: {}", error.what()));
  }
  try {
    (void)parse_key_storage(options.keys);
  } catch (const Error& error) {
    throw Error(fmt::format("--keys: {}", error.what()));
  }
  try {
    (void)parse_kv_type(options.kv_type);
  } catch (const Error& error) {
    throw Error(fmt::format("--kv-type: {}", error.what()));
  }
  try {
    (void)model::parse_decode_activations(options.decode_activations);
  } catch (const Error& error) {
    throw Error(fmt::format("--decode-activations: {}", error.what()));
  }
  // A byte budget becomes a token budget once the model's shape is known: check at a budget of
  // 64 tokens per head until then.
  PolicyOptions typed = options;
  if (options.budget_bytes) typed.budget = 64;
  const PolicyParams params = resolve_params(typed, nullptr);
  // AnLLM's default anchor ids come from the model; every other policy can be built now.
  if (options.policy == "anllm" && !params.has("anchor_ids")) return;
  const std::unique_ptr<Policy> policy = spec.make(resolved(spec, params));
  if (allocation != Allocation::uniform && !policy->score_rule()) {
    throw Error(fmt::format("--allocation {}: policy '{}' {}", options.allocation, options.policy,
                            kNoScoreRule));
  }
  if (!options.granularity.empty() &&
      parse_granularity(options.granularity).kind() == Granularity::Kind::block &&
      !policy->supports_blocks()) {
    throw Error(
        fmt::format("--granularity {}: policy '{}' has no block form of its keep rule (window, "
                    "streaming_llm, h2o, tova and full have one)",
                    options.granularity, options.policy));
  }
  if (options.catalyst && !policy->signals().contains(Signal::catalyst_attention)) {
    throw Error(fmt::format(
        "--catalyst does not apply to policy '{}' (only infinipot runs a catalyst prompt)",
        options.policy));
  }
}

PolicySetup make_policy_setup(const PolicyOptions& given, const model::Model& model) {
  validate_policy_options(given);
  PolicyOptions options = given;
  const KvType kv_type = parse_kv_type(options.kv_type);
  if (options.budget_bytes) {
    try {
      check_kv_type(kv_type, model.config.head_dim());
    } catch (const Error& error) {
      throw Error(fmt::format("--kv-type: {}", error.what()));
    }
    options.budget = budget_from_bytes(*options.budget_bytes, model.config.layers,
                                       model.config.kv_heads, model.config.head_dim(), kv_type);
  }
  const PolicySpec& spec = policy_spec(options.policy);
  PolicySetup setup;
  setup.name = options.policy;
  setup.params = resolved(spec, resolve_params(options, &model.tokenizer));
  setup.policy = spec.make(setup.params);
  if (!options.positions.empty()) {
    setup.decoder_options.position_mode = parse_position_mode(options.positions);
  }
  if (!options.granularity.empty()) {
    setup.decoder_options.granularity = parse_granularity(options.granularity);
  }
  setup.decoder_options.key_storage = parse_key_storage(options.keys);
  setup.decoder_options.kv_type = parse_kv_type(options.kv_type);
  try {
    check_kv_type(setup.decoder_options.kv_type, model.config.head_dim());
  } catch (const Error& error) {
    throw Error(fmt::format("--kv-type: {}", error.what()));
  }
  setup.decoder_options.max_chunk = options.chunk;
  // Uniform under a byte budget is the --budget it holds per head (any bounded policy takes it);
  // pyramid and adaptive split the bytes themselves (policies/allocated.hpp).
  setup.decoder_options.allocation = parse_allocation(options.allocation);
  setup.decoder_options.pyramid_beta = options.pyramid_beta;
  setup.decoder_options.adaptive_floor = options.adaptive_floor;
  if (options.budget_bytes && setup.decoder_options.allocation != Allocation::uniform) {
    setup.decoder_options.budget_bytes = *options.budget_bytes;
  }
  setup.budget_bytes = options.budget_bytes;
  setup.decoder_options.decode_activations =
      model::parse_decode_activations(options.decode_activations);
  if (setup.policy->signals().contains(Signal::catalyst_attention)) {
    const std::string text =
        options.catalyst.value_or(std::string(kInfiniPotGeneralCatalystPrompt));
    // No BOS: the catalyst continues the context, it does not start a sequence.
    setup.catalyst = model.tokenizer.encode(text, /*add_bos=*/false);
  }
  return setup;
}

std::unique_ptr<model::Decoder> make_decoder(const model::Model& model, PolicySetup& setup) {
  KVEVICT_REQUIRE(setup.policy != nullptr, "make_decoder: the setup's policy was already used");
  auto decoder =
      std::make_unique<model::Decoder>(model, std::move(setup.policy), setup.decoder_options);
  if (setup.catalyst) decoder->set_catalyst(*setup.catalyst);
  return decoder;
}

nlohmann::ordered_json params_json(const PolicyParams& params) {
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  for (const auto& [key, value] : params.values()) {
    if (const auto* number = std::get_if<double>(&value)) {
      const bool integral = *number == std::floor(*number) && std::fabs(*number) < 9.0e15;
      json[key] = integral ? nlohmann::ordered_json(static_cast<std::int64_t>(*number))
                           : nlohmann::ordered_json(*number);
    } else if (const auto* word = std::get_if<std::string>(&value)) {
      json[key] = *word;
    } else {
      json[key] = std::get<std::vector<std::int64_t>>(value);
    }
  }
  return json;
}

std::string describe_policy(const PolicySetup& setup, const model::Decoder& decoder) {
  const std::string params = setup.params.to_string();
  const Sequence& sequence = decoder.cache().sequence();
  const model::DecodeActivations activations = decoder.options().decode_activations;
  const Allocation allocation = decoder.options().allocation;
  return fmt::format(
      "{}{}{}{}, positions {}, granularity {}, keys {}, chunk {}{}{}", setup.name,
      params.empty() ? std::string() : " (" + params + ")",
      allocation == Allocation::uniform ? std::string()
                                        : ", allocation " + std::string(to_string(allocation)),
      setup.budget_bytes ? fmt::format(", budget {} bytes", *setup.budget_bytes) : std::string(),
      to_string(sequence.position_mode()), to_string(sequence.granularity()),
      to_string(decoder.options().key_storage), decoder.options().max_chunk,
      describe_kv_type(decoder.options().kv_type),
      activations == model::DecodeActivations::f32
          ? std::string()
          : ", decode activations " + std::string(to_string(activations)));
}

std::string keep_set_text(Granularity granularity) {
  switch (granularity.kind()) {
    case Granularity::Kind::head:
      return "one keep-set per KV head";
    case Granularity::Kind::layer:
      return "one keep-set per layer";
    case Granularity::Kind::token:
      return "one keep-set for the whole model, per token";
    case Granularity::Kind::block:
      return fmt::format("one keep-set for the whole model, in blocks of {} tokens",
                         granularity.block_tokens());
  }
  return "";
}

std::string describe_granularity(const PolicySetup& setup, const model::Decoder& decoder) {
  const Sequence& sequence = decoder.cache().sequence();
  const Granularity used = sequence.granularity();
  const std::string head = fmt::format("{}: {}", to_string(used), keep_set_text(used));
  if (setup.decoder_options.granularity) return head + " (--granularity)";
  if (used.kind() == Granularity::Kind::token) {
    return fmt::format("{} ({}'s default, and kvevict-llama's)", head, setup.name);
  }
  return fmt::format(
      "{} ({}'s default; kvevict-llama decides per token, as llama.cpp's cells are: "
      "--granularity token here decides as it does)",
      head, setup.name);
}

std::string describe_kv_type(KvType type) {
  return type == KvType::f32 ? std::string() : ", kv " + std::string(to_string(type));
}

nlohmann::ordered_json policy_json(const PolicySetup& setup, const model::Decoder& decoder) {
  const Sequence& sequence = decoder.cache().sequence();
  nlohmann::ordered_json json;
  json["name"] = setup.name;
  json["params"] = params_json(setup.params);
  json["positions"] = std::string(to_string(sequence.position_mode()));
  json["granularity"] = std::string(to_string(sequence.granularity()));
  json["keys"] = std::string(to_string(decoder.options().key_storage));
  json["kv_type"] = std::string(to_string(decoder.options().kv_type));
  json["decode_activations"] = std::string(to_string(decoder.options().decode_activations));
  json["chunk"] = decoder.options().max_chunk;
  // Only when not uniform, so that earlier results' policy records stay as they were.
  if (decoder.options().allocation != Allocation::uniform) {
    json["allocation"] = std::string(to_string(decoder.options().allocation));
  }
  if (setup.budget_bytes) json["budget_bytes"] = *setup.budget_bytes;
  if (setup.catalyst) json["catalyst_tokens"] = setup.catalyst->size();
  return json;
}

bool evicts_only_before_turns(const Policy& policy) {
  const TriggerSet triggers = policy.triggers();
  return triggers.contains(Trigger::before_turn) && !triggers.contains(Trigger::after_forward) &&
         !triggers.contains(Trigger::anchor) && !triggers.contains(Trigger::pot_full);
}

void warn_if_single_turn(const Policy& policy, bool input_has_turns) {
  if (input_has_turns || !evicts_only_before_turns(policy)) return;
  warn(fmt::format(
      "{} evicts only before a turn, and this input is one turn (no --turn-separator, or it never "
      "occurs): nothing is evicted and the cache holds every token",
      policy.name()));
}

void warn_if_past_context(const model::Decoder& decoder, const model::ModelConfig& config,
                          std::int64_t tokens) {
  if (config.context_length <= 0) return;
  const Sequence& sequence = decoder.cache().sequence();
  // RoPE sees the distance between a query and a key. Under original positions a policy may keep
  // the first token to the end (the full cache, sinks, heavy hitters): distances reach tokens - 1.
  // The shifting modes keep them below what the policy retains plus one chunk.
  std::int64_t distance = tokens - 1;
  const std::optional<int> retained = sequence.policy().retained_limit();
  if (sequence.position_mode() != PositionMode::original && retained) {
    distance =
        std::min<std::int64_t>(distance, std::int64_t{*retained} + decoder.options().max_chunk);
  }
  if (distance < config.context_length) return;
  warn(fmt::format(
      "{} tokens put keys up to {} positions behind the query (positions {}), past the model's "
      "trained context of {}: expect worse predictions beyond it{}",
      tokens, distance, to_string(sequence.position_mode()), config.context_length,
      sequence.position_mode() == PositionMode::original && retained
          ? "; --positions cache_index keeps distances within the policy's budget"
          : ""));
}

}  // namespace kvevict::harness
