// GGUF's block formats Q8_0 and Q4_0 (kvevict::model::DType), in scalar code: converting a row to
// f32 (embedding lookups, writers, the tests' naive loops) and quantising f32 values (the GGUF
// writer, random models). The decoder's products read the blocks in place (kernels/kernels.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <kvevict/model/model.hpp>
#include <span>
#include <vector>

namespace kvevict::model {

inline constexpr std::int64_t kQuantBlockValues = 32;
inline constexpr std::size_t kQ8_0BlockBytes = 34;  // f16 d, 32 x int8 q
inline constexpr std::size_t kQ4_0BlockBytes = 18;  // f16 d, 16 bytes of two 4-bit q each

/// `count` values of type `dtype` starting at `source` (a multiple of block_values) as f32.
void convert_to_f32(const std::byte* source, DType dtype, std::size_t count, float* out);

/// `values` (a multiple of 32, all finite) as Q8_0 or Q4_0 blocks; throws kvevict::Error naming
/// the problem otherwise. Q8_0: d = the smallest f16 with 127 d >= max|x|, q = round(x / d), so
/// |x - q d| <= d / 2. Q4_0: llama.cpp's reference quantiser (d = the value of largest magnitude
/// over -8, q = min(15, trunc(x / d + 8.5))): |x - (q - 8) d| <= d / 2 except for values of the
/// sign opposite to that extreme and near its magnitude, clamped at 7 d.
[[nodiscard]] std::vector<std::byte> quantize(std::span<const float> values, DType dtype);

}  // namespace kvevict::model
