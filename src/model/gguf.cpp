// GGUF: container parser and writer, and the Llama model mapping (load_gguf / serialize_gguf).
#include "gguf.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "half.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "model_io.hpp"

namespace kvevict::model {
namespace gguf {
namespace {

using detail::in_quotes;

using detail::ByteReader;
using detail::ByteWriter;

constexpr std::uint64_t kMaxKeyLength = 65535;  // the GGUF spec's limit for keys
constexpr std::uint64_t kMaxNameLength = 65535;
// Smallest possible encodings, used to bound counts by the bytes that remain.
constexpr std::uint64_t kMinMetadataBytes = 8 + 4 + 1;            // empty key, type, 1-byte value
constexpr std::uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // empty name, 1 dim
// Element counts beyond this are corrupt (and would overflow byte sizes).
constexpr std::int64_t kMaxElements = std::int64_t{1} << 56;

[[noreturn]] void fail(const std::string& message) { throw Error("GGUF: " + message); }

/// Encoded size of a fixed-size scalar type, 0 for string / array.
std::uint64_t scalar_size(ValueType type) {
  switch (type) {
    case ValueType::uint8:
    case ValueType::int8:
    case ValueType::boolean:
      return 1;
    case ValueType::uint16:
    case ValueType::int16:
      return 2;
    case ValueType::uint32:
    case ValueType::int32:
    case ValueType::float32:
      return 4;
    case ValueType::uint64:
    case ValueType::int64:
    case ValueType::float64:
      return 8;
    case ValueType::string:
    case ValueType::array:
      return 0;
  }
  return 0;
}

bool known_value_type(std::uint32_t type) { return type <= 12; }

bool is_integer(ValueType type) {
  switch (type) {
    case ValueType::uint8:
    case ValueType::int8:
    case ValueType::uint16:
    case ValueType::int16:
    case ValueType::uint32:
    case ValueType::int32:
    case ValueType::uint64:
    case ValueType::int64:
      return true;
    default:
      return false;
  }
}

bool is_signed(ValueType type) {
  return type == ValueType::int8 || type == ValueType::int16 || type == ValueType::int32 ||
         type == ValueType::int64;
}

std::string_view read_string(ByteReader& reader, std::uint64_t max_length, std::string_view what) {
  const std::uint64_t length = reader.u64(what);
  if (length > reader.remaining()) {
    fail("string length " + std::to_string(length) + " of " + std::string(what) +
         " exceeds the file (" + std::to_string(reader.remaining()) + " bytes left)");
  }
  if (length > max_length) {
    fail("string length " + std::to_string(length) + " of " + std::string(what) +
         " is absurd (limit " + std::to_string(max_length) + ")");
  }
  return reader.string(length, what);
}

/// Reads one scalar of `type` into `value` (type already known to be a scalar).
void read_scalar(ByteReader& reader, ValueType type, Value& value, std::string_view what) {
  switch (type) {
    case ValueType::uint8:
    case ValueType::boolean:
      value.unsigned_value = reader.u8(what);
      break;
    case ValueType::int8:
      value.signed_value = static_cast<std::int8_t>(reader.u8(what));
      break;
    case ValueType::uint16:
      value.unsigned_value = reader.u16(what);
      break;
    case ValueType::int16:
      value.signed_value = static_cast<std::int16_t>(reader.u16(what));
      break;
    case ValueType::uint32:
      value.unsigned_value = reader.u32(what);
      break;
    case ValueType::int32:
      value.signed_value = reader.i32(what);
      break;
    case ValueType::uint64:
      value.unsigned_value = reader.u64(what);
      break;
    case ValueType::int64:
      value.signed_value = static_cast<std::int64_t>(reader.u64(what));
      break;
    case ValueType::float32:
      value.float_value = reader.f32(what);
      break;
    case ValueType::float64:
      value.float_value = reader.f64(what);
      break;
    default:
      break;
  }
}

/// Reads (and for arrays walks, without allocating) one value of `type` for metadata `key`.
Value read_value(ByteReader& reader, ValueType type, std::string_view key, int depth) {
  Value value;
  value.type = type;
  const std::string what = "metadata " + in_quotes(key);
  if (type == ValueType::string) {
    value.string_value = read_string(reader, kMaxStringLength, what);
    return value;
  }
  if (type != ValueType::array) {
    read_scalar(reader, type, value, what);
    return value;
  }
  if (depth >= kMaxArrayNesting) {
    fail("arrays of metadata " + in_quotes(key) + " are nested deeper than " +
         std::to_string(kMaxArrayNesting));
  }
  const std::uint32_t element_type = reader.u32(what + " array element type");
  if (!known_value_type(element_type)) {
    fail("unknown array element type " + std::to_string(element_type) + " of metadata " +
         in_quotes(key));
  }
  value.element_type = static_cast<ValueType>(element_type);
  value.count = reader.u64(what + " array length");
  std::uint64_t min_element_bytes = scalar_size(value.element_type);
  if (value.element_type == ValueType::string) min_element_bytes = 8;
  if (value.element_type == ValueType::array) min_element_bytes = 4 + 8;
  if (value.count > reader.remaining() / min_element_bytes) {
    fail("array length " + std::to_string(value.count) + " of metadata " + in_quotes(key) +
         " exceeds the file (" + std::to_string(reader.remaining()) + " bytes left)");
  }
  const std::size_t begin = reader.position();
  if (value.element_type == ValueType::string) {
    for (std::uint64_t i = 0; i < value.count; ++i)
      (void)read_string(reader, kMaxStringLength, what);
  } else if (value.element_type == ValueType::array) {
    for (std::uint64_t i = 0; i < value.count; ++i) {
      (void)read_value(reader, ValueType::array, key, depth + 1);
    }
  } else {
    reader.skip(value.count * min_element_bytes, what);
  }
  // Re-read the walked span as a view (the walk has already checked its bounds).
  const std::size_t end = reader.position();
  reader.seek(begin);
  value.array_bytes = reader.bytes(end - begin, what);
  return value;
}

/// Bytes of a tensor of a supported type, or 0 for other types.
std::uint64_t tensor_size(const TensorInfo& tensor) {
  const std::int64_t elements = element_count(tensor);
  const auto bytes = [&](std::int64_t per_element) {
    return static_cast<std::uint64_t>(checked_product(
        {elements, per_element}, "GGUF: tensor " + in_quotes(tensor.name) + " bytes"));
  };
  switch (static_cast<TensorType>(tensor.type)) {
    case TensorType::f32:
      return bytes(4);
    case TensorType::f16:
    case TensorType::bf16:
      return bytes(2);
    case TensorType::q8_0:
    case TensorType::q4_0:
      if (tensor.dims[0] % kQuantBlockValues != 0) {
        fail(tensor_type_name(tensor.type) + " tensor " + in_quotes(tensor.name) + " has ne[0] = " +
             std::to_string(tensor.dims[0]) + ", not a multiple of the block size 32");
      }
      return static_cast<std::uint64_t>(checked_product(
          {elements / kQuantBlockValues, static_cast<TensorType>(tensor.type) == TensorType::q8_0
                                             ? kQ8BlockBytes
                                             : kQ4BlockBytes},
          "GGUF: tensor " + in_quotes(tensor.name) + " bytes"));
  }
  return 0;
}

double decode_double(const Value& element) {
  if (element.type == ValueType::float32 || element.type == ValueType::float64) {
    return element.float_value;
  }
  if (is_signed(element.type)) return static_cast<double>(element.signed_value);
  return static_cast<double>(element.unsigned_value);
}

}  // namespace

std::string_view to_string(ValueType type) {
  static constexpr std::string_view kNames[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                                "int32",  "float32", "bool",   "string", "array",
                                                "uint64", "int64",   "float64"};
  const auto index = static_cast<std::uint32_t>(type);
  return index < std::size(kNames) ? kNames[index] : "unknown";
}

std::string tensor_type_name(std::uint32_t type) {
  static constexpr std::string_view kNames[] = {
      "F32",     "F16",    "Q4_0",    "Q4_1",  "Q4_2",   "Q4_3",  "Q5_0",  "Q5_1",
      "Q8_0",    "Q8_1",   "Q2_K",    "Q3_K",  "Q4_K",   "Q5_K",  "Q6_K",  "Q8_K",
      "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS",
      "I8",      "I16",    "I32",     "I64",   "F64",    "IQ1_M", "BF16"};
  if (type < std::size(kNames)) return std::string(kNames[type]);
  return "type " + std::to_string(type);
}

bool is_supported(std::uint32_t type) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::f32:
    case TensorType::f16:
    case TensorType::bf16:
    case TensorType::q8_0:
    case TensorType::q4_0:
      return true;
  }
  return false;
}

