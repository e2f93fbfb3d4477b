// Model contract (dtype helpers, config validation, weight accounting, format dispatch) and the
// helpers the format readers and writers share.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <kvevict/model/model.hpp>
#include <limits>
#include <new>
#include <system_error>
#include <utility>

#include "../common/input_files.hpp"
#include "half.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "model_io.hpp"
#include "quant.hpp"

namespace kvevict::model {

static_assert(std::endian::native == std::endian::little,
              "model files are little-endian and read in place");

std::int64_t block_values(DType dtype) {
  return dtype == DType::q8_0 || dtype == DType::q4_0 ? kQuantBlockValues : 1;
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::q8_0:
      return kQ8_0BlockBytes;
    case DType::q4_0:
      return kQ4_0BlockBytes;
  }
  throw Error("unknown DType " + std::to_string(static_cast<int>(dtype)));
}

std::size_t dtype_bytes(DType dtype, std::int64_t values) {
  const std::int64_t per_block = block_values(dtype);
  KVEVICT_REQUIRE(values >= 0 && values % per_block == 0,
                  std::to_string(values) + " " + std::string(to_string(dtype)) +
                      " values are not a whole number of blocks of " + std::to_string(per_block));
  return static_cast<std::size_t>(values / per_block) * dtype_size(dtype);
}

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::q8_0:
      return "q8_0";
    case DType::q4_0:
      return "q4_0";
  }
  return "unknown";
}

void WeightMatrix::row_to_f32(std::int64_t r, float* out) const {
  KVEVICT_REQUIRE(r >= 0 && r < rows, "WeightMatrix::row_to_f32: row " + std::to_string(r) +
                                          " out of range [0, " + std::to_string(rows) + ")");
  convert_to_f32(data + static_cast<std::size_t>(r) * row_bytes(), dtype,
                 static_cast<std::size_t>(cols), out);
}

namespace {

// Beyond these a configuration is a corrupt file, not a model (the largest Llamas are ~16k wide,
// 128k vocab, 126 layers).
constexpr int kMaxWidth = 1 << 20;
constexpr int kMaxVocab = 1 << 22;
constexpr int kMaxLayers = 4096;

void require_size(int value, const char* name, int limit) {
  KVEVICT_REQUIRE(value > 0, std::string("model config: ") + name + " must be positive, got " +
                                 std::to_string(value));
  KVEVICT_REQUIRE(value <= limit, std::string("model config: ") + name + " " +
                                      std::to_string(value) + " is absurd (limit " +
                                      std::to_string(limit) + ")");
}

}  // namespace

void ModelConfig::validate() const {
  require_size(dim, "dim", kMaxWidth);
  require_size(hidden_dim, "hidden_dim", kMaxWidth);
  require_size(layers, "layers", kMaxLayers);
  require_size(heads, "heads", kMaxWidth);
  require_size(kv_heads, "kv_heads", kMaxWidth);
  require_size(vocab_size, "vocab_size", kMaxVocab);
  KVEVICT_REQUIRE(context_length >= 0, "model config: context_length must be >= 0, got " +
                                           std::to_string(context_length));
  KVEVICT_REQUIRE(dim % heads == 0, "model config: dim " + std::to_string(dim) +
                                        " is not divisible by heads " + std::to_string(heads));
  KVEVICT_REQUIRE(heads % kv_heads == 0, "model config: heads " + std::to_string(heads) +
                                             " is not divisible by kv_heads " +
                                             std::to_string(kv_heads));
  KVEVICT_REQUIRE(head_dim() % 2 == 0,
                  "model config: head_dim " + std::to_string(head_dim()) + " is odd (RoPE pairs)");
  KVEVICT_REQUIRE(rotary_dim >= 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim(),
                  "model config: rotary_dim " + std::to_string(rotary_dim) +
                      " must be 0 (= head_dim) or an even number <= head_dim " +
                      std::to_string(head_dim()));
  KVEVICT_REQUIRE(
      std::isfinite(rope_theta) && rope_theta > 1.0,
      "model config: rope_theta must be finite and > 1, got " + std::to_string(rope_theta));
  KVEVICT_REQUIRE(std::isfinite(norm_eps) && norm_eps > 0.0f && norm_eps < 1.0f,
                  "model config: norm_eps must be in (0, 1), got " + std::to_string(norm_eps));
}

