// Writes the fuzz targets' seed corpora (corpus/<target>/) and regression inputs
// (regressions/<target>/) from kvevict's own writers and from descriptions of the findings, so that
// the committed files can be regenerated and reviewed:
//
//   cmake --build BUILD --target kvevict_fuzz_seeds
//   BUILD/tests/fuzz/kvevict_fuzz_seeds tests/fuzz eval/configs
//
// Seeds are small valid inputs of every kind a target reads (a few kilobytes each); a regression
// input reproduces one finding of docs/reliability.md and must keep failing cleanly.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policy_registry.hpp>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "fuzz_input.hpp"
#include "model/model_io.hpp"
#include "replay/replay.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace kvevict;

void write(const fs::path& path, std::span<const std::byte> bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  if (!out) throw Error("cannot write " + path.string());
  std::printf("%8zu  %s\n", bytes.size(), path.c_str());
}

void write(const fs::path& path, std::string_view text) { write(path, fuzz::as_bytes(text)); }

// --- models ------------------------------------------------------------------------------------

model::ModelConfig tiny_config(int dim, int vocab) {
  model::ModelConfig config;
  config.dim = dim;
  config.hidden_dim = 2 * dim;
  config.layers = 1;
  config.heads = 2;
  config.kv_heads = 1;
  config.vocab_size = vocab;
  config.context_length = 8;
  return config;
}

/// A SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte pieces, a few merges and <AC>.
model::Tokenizer sentencepiece_tokenizer() {
  model::Tokenizer tokenizer;
  tokenizer.kind = model::Tokenizer::Kind::sentencepiece;
  tokenizer.pieces = {"<unk>", "<s>", "</s>"};
  static const char* const kHex = "0123456789ABCDEF";
  for (int byte = 0; byte < 256; ++byte) {
    std::string piece = "<0x";  // appended piecewise: GCC 12 warns falsely on "<0x" + ...
    piece += kHex[byte / 16];
    piece += kHex[byte % 16];
    piece += '>';
    tokenizer.pieces.push_back(std::move(piece));
  }
  for (const char* piece : {"\xe2\x96\x81", "\xe2\x96\x81t", "he", "\xe2\x96\x81the", "ke", "ey",
                            "\xe2\x96\x81key", "in", "\xe2\x96\x81in", "<AC>"}) {
    tokenizer.pieces.emplace_back(piece);
  }
  for (std::size_t i = 0; i < tokenizer.pieces.size(); ++i) {
    tokenizer.scores.push_back(i < 259 ? 0.0f : -static_cast<float>(i - 259));
  }
  tokenizer.bos_id = 1;
  tokenizer.eos_id = 2;
  tokenizer.types = model::detail::infer_piece_types(tokenizer.pieces, 1, 2, 0);
  tokenizer.vocab_size = static_cast<int>(tokenizer.pieces.size());
  return tokenizer;
}

model::Model byte_model(int dim, model::DType dtype) {
  return model::make_random_model(tiny_config(dim, 260), 1, dtype);
}

model::Model sentencepiece_model(model::DType dtype, bool tied) {
  const model::Tokenizer tokenizer = sentencepiece_tokenizer();
  model::ModelConfig config = tiny_config(4, tokenizer.vocab_size);
  config.tied_embeddings = tied;
  model::Model model = model::make_random_model(config, 2, dtype);
  model.tokenizer = tokenizer;
  return model;
}

std::vector<std::byte> safetensors_input(const model::Model& model) {
  const model::SafetensorsFiles files = model::serialize_safetensors(model);
  return fuzz::join_two(fuzz::as_bytes(files.config_json), files.tensors);
}

/// config.json of the tiny byte-level model (what the hostile safetensors inputs sit beside).
std::string tiny_config_json() {
  return model::serialize_safetensors(byte_model(4, model::DType::f32)).config_json;
}