std::int64_t element_count(const TensorInfo& tensor) {
  std::int64_t elements = 1;
  for (const std::int64_t dim : tensor.dims) {
    elements = checked_product(
        {elements, dim},
        "GGUF: tensor " + in_quotes(tensor.name) + " has an absurd dimension: its element count",
        kMaxElements);
  }
  return elements;
}

// --- File --------------------------------------------------------------------------------------

const Value* File::find(std::string_view key) const {
  const auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  for (const TensorInfo& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

std::span<const std::byte> File::tensor_data(const TensorInfo& tensor) const {
  if (!is_supported(tensor.type)) {
    fail("tensor " + in_quotes(tensor.name) + " has unsupported type " +
         tensor_type_name(tensor.type) + " (" + std::to_string(tensor.type) +
         "); kvevict reads F32, F16, BF16, Q8_0 and Q4_0");
  }
  return bytes.subspan(static_cast<std::size_t>(data_offset + tensor.offset),
                       static_cast<std::size_t>(tensor.size));
}

std::optional<std::uint64_t> File::get_uint(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (!is_integer(value->type)) {
    fail("metadata " + in_quotes(key) + " has type " + std::string(to_string(value->type)) +
         ", expected an integer");
  }
  if (is_signed(value->type)) {
    if (value->signed_value < 0) {
      fail("metadata " + in_quotes(key) + " is negative (" + std::to_string(value->signed_value) +
           ")");
    }
    return static_cast<std::uint64_t>(value->signed_value);
  }
  return value->unsigned_value;
}

std::optional<double> File::get_float(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (value->type == ValueType::float32 || value->type == ValueType::float64) {
    return value->float_value;
  }
  if (is_integer(value->type)) return decode_double(*value);
  fail("metadata " + in_quotes(key) + " has type " + std::string(to_string(value->type)) +
       ", expected a number");
}

std::optional<std::string_view> File::get_string(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (value->type != ValueType::string) {
    fail("metadata " + in_quotes(key) + " has type " + std::string(to_string(value->type)) +
         ", expected a string");
  }
  return value->string_value;
}

std::optional<std::vector<std::string>> File::get_string_array(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (value->type != ValueType::array || value->element_type != ValueType::string) {
    fail("metadata " + in_quotes(key) + " is not an array of strings");
  }
  ByteReader reader(value->array_bytes, "GGUF");
  std::vector<std::string> strings;
  strings.reserve(static_cast<std::size_t>(value->count));  // checked against the file by parse
  const std::string what = "metadata " + in_quotes(key);
  for (std::uint64_t i = 0; i < value->count; ++i) {
    strings.emplace_back(read_string(reader, kMaxStringLength, what));
  }
  return strings;
}

namespace {
template <class T>
std::vector<T> numeric_array(std::string_view key, const Value& value) {
  if (value.type != ValueType::array ||
      !(is_integer(value.element_type) || value.element_type == ValueType::float32 ||
        value.element_type == ValueType::float64)) {
    fail("metadata " + in_quotes(key) + " is not a numeric array");
  }
  ByteReader reader(value.array_bytes, "GGUF");
  std::vector<T> numbers;
  numbers.reserve(static_cast<std::size_t>(value.count));  // checked against the file by parse
  const std::string what = "metadata " + in_quotes(key);
  for (std::uint64_t i = 0; i < value.count; ++i) {
    Value element;
    element.type = value.element_type;
    read_scalar(reader, value.element_type, element, "metadata array");
    if constexpr (std::is_same_v<T, float>) {
      numbers.push_back(detail::narrow_to_f32(decode_double(element), what));
    } else {  // integer elements only (checked by the caller): modular narrowing, as C++20 defines
      numbers.push_back(is_signed(element.type) ? static_cast<T>(element.signed_value)
                                                : static_cast<T>(element.unsigned_value));
    }
  }
  return numbers;
}
}  // namespace

std::optional<std::vector<float>> File::get_float_array(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  return numeric_array<float>(key, *value);
}

std::optional<std::vector<std::int32_t>> File::get_int_array(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (!is_integer(value->element_type)) {
    fail("metadata " + in_quotes(key) + " is not an integer array");
  }
  return numeric_array<std::int32_t>(key, *value);
}

// --- parse -------------------------------------------------------------------------------------

File parse(std::span<const std::byte> bytes) {
  ByteReader reader(bytes, "GGUF");
  File file;
  file.bytes = bytes;
  const std::string_view magic = reader.string(4, "magic");
  if (magic != kMagic) fail("bad magic (not a GGUF file)");
  file.version = reader.u32("version");
  if (file.version != 2 && file.version != 3) {
    const bool byte_swapped = file.version == 0x02000000u || file.version == 0x03000000u;
    fail("unsupported version " + std::to_string(file.version) +
         (byte_swapped ? " (a big-endian file?)" : "") + "; kvevict reads versions 2 and 3");
  }
  const std::uint64_t tensor_count = reader.u64("tensor count");
  const std::uint64_t metadata_count = reader.u64("metadata count");
  if (tensor_count > kMaxTensors) {
    fail("tensor count " + std::to_string(tensor_count) + " is absurd (limit " +
         std::to_string(kMaxTensors) + ")");
  }
  if (metadata_count > kMaxMetadata || metadata_count > reader.remaining() / kMinMetadataBytes) {
    fail("metadata count " + std::to_string(metadata_count) + " is absurd for a file with " +
         std::to_string(reader.remaining()) + " bytes left");
  }

  for (std::uint64_t i = 0; i < metadata_count; ++i) {
    const std::string_view key = read_string(reader, kMaxKeyLength, "metadata key");
    const std::uint32_t type = reader.u32("value type of metadata " + in_quotes(key));
    if (!known_value_type(type)) {
      fail("unknown value type " + std::to_string(type) + " of metadata " + in_quotes(key));
    }
    Value value = read_value(reader, static_cast<ValueType>(type), key, 0);
    if (!file.metadata.emplace(std::string(key), value).second) {
      fail("duplicate metadata key " + in_quotes(key));
    }
  }

  if (const auto alignment = file.get_uint("general.alignment")) {
    if (*alignment == 0 || (*alignment & (*alignment - 1)) != 0 || *alignment > (1u << 30)) {
      fail("general.alignment " + std::to_string(*alignment) + " is not a power of two");
    }
    file.alignment = static_cast<std::uint32_t>(*alignment);
  }

  if (tensor_count > reader.remaining() / kMinTensorInfoBytes) {
    fail("tensor count " + std::to_string(tensor_count) + " is absurd for a file with " +
         std::to_string(reader.remaining()) + " bytes left");
  }
  file.tensors.reserve(static_cast<std::size_t>(tensor_count));
  std::unordered_set<std::string> names;
  for (std::uint64_t i = 0; i < tensor_count; ++i) {
    TensorInfo tensor;
    tensor.name = std::string(read_string(reader, kMaxNameLength, "tensor name"));
    const std::string what = "tensor " + in_quotes(tensor.name);
    const std::uint32_t n_dims = reader.u32(what + " dimension count");
    if (n_dims < 1 || n_dims > static_cast<std::uint32_t>(kMaxDims)) {
      fail(what + " has " + std::to_string(n_dims) + " dimensions (1 to 4 supported)");
    }
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      const std::uint64_t dim = reader.u64(what + " dimension");
      if (dim == 0 || dim > static_cast<std::uint64_t>(kMaxElements)) {
        fail(what + " has an absurd dimension " + std::to_string(dim));
      }
      tensor.dims.push_back(static_cast<std::int64_t>(dim));
    }
    (void)element_count(tensor);  // the product of the dimensions is bounded too
    tensor.type = reader.u32(what + " type");
    tensor.offset = reader.u64(what + " offset");
    if (tensor.offset % file.alignment != 0) {
      fail(what + " offset " + std::to_string(tensor.offset) +
           " is not a multiple of the alignment " + std::to_string(file.alignment));
    }
    tensor.size = tensor_size(tensor);
    if (!names.insert(tensor.name).second) fail("duplicate tensor " + in_quotes(tensor.name));
    file.tensors.push_back(std::move(tensor));
  }

  // The data section starts at the next multiple of the alignment.
  const std::uint64_t header_end = reader.position();
  file.data_offset = (header_end + file.alignment - 1) / file.alignment * file.alignment;
  const std::uint64_t data_size =
      bytes.size() > file.data_offset ? bytes.size() - file.data_offset : 0;
  std::vector<detail::TensorBytes> extents;
  for (const TensorInfo& tensor : file.tensors) {
    if (!is_supported(tensor.type)) continue;  // its size is unknown; it is rejected if used
    if (tensor.offset > data_size || tensor.size > data_size - tensor.offset) {
      fail("tensor " + in_quotes(tensor.name) + " (" + std::to_string(tensor.size) +
           " bytes at data offset " + std::to_string(tensor.offset) +
           ") extends beyond the end of the file (the data section holds " +
           std::to_string(data_size) + " bytes)");
    }
    extents.push_back({tensor.name, tensor.offset, tensor.offset + tensor.size});
  }
  // ggml's own loader goes further: each offset must follow the previous tensor's padded end.
  detail::require_disjoint(std::move(extents), "GGUF");
  return file;
}

// --- Writer ------------------------------------------------------------------------------------

namespace {
void put_string(ByteWriter& out, std::string_view text) {
  out.u64(text.size());
  out.string(text);
}
}  // namespace

void Writer::key_and_type(std::string_view key, ValueType type) {
  ByteWriter out;
  put_string(out, key);
  out.u32(static_cast<std::uint32_t>(type));
  metadata_.insert(metadata_.end(), out.buffer().begin(), out.buffer().end());
  ++metadata_count_;
}

void Writer::add_raw(std::string_view key, ValueType type, std::span<const std::byte> encoded) {
  key_and_type(key, type);
  metadata_.insert(metadata_.end(), encoded.begin(), encoded.end());
}

void Writer::add_uint32(std::string_view key, std::uint32_t value) {
  ByteWriter out;
  out.u32(value);
  add_raw(key, ValueType::uint32, out.buffer());
}
void Writer::add_int32(std::string_view key, std::int32_t value) {
  ByteWriter out;
  out.i32(value);
  add_raw(key, ValueType::int32, out.buffer());
}
void Writer::add_uint64(std::string_view key, std::uint64_t value) {
  ByteWriter out;
  out.u64(value);
  add_raw(key, ValueType::uint64, out.buffer());
}
void Writer::add_float32(std::string_view key, float value) {
  ByteWriter out;
  out.f32(value);
  add_raw(key, ValueType::float32, out.buffer());
}
void Writer::add_bool(std::string_view key, bool value) {
  ByteWriter out;
  out.u8(value ? 1 : 0);
  add_raw(key, ValueType::boolean, out.buffer());
}
void Writer::add_string(std::string_view key, std::string_view value) {
  ByteWriter out;
  put_string(out, value);
  add_raw(key, ValueType::string, out.buffer());
}
void Writer::add_string_array(std::string_view key, const std::vector<std::string>& values) {
  ByteWriter out;
  out.u32(static_cast<std::uint32_t>(ValueType::string));
  out.u64(values.size());
  for (const std::string& value : values) put_string(out, value);
  add_raw(key, ValueType::array, out.buffer());
}
void Writer::add_float32_array(std::string_view key, std::span<const float> values) {
  ByteWriter out;
  out.u32(static_cast<std::uint32_t>(ValueType::float32));
  out.u64(values.size());
  for (const float value : values) out.f32(value);
  add_raw(key, ValueType::array, out.buffer());
}
void Writer::add_int32_array(std::string_view key, std::span<const std::int32_t> values) {
  ByteWriter out;
  out.u32(static_cast<std::uint32_t>(ValueType::int32));
  out.u64(values.size());
  for (const std::int32_t value : values) out.i32(value);
  add_raw(key, ValueType::array, out.buffer());
}

void Writer::add_tensor(std::string_view name, std::vector<std::int64_t> dims, std::uint32_t type,
                        std::vector<std::byte> data) {
  tensors_.push_back(PendingTensor{std::string(name), std::move(dims), type, std::move(data)});
}

std::vector<std::byte> Writer::finish() const {
  ByteWriter out;
  out.string(kMagic);
  out.u32(version_);
  out.u64(tensors_.size());
  const bool write_alignment = alignment_ != kDefaultAlignment;
  out.u64(metadata_count_ + (write_alignment ? 1 : 0));
  if (write_alignment) {
    put_string(out, "general.alignment");
    out.u32(static_cast<std::uint32_t>(ValueType::uint32));
    out.u32(alignment_);
  }
  out.bytes(metadata_);
  std::uint64_t offset = 0;
  for (const PendingTensor& tensor : tensors_) {
    put_string(out, tensor.name);
    out.u32(static_cast<std::uint32_t>(tensor.dims.size()));
    for (const std::int64_t dim : tensor.dims) out.u64(static_cast<std::uint64_t>(dim));
    out.u32(tensor.type);
    out.u64(offset);
    offset += (tensor.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  // Padding between tensors but none after the last: the file ends with its data, so every
  // proper prefix of a written file is detectably truncated.
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    out.pad_to(alignment_);
    out.bytes(tensors_[i].data);
  }
  if (tensors_.empty()) out.pad_to(alignment_);
  return std::move(out.buffer());
}

}  // namespace gguf

// --- Llama model mapping -----------------------------------------------------------------------

namespace {

using detail::TensorRole;

constexpr std::string_view kByteTokenizerModel = "kvevict-bytes";
constexpr std::string_view kAnchorKey = "kvevict.anchor_token_id";

[[noreturn]] void fail(const std::string& message) { throw Error("GGUF: " + message); }

std::string tensor_name(TensorRole role, int layer) {
  const std::string block = "blk." + std::to_string(layer) + ".";
  switch (role) {
    case TensorRole::token_embedding:
      return "token_embd.weight";
    case TensorRole::attention_norm:
      return block + "attn_norm.weight";
    case TensorRole::wq:
      return block + "attn_q.weight";
    case TensorRole::wk:
      return block + "attn_k.weight";
    case TensorRole::wv:
      return block + "attn_v.weight";
    case TensorRole::wo:
      return block + "attn_output.weight";
    case TensorRole::ffn_norm:
      return block + "ffn_norm.weight";
    case TensorRole::w_gate:
      return block + "ffn_gate.weight";
    case TensorRole::w_up:
      return block + "ffn_up.weight";
    case TensorRole::w_down:
      return block + "ffn_down.weight";
    case TensorRole::final_norm:
      return "output_norm.weight";
    case TensorRole::output:
      return "output.weight";
  }
  return {};
}

int metadata_int(const gguf::File& file, std::string_view key, std::optional<int> fallback) {
  const std::optional<std::uint64_t> value = file.get_uint(key);
  if (!value) {
    if (fallback) return *fallback;
    fail("missing metadata key '" + std::string(key) + "'");
  }
  if (*value > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
    fail("metadata '" + std::string(key) + "' = " + std::to_string(*value) + " is absurd");
  }
  return static_cast<int>(*value);
}

std::int32_t token_id(const gguf::File& file, std::string_view key, std::int32_t fallback) {
  const std::optional<std::uint64_t> value = file.get_uint(key);
  if (!value) return fallback;
  if (*value > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max())) {
    fail("metadata '" + std::string(key) + "' = " + std::to_string(*value) + " is absurd");
  }
  return static_cast<std::int32_t>(*value);
}

DType dtype_of(gguf::TensorType type) {
  switch (type) {
    case gguf::TensorType::f32:
      return DType::f32;
    case gguf::TensorType::f16:
      return DType::f16;
    case gguf::TensorType::bf16:
      return DType::bf16;
    case gguf::TensorType::q8_0:
      return DType::q8_0;
    case gguf::TensorType::q4_0:
      return DType::q4_0;
  }
  fail("tensor type " + std::to_string(static_cast<std::uint32_t>(type)) + " has no DType");
}

gguf::TensorType gguf_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return gguf::TensorType::f32;
    case DType::f16:
      return gguf::TensorType::f16;
    case DType::bf16:
      return gguf::TensorType::bf16;
    case DType::q8_0:
      return gguf::TensorType::q8_0;
    case DType::q4_0:
      return gguf::TensorType::q4_0;
  }
  return gguf::TensorType::f32;
}

