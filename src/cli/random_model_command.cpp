// `kvevict random-model --out PATH ...`: writes a deterministic random Llama (make_random_model)
// as GGUF, safetensors or a llama2.c checkpoint, so that the demo and the tests run end to end
// without a trained model. Same options, same bytes, on every platform.
#include <fmt/format.h>

#include <cstdint>
#include <filesystem>
#include <iostream>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/model/random_model.hpp>
#include <memory>
#include <string>
#include <system_error>

#include "command.hpp"
#include "harness/report.hpp"
#include "model/model_io.hpp"

namespace kvevict::cli {
namespace {

struct RandomModelOptions {
  std::string out;
  std::string format = "gguf";
  int dim = 64;
  int layers = 2;
  int heads = 4;
  int kv_heads = 2;
  int hidden = 172;
  int vocab = 259;  // bytes + BOS, EOS and the AnLLM anchor "<AC>"
  int context = 256;
  std::uint64_t seed = 1;
  std::string dtype = "f32";
  bool tied = false;
};

model::DType parse_dtype(const std::string& text) {
  if (text == "f32") return model::DType::f32;
  if (text == "f16") return model::DType::f16;
  if (text == "bf16") return model::DType::bf16;
  throw Error(fmt::format("--dtype must be f32, f16 or bf16, got '{}'", text));
}

void require_positive(int value, const char* option) {
  if (value < 1) throw Error(fmt::format("{} must be at least 1, got {}", option, value));
}

// Writes through a temporary file and renames it, so that an interrupted run never leaves a
// truncated model where a build expects a complete one.
template <class Write>
void write_atomically(const std::filesystem::path& path, Write write) {
  std::filesystem::path temporary = path;
  temporary += ".tmp";
  write(temporary);
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) {
    std::filesystem::remove(temporary, error);
    throw Error(fmt::format("cannot move the model into place at '{}'", path.string()));
  }
}

int run_random_model(const RandomModelOptions& options) {
  if (options.format != "gguf" && options.format != "safetensors" && options.format != "llama2c") {
    throw Error(
        fmt::format("--format must be gguf, safetensors or llama2c, got '{}'", options.format));
  }
  require_positive(options.dim, "--dim");
  require_positive(options.layers, "--layers");
  require_positive(options.heads, "--heads");
  require_positive(options.kv_heads, "--kv-heads");
  require_positive(options.hidden, "--hidden");
  require_positive(options.vocab, "--vocab");
  require_positive(options.context, "--context");
  const model::DType dtype = parse_dtype(options.dtype);

  model::ModelConfig config;
  config.dim = options.dim;
  config.hidden_dim = options.hidden;
  config.layers = options.layers;
  config.heads = options.heads;
  config.kv_heads = options.kv_heads;
  config.vocab_size = options.vocab;
  config.context_length = options.context;
  config.tied_embeddings = options.tied;
  try {
    config.validate();
  } catch (const Error& error) {
    throw Error(fmt::format("invalid dimensions: {}", error.what()));
  }
  const model::Model model = model::make_random_model(config, options.seed, dtype);

  const std::filesystem::path out = options.out;
  std::error_code error;
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path(), error);
  if (options.format == "gguf") {
    write_atomically(out,
                     [&](const std::filesystem::path& path) { model::write_gguf(model, path); });
  } else if (options.format == "llama2c") {
    write_atomically(out,
                     [&](const std::filesystem::path& path) { model::write_llama2c(model, path); });
  } else {
    model::write_safetensors(model, out);  // a directory: model.safetensors + config.json
  }
  std::cout << fmt::format(
      "wrote {} ({}, {}, {} layers, dim {}, hidden {}, {} heads / {} KV heads, vocab {}, context "
      "{}, seed {}): {} of weights\n",
      out.string(), options.format, options.dtype, config.layers, config.dim, config.hidden_dim,
      config.heads, config.kv_heads, config.vocab_size, config.context_length, options.seed,
      format_bytes(model.weight_bytes()));
  return kExitOk;
}

}  // namespace

Command add_random_model_command(CLI::App& parent) {
  auto options = std::make_shared<RandomModelOptions>();
  CLI::App* app = parent.add_subcommand(
      "random-model", "Write a deterministic random Llama model (GGUF, safetensors or llama2.c)");
  app->add_option("-o,--out", options->out,
                  "output path (safetensors: a directory for model.safetensors + config.json)")
      ->required();
  app->add_option("--format", options->format, "gguf, safetensors or llama2c (f32, no tokenizer)")
      ->capture_default_str();
  app->add_option("--dim", options->dim, "model width")->capture_default_str();
  app->add_option("--layers", options->layers, "transformer layers")->capture_default_str();
  app->add_option("--heads", options->heads, "query heads")->capture_default_str();
  app->add_option("--kv-heads", options->kv_heads, "key/value heads (divides --heads)")
      ->capture_default_str();
  app->add_option("--hidden", options->hidden, "SwiGLU inner width")->capture_default_str();
  app->add_option("--vocab", options->vocab, "vocabulary size (256 bytes + specials)")
      ->capture_default_str();
  app->add_option("--context", options->context, "context length recorded in the file")
      ->capture_default_str();
  app->add_option("--seed", options->seed, "weight seed")->capture_default_str();
  app->add_option("--dtype", options->dtype, "weight dtype: f32, f16 or bf16")
      ->capture_default_str();
  app->add_flag("--tied", options->tied, "tie the output head to the token embedding");
  app->footer(
      "Write a deterministic random Llama model (weights from --seed; byte-level tokenizer with\n"
      "BOS 256, EOS 257 and the AnLLM anchor <AC> 258 where --vocab holds them), for demos and\n"
      "tests before trained models exist. The same options give the same bytes on every\n"
      "platform.\n"
      "\n"
      "Examples:\n"
      "  kvevict random-model --out models/random-tiny.gguf\n"
      "  kvevict random-model --out models/random-small --format safetensors --dim 256 \\\n"
      "      --layers 4 --heads 8 --kv-heads 2 --hidden 688 --dtype bf16");
  return Command{app, [options] { return run_random_model(*options); }};
}

}  // namespace kvevict::cli
