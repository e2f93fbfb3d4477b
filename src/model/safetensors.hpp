// safetensors container: u64 little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {string: string}}, then the data (offsets relative to its start).
// A bounds-checked parser and a writer; the Llama model mapping (with Hugging Face config.json)
// lives in safetensors.cpp (load_safetensors / serialize_safetensors in model_io.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::model::safetensors {

/// The reference implementation's limit on the header (it is JSON text, not data).
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

/// Bytes per element of a safetensors dtype name ("F32" -> 4), or 0 for names kvevict does not
/// know.
[[nodiscard]] std::size_t dtype_size(std::string_view dtype);

struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  ///< relative to the data section
  std::uint64_t end = 0;
};

/// A parsed file. Views into `bytes`, which the caller keeps alive.
struct File {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  std::uint64_t data_offset = 0;  ///< absolute: 8 + header length
  std::span<const std::byte> bytes;

  [[nodiscard]] const TensorInfo* find(std::string_view name) const;
  [[nodiscard]] std::span<const std::byte> data(const TensorInfo& tensor) const;
};

/// Parses and checks the header: valid JSON object, every entry's dtype / shape / offsets, offsets
/// inside the data section, byte counts matching dtype * shape for known dtypes.
[[nodiscard]] File parse(std::span<const std::byte> bytes);

/// Builds a file. Tensors are laid out by decreasing element size (so each starts at a multiple of
/// its element size) with no gaps; the header is padded with spaces to a multiple of 8.
class Writer {
 public:
  void add_tensor(std::string_view name, std::string_view dtype, std::vector<std::int64_t> shape,
                  std::vector<std::byte> data);
  void add_metadata(std::string_view key, std::string_view value);
  [[nodiscard]] std::vector<std::byte> finish() const;

 private:
  struct PendingTensor {
    std::string name;
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> data;
  };
  std::vector<PendingTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kvevict::model::safetensors