void load_tensor(Model& model, const gguf::File& file, TensorRole role, int layer) {
  const std::string name = tensor_name(role, layer);
  const gguf::TensorInfo* tensor = file.find_tensor(name);
  if (tensor == nullptr) fail("missing tensor '" + name + "'");
  std::vector<std::int64_t> expected = detail::expected_shape(model.config, role);
  std::reverse(expected.begin(), expected.end());  // GGUF lists the fastest dimension first
  if (tensor->dims != expected) {
    fail("tensor '" + name + "' has shape " + detail::shape_string(tensor->dims) +
         " (fastest first), expected " + detail::shape_string(expected) + " for this config");
  }
  const std::span<const std::byte> bytes = file.tensor_data(*tensor);
  const auto type = static_cast<gguf::TensorType>(tensor->type);
  const auto count = static_cast<std::size_t>(gguf::element_count(*tensor));
  if (detail::is_norm(role)) {
    std::vector<float>& norm = detail::norm_of(model, role, layer);
    norm = detail::to_f32(bytes, dtype_of(type), count);
    return;
  }
  // Matrices stay in the file's type (and bytes, when aligned).
  detail::matrix_of(model, role, layer) =
      detail::matrix_view(model, bytes, dtype_of(type), tensor->dims[1], tensor->dims[0]);
}

