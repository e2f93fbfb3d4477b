// GGUF container (llama.cpp's model file, versions 2 and 3, little-endian): a bounds-checked
// parser of the header, metadata and tensor infos, and a writer. The Llama-specific mapping to a
// Model lives in gguf.cpp (load_gguf / serialize_gguf in model_io.hpp).
//
// Layout: "GGUF", u32 version, u64 tensor count, u64 metadata count, metadata (string key, u32
// value type, value), tensor infos (string name, u32 n_dims, u64 ne[n_dims] fastest-varying
// first, u32 ggml type, u64 offset relative to the data section), padding to the alignment
// (general.alignment, default 32), tensor data. Strings are u64 length + bytes; arrays are u32
// element type + u64 count + elements.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::model {
struct Model;
enum class DType : std::uint8_t;
}  // namespace kvevict::model

namespace kvevict::model::gguf {

inline constexpr std::string_view kMagic = "GGUF";
inline constexpr std::uint32_t kDefaultAlignment = 32;
/// Bounds that no real file approaches; larger counts are rejected as corrupt before anything is
/// sized from them (besides the check against the bytes that remain).
inline constexpr std::uint64_t kMaxTensors = 1 << 17;
inline constexpr std::uint64_t kMaxMetadata = 1 << 16;
inline constexpr std::uint64_t kMaxStringLength = 1 << 24;  // keys and names are far shorter
inline constexpr int kMaxArrayNesting = 8;
inline constexpr int kMaxDims = 4;

enum class ValueType : std::uint32_t {
  uint8 = 0,
  int8 = 1,
  uint16 = 2,
  int16 = 3,
  uint32 = 4,
  int32 = 5,
  float32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  uint64 = 10,
  int64 = 11,
  float64 = 12,
};
[[nodiscard]] std::string_view to_string(ValueType type);

/// ggml tensor types kvevict reads (the others are named in errors).
enum class TensorType : std::uint32_t { f32 = 0, f16 = 1, q4_0 = 2, q8_0 = 8, bf16 = 30 };
inline constexpr std::int64_t kQuantBlockValues = 32;  // Q8_0 and Q4_0
inline constexpr std::int64_t kQ8BlockBytes = 34;      // f16 scale + 32 int8
inline constexpr std::int64_t kQ4BlockBytes = 18;      // f16 scale + 32 4-bit values
/// "F32", "Q4_K", ... or "type N".
[[nodiscard]] std::string tensor_type_name(std::uint32_t type);
[[nodiscard]] bool is_supported(std::uint32_t type);

/// One metadata value. Scalars are decoded; strings and arrays are views into the file bytes
/// (arrays are decoded on demand by File's typed getters).
struct Value {
  ValueType type = ValueType::uint8;
  std::uint64_t unsigned_value = 0;           ///< unsigned integers and booleans
  std::int64_t signed_value = 0;              ///< signed integers
  double float_value = 0;                     ///< float32 / float64
  std::string_view string_value;              ///< string
  ValueType element_type = ValueType::uint8;  ///< array
  std::uint64_t count = 0;                    ///< array
  std::span<const std::byte> array_bytes;     ///< array: the encoded elements
};

struct TensorInfo {
  std::string name;
  std::vector<std::int64_t> dims;  ///< ne[0] (fastest, = columns) first
  std::uint32_t type = 0;
  std::uint64_t offset = 0;  ///< relative to the data section
  std::uint64_t size = 0;    ///< bytes (0 for unsupported types: their size is not computed)
};

/// The product of the tensor's dimensions; kvevict::Error when it exceeds 2^56 (a corrupt file).
[[nodiscard]] std::int64_t element_count(const TensorInfo& tensor);

/// A parsed file. Views into `bytes`, which the caller keeps alive.
struct File {
  std::uint32_t version = 0;
  std::uint32_t alignment = kDefaultAlignment;
  std::map<std::string, Value, std::less<>> metadata;
  std::vector<TensorInfo> tensors;
  std::uint64_t data_offset = 0;  ///< absolute offset of the data section
  std::span<const std::byte> bytes;

  [[nodiscard]] const Value* find(std::string_view key) const;
  [[nodiscard]] const TensorInfo* find_tensor(std::string_view name) const;
  /// The tensor's bytes (bounds were checked by parse; unsupported types throw).
  [[nodiscard]] std::span<const std::byte> tensor_data(const TensorInfo& tensor) const;

  // Typed getters: nullopt when the key is absent, kvevict::Error naming the key when its type
  // does not fit. Integers accept any integer type whose value fits; floats accept float32,
  // float64 and integers.
  [[nodiscard]] std::optional<std::uint64_t> get_uint(std::string_view key) const;
  [[nodiscard]] std::optional<double> get_float(std::string_view key) const;
  [[nodiscard]] std::optional<std::string_view> get_string(std::string_view key) const;
  [[nodiscard]] std::optional<std::vector<std::string>> get_string_array(
      std::string_view key) const;
  [[nodiscard]] std::optional<std::vector<float>> get_float_array(std::string_view key) const;
  [[nodiscard]] std::optional<std::vector<std::int32_t>> get_int_array(std::string_view key) const;
};

/// Parses and bounds-checks everything: header, every metadata value (unknown keys and nested
/// arrays are walked and kept as views), tensor infos (dims, type, alignment, duplicate names)
/// and that each supported tensor lies inside the data section.
[[nodiscard]] File parse(std::span<const std::byte> bytes);

/// Builds a GGUF file: metadata in insertion order, then tensor infos, then aligned data.
/// Nothing is validated, so tests can also build malformed files with it.
class Writer {
 public:
  explicit Writer(std::uint32_t alignment = kDefaultAlignment, std::uint32_t version = 3)
      : alignment_(alignment), version_(version) {}

  void add_uint32(std::string_view key, std::uint32_t value);
  void add_int32(std::string_view key, std::int32_t value);
  void add_uint64(std::string_view key, std::uint64_t value);
  void add_float32(std::string_view key, float value);
  void add_bool(std::string_view key, bool value);
  void add_string(std::string_view key, std::string_view value);
  void add_string_array(std::string_view key, const std::vector<std::string>& values);
  void add_float32_array(std::string_view key, std::span<const float> values);
  void add_int32_array(std::string_view key, std::span<const std::int32_t> values);
  /// Any value already encoded (everything after the type field).
  void add_raw(std::string_view key, ValueType type, std::span<const std::byte> encoded);
  /// `dims` fastest first; `data` is stored as given.
  void add_tensor(std::string_view name, std::vector<std::int64_t> dims, std::uint32_t type,
                  std::vector<std::byte> data);

  [[nodiscard]] std::vector<std::byte> finish() const;

 private:
  struct PendingTensor {
    std::string name;
    std::vector<std::int64_t> dims;
    std::uint32_t type;
    std::vector<std::byte> data;
  };
  void key_and_type(std::string_view key, ValueType type);

  std::uint32_t alignment_;
  std::uint32_t version_;
  std::uint64_t metadata_count_ = 0;
  std::vector<std::byte> metadata_;
  std::vector<PendingTensor> tensors_;
};

/// Adds a Llama model's metadata (architecture, hyperparameters, tokenizer) and tensors to
/// `writer`, permuting Q/K rows to interleaved RoPE when the model is half_split. With a
/// `quantize_to` (DType::q8_0 or q4_0), matrices whose column count is a multiple of 32 are stored
/// in that type. serialize_gguf is a Writer plus this; tests add extra metadata around it.
void add_llama_model(Writer& writer, const Model& model, std::optional<DType> quantize_to);

}  // namespace kvevict::model::gguf