std::size_t Model::weight_bytes() const {
  std::size_t total = token_embedding.bytes() + final_norm.size() * sizeof(float);
  // A tied classifier is the embedding matrix itself: count its bytes once.
  if (output.data != token_embedding.data) total += output.bytes();
  for (const LayerWeights& layer : layers) {
    total += (layer.attention_norm.size() + layer.ffn_norm.size()) * sizeof(float);
    for (const WeightMatrix* matrix :
         {&layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.w_gate, &layer.w_up, &layer.w_down}) {
      total += matrix->bytes();
    }
  }
  return total;
}

Model load_model(const std::filesystem::path& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) return load_safetensors(path);
  if (path.extension() == ".safetensors") return load_safetensors(path);
  // Before the sniffing read below: opening a FIFO would block.
  common::require_regular_file(path, "model file");
  std::ifstream stream(path, std::ios::binary);
  KVEVICT_REQUIRE(stream.good(), "cannot open model file " + path.string());
  std::array<char, 9> head{};
  stream.read(head.data(), head.size());
  const auto head_bytes = static_cast<std::size_t>(stream.gcount());
  if (head_bytes >= 4 && std::string_view(head.data(), 4) == "GGUF") return load_gguf(path);
  // safetensors without its extension: a u64 header length that fits the file, then '{'. (For a
  // llama2.c header those 8 bytes are dim | hidden_dim << 32, far beyond any file size.)
  if (head_bytes == 9 && head[8] == '{') {
    std::uint64_t header_length;
    std::memcpy(&header_length, head.data(), 8);
    const std::uintmax_t file_size = std::filesystem::file_size(path, error);
    if (!error && header_length < file_size) return load_safetensors(path);
  }
  // llama2.c checkpoints have no magic; use a tokenizer.bin beside the checkpoint when there is
  // one.
  const std::filesystem::path tokenizer = path.parent_path() / "tokenizer.bin";
  if (tokenizer != path && std::filesystem::is_regular_file(tokenizer, error)) {
    return load_llama2c(path, tokenizer);
  }
  return load_llama2c(path);
}

WeightMatrix permute_rope_rows(const WeightMatrix& matrix, int heads, int head_dim, int rotary_dim,
                               RopeLayout from, RopeLayout to,
                               std::vector<std::shared_ptr<const void>>& storage) {
  if (from == to) return matrix;
  if (rotary_dim == 0) rotary_dim = head_dim;
  KVEVICT_REQUIRE(heads > 0 && head_dim > 0 && matrix.rows == std::int64_t{heads} * head_dim,
                  "permute_rope_rows: matrix has " + std::to_string(matrix.rows) +
                      " rows, expected heads * head_dim = " + std::to_string(heads) + " * " +
                      std::to_string(head_dim));
  KVEVICT_REQUIRE(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
                  "permute_rope_rows: rotary_dim " + std::to_string(rotary_dim) +
                      " must be even and <= head_dim " + std::to_string(head_dim));
  const std::size_t row_bytes = matrix.row_bytes();
  detail::AlignedBytes permuted = detail::allocate_aligned(matrix.bytes());
  const int half = rotary_dim / 2;
  for (int head = 0; head < heads; ++head) {
    const std::size_t base = static_cast<std::size_t>(head) * static_cast<std::size_t>(head_dim);
    for (int row = 0; row < head_dim; ++row) {
      // Where the row that lands at `row` comes from.
      int source = row;
      if (row < rotary_dim) {
        if (to == RopeLayout::interleaved) {
          source = row % 2 == 0 ? row / 2 : row / 2 + half;
        } else {
          source = row < half ? 2 * row : 2 * (row - half) + 1;
        }
      }
      std::memcpy(permuted.data() + (base + static_cast<std::size_t>(row)) * row_bytes,
                  matrix.data + (base + static_cast<std::size_t>(source)) * row_bytes, row_bytes);
    }
  }
  WeightMatrix result = matrix;
  result.data = permuted.data();
  storage.push_back(permuted.owner);
  return result;
}