Tokenizer read_tokenizer(const gguf::File& file) {
  Tokenizer tokenizer;
  const std::optional<std::string_view> kind = file.get_string("tokenizer.ggml.model");
  tokenizer.anchor_id = token_id(file, kAnchorKey, -1);
  if (!kind || *kind == kByteTokenizerModel) {
    tokenizer.kind = Tokenizer::Kind::byte_level;
    tokenizer.bos_id = token_id(file, "tokenizer.ggml.bos_token_id", -1);
    tokenizer.eos_id = token_id(file, "tokenizer.ggml.eos_token_id", -1);
    return tokenizer;
  }
  if (*kind != "llama") {
    fail("tokenizer model '" + std::string(*kind) +
         "' is not supported (kvevict reads 'llama' SentencePiece and '" +
         std::string(kByteTokenizerModel) + "')");
  }
  tokenizer.kind = Tokenizer::Kind::sentencepiece;
  // llama.cpp's defaults for SentencePiece vocabularies.
  tokenizer.bos_id = token_id(file, "tokenizer.ggml.bos_token_id", 1);
  tokenizer.eos_id = token_id(file, "tokenizer.ggml.eos_token_id", 2);
  auto pieces = file.get_string_array("tokenizer.ggml.tokens");
  if (!pieces) fail("missing metadata key 'tokenizer.ggml.tokens'");
  tokenizer.pieces = std::move(*pieces);
  if (auto scores = file.get_float_array("tokenizer.ggml.scores")) {
    tokenizer.scores = std::move(*scores);
  }
  if (auto types = file.get_int_array("tokenizer.ggml.token_type")) {
    tokenizer.types = std::move(*types);
  } else {
    tokenizer.types =
        detail::infer_piece_types(tokenizer.pieces, tokenizer.bos_id, tokenizer.eos_id,
                                  token_id(file, "tokenizer.ggml.unknown_token_id", 0));
  }
  return tokenizer;
}