/// A safetensors file of one tensor entry (a header, and `data` after it).
std::vector<std::byte> safetensors_file(const json& header, std::size_t data_bytes) {
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  std::vector<std::byte> file(8 + text.size() + data_bytes);
  const std::uint64_t length = text.size();
  std::memcpy(file.data(), &length, 8);
  std::memcpy(file.data() + 8, text.data(), text.size());
  return file;
}

std::string nested_array(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

/// `config` (JSON text of an object) with `key` set to an array nested `depth` deep.
std::string with_nested(std::string config, std::string_view key, int depth) {
  const std::size_t close = config.rfind('}');
  config.erase(close);
  return config + ", \"" + std::string(key) + "\": " + nested_array(depth) + "}";
}

/// An untied GGUF model whose output.weight tensor info points at token_embd.weight's bytes
/// (offset 0: the writer puts the embedding first).
std::vector<std::byte> gguf_aliasing_output(const model::Model& untied) {
  std::vector<std::byte> file = model::serialize_gguf(untied);
  const std::string_view name = "output.weight";
  std::string key(8, '\0');
  const std::uint64_t length = name.size();
  std::memcpy(key.data(), &length, 8);
  key += name;
  const std::string_view text = fuzz::as_text(file);
  const std::size_t at = text.find(key);
  if (at == std::string_view::npos) throw Error("no output.weight tensor info");
  // name, u32 n_dims (2), u64 ne[2], u32 type, then the u64 offset.
  const std::size_t offset_at = at + key.size() + 4 + 16 + 4;
  const std::uint64_t zero = 0;
  std::memcpy(file.data() + offset_at, &zero, 8);
  return file;
}

/// An untied safetensors model whose lm_head.weight has model.embed_tokens.weight's data_offsets.
std::vector<std::byte> safetensors_aliasing_output(const model::Model& untied) {
  const model::SafetensorsFiles files = model::serialize_safetensors(untied);
  std::uint64_t length = 0;
  std::memcpy(&length, files.tensors.data(), 8);
  json header = json::parse(fuzz::as_text(std::span(files.tensors).subspan(8, length)));
  header["lm_head.weight"]["data_offsets"] = header["model.embed_tokens.weight"]["data_offsets"];
  std::vector<std::byte> tensors = safetensors_file(header, 0);
  tensors.insert(tensors.end(), files.tensors.begin() + 8 + static_cast<std::ptrdiff_t>(length),
                 files.tensors.end());
  return fuzz::join_two(fuzz::as_bytes(files.config_json), tensors);
}

void model_seeds(const fs::path& root) {
  using model::DType;
  const model::Model sentencepiece = sentencepiece_model(DType::f32, /*tied=*/false);
  const fs::path gguf = root / "corpus" / "gguf";
  write(gguf / "bytes-f32.gguf", model::serialize_gguf(byte_model(4, DType::f32)));
  write(gguf / "sentencepiece-f16-untied.gguf",
        model::serialize_gguf(sentencepiece_model(DType::f16, /*tied=*/false)));
  write(gguf / "bytes-bf16-align64.gguf",
        model::serialize_gguf(byte_model(4, DType::bf16), {.alignment = 64}));
  write(gguf / "bytes-q8_0.gguf",
        model::serialize_gguf(byte_model(32, DType::f32), {.quantize_q8_0 = true}));

  const fs::path safetensors = root / "corpus" / "safetensors";
  write(safetensors / "bytes-f32", safetensors_input(byte_model(4, DType::f32)));
  write(safetensors / "sentencepiece-bf16",
        safetensors_input(sentencepiece_model(DType::bf16, /*tied=*/true)));
  write(safetensors / "sentencepiece-f16-untied",
        safetensors_input(sentencepiece_model(DType::f16, /*tied=*/false)));

  const fs::path llama2c = root / "corpus" / "llama2c";
  write(llama2c / "bytes-no-tokenizer",
        fuzz::join_two({}, model::serialize_llama2c(byte_model(4, DType::f32))));
  write(llama2c / "sentencepiece-untied",
        fuzz::join_two(model::serialize_llama2c_tokenizer(sentencepiece.tokenizer),
                       model::serialize_llama2c(sentencepiece)));

  // Findings (docs/reliability.md).
  const fs::path regressions = root / "regressions";
  // Fuzzing (fuzz_gguf's round trip): output.weight over token_embd.weight's bytes loaded as an
  // untied classifier aliasing the embedding (and weight_bytes() counted it once).
  write(regressions / "gguf" / "output-aliases-embedding", gguf_aliasing_output(sentencepiece));
  // The same in safetensors, by analogy (found in review after the GGUF finding).
  write(regressions / "safetensors" / "lm-head-aliases-embedding",
        safetensors_aliasing_output(sentencepiece));
  // Issue 14 item 1: a zero dimension made the element count a divisor of 0 (SIGFPE).
  const json zero_dimension = {{"model.embed_tokens.weight",
                                {{"dtype", "F32"}, {"shape", {0, 5}}, {"data_offsets", {0, 0}}}}};
  write(regressions / "safetensors" / "zero-dimension",
        fuzz::join_two(fuzz::as_bytes(tiny_config_json()), safetensors_file(zero_dimension, 0)));
  // Issue 14 item 2: error messages dump()ed the offending value, recursing once per level.
  const std::vector<std::byte> tensors =
      model::serialize_safetensors(byte_model(4, DType::f32)).tensors;
  write(regressions / "safetensors" / "hidden-act-nested-100000",
        fuzz::join_two(fuzz::as_bytes(with_nested(tiny_config_json(), "hidden_act", 100000)),
                       tensors));
  write(regressions / "safetensors" / "kvevict-tokenizer-nested-100000",
        fuzz::join_two(fuzz::as_bytes(with_nested(tiny_config_json(), "kvevict_tokenizer", 100000)),
                       tensors));
}

// --- tokenizer -----------------------------------------------------------------------------------

/// fuzz_tokenizer's input: flags, then vocabulary records (score, type, piece) and the text.
std::vector<std::byte> tokenizer_input(std::uint8_t flags, const std::vector<std::string>& pieces,
                                       std::string_view text) {
  std::string vocabulary;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    if (i > 0) vocabulary += '\0';
    vocabulary += static_cast<char>(-static_cast<int>(i));  // later pieces merge later
    vocabulary += static_cast<char>(1);                     // normal
    vocabulary += pieces[i];
  }
  std::vector<std::byte> input = fuzz::join_two(fuzz::as_bytes(vocabulary), fuzz::as_bytes(text));
  input.insert(input.begin(), static_cast<std::byte>(flags));
  return input;
}

