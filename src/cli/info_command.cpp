// `kvevict info MODEL [--json]` (or --model MODEL): what a model file holds (format,
// architecture, tokenizer, weight bytes by dtype) and what its KV cache costs per token, in
// kvevict's store.
#include <fmt/format.h>

#include <cstdint>
#include <filesystem>
#include <iostream>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/slot_table.hpp>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "cli/options.hpp"
#include "command.hpp"
#include "harness/policy_setup.hpp"
#include "harness/report.hpp"

namespace kvevict::cli {
namespace {

struct InfoOptions {
  std::string model;
  bool json = false;
};

std::string_view layout_name(RopeLayout layout) {
  return layout == RopeLayout::half_split ? "half_split" : "interleaved";
}

std::string_view tokenizer_kind(model::Tokenizer::Kind kind) {
  return kind == model::Tokenizer::Kind::byte_level ? "byte_level" : "sentencepiece";
}

// Bytes of every weight by in-memory dtype (norms are f32; a tied classifier counts once).
std::map<std::string, std::uint64_t> weight_bytes_by_dtype(const model::Model& model) {
  std::map<std::string, std::uint64_t> bytes;
  const auto add_matrix = [&](const model::WeightMatrix& matrix) {
    bytes[std::string(model::to_string(matrix.dtype))] += matrix.bytes();
  };
  const auto add_norm = [&](const std::vector<float>& norm) {
    bytes["f32"] += norm.size() * sizeof(float);
  };
  add_matrix(model.token_embedding);
  if (model.output.data != model.token_embedding.data) add_matrix(model.output);
  add_norm(model.final_norm);
  for (const model::LayerWeights& layer : model.layers) {
    add_norm(layer.attention_norm);
    add_norm(layer.ffn_norm);
    for (const model::WeightMatrix* matrix :
         {&layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.w_gate, &layer.w_up, &layer.w_down}) {
      add_matrix(*matrix);
    }
  }
  return bytes;
}

// Slot metadata bytes per token of each policy at its own granularity (one metadata row per
// decision unit: per KV head, per layer, or one for the whole model), from an instance built with
// a nominal budget (neither the column count nor the granularity depends on the budget).
std::map<std::string, std::uint64_t> metadata_bytes_by_policy(const model::ModelConfig& c) {
  std::map<std::string, std::uint64_t> bytes;
  for (const PolicySpec* spec : policy_specs()) {
    PolicyParams params;
    if (spec->budget != nullptr) params = spec->budget(64, kDefaultSinks);
    if (spec->find("anchor_ids") != nullptr) params.set_list("anchor_ids", {0});
    const std::unique_ptr<Policy> policy = spec->make(spec->resolve(params));
    const UnitLayout units(c.layers, c.kv_heads, policy->default_granularity());
    const SlotTable one_slot(UnitLayout(1, 1, Granularity::head), PositionMode::original, 1,
                             policy->score_columns());
    bytes[std::string(spec->name)] =
        static_cast<std::uint64_t>(units.units()) * one_slot.bytes_per_slot();
  }
  return bytes;
}

// Metadata bytes of one slot with `score_columns` policy columns (SlotTable's own accounting).
std::uint64_t metadata_bytes_per_slot(int score_columns) {
  return SlotTable(UnitLayout(1, 1, Granularity::head), PositionMode::original, 1, score_columns)
      .bytes_per_slot();
}

nlohmann::ordered_json info_json(const std::string& path, const model::Model& model) {
  const model::ModelConfig& c = model.config;
  const std::uint64_t head_caches = static_cast<std::uint64_t>(c.layers) * c.kv_heads;
  nlohmann::ordered_json json;
  json["path"] = path;
  json["format"] = model.format;
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) {
    json["file_bytes"] = std::filesystem::file_size(path, error);
  }
  nlohmann::ordered_json& config = json["config"];
  config["dim"] = c.dim;
  config["hidden_dim"] = c.hidden_dim;
  config["layers"] = c.layers;
  config["heads"] = c.heads;
  config["kv_heads"] = c.kv_heads;
  config["head_dim"] = c.head_dim();
  config["vocab_size"] = c.vocab_size;
  config["context_length"] = c.context_length;
  config["rope_theta"] = c.rope_theta;
  config["rope_layout"] = layout_name(c.rope_layout);
  config["rotary_dim"] = c.rotary_dim == 0 ? c.head_dim() : c.rotary_dim;
  // The float's shortest decimal (1e-05), not its widened double (9.99999974737875e-06).
  config["norm_eps"] = std::stod(fmt::format("{}", c.norm_eps));
  config["tied_embeddings"] = c.tied_embeddings;

  const model::Tokenizer& t = model.tokenizer;
  nlohmann::ordered_json& tokenizer = json["tokenizer"];
  tokenizer["kind"] = tokenizer_kind(t.kind);
  tokenizer["vocab_size"] = t.vocab_size;
  tokenizer["bos_id"] = t.bos_id;
  tokenizer["eos_id"] = t.eos_id;
  tokenizer["anchor_id"] = t.anchor_id;