Model load_gguf_bytes(const detail::AlignedBytes& bytes) {
  const gguf::File file = gguf::parse(bytes.span());
  Model model;
  model.format = "gguf";
  model.storage.push_back(bytes.owner);

  const std::optional<std::string_view> architecture = file.get_string("general.architecture");
  if (!architecture) fail("missing metadata key 'general.architecture'");
  if (*architecture != "llama") {
    fail("architecture '" + std::string(*architecture) + "' is not supported (only llama)");
  }
  ModelConfig& config = model.config;
  config.dim = metadata_int(file, "llama.embedding_length", std::nullopt);
  config.hidden_dim = metadata_int(file, "llama.feed_forward_length", std::nullopt);
  config.layers = metadata_int(file, "llama.block_count", std::nullopt);
  config.heads = metadata_int(file, "llama.attention.head_count", std::nullopt);
  config.kv_heads = metadata_int(file, "llama.attention.head_count_kv", config.heads);
  config.context_length = metadata_int(file, "llama.context_length", 0);
  config.rope_theta = file.get_float("llama.rope.freq_base").value_or(10000.0);
  config.norm_eps =
      detail::narrow_to_f32(file.get_float("llama.attention.layer_norm_rms_epsilon").value_or(1e-5),
                            "llama.attention.layer_norm_rms_epsilon");
  config.rope_layout = RopeLayout::interleaved;  // llama.cpp's converter permuted Q/K for it

  const gguf::TensorInfo* embedding = file.find_tensor("token_embd.weight");
  if (embedding == nullptr) fail("missing tensor 'token_embd.weight'");
  if (embedding->dims.size() != 2) {
    fail("tensor 'token_embd.weight' has shape " + detail::shape_string(embedding->dims) +
         ", expected [dim, vocab]");
  }
  if (embedding->dims[1] > std::numeric_limits<int>::max()) {
    fail("vocabulary size " + std::to_string(embedding->dims[1]) + " is absurd");
  }
  config.vocab_size = static_cast<int>(embedding->dims[1]);
  if (const auto vocab = file.get_uint("llama.vocab_size");
      vocab && *vocab != static_cast<std::uint64_t>(embedding->dims[1])) {
    fail("llama.vocab_size " + std::to_string(*vocab) + " does not match token_embd.weight's " +
         std::to_string(embedding->dims[1]) + " rows");
  }
  try {
    config.validate();
  } catch (const Error& error) {
    fail(error.what());
  }
  const int rotary_dim = metadata_int(file, "llama.rope.dimension_count", config.head_dim());
  config.rotary_dim = rotary_dim == config.head_dim() ? 0 : rotary_dim;
  config.tied_embeddings = file.find_tensor("output.weight") == nullptr;

  model.layers.resize(static_cast<std::size_t>(config.layers));
  load_tensor(model, file, TensorRole::token_embedding, 0);
  for (int layer = 0; layer < config.layers; ++layer) {
    for (const TensorRole role : detail::kLayerRoles) load_tensor(model, file, role, layer);
  }
  load_tensor(model, file, TensorRole::final_norm, 0);
  if (config.tied_embeddings) {
    model.output = model.token_embedding;
  } else {
    load_tensor(model, file, TensorRole::output, 0);
  }
  model.tokenizer = read_tokenizer(file);
  detail::finish_model(model, "GGUF");
  return model;
}