void tokenizer_seeds(const fs::path& root) {
  const fs::path dir = root / "corpus" / "tokenizer";
  const std::vector<std::string> words = {
      "<unk>",           "<s>", "</s>", "\xe2\x96\x81",    "\xe2\x96\x81t", "he",
      "\xe2\x96\x81the", "ke",  "ey",   "\xe2\x96\x81key", "<0x41>",        "\xc3\xa9"};
  const std::string text = "the key is in the hat: A caf\xc3\xa9, 12345 \xe2\x96\x81 \xff\n";
  write(dir / "bytes", tokenizer_input(0x00, words, text));
  write(dir / "sentencepiece-byte-pieces", tokenizer_input(0x03, words, text));
  write(dir / "sentencepiece-no-byte-pieces", tokenizer_input(0x01, words, text));
  write(dir / "sentencepiece-explicit-types-bos", tokenizer_input(0x0f, words, text));
  write(dir / "sentencepiece-empty-text", tokenizer_input(0x0b, words, ""));
}

// --- replay --------------------------------------------------------------------------------------

void replay_seeds(const fs::path& root) {
  const fs::path dir = root / "corpus" / "replay";
  const int tokens = 8;
  const json chunks = {4, 1, 1, 2};
  // Deterministic logits in [-5, 5]; the format ignores entries above the diagonal (kept as 0).
  json logits = json::array();
  json head = json::array();
  for (int h = 0; h < 2; ++h) {
    json rows = json::array();
    for (int i = 0; i < tokens; ++i) {
      json row = json::array();
      for (int j = 0; j < tokens; ++j) row.push_back(j > i ? 0 : (i * 7 + j * 3 + h * 5) % 11 - 5);
      rows.push_back(row);
    }
    head.push_back(rows);
  }
  logits.push_back(head);
  json surprisal = json::array();
  json token_ids = json::array();
  for (int i = 0; i < tokens; ++i) {
    surprisal.push_back((i * 5 % 7) * 0.5);
    token_ids.push_back(i % 3 == 2 ? 5 : 10 + i);
  }
  const std::vector<json> policies = {
      {{"name", "full"}},
      {{"name", "window"}, {"recent", 3}},
      {{"name", "streaming_llm"}, {"sinks", 1}, {"recent", 2}},
      {{"name", "h2o"}, {"heavy", 2}, {"recent", 2}},
      {{"name", "tova"}, {"budget", 3}},
      {{"name", "sirllm"}, {"sinks", 1}, {"entropy", 3}, {"recent", 1}, {"decay", 0.9}},
      {{"name", "anllm"}, {"anchor_ids", {5}}},
      {{"name", "infinipot"}, {"pot", 4}, {"keep", 2}, {"novel", 1}},
  };
  for (const json& policy : policies) {
    const std::string name = policy.at("name").get<std::string>();
    json document = {{"format", replay::kReplayFormat},
                     {"name", name + "-seed"},
                     {"shape", {{"layers", 1}, {"q_heads", 2}, {"kv_heads", 1}}},
                     {"tokens", tokens},
                     {"chunks", name == "infinipot" ? json{4, 2, 2} : chunks},
                     {"policy", policy},
                     {"logits", logits}};
    if (name == "sirllm" || name == "infinipot") document["surprisal"] = surprisal;
    if (name == "anllm") document["token_ids"] = token_ids;
    if (name == "infinipot") {
      json catalyst_logits = json::array({json::array()});
      for (int h = 0; h < 2; ++h) {
        json rows = json::array();
        for (int p = 0; p < 2; ++p) {
          json row = json::array();
          for (int c = 0; c < tokens + 2; ++c) row.push_back((p * 3 + c * 2 + h) % 7 - 3);
          rows.push_back(row);
        }
        catalyst_logits[0].push_back(rows);
      }
      document["catalyst"] = {{"length", 2}, {"logits", catalyst_logits}};
    }
    // The seed's expected result is what kvevict computes: a seed, not a conformance claim.
    document["expected"] =
        replay::result_to_json(replay::run_replay(replay::parse_replay(document)));
    write(dir / (name + ".json"), document.dump() + "\n");
  }
  // Issue 14 item 4: 8192 tokens ask for 2^26 logits; a 512 MiB buffer was zero-filled before
  // `logits` was found not to be an array.
  const json not_an_array = {{"format", replay::kReplayFormat},
                             {"name", "logits-not-an-array"},
                             {"shape", {{"layers", 1}, {"q_heads", 1}, {"kv_heads", 1}}},
                             {"tokens", 8192},
                             {"chunks", {8192}},
                             {"policy", {{"name", "window"}, {"recent", 8}}},
                             {"logits", 0}};
  write(root / "regressions" / "replay" / "logits-not-an-array-8192-tokens",
        not_an_array.dump() + "\n");
}

