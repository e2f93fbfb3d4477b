// safetensors: container parser and writer, and the Llama mapping with Hugging Face config.json.
#include "safetensors.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>
#include <unordered_set>
#include <utility>

#include "../common/bounded_json.hpp"
#include "../common/input_files.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "model_io.hpp"

namespace kvevict::model {
namespace {

using detail::in_quotes;

using nlohmann::json;

[[noreturn]] void fail(const std::string& message) { throw Error("safetensors: " + message); }

// Element counts beyond this are corrupt (2^56 elements of 8 bytes still fit a uint64 byte count).
constexpr std::int64_t kMaxElements = std::int64_t{1} << 56;

}  // namespace

namespace safetensors {

std::size_t dtype_size(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

const TensorInfo* File::find(std::string_view name) const {
  for (const TensorInfo& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

std::span<const std::byte> File::data(const TensorInfo& tensor) const {
  return bytes.subspan(static_cast<std::size_t>(data_offset + tensor.begin),
                       static_cast<std::size_t>(tensor.end - tensor.begin));
}

File parse(std::span<const std::byte> bytes) {
  detail::ByteReader reader(bytes, "safetensors");
  const std::uint64_t header_length = reader.u64("header length");
  if (header_length > reader.remaining()) {
    fail("header length " + std::to_string(header_length) + " exceeds the file (" +
         std::to_string(reader.remaining()) + " bytes left)");
  }
  if (header_length > kMaxHeaderBytes) {
    fail("header length " + std::to_string(header_length) + " is absurd (limit " +
         std::to_string(kMaxHeaderBytes) + ")");
  }
  const std::string_view text = reader.string(header_length, "header");
  json header;
  try {
    header = common::parse_json_bounded<json>(text, "safetensors: header");
  } catch (const json::exception& error) {
    fail(std::string("header is not valid JSON: ") + error.what());
  }
  if (!header.is_object()) fail("header is not a JSON object");

  File file;
  file.bytes = bytes;
  file.data_offset = 8 + header_length;
  const std::uint64_t data_size = bytes.size() - file.data_offset;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (value.is_string()) file.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor " + in_quotes(name);
    if (!entry.is_object()) fail(what + " is not an object");
    TensorInfo tensor;
    tensor.name = name;
    const auto dtype = entry.find("dtype");
    if (dtype == entry.end() || !dtype->is_string()) fail(what + " has no string 'dtype'");
    tensor.dtype = dtype->get<std::string>();
    const auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array()) fail(what + " has no array 'shape'");
    // A zero dimension is a valid empty tensor; the product stays exact and bounded either way.
    std::int64_t elements = 1;
    for (const json& dim : *shape) {
      if (!dim.is_number_unsigned() || dim.get<std::uint64_t>() > kMaxElements) {
        fail(what + " has a shape entry that is not a count up to " + std::to_string(kMaxElements) +
             ": " + common::json_preview(dim));
      }
      tensor.shape.push_back(static_cast<std::int64_t>(dim.get<std::uint64_t>()));
      elements = checked_product({elements, tensor.shape.back()},
                                 "safetensors: " + what + " has an absurd shape: its element count",
                                 kMaxElements);
    }
    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      fail(what + " has no 'data_offsets' pair [begin, end]");
    }
    tensor.begin = (*offsets)[0].get<std::uint64_t>();
    tensor.end = (*offsets)[1].get<std::uint64_t>();
    if (tensor.begin > tensor.end || tensor.end > data_size) {
      fail(what + " data_offsets [" + std::to_string(tensor.begin) + ", " +
           std::to_string(tensor.end) + "] lie outside the data section (" +
           std::to_string(data_size) + " bytes)");
    }
    const std::size_t element_size = dtype_size(tensor.dtype);
    const auto needed = static_cast<std::uint64_t>(
        checked_product({elements, static_cast<std::int64_t>(element_size)},
                        "safetensors: " + what + " byte count"));
    if (element_size != 0 && tensor.end - tensor.begin != needed) {
      fail(what + " size mismatch: " + std::to_string(tensor.end - tensor.begin) +
           " bytes for dtype " + tensor.dtype + " and shape " + detail::shape_string(tensor.shape) +
           " (needs " + std::to_string(needed) + ")");
    }
    file.tensors.push_back(std::move(tensor));
  }
  // The format promises that no two tensors' bytes overlap (its README, "Prevent DOS attacks").
  std::vector<detail::TensorBytes> extents;
  for (const TensorInfo& tensor : file.tensors) {
    extents.push_back({tensor.name, tensor.begin, tensor.end});
  }
  detail::require_disjoint(std::move(extents), "safetensors");
  return file;
}

void Writer::add_tensor(std::string_view name, std::string_view dtype,
                        std::vector<std::int64_t> shape, std::vector<std::byte> data) {
  tensors_.push_back(
      PendingTensor{std::string(name), std::string(dtype), std::move(shape), std::move(data)});
}

void Writer::add_metadata(std::string_view key, std::string_view value) {
  metadata_[std::string(key)] = std::string(value);
}

std::vector<std::byte> Writer::finish() const {
  std::vector<const PendingTensor*> order;
  for (const PendingTensor& tensor : tensors_) order.push_back(&tensor);
  std::stable_sort(order.begin(), order.end(), [](const PendingTensor* a, const PendingTensor* b) {
    return dtype_size(a->dtype) > dtype_size(b->dtype);
  });
  json header = json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::uint64_t offset = 0;
  for (const PendingTensor* tensor : order) {
    header[tensor->name] = {{"dtype", tensor->dtype},
                            {"shape", tensor->shape},
                            {"data_offsets", {offset, offset + tensor->data.size()}}};
    offset += tensor->data.size();
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');  // keeps the data 8-byte aligned
  detail::ByteWriter out;
  out.u64(text.size());
  out.string(text);
  for (const PendingTensor* tensor : order) out.bytes(tensor->data);
  return std::move(out.buffer());
}

}  // namespace safetensors

// --- Llama mapping -----------------------------------------------------------------------------

namespace {

using detail::TensorRole;

std::string tensor_name(TensorRole role, int layer) {
  const std::string block = "model.layers." + std::to_string(layer) + ".";
  switch (role) {
    case TensorRole::token_embedding:
      return "model.embed_tokens.weight";
    case TensorRole::attention_norm:
      return block + "input_layernorm.weight";
    case TensorRole::wq:
      return block + "self_attn.q_proj.weight";
    case TensorRole::wk:
      return block + "self_attn.k_proj.weight";
    case TensorRole::wv:
      return block + "self_attn.v_proj.weight";
    case TensorRole::wo:
      return block + "self_attn.o_proj.weight";
    case TensorRole::ffn_norm:
      return block + "post_attention_layernorm.weight";
    case TensorRole::w_gate:
      return block + "mlp.gate_proj.weight";
    case TensorRole::w_up:
      return block + "mlp.up_proj.weight";
    case TensorRole::w_down:
      return block + "mlp.down_proj.weight";
    case TensorRole::final_norm:
      return "model.norm.weight";
    case TensorRole::output:
      return "lm_head.weight";
  }
  return {};
}

std::optional<DType> to_dtype(std::string_view name) {
  if (name == "F32") return DType::f32;
  if (name == "F16") return DType::f16;
  if (name == "BF16") return DType::bf16;
  return std::nullopt;
}

// Safetensors has no block formats: Q8_0 and Q4_0 matrices are written as F32.
DType stored_dtype(DType dtype) { return block_values(dtype) > 1 ? DType::f32 : dtype; }

std::string_view dtype_name(DType dtype) {
  switch (stored_dtype(dtype)) {
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
    default:
      return "F32";
  }
}

std::string_view torch_dtype(DType dtype) {
  switch (stored_dtype(dtype)) {
    case DType::f16:
      return "float16";
    case DType::bf16:
      return "bfloat16";
    default:
      return "float32";
  }
}

// --- config.json -------------------------------------------------------------------------------

const json* member(const json& object, std::string_view key) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

int config_int(const json& config, std::string_view key, std::optional<int> fallback) {
  const json* value = member(config, key);
  if (value == nullptr) {
    if (fallback) return *fallback;
    fail("config.json lacks " + in_quotes(key));
  }
  if (!value->is_number_integer()) fail("config.json " + in_quotes(key) + " must be an integer");
  const auto number = value->get<std::int64_t>();
  if (number < std::numeric_limits<int>::min() || number > std::numeric_limits<int>::max()) {
    fail("config.json " + in_quotes(key) + " = " + std::to_string(number) + " is absurd");
  }
  return static_cast<int>(number);
}

double config_number(const json& config, std::string_view key, double fallback) {
  const json* value = member(config, key);
  if (value == nullptr) return fallback;
  if (!value->is_number()) fail("config.json " + in_quotes(key) + " must be a number");
  return value->get<double>();
}

bool config_bool(const json& config, std::string_view key, bool fallback) {
  const json* value = member(config, key);
  if (value == nullptr) return fallback;
  if (!value->is_boolean()) fail("config.json " + in_quotes(key) + " must be true or false");
  return value->get<bool>();
}

/// A token id: an integer, null / absent (-1), or a list (its first entry, as for Llama 3's eos).
std::int32_t config_token(const json& config, std::string_view key) {
  const json* value = member(config, key);
  if (value == nullptr) return -1;
  if (value->is_array()) {
    if (value->empty()) return -1;
    value = &(*value)[0];
  }
  if (!value->is_number_integer()) fail("config.json " + in_quotes(key) + " must be a token id");
  const auto id = value->get<std::int64_t>();
  if (id < -1 || id > std::numeric_limits<std::int32_t>::max()) {
    fail("config.json " + in_quotes(key) + " = " + std::to_string(id) + " is absurd");
  }
  return static_cast<std::int32_t>(id);
}

json parse_config(std::string_view text) {
  json config;
  try {
    config = common::parse_json_bounded<json>(text, "safetensors: config.json");
  } catch (const json::exception& error) {
    fail(std::string("config.json is not valid JSON: ") + error.what());
  }
  if (!config.is_object()) fail("config.json is not a JSON object");
  return config;
}

bool is_llama(const json& config) {
  if (const json* type = member(config, "model_type"); type && *type == "llama") return true;
  if (const json* architectures = member(config, "architectures");
      architectures && architectures->is_array()) {
    for (const json& name : *architectures) {
      if (name == "LlamaForCausalLM") return true;
    }
  }
  return false;
}

ModelConfig read_config(const json& config) {
  if (!is_llama(config)) {
    const json* type = member(config, "model_type");
    fail("config.json describes " +
         (type && type->is_string() ? "model_type " + in_quotes(type->get<std::string>())
                                    : std::string("no llama model")) +
         "; only llama (LlamaForCausalLM) is supported");
  }
  ModelConfig result;
  result.dim = config_int(config, "hidden_size", std::nullopt);
  result.hidden_dim = config_int(config, "intermediate_size", std::nullopt);
  result.layers = config_int(config, "num_hidden_layers", std::nullopt);
  result.heads = config_int(config, "num_attention_heads", std::nullopt);
  result.kv_heads = config_int(config, "num_key_value_heads", result.heads);
  result.vocab_size = config_int(config, "vocab_size", std::nullopt);
  result.context_length = config_int(config, "max_position_embeddings", 0);
  result.rope_theta = config_number(config, "rope_theta", 10000.0);
  result.norm_eps =  // 1e-6 is Hugging Face's default
      detail::narrow_to_f32(config_number(config, "rms_norm_eps", 1e-6),
                            "config.json rms_norm_eps");
  result.tied_embeddings = config_bool(config, "tie_word_embeddings", false);
  result.rope_layout = RopeLayout::half_split;
  try {
    result.validate();
  } catch (const Error& error) {
    fail(error.what());
  }
  // Features of the HF Llama family that change the computation: refuse rather than misread.
  if (member(config, "rope_scaling") != nullptr) fail("config.json rope_scaling is not supported");
  if (config_bool(config, "attention_bias", false) || config_bool(config, "mlp_bias", false)) {
    fail("config.json attention_bias / mlp_bias are not supported");
  }
  if (const json* act = member(config, "hidden_act"); act && *act != "silu") {
    fail("config.json hidden_act " + common::json_preview(*act) + " is not supported (only silu)");
  }
  if (const int head_dim = config_int(config, "head_dim", result.head_dim());
      head_dim != result.head_dim()) {
    fail("config.json head_dim " + std::to_string(head_dim) +
         " is not hidden_size / heads = " + std::to_string(result.head_dim()));
  }
  return result;
}

Tokenizer read_tokenizer(const json& config) {
  Tokenizer tokenizer;
  tokenizer.bos_id = config_token(config, "bos_token_id");
  tokenizer.eos_id = config_token(config, "eos_token_id");
  tokenizer.anchor_id = config_token(config, "anchor_token_id");
  const json* kind = member(config, "kvevict_tokenizer");
  if (kind == nullptr || *kind == "bytes") {
    tokenizer.kind = Tokenizer::Kind::byte_level;
    return tokenizer;
  }
  if (*kind != "sentencepiece") {
    fail("config.json kvevict_tokenizer " + common::json_preview(*kind) +
         " is not supported (\"bytes\" or \"sentencepiece\")");
  }
  tokenizer.kind = Tokenizer::Kind::sentencepiece;
  const json* pieces = member(config, "kvevict_tokenizer_pieces");
  if (pieces == nullptr || !pieces->is_array()) {
    fail("config.json lacks the array 'kvevict_tokenizer_pieces'");
  }
  for (const json& piece : *pieces) {
    if (!piece.is_string()) fail("config.json kvevict_tokenizer_pieces holds a non-string");
    tokenizer.pieces.push_back(piece.get<std::string>());
  }
  if (const json* scores = member(config, "kvevict_tokenizer_scores")) {
    if (!scores->is_array()) fail("config.json kvevict_tokenizer_scores is not an array");
    for (const json& score : *scores) {
      if (!score.is_number()) fail("config.json kvevict_tokenizer_scores holds a non-number");
      tokenizer.scores.push_back(
          detail::narrow_to_f32(score.get<double>(), "config.json kvevict_tokenizer_scores"));
    }
  }
  if (const json* types = member(config, "kvevict_tokenizer_types")) {
    if (!types->is_array()) fail("config.json kvevict_tokenizer_types is not an array");
    for (const json& type : *types) {
      if (!type.is_number_integer())
        fail("config.json kvevict_tokenizer_types holds a non-integer");
      tokenizer.types.push_back(type.get<std::int32_t>());
    }
  }
  return tokenizer;
}

void load_tensor(Model& model, const safetensors::File& file, TensorRole role, int layer) {
  const std::string name = tensor_name(role, layer);
  const safetensors::TensorInfo* tensor = file.find(name);
  if (tensor == nullptr) fail("missing tensor " + in_quotes(name));
  const std::vector<std::int64_t> expected = detail::expected_shape(model.config, role);
  if (tensor->shape != expected) {
    fail("tensor " + in_quotes(name) + " has shape " + detail::shape_string(tensor->shape) +
         ", expected " + detail::shape_string(expected) + " for config.json");
  }
  const std::optional<DType> dtype = to_dtype(tensor->dtype);
  if (!dtype) {
    fail("tensor " + in_quotes(name) + " has unsupported dtype " + tensor->dtype +
         " (kvevict reads F32, F16, BF16)");
  }
  const std::span<const std::byte> bytes = file.data(*tensor);
  if (detail::is_norm(role)) {
    detail::norm_of(model, role, layer) =
        detail::to_f32(bytes, *dtype, static_cast<std::size_t>(expected[0]));
    return;
  }
  detail::matrix_of(model, role, layer) =
      detail::matrix_view(model, bytes, *dtype, expected[0], expected[1]);
}

Model load_safetensors_bytes(const detail::AlignedBytes& bytes, std::string_view config_text) {
  // Read config.json first: it is small and decides the shapes the tensors must have.
  const json config = parse_config(config_text);
  Model model;
  model.format = "safetensors";
  model.config = read_config(config);
  model.tokenizer = read_tokenizer(config);
  const safetensors::File file = safetensors::parse(bytes.span());
  model.storage.push_back(bytes.owner);
  model.layers.resize(static_cast<std::size_t>(model.config.layers));
  load_tensor(model, file, TensorRole::token_embedding, 0);
  for (int layer = 0; layer < model.config.layers; ++layer) {
    for (const TensorRole role : detail::kLayerRoles) load_tensor(model, file, role, layer);
  }
  load_tensor(model, file, TensorRole::final_norm, 0);
  if (model.config.tied_embeddings) {
    model.output = model.token_embedding;
  } else {
    load_tensor(model, file, TensorRole::output, 0);
  }
  detail::finish_model(model, "safetensors");
  return model;
}

std::string read_text(const std::filesystem::path& path) {
  const detail::AlignedBytes bytes = detail::read_file(path, "safetensors");
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size};
}

json config_json(const Model& model) {
  const ModelConfig& config = model.config;
  json result = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_act", "silu"},
      {"hidden_size", config.dim},
      {"intermediate_size", config.hidden_dim},
      {"num_hidden_layers", config.layers},
      {"num_attention_heads", config.heads},
      {"num_key_value_heads", config.kv_heads},
      {"vocab_size", config.vocab_size},
      {"max_position_embeddings", config.context_length},
      {"rope_theta", config.rope_theta},
      {"rms_norm_eps", config.norm_eps},
      {"tie_word_embeddings", config.tied_embeddings},
      {"torch_dtype", torch_dtype(model.layers.empty() ? DType::f32 : model.layers[0].wq.dtype)},
  };
  const Tokenizer& tokenizer = model.tokenizer;
  const std::pair<const char*, std::int32_t> ids[] = {{"bos_token_id", tokenizer.bos_id},
                                                      {"eos_token_id", tokenizer.eos_id},
                                                      {"anchor_token_id", tokenizer.anchor_id}};
  for (const auto& [key, id] : ids) {
    if (id >= 0) result[key] = id;
  }
  if (tokenizer.kind == Tokenizer::Kind::byte_level) {
    result["kvevict_tokenizer"] = "bytes";
  } else {
    result["kvevict_tokenizer"] = "sentencepiece";
    result["kvevict_tokenizer_pieces"] = tokenizer.pieces;
    result["kvevict_tokenizer_scores"] = tokenizer.scores;
    result["kvevict_tokenizer_types"] = tokenizer.types;
  }
  return result;
}

}  // namespace