void add_tokenizer(gguf::Writer& writer, const Tokenizer& tokenizer) {
  if (tokenizer.kind == Tokenizer::Kind::byte_level) {
    writer.add_string("tokenizer.ggml.model", kByteTokenizerModel);
  } else {
    writer.add_string("tokenizer.ggml.model", "llama");
    writer.add_string_array("tokenizer.ggml.tokens", tokenizer.pieces);
    std::vector<float> scores = tokenizer.scores;
    scores.resize(tokenizer.pieces.size(), 0.0f);
    writer.add_float32_array("tokenizer.ggml.scores", scores);
    std::vector<std::int32_t> types = tokenizer.types;
    if (types.size() != tokenizer.pieces.size()) {
      types = detail::infer_piece_types(tokenizer.pieces, tokenizer.bos_id, tokenizer.eos_id, -1);
    }
    writer.add_int32_array("tokenizer.ggml.token_type", types);
  }
  const std::pair<std::string_view, std::int32_t> ids[] = {
      {"tokenizer.ggml.bos_token_id", tokenizer.bos_id},
      {"tokenizer.ggml.eos_token_id", tokenizer.eos_id},
      {kAnchorKey, tokenizer.anchor_id}};
  for (const auto& [key, id] : ids) {
    if (id >= 0) writer.add_uint32(key, static_cast<std::uint32_t>(id));
  }
}