// --- eval config -------------------------------------------------------------------------------

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void eval_config_seeds(const fs::path& root, const fs::path& configs) {
  const fs::path dir = root / "corpus" / "eval_config";
  for (const fs::directory_entry& entry : fs::directory_iterator(configs)) {
    if (entry.path().extension() == ".json") {
      write(dir / entry.path().filename(), read_text(entry.path()));
    }
  }
  const fs::path regressions = root / "regressions" / "eval_config";
  const auto grid = [](const std::string& tasks) {
    return R"({"name": "g", "model": "m.gguf", "budgets": [64], "policies": [{"policy": "window"}],
 "tasks": [)" +
           tasks + "]}\n";
  };
  // Issue 14 item 2: the message for a non-string name dump()ed it.
  write(regressions / "name-nested-100000",
        R"({"model": "m.gguf", "policies": [{"policy": "full"}], "tasks": [{"task": "stream_bpb"}],
 "name": )" +
            nested_array(100000) + "}\n");
  // Issue 14 item 4: lengths up to 2^40 tokens and 2^20 turns were accepted, then failed with
  // std::bad_alloc while the documents were built.
  write(regressions / "passkey-length-2pow40",
        grid(R"({"task": "passkey", "lengths": [1099511627776], "documents": 1})"));
  write(regressions / "grocery-turns-2pow20-1",
        grid(R"({"task": "grocery", "turns": [1048575], "length": 1099511627776})"));
  // Found in review: the cells of 2,000 lengths x 2,000 depths (4 million) were all enumerated.
  std::string lengths;
  std::string depths;
  for (int i = 0; i < 2000; ++i) {
    if (i > 0) {  // appended piecewise: GCC 12 warns falsely on "," + std::string
      lengths += ',';
      depths += ',';
    }
    lengths += std::to_string(200 + i);
    depths += std::to_string(i / 2000.0).substr(0, 8);
  }
  write(regressions / "passkey-4-million-cells",
        grid(R"({"task": "passkey", "documents": 1, "lengths": [)" + lengths + R"(], "depths": [)" +
             depths + "]}"));
}

