// llama-bench's two tests, run by kvevict's reference decoder on a GGUF file, so that the two
// programs can be compared on the same weights (bench/compare_llama_cpp.sh):
//
//   pp<P>: one forward of a prompt of P random tokens (the first one BOS) into an empty cache;
//   tg<N>: N forwards of one token each, from an empty cache (llama-bench's "generation").
//
// Each test runs once untimed (warm-up), then --repetitions times; the line printed is
// "<test> <mean tokens/s> <standard deviation>" over those, wall time, like llama-bench's avg_ts.
// The policy is "full" (no eviction), keys stored after RoPE (the decoder's default).
//
//   pp_tg --model m.gguf [-p 512] [-n 128] [-r 5] [-t 1] [--target AVX2]
//         [--decode-activations f32|q8_0]
//   pp_tg --write-stories15m out.gguf --dtype f32|f16|bf16|q8_0|q4_0
//   pp_tg --write-tinyllama out.gguf --dtype f32|f16|bf16|q8_0|q4_0
//
// --write-stories15m writes a stories15M-shaped Llama (dim 288, 6 layers, 6 heads, hidden 768,
// vocab 32000, untied classifier), --write-tinyllama one of TinyLlama-1.1B's shape (dim 2048, 16
// layers, 32 query / 8 KV heads, hidden 5632, vocab 32000, untied: 0.85B weights, 1.7 GB in F16),
// with random weights (make_random_model, seed 1) through kvevict's GGUF writer, with a
// SentencePiece vocabulary of placeholder pieces (<unk>, <s>, </s>, the 256 byte pieces, then
// "▁t<i>") that llama.cpp accepts. --target runs every kernel on one
// SIMD target (kernels::available_targets(), e.g. AVX2 to match a llama.cpp built for AVX2).
// --decode-activations q8_0 multiplies Q8_0 / Q4_0 weights by 8-bit activations when decoding
// (model::DecodeActivations), as llama.cpp does; f32 (the default) keeps the f32 ones.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <kvevict/error.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policy_registry.hpp>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/kernels/kernels.hpp"
#include "model/model_io.hpp"

namespace {

using namespace kvevict;
using model::DType;

struct Options {
  std::string model;
  std::string write_path;
  std::string write_shape;  // "stories15m" or "tinyllama"
  std::string dtype = "f32";
  std::string target;
  model::DecodeActivations decode_activations = model::DecodeActivations::f32;
  int prompt = 512;
  int generate = 128;
  int repetitions = 5;
  int threads = 1;
};

DType parse_dtype(const std::string& text) {
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16, DType::q8_0, DType::q4_0}) {
    if (text == model::to_string(dtype)) return dtype;
  }
  throw Error("--dtype must be f32, f16, bf16, q8_0 or q4_0, got '" + text + "'");
}

int parse_count(const std::string& flag, const char* text) {
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  KVEVICT_REQUIRE(end != text && *end == '\0' && value > 0 && value <= 1 << 20,
                  flag + " needs a positive count, got '" + text + "'");
  return static_cast<int>(value);
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    KVEVICT_REQUIRE(i + 1 < argc, "option " + flag + " needs a value");
    const char* value = argv[++i];
    if (flag == "--model" || flag == "-m") {
      options.model = value;
    } else if (flag == "--write-stories15m" || flag == "--write-tinyllama") {
      options.write_path = value;
      options.write_shape = flag.substr(std::string("--write-").size());
    } else if (flag == "--dtype") {
      options.dtype = value;
    } else if (flag == "--target") {
      options.target = value;
    } else if (flag == "--decode-activations") {
      options.decode_activations = model::parse_decode_activations(value);
    } else if (flag == "-p") {
      options.prompt = parse_count(flag, value);
    } else if (flag == "-n") {
      options.generate = parse_count(flag, value);
    } else if (flag == "-r") {
      options.repetitions = parse_count(flag, value);
    } else if (flag == "-t") {
      options.threads = parse_count(flag, value);
    } else {
      throw Error("unknown option '" + flag + "' (see bench/pp_tg.cpp)");
    }
  }
  KVEVICT_REQUIRE(!options.model.empty() || !options.write_path.empty(),
                  "give --model <file.gguf>, --write-stories15m <out.gguf> or --write-tinyllama "
                  "<out.gguf>");
  return options;
}

// The shapes --write-stories15m and --write-tinyllama name.
model::ModelConfig shape_config(const std::string& shape) {
  model::ModelConfig config;
  if (shape == "tinyllama") {
    config.dim = 2048;
    config.hidden_dim = 5632;
    config.layers = 16;
    config.heads = 32;
    config.kv_heads = 8;
  } else {
    config.dim = 288;
    config.hidden_dim = 768;
    config.layers = 6;
    config.heads = 6;
    config.kv_heads = 6;
  }
  config.vocab_size = 32000;
  config.context_length = 2048;
  config.rope_layout = RopeLayout::interleaved;
  return config;
}