// llama.cpp's llama_ftype of the matrices' type.
std::uint32_t file_type(const Model& model, std::optional<DType> quantize_to) {
  switch (quantize_to            ? *quantize_to
          : model.layers.empty() ? DType::f32
                                 : model.layers[0].wq.dtype) {
    case DType::f32:
      return 0;
    case DType::f16:
      return 1;
    case DType::bf16:
      return 32;
    case DType::q8_0:
      return 7;
    case DType::q4_0:
      return 2;
  }
  return 0;
}

}  // namespace

Model load_gguf(const std::filesystem::path& path) {
  return load_gguf_bytes(detail::read_file(path, "GGUF"));
}

Model load_gguf(std::span<const std::byte> file) {
  return load_gguf_bytes(detail::copy_aligned(file));
}

std::vector<std::byte> serialize_gguf(const Model& model, const GgufWriteOptions& options) {
  const std::uint32_t alignment = options.alignment;
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    fail("write alignment " + std::to_string(alignment) + " is not a power of two");
  }
  gguf::Writer writer(alignment);
  if (options.quantize_q8_0 && options.quantize_q4_0) fail("quantize to Q8_0 or to Q4_0, not both");
  std::optional<DType> quantize_to;
  if (options.quantize_q8_0) quantize_to = DType::q8_0;
  if (options.quantize_q4_0) quantize_to = DType::q4_0;
  gguf::add_llama_model(writer, model, quantize_to);
  return writer.finish();
}

