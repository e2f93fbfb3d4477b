#include "quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "half.hpp"
#include "kvevict/error.hpp"

namespace kvevict::model {
namespace {

float block_scale(const std::byte* block) {
  std::uint16_t bits;
  std::memcpy(&bits, block, 2);
  return f16_to_float(bits);
}

void quantize_q8_0_block(const float* x, std::byte* block) {
  float max_magnitude = 0.0f;
  for (std::int64_t i = 0; i < kQuantBlockValues; ++i)
    max_magnitude = std::max(max_magnitude, std::fabs(x[i]));
  // Round the scale up to an f16 d with 127 d >= max|x|: then every |x / d| <= 127 and the
  // only error is rounding x / d to an integer, at most d / 2.
  std::uint16_t scale_bits = float_to_f16(max_magnitude / 127.0f);
  while (static_cast<double>(f16_to_float(scale_bits)) * 127.0 < max_magnitude) ++scale_bits;
  KVEVICT_REQUIRE((scale_bits & 0x7fffu) < 0x7c00u,
                  "quantize: weight magnitude too large for a Q8_0 f16 scale");
  const double scale = f16_to_float(scale_bits);
  std::memcpy(block, &scale_bits, 2);
  for (std::int64_t i = 0; i < kQuantBlockValues; ++i) {
    const double quant = scale == 0.0 ? 0.0 : std::round(x[i] / scale);
    block[2 + i] =
        static_cast<std::byte>(static_cast<std::int8_t>(std::clamp(quant, -127.0, 127.0)));
  }
}

// llama.cpp's quantize_row_q4_0_ref, so that both programs hold the same bytes for a model.
void quantize_q4_0_block(const float* x, std::byte* block) {
  float extreme = 0.0f;  // the value of largest magnitude, with its sign
  for (std::int64_t i = 0; i < kQuantBlockValues; ++i) {
    if (std::fabs(x[i]) > std::fabs(extreme)) extreme = x[i];
  }
  const float d = extreme / -8.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  const std::uint16_t scale_bits = float_to_f16(d);
  KVEVICT_REQUIRE((scale_bits & 0x7fffu) < 0x7c00u,
                  "quantize: weight magnitude too large for a Q4_0 f16 scale");
  std::memcpy(block, &scale_bits, 2);
  constexpr std::int64_t kHalf = kQuantBlockValues / 2;
  for (std::int64_t i = 0; i < kHalf; ++i) {
    const auto low = std::min(15, static_cast<int>(x[i] * inverse + 8.5f));
    const auto high = std::min(15, static_cast<int>(x[kHalf + i] * inverse + 8.5f));
    block[2 + i] = static_cast<std::byte>(low | (high << 4));
  }
}

}  // namespace

void convert_to_f32(const std::byte* source, DType dtype, std::size_t count, float* out) {
  switch (dtype) {
    case DType::f32:
      if (count > 0) std::memcpy(out, source, count * sizeof(float));
      return;
    case DType::f16:
    case DType::bf16:
      for (std::size_t i = 0; i < count; ++i) {
        std::uint16_t half;
        std::memcpy(&half, source + 2 * i, 2);
        out[i] = dtype == DType::f16 ? f16_to_float(half) : bf16_to_float(half);
      }
      return;
    case DType::q8_0:
      for (std::size_t b = 0; b < count / kQuantBlockValues; ++b) {
        const std::byte* block = source + b * kQ8_0BlockBytes;
        const float scale = block_scale(block);
        for (std::int64_t i = 0; i < kQuantBlockValues; ++i) {
          out[b * kQuantBlockValues + static_cast<std::size_t>(i)] =
              static_cast<float>(static_cast<std::int8_t>(block[2 + i])) * scale;
        }
      }
      return;
    case DType::q4_0:
      for (std::size_t b = 0; b < count / kQuantBlockValues; ++b) {
        const std::byte* block = source + b * kQ4_0BlockBytes;
        const float scale = block_scale(block);
        float* values = out + b * kQuantBlockValues;
        for (std::size_t i = 0; i < kQuantBlockValues / 2; ++i) {
          const auto byte = std::to_integer<int>(block[2 + i]);
          values[i] = static_cast<float>((byte & 0xf) - 8) * scale;
          values[i + kQuantBlockValues / 2] = static_cast<float>((byte >> 4) - 8) * scale;
        }
      }
      return;
  }
}

std::vector<std::byte> quantize(std::span<const float> values, DType dtype) {
  KVEVICT_REQUIRE(dtype == DType::q8_0 || dtype == DType::q4_0,
                  "quantize: " + std::string(to_string(dtype)) + " is not a block format");
  KVEVICT_REQUIRE(values.size() % kQuantBlockValues == 0,
                  "quantize: " + std::to_string(values.size()) +
                      " values are not a whole number of blocks of 32");
  for (const float value : values) {
    KVEVICT_REQUIRE(std::isfinite(value), "quantize: cannot quantise a non-finite weight to " +
                                              std::string(to_string(dtype)));
  }
  const std::size_t blocks = values.size() / kQuantBlockValues;
  const std::size_t block_bytes = dtype_size(dtype);
  std::vector<std::byte> out(blocks * block_bytes);
  for (std::size_t b = 0; b < blocks; ++b) {
    const float* x = values.data() + b * kQuantBlockValues;
    if (dtype == DType::q8_0) {
      quantize_q8_0_block(x, out.data() + b * block_bytes);
    } else {
      quantize_q4_0_block(x, out.data() + b * block_bytes);
    }
  }
  return out;
}

}  // namespace kvevict::model