namespace detail {

AlignedBytes allocate_aligned(std::size_t size) {
  constexpr std::align_val_t kAlignment{64};
  // operator new with size 0 is valid and returns a unique pointer; keep one byte for simplicity.
  auto* raw = static_cast<std::byte*>(::operator new[](std::max<std::size_t>(size, 1), kAlignment));
  AlignedBytes result;
  result.owner = std::shared_ptr<std::byte[]>(
      raw, [](std::byte* pointer) { ::operator delete[](pointer, kAlignment); });
  result.size = size;
  return result;
}

AlignedBytes copy_aligned(std::span<const std::byte> bytes) {
  AlignedBytes result = allocate_aligned(bytes.size());
  if (!bytes.empty()) std::memcpy(result.data(), bytes.data(), bytes.size());
  return result;
}

AlignedBytes read_file(const std::filesystem::path& path, std::string_view format) {
  common::require_regular_file(path, std::string(format) + " file");
  std::ifstream stream(path, std::ios::binary | std::ios::ate);
  KVEVICT_REQUIRE(stream.good(), std::string(format) + ": cannot open " + path.string());
  const std::streamoff size = stream.tellg();
  KVEVICT_REQUIRE(size >= 0, std::string(format) + ": cannot size " + path.string());
  stream.seekg(0);
  AlignedBytes result = allocate_aligned(static_cast<std::size_t>(size));
  stream.read(reinterpret_cast<char*>(result.data()), size);
  KVEVICT_REQUIRE(stream.gcount() == size, std::string(format) + ": cannot read " + path.string());
  return result;
}

void write_file(const std::filesystem::path& path, std::span<const std::byte> bytes,
                std::string_view format) {
  std::ofstream stream(path, std::ios::binary | std::ios::trunc);
  KVEVICT_REQUIRE(stream.good(), std::string(format) + ": cannot create " + path.string());
  stream.write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
  stream.close();
  KVEVICT_REQUIRE(!stream.fail(), std::string(format) + ": cannot write " + path.string());
}

// --- ByteReader / ByteWriter -----------------------------------------------------------------

void ByteReader::need(std::uint64_t length, std::string_view what) const {
  if (length <= remaining()) return;
  throw Error(std::string(format_) + ": truncated file: " + std::string(what) + " needs " +
              std::to_string(length) + " bytes at offset " + std::to_string(position_) + ", only " +
              std::to_string(remaining()) + " left");
}

std::span<const std::byte> ByteReader::bytes(std::uint64_t length, std::string_view what) {
  need(length, what);
  const auto result = bytes_.subspan(position_, static_cast<std::size_t>(length));
  position_ += static_cast<std::size_t>(length);
  return result;
}

std::string_view ByteReader::string(std::uint64_t length, std::string_view what) {
  const auto view = bytes(length, what);
  return {reinterpret_cast<const char*>(view.data()), view.size()};
}

void ByteReader::skip(std::uint64_t length, std::string_view what) { (void)bytes(length, what); }

namespace {
template <class T>
T read_value(ByteReader& reader, std::string_view what) {
  T value;
  std::memcpy(&value, reader.bytes(sizeof(T), what).data(), sizeof(T));
  return value;
}
}  // namespace

std::uint8_t ByteReader::u8(std::string_view what) { return read_value<std::uint8_t>(*this, what); }
std::uint16_t ByteReader::u16(std::string_view what) {
  return read_value<std::uint16_t>(*this, what);
}
std::uint32_t ByteReader::u32(std::string_view what) {
  return read_value<std::uint32_t>(*this, what);
}
std::uint64_t ByteReader::u64(std::string_view what) {
  return read_value<std::uint64_t>(*this, what);
}
std::int32_t ByteReader::i32(std::string_view what) {
  return read_value<std::int32_t>(*this, what);
}
float ByteReader::f32(std::string_view what) { return read_value<float>(*this, what); }
double ByteReader::f64(std::string_view what) { return read_value<double>(*this, what); }

void ByteWriter::append(const void* data, std::size_t size) {
  const auto* begin = static_cast<const std::byte*>(data);
  buffer_.insert(buffer_.end(), begin, begin + size);
}

void ByteWriter::pad_to(std::size_t alignment, std::byte fill) {
  while (buffer_.size() % alignment != 0) buffer_.push_back(fill);
}

// --- Tensor roles ------------------------------------------------------------------------------

bool is_norm(TensorRole role) {
  return role == TensorRole::attention_norm || role == TensorRole::ffn_norm ||
         role == TensorRole::final_norm;
}

std::vector<std::int64_t> expected_shape(const ModelConfig& config, TensorRole role) {
  const std::int64_t dim = config.dim;
  const std::int64_t q_rows = std::int64_t{config.heads} * config.head_dim();
  const std::int64_t kv_rows = std::int64_t{config.kv_heads} * config.head_dim();
  switch (role) {
    case TensorRole::token_embedding:
    case TensorRole::output:
      return {config.vocab_size, dim};
    case TensorRole::attention_norm:
    case TensorRole::ffn_norm:
    case TensorRole::final_norm:
      return {dim};
    case TensorRole::wq:
      return {q_rows, dim};
    case TensorRole::wk:
    case TensorRole::wv:
      return {kv_rows, dim};
    case TensorRole::wo:
      return {dim, q_rows};
    case TensorRole::w_gate:
    case TensorRole::w_up:
      return {config.hidden_dim, dim};
    case TensorRole::w_down:
      return {dim, config.hidden_dim};
  }
  throw Error("unknown tensor role");
}

namespace {
template <class ModelT>
auto& matrix_in(ModelT& model, TensorRole role, int layer) {
  switch (role) {
    case TensorRole::token_embedding:
      return model.token_embedding;
    case TensorRole::output:
      return model.output;
    case TensorRole::wq:
      return model.layers.at(static_cast<std::size_t>(layer)).wq;
    case TensorRole::wk:
      return model.layers.at(static_cast<std::size_t>(layer)).wk;
    case TensorRole::wv:
      return model.layers.at(static_cast<std::size_t>(layer)).wv;
    case TensorRole::wo:
      return model.layers.at(static_cast<std::size_t>(layer)).wo;
    case TensorRole::w_gate:
      return model.layers.at(static_cast<std::size_t>(layer)).w_gate;
    case TensorRole::w_up:
      return model.layers.at(static_cast<std::size_t>(layer)).w_up;
    case TensorRole::w_down:
      return model.layers.at(static_cast<std::size_t>(layer)).w_down;
    default:
      throw Error("tensor role is a norm, not a matrix");
  }
}

template <class ModelT>
auto& norm_in(ModelT& model, TensorRole role, int layer) {
  switch (role) {
    case TensorRole::attention_norm:
      return model.layers.at(static_cast<std::size_t>(layer)).attention_norm;
    case TensorRole::ffn_norm:
      return model.layers.at(static_cast<std::size_t>(layer)).ffn_norm;
    case TensorRole::final_norm:
      return model.final_norm;
    default:
      throw Error("tensor role is a matrix, not a norm");
  }
}
}  // namespace

WeightMatrix& matrix_of(Model& model, TensorRole role, int layer) {
  return matrix_in(model, role, layer);
}
const WeightMatrix& matrix_of(const Model& model, TensorRole role, int layer) {
  return matrix_in(model, role, layer);
}
std::vector<float>& norm_of(Model& model, TensorRole role, int layer) {
  return norm_in(model, role, layer);
}
const std::vector<float>& norm_of(const Model& model, TensorRole role, int layer) {
  return norm_in(model, role, layer);
}

std::string shape_string(std::span<const std::int64_t> shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

// --- Tensor data -------------------------------------------------------------------------------

WeightMatrix matrix_view(Model& model, std::span<const std::byte> bytes, DType dtype,
                         std::int64_t rows, std::int64_t cols) {
  WeightMatrix matrix{dtype, rows, cols, bytes.data()};
  KVEVICT_REQUIRE(bytes.size() == matrix.bytes(), "matrix_view: byte count does not match shape");
  // Blocks (Q8_0, Q4_0) are read with unaligned loads; values need their own alignment.
  const std::size_t alignment = block_values(dtype) == 1 ? dtype_size(dtype) : 1;
  if (reinterpret_cast<std::uintptr_t>(bytes.data()) % alignment != 0) {
    const AlignedBytes copy = copy_aligned(bytes);
    model.storage.push_back(copy.owner);
    matrix.data = copy.data();
  }
  return matrix;
}

float narrow_to_f32(double value, std::string_view what) {
  KVEVICT_REQUIRE(!std::isfinite(value) || std::fabs(value) <= std::numeric_limits<float>::max(),
                  std::string(what) + " = " + std::to_string(value) + " is beyond the f32 range");
  return static_cast<float>(value);
}

std::vector<float> to_f32(std::span<const std::byte> bytes, DType dtype, std::size_t count) {
  KVEVICT_REQUIRE(dtype_bytes(dtype, static_cast<std::int64_t>(count)) <= bytes.size(),
                  "to_f32: too few bytes");
  std::vector<float> values(count);
  convert_to_f32(bytes.data(), dtype, count, values.data());
  return values;
}

std::vector<std::byte> matrix_bytes_as(const WeightMatrix& matrix, DType dtype) {
  const std::size_t count = static_cast<std::size_t>(matrix.rows * matrix.cols);
  if (matrix.dtype == dtype) return {matrix.data, matrix.data + matrix.bytes()};
  const std::vector<float> values = to_f32({matrix.data, matrix.bytes()}, matrix.dtype, count);
  if (block_values(dtype) > 1) return quantize(values, dtype);
  std::vector<std::byte> out(count * dtype_size(dtype));
  for (std::size_t i = 0; i < count; ++i) {
    if (dtype == DType::f32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const std::uint16_t half =
          dtype == DType::f16 ? float_to_f16(values[i]) : float_to_bf16(values[i]);
      std::memcpy(out.data() + 2 * i, &half, 2);
    }
  }
  return out;
}

void convert_rope_layout(Model& model, RopeLayout target) {
  const ModelConfig& config = model.config;
  for (LayerWeights& layer : model.layers) {
    layer.wq = permute_rope_rows(layer.wq, config.heads, config.head_dim(), config.rotary_dim,
                                 config.rope_layout, target, model.storage);
    layer.wk = permute_rope_rows(layer.wk, config.kv_heads, config.head_dim(), config.rotary_dim,
                                 config.rope_layout, target, model.storage);
  }
  model.config.rope_layout = target;
}

void finish_model(Model& model, std::string_view format) {
  try {
    model.config.validate();
  } catch (const Error& error) {
    throw Error(std::string(format) + ": " + error.what());
  }
  Tokenizer& tokenizer = model.tokenizer;
  const int vocab = model.config.vocab_size;
  tokenizer.vocab_size = vocab;
  if (tokenizer.kind == Tokenizer::Kind::sentencepiece) {
    const std::size_t pieces = tokenizer.pieces.size();
    KVEVICT_REQUIRE(pieces > 0 && pieces <= static_cast<std::size_t>(vocab),
                    std::string(format) + ": tokenizer has " + std::to_string(pieces) +
                        " pieces for a vocabulary of " + std::to_string(vocab));
    if (tokenizer.scores.empty()) tokenizer.scores.assign(pieces, 0.0f);
    KVEVICT_REQUIRE(tokenizer.scores.size() == pieces, std::string(format) + ": tokenizer has " +
                                                           std::to_string(tokenizer.scores.size()) +
                                                           " scores for " + std::to_string(pieces) +
                                                           " pieces");
    if (tokenizer.types.empty()) {
      tokenizer.types = infer_piece_types(tokenizer.pieces, tokenizer.bos_id, tokenizer.eos_id, -1);
    }
    KVEVICT_REQUIRE(tokenizer.types.size() == pieces, std::string(format) + ": tokenizer has " +
                                                          std::to_string(tokenizer.types.size()) +
                                                          " token types for " +
                                                          std::to_string(pieces) + " pieces");
    if (tokenizer.anchor_id < 0) tokenizer.anchor_id = find_piece(tokenizer, "<AC>");
  }
  const std::pair<const char*, std::int32_t> ids[] = {
      {"bos", tokenizer.bos_id}, {"eos", tokenizer.eos_id}, {"anchor", tokenizer.anchor_id}};
  for (const auto& [name, id] : ids) {
    KVEVICT_REQUIRE(id >= -1 && id < vocab, std::string(format) + ": tokenizer " + name +
                                                " token id " + std::to_string(id) +
                                                " is outside the vocabulary of " +
                                                std::to_string(vocab));
  }
}

void require_disjoint(std::vector<TensorBytes> tensors, std::string_view format) {
  std::erase_if(tensors, [](const TensorBytes& tensor) { return tensor.begin == tensor.end; });
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorBytes& a, const TensorBytes& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    const TensorBytes& before = tensors[i - 1];
    const TensorBytes& after = tensors[i];
    KVEVICT_REQUIRE(after.begin >= before.end,
                    std::string(format) + ": tensors " + in_quotes(before.name) + " and " +
                        in_quotes(after.name) + " overlap in the data section (bytes [" +
                        std::to_string(before.begin) + ", " + std::to_string(before.end) +
                        ") and [" + std::to_string(after.begin) + ", " + std::to_string(after.end) +
                        "))");
  }
}

}  // namespace detail
namespace detail {

// Appended piecewise: GCC 12 reports a false -Wrestrict for "'" + std::string(text) + "'".
std::string in_quotes(std::string_view text) {
  std::string result;
  result.reserve(text.size() + 2);
  result += '\'';
  result += text;
  result += '\'';
  return result;
}

}  // namespace detail
}  // namespace kvevict::model