Model load_safetensors(const std::filesystem::path& path) {
  std::error_code error;
  std::filesystem::path tensors = path;
  if (std::filesystem::is_directory(path, error)) {
    tensors = path / "model.safetensors";
    if (!std::filesystem::exists(tensors, error) &&
        std::filesystem::exists(path / "model.safetensors.index.json", error)) {
      fail("sharded checkpoints are not supported (" + path.string() + ")");
    }
  }
  const std::filesystem::path config = tensors.parent_path() / "config.json";
  if (!std::filesystem::exists(config, error)) {
    fail("config.json not found beside " + tensors.string());
  }
  common::require_regular_file(config, "config.json");
  return load_safetensors_bytes(detail::read_file(tensors, "safetensors"), read_text(config));
}

Model load_safetensors(std::span<const std::byte> file, std::string_view config_json) {
  return load_safetensors_bytes(detail::copy_aligned(file), config_json);
}

SafetensorsFiles serialize_safetensors(const Model& source) {
  Model model = source;  // shallow: shares the weights; Q/K may be replaced by permuted copies
  try {
    model.config.validate();
  } catch (const Error& error) {
    fail(error.what());
  }
  if (model.layers.size() != static_cast<std::size_t>(model.config.layers)) {
    fail("model has " + std::to_string(model.layers.size()) + " layers, its config " +
         std::to_string(model.config.layers));
  }
  if (model.config.rotary_dim != 0 && model.config.rotary_dim != model.config.head_dim()) {
    fail("a Hugging Face Llama config cannot express rotary_dim " +
         std::to_string(model.config.rotary_dim) + " < head_dim");
  }
  detail::convert_rope_layout(model, RopeLayout::half_split);
  const ModelConfig& config = model.config;

  safetensors::Writer writer;
  writer.add_metadata("format", "pt");
  const auto add = [&](TensorRole role, int layer) {
    const std::string name = tensor_name(role, layer);
    const std::vector<std::int64_t> shape = detail::expected_shape(config, role);
    if (detail::is_norm(role)) {
      const std::vector<float>& norm = detail::norm_of(model, role, layer);
      if (norm.size() != static_cast<std::size_t>(config.dim)) {
        fail("norm " + in_quotes(name) + " has " + std::to_string(norm.size()) +
             " values, expected " + std::to_string(config.dim));
      }
      const auto* begin = reinterpret_cast<const std::byte*>(norm.data());
      writer.add_tensor(name, "F32", shape, {begin, begin + norm.size() * sizeof(float)});
      return;
    }
    const WeightMatrix& matrix = detail::matrix_of(model, role, layer);
    if (matrix.data == nullptr || matrix.rows != shape[0] || matrix.cols != shape[1]) {
      fail("matrix " + in_quotes(name) + " is missing or has the wrong shape");
    }
    writer.add_tensor(name, dtype_name(matrix.dtype), shape,
                      detail::matrix_bytes_as(matrix, stored_dtype(matrix.dtype)));
  };
  add(TensorRole::token_embedding, 0);
  for (int layer = 0; layer < config.layers; ++layer) {
    for (const TensorRole role : detail::kLayerRoles) add(role, layer);
  }
  add(TensorRole::final_norm, 0);
  if (!config.tied_embeddings) add(TensorRole::output, 0);

  SafetensorsFiles files;
  files.tensors = writer.finish();
  try {
    files.config_json = config_json(model).dump(2) + "\n";
  } catch (const json::exception& error) {
    fail(std::string("cannot write config.json: ") + error.what());
  }
  return files;
}

void write_safetensors(const Model& model, const std::filesystem::path& dir) {
  const SafetensorsFiles files = serialize_safetensors(model);
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) fail("cannot create directory " + dir.string() + ": " + error.message());
  detail::write_file(dir / "model.safetensors", files.tensors, "safetensors");
  const auto* text = reinterpret_cast<const std::byte*>(files.config_json.data());
  detail::write_file(dir / "config.json", {text, files.config_json.size()}, "safetensors");
}

}  // namespace kvevict::model