void write_model(const Options& options) {
  const model::ModelConfig config = shape_config(options.write_shape);
  model::Model m = model::make_random_model(config, 1, parse_dtype(options.dtype));
  model::Tokenizer& tokenizer = m.tokenizer;
  tokenizer.kind = model::Tokenizer::Kind::sentencepiece;
  tokenizer.pieces = {"<unk>", "<s>", "</s>"};
  tokenizer.types = {2, 3, 3};
  for (int byte = 0; byte < 256; ++byte) {
    char piece[8];
    std::snprintf(piece, sizeof piece, "<0x%02X>", byte);
    tokenizer.pieces.emplace_back(piece);
    tokenizer.types.push_back(6);
  }
  while (static_cast<int>(tokenizer.pieces.size()) < config.vocab_size) {
    tokenizer.pieces.push_back("\xe2\x96\x81t" + std::to_string(tokenizer.pieces.size()));
    tokenizer.types.push_back(1);
  }
  tokenizer.scores.assign(tokenizer.pieces.size(), 0.0f);
  tokenizer.bos_id = 1;
  tokenizer.eos_id = 2;
  tokenizer.anchor_id = -1;
  model::write_gguf(m, options.write_path);
}

struct Rate {
  double mean = 0.0;
  double deviation = 0.0;
};

// Tokens per second of `run` (which processes `tokens` tokens into a fresh decoder made by
// `make`, untimed) over `repetitions` timed runs.
template <class Make, class Run>
Rate measure(int tokens, int repetitions, Make&& make, Run&& run) {
  run(*make());  // warm-up
  std::vector<double> rates;
  for (int r = 0; r < repetitions; ++r) {
    const std::unique_ptr<model::Decoder> decoder = make();
    const auto start = std::chrono::steady_clock::now();
    run(*decoder);
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
    rates.push_back(tokens / seconds.count());
  }
  Rate rate;
  for (const double value : rates) rate.mean += value / repetitions;
  for (const double value : rates) rate.deviation += (value - rate.mean) * (value - rate.mean);
  rate.deviation = repetitions > 1 ? std::sqrt(rate.deviation / (repetitions - 1)) : 0.0;
  return rate;
}

void run_tests(const Options& options) {
  if (!options.target.empty()) {
    bool found = false;
    for (const std::int64_t target : model::kernels::available_targets()) {
      if (model::kernels::target_name(target) == options.target) {
        model::kernels::force_target(target);
        found = true;
      }
    }
    KVEVICT_REQUIRE(found, "--target " + options.target + " is not available on this CPU");
  }
  const model::Model m = model::load_model(options.model);
  const int vocab = m.config.vocab_size;
  std::mt19937 random(42);
  const auto random_tokens = [&](int count) {
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(count));
    for (auto& token : tokens)
      token = static_cast<std::int32_t>(random() % static_cast<unsigned>(vocab));
    if (m.tokenizer.bos_id >= 0) tokens[0] = m.tokenizer.bos_id;
    return tokens;
  };
  model::DecoderOptions decoder_options;
  decoder_options.max_chunk = options.prompt;
  decoder_options.threads = options.threads;
  decoder_options.decode_activations = options.decode_activations;
  const auto fresh_decoder = [&] {
    return std::make_unique<model::Decoder>(m, make_policy("full", PolicyParams()),
                                            decoder_options);
  };

  const std::vector<std::int32_t> prompt = random_tokens(options.prompt);
  const Rate pp = measure(options.prompt, options.repetitions, fresh_decoder,
                          [&](model::Decoder& decoder) { decoder.forward(prompt); });
  const std::vector<std::int32_t> generated = random_tokens(options.generate);
  const Rate tg =
      measure(options.generate, options.repetitions, fresh_decoder, [&](model::Decoder& decoder) {
        for (const std::int32_t token : generated) decoder.forward({&token, 1});
      });
  std::printf("target %s\n", model::kernels::active_target().c_str());
  std::printf("decode_activations %s\n",
              std::string(to_string(options.decode_activations)).c_str());
  std::printf("pp%d %.2f %.2f\n", options.prompt, pp.mean, pp.deviation);
  std::printf("tg%d %.2f %.2f\n", options.generate, tg.mean, tg.deviation);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options options = parse(argc, argv);
    if (!options.write_path.empty()) {
      write_model(options);
    } else {
      run_tests(options);
    }
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "pp_tg: %s\n", error.what());
    return 1;
  }
}