// --- C API call sequences ----------------------------------------------------------------------

// One seed per policy and configuration: the header fuzz_c_api.cpp reads (policy, --budget 8 with
// 2 sinks, 2 layers x 2 KV heads x 2 query heads per KV head, chunks of up to 4 tokens, the
// policy's own positions and granularity or `mode` and `granularity` (indices into its lists),
// a backend with both callbacks), then pseudo-random calls, mostly well-formed forwards (op 0);
// and each policy's first seed again in pool mode.
void c_api_seeds(const fs::path& root) {
  const fs::path dir = root / "corpus" / "c_api";
  const std::vector<std::string_view> names = policy_names();
  for (std::size_t p = 0; p < names.size(); ++p) {
    for (const auto& [label, mode, granularity] :
         {std::tuple{"", 0, 0}, std::tuple{"-cache_index-token", 2, 3}}) {
      std::vector<std::uint8_t> bytes = {static_cast<std::uint8_t>(p),
                                         0,
                                         8,
                                         2,
                                         1,  // policy
                                         1,
                                         1,
                                         1,
                                         1,
                                         3,  // layers, kv_heads, q_heads, max_chunk
                                         static_cast<std::uint8_t>(mode),
                                         static_cast<std::uint8_t>(granularity),
                                         1,
                                         1,
                                         2,
                                         1};  // post-RoPE keys, folds; backend
      std::uint32_t state = 12345u + static_cast<std::uint32_t>(p);
      for (int i = 0; i < 600; ++i) {
        state = state * 1664525u + 1013904223u;
        const auto random = static_cast<std::uint8_t>(state >> 24);
        bytes.push_back(i % 8 == 0 ? static_cast<std::uint8_t>(12 * (random % 8 == 0)) : random);
      }
      write(dir / (std::string(names[p]) + label), std::as_bytes(std::span(bytes)));
      // The same calls in pool mode (a first byte of 0xC0 or more): the sequence in a KV pool with
      // a neighbour, the seed's ops 12 now make_room with arbitrary feeds.
      if (std::string_view(label).empty()) {
        bytes.insert(bytes.begin(), 0xC0);
        write(dir / ("pool-" + std::string(names[p])), std::as_bytes(std::span(bytes)));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: kvevict_fuzz_seeds TESTS_FUZZ_DIR EVAL_CONFIGS_DIR\n");
    return 2;
  }
  try {
    const fs::path root = argv[1];
    model_seeds(root);
    tokenizer_seeds(root);
    replay_seeds(root);
    eval_config_seeds(root, argv[2]);
    c_api_seeds(root);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "kvevict_fuzz_seeds: %s\n", error.what());
    return 1;
  }
  return 0;
}