  nlohmann::ordered_json& weights = json["weights"];
  weights["total_bytes"] = model.weight_bytes();
  weights["bytes_by_dtype"] = weight_bytes_by_dtype(model);

  nlohmann::ordered_json& kv = json["kv_cache"];
  kv["kv_bytes_per_token"] = head_caches * c.head_dim() * 2 * sizeof(float);
  kv["metadata_bytes_per_token"] = head_caches * metadata_bytes_per_slot(0);
  kv["metadata_bytes_per_score_column"] = head_caches * sizeof(float);
  nlohmann::ordered_json& by_policy = kv["metadata_bytes_per_token_by_policy"];
  for (const auto& [name, bytes] : metadata_bytes_by_policy(c)) by_policy[name] = bytes;
  return json;
}

void print_text(const nlohmann::ordered_json& json) {
  const auto& config = json["config"];
  const auto& tokenizer = json["tokenizer"];
  const auto& weights = json["weights"];
  const auto& kv = json["kv_cache"];
  std::string out;
  out += fmt::format("model          {}\n", json["path"].get<std::string>());
  out += fmt::format("format         {}", json["format"].get<std::string>());
  if (json.contains("file_bytes")) {
    out += fmt::format(" ({})", format_bytes(json["file_bytes"].get<std::uint64_t>()));
  }
  out += '\n';
  out += fmt::format("architecture   Llama: {} layers, dim {}, hidden {}\n",
                     config["layers"].get<int>(), config["dim"].get<int>(),
                     config["hidden_dim"].get<int>());
  out +=
      fmt::format("attention      {} heads, {} KV heads, head_dim {}\n", config["heads"].get<int>(),
                  config["kv_heads"].get<int>(), config["head_dim"].get<int>());
  out += fmt::format("vocabulary     {} ({}; bos {}, eos {}, anchor {})\n",
                     config["vocab_size"].get<int>(), tokenizer["kind"].get<std::string>(),
                     tokenizer["bos_id"].get<int>(), tokenizer["eos_id"].get<int>(),
                     tokenizer["anchor_id"].get<int>());
  out += fmt::format("context        {}\n", config["context_length"].get<int>());
  out += fmt::format("rope           theta {}, {} layout, rotary_dim {}\n",
                     config["rope_theta"].get<double>(), config["rope_layout"].get<std::string>(),
                     config["rotary_dim"].get<int>());
  out += fmt::format("norm eps       {}\n", config["norm_eps"].get<float>());
  out += fmt::format("tied           {}\n", config["tied_embeddings"].get<bool>() ? "yes" : "no");
  out += fmt::format("weights        {} ({} bytes)",
                     format_bytes(weights["total_bytes"].get<std::uint64_t>()),
                     weights["total_bytes"].get<std::uint64_t>());
  for (const auto& [dtype, bytes] : weights["bytes_by_dtype"].items()) {
    out += fmt::format(", {} {}", dtype, format_bytes(bytes.get<std::uint64_t>()));
  }
  out += '\n';
  out += fmt::format(
      "KV per token   {} bytes of keys + values (layers x kv_heads x head_dim x 2 x 4)\n",
      kv["kv_bytes_per_token"].get<std::uint64_t>());
  out += fmt::format(
      "               + {} bytes of kvevict slot metadata at one keep-set per KV head, + {} per "
      "score "
      "column; by policy, at its granularity:\n",
      kv["metadata_bytes_per_token"].get<std::uint64_t>(),
      kv["metadata_bytes_per_score_column"].get<std::uint64_t>());
  std::string policies;
  for (const auto& [name, bytes] : kv["metadata_bytes_per_token_by_policy"].items()) {
    policies +=
        fmt::format("{}{} {}", policies.empty() ? "" : ", ", name, bytes.get<std::uint64_t>());
  }
  out += fmt::format("               {}\n", policies);
  std::cout << out << std::flush;
}

int run_info(const InfoOptions& options) {
  const model::Model model = load_model_file(options.model);
  const nlohmann::ordered_json json = info_json(options.model, model);
  if (options.json) {
    std::cout << dump_json(json) << '\n' << std::flush;
  } else {
    print_text(json);
  }
  if (!std::cout) throw Error("error while writing to stdout");
  return kExitOk;
}

}  // namespace

Command add_info_command(CLI::App& parent) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* app =
      parent.add_subcommand("info", "Describe a model file and its KV-cache cost per token");
  add_model_option(*app, options->model);
  app->add_flag("--json", options->json, "print one JSON object");
  app->footer(
      "Describe a model file: format, architecture (layers, dims, heads, KV heads, head_dim),\n"
      "vocabulary and tokenizer, context length, RoPE theta and layout, norm eps, tied\n"
      "embeddings, weight bytes by dtype, and KV-cache bytes per token (keys + values, plus\n"
      "kvevict's per-slot metadata, shown separately and per policy).\n"
      "\n"
      "Examples:\n"
      "  kvevict info models/toy-base\n"
      "  kvevict info --model models/toy-anchor --json");
  return Command{app, [options] { return run_info(*options); }};
}

}  // namespace kvevict::cli