void write_gguf(const Model& model, const std::filesystem::path& path,
                const GgufWriteOptions& options) {
  detail::write_file(path, serialize_gguf(model, options), "GGUF");
}

void gguf::add_llama_model(Writer& writer, const Model& source, std::optional<DType> quantize_to) {
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
  detail::convert_rope_layout(model, RopeLayout::interleaved);
  const ModelConfig& config = model.config;

  writer.add_string("general.architecture", "llama");
  writer.add_string("general.name", "kvevict");
  writer.add_uint32("general.file_type", file_type(model, quantize_to));
  writer.add_uint32("llama.context_length", static_cast<std::uint32_t>(config.context_length));
  writer.add_uint32("llama.embedding_length", static_cast<std::uint32_t>(config.dim));
  writer.add_uint32("llama.block_count", static_cast<std::uint32_t>(config.layers));
  writer.add_uint32("llama.feed_forward_length", static_cast<std::uint32_t>(config.hidden_dim));
  writer.add_uint32(
      "llama.rope.dimension_count",
      static_cast<std::uint32_t>(config.rotary_dim ? config.rotary_dim : config.head_dim()));
  writer.add_uint32("llama.attention.head_count", static_cast<std::uint32_t>(config.heads));
  writer.add_uint32("llama.attention.head_count_kv", static_cast<std::uint32_t>(config.kv_heads));
  writer.add_float32("llama.attention.layer_norm_rms_epsilon", config.norm_eps);
  writer.add_float32("llama.rope.freq_base",
                     detail::narrow_to_f32(config.rope_theta, "rope_theta"));
  writer.add_uint32("llama.vocab_size", static_cast<std::uint32_t>(config.vocab_size));
  add_tokenizer(writer, model.tokenizer);

  const auto add = [&](TensorRole role, int layer) {
    const std::string name = tensor_name(role, layer);
    std::vector<std::int64_t> dims = detail::expected_shape(config, role);
    std::reverse(dims.begin(), dims.end());
    if (detail::is_norm(role)) {
      const std::vector<float>& norm = detail::norm_of(model, role, layer);
      if (norm.size() != static_cast<std::size_t>(config.dim)) {
        fail("norm '" + name + "' has " + std::to_string(norm.size()) + " values, expected " +
             std::to_string(config.dim));
      }
      const auto* begin = reinterpret_cast<const std::byte*>(norm.data());
      writer.add_tensor(name, dims, static_cast<std::uint32_t>(gguf::TensorType::f32),
                        {begin, begin + norm.size() * sizeof(float)});
      return;
    }
    const WeightMatrix& matrix = detail::matrix_of(model, role, layer);
    if (matrix.data == nullptr || matrix.rows != dims[1] || matrix.cols != dims[0]) {
      fail("matrix '" + name + "' is missing or has the wrong shape");
    }
    const DType dtype =
        quantize_to && matrix.cols % gguf::kQuantBlockValues == 0 ? *quantize_to : matrix.dtype;
    writer.add_tensor(name, dims, static_cast<std::uint32_t>(gguf_type(dtype)),
                      detail::matrix_bytes_as(matrix, dtype));
  };
  add(TensorRole::token_embedding, 0);
  for (int layer = 0; layer < config.layers; ++layer) {
    for (const TensorRole role : detail::kLayerRoles) add(role, layer);
  }
  add(TensorRole::final_norm, 0);
  if (!config.tied_embeddings) add(TensorRole::output, 0);
}

}  // namespace kvevict::model
