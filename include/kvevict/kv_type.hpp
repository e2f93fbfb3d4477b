// KvType: how kvevict's KvStore (and an engine telling kvevict about its own cache) stores keys and
// values: f32, f16, bf16 or ggml's Q8_0. One stored row is one token's key (or value) of one KV
// head, head_dim values; the encode / decode functions here are the only places a row changes
// representation, and each encode is one rounding.
//
// Q8_0 is ggml's block_q8_0: blocks of 32 consecutive values of a row, each an f16 scale d and 32
// int8 q, value = q * d (34 bytes per 32 values, 8.5 bits a value). The block runs along head_dim,
// inside one row, not across tokens: a row is written when its token arrives and never together
// with its neighbours (which may be evicted at any time), and a block of 32 keeps one outlier
// channel from flattening a whole head's row. head_dim must be a multiple of 32 (64 and 128 are the
// common ones; the toy models have 32).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include "kvevict/detail/half.hpp"
#include "kvevict/error.hpp"

namespace kvevict {

enum class KvType : std::uint8_t { f32, f16, bf16, q8_0 };

inline constexpr int kQ8_0BlockValues = 32;
inline constexpr std::size_t kQ8_0BlockBytes = 2 + kQ8_0BlockValues;  // f16 scale + 32 int8

[[nodiscard]] inline std::string_view to_string(KvType type) {
  switch (type) {
    case KvType::f32:
      return "f32";
    case KvType::f16:
      return "f16";
    case KvType::bf16:
      return "bf16";
    case KvType::q8_0:
      return "q8_0";
  }
  return "?";
}

/// Parses "f32", "f16", "bf16" or "q8_0"; throws kvevict::Error otherwise.
[[nodiscard]] inline KvType parse_kv_type(std::string_view text) {
  for (KvType type : {KvType::f32, KvType::f16, KvType::bf16, KvType::q8_0}) {
    if (text == to_string(type)) return type;
  }
  throw Error("unknown K/V storage type '" + std::string(text) +
              "' (expected f32, f16, bf16 or q8_0)");
}

/// Throws unless rows of head_dim values can be stored as `type` (Q8_0: whole blocks of 32).
inline void check_kv_type(KvType type, int head_dim) {
  KVEVICT_REQUIRE(
      type != KvType::q8_0 || head_dim % kQ8_0BlockValues == 0,
      "K/V storage type q8_0 needs head_dim a multiple of 32, got " + std::to_string(head_dim));
}

/// Bytes of one stored row of head_dim values, Q8_0 scales included.
[[nodiscard]] inline std::size_t kv_row_bytes(KvType type, int head_dim) {
  check_kv_type(type, head_dim);
  const auto n = static_cast<std::size_t>(head_dim);
  switch (type) {
    case KvType::f32:
      return 4 * n;
    case KvType::f16:
    case KvType::bf16:
      return 2 * n;
    case KvType::q8_0:
      return n / kQ8_0BlockValues * kQ8_0BlockBytes;
  }
  return 0;
}

/// The error of one rounding to `type`, as a fraction: f32, f16 and bf16 round each value x to
/// within u |x| (u = 2^-24, 2^-11, 2^-8; below f16's normal range, 2^-25 absolute); Q8_0 rounds
/// each value to within u * max|x| over its block of 32 (u = (1 + 2^-10) / 254: half a step of a
/// scale max|x| / 127, rounded up to an f16).
[[nodiscard]] inline double kv_rounding_unit(KvType type) {
  switch (type) {
    case KvType::f32:
      return 0x1p-24;
    case KvType::f16:
      return 0x1p-11;
    case KvType::bf16:
      return 0x1p-8;
    case KvType::q8_0:
      return (1.0 + 0x1p-10) / 254.0;
  }
  return 0.0;
}

/// Rows of one head as stored, row s (slot s) at data + s * row_bytes.
struct StoredRows {
  const std::uint8_t* data = nullptr;
  KvType type = KvType::f32;
  std::size_t row_bytes = 0;
  [[nodiscard]] const std::uint8_t* row(std::int64_t slot) const {
    return data + static_cast<std::size_t>(slot) * row_bytes;
  }
};

namespace detail {

[[noreturn]] inline void kv_overflow(KvType type, double magnitude) {
  throw Error("K/V storage type " + std::string(to_string(type)) +
              " cannot hold a key or value of magnitude " + std::to_string(magnitude) +
              " (use --kv-type bf16 or f32)");
}

// One Q8_0 block from 32 values. The scale is rounded up to an f16 d with 127 d >= max|x|, so
// every |x / d| <= 127 and the only error is rounding x / d to an integer: at most d / 2.
template <class Real>
void encode_q8_0_block(const Real* x, std::uint8_t* block) {
  double max_magnitude = 0.0;
  for (int i = 0; i < kQ8_0BlockValues; ++i) {
    const double magnitude = std::fabs(static_cast<double>(x[i]));
    if (!(magnitude <= std::numeric_limits<double>::max())) kv_overflow(KvType::q8_0, magnitude);
    max_magnitude = std::max(max_magnitude, magnitude);
  }
  std::uint16_t scale_bits = float_to_f16(static_cast<float>(max_magnitude / 127.0));
  while (static_cast<double>(f16_to_float(scale_bits)) * 127.0 < max_magnitude) ++scale_bits;
  if ((scale_bits & 0x7fffu) >= 0x7c00u) kv_overflow(KvType::q8_0, max_magnitude);
  const double scale = f16_to_float(scale_bits);
  std::memcpy(block, &scale_bits, 2);
  for (int i = 0; i < kQ8_0BlockValues; ++i) {
    const double quant = scale == 0.0 ? 0.0 : std::round(static_cast<double>(x[i]) / scale);
    block[2 + i] =
        static_cast<std::uint8_t>(static_cast<std::int8_t>(std::clamp(quant, -127.0, 127.0)));
  }
}

}  // namespace detail

/// Rounds head_dim values to `type` into `out` (kv_row_bytes(type, head_dim) bytes): one rounding
/// (from double through f32 for f16 / bf16: at most 2^-24 relative more). Throws kvevict::Error
/// for a value the type cannot hold: |x| > 65504 in f16, a Q8_0 scale past f16's range, a NaN or
/// an infinity in Q8_0 (f32, f16 and bf16 keep NaN and infinities, as f32 arithmetic would).
template <class Real>
void encode_kv_row(KvType type, const Real* in, int head_dim, std::uint8_t* out) {
  switch (type) {
    case KvType::f32:
      for (int i = 0; i < head_dim; ++i) {
        const auto value = static_cast<float>(in[i]);
        std::memcpy(out + 4 * i, &value, 4);
      }
      return;
    case KvType::f16:
      for (int i = 0; i < head_dim; ++i) {
        const auto value = static_cast<float>(in[i]);
        const std::uint16_t bits = detail::float_to_f16(value);
        if ((bits & 0x7fffu) == 0x7c00u && std::isfinite(value)) {
          detail::kv_overflow(type, std::fabs(value));
        }
        std::memcpy(out + 2 * i, &bits, 2);
      }
      return;
    case KvType::bf16:
      for (int i = 0; i < head_dim; ++i) {
        const std::uint16_t bits = detail::float_to_bf16(static_cast<float>(in[i]));
        std::memcpy(out + 2 * i, &bits, 2);
      }
      return;
    case KvType::q8_0:
      for (int b = 0; b < head_dim / kQ8_0BlockValues; ++b) {
        detail::encode_q8_0_block(in + b * kQ8_0BlockValues, out + b * kQ8_0BlockBytes);
      }
      return;
  }
}

/// The head_dim values of a stored row (exact: every stored value is an f32).
template <class Real>
void decode_kv_row(KvType type, const std::uint8_t* in, int head_dim, Real* out) {
  std::uint16_t bits = 0;
  switch (type) {
    case KvType::f32:
      for (int i = 0; i < head_dim; ++i) {
        float value;
        std::memcpy(&value, in + 4 * i, 4);
        out[i] = static_cast<Real>(value);
      }
      return;
    case KvType::f16:
      for (int i = 0; i < head_dim; ++i) {
        std::memcpy(&bits, in + 2 * i, 2);
        out[i] = static_cast<Real>(detail::f16_to_float(bits));
      }
      return;
    case KvType::bf16:
      for (int i = 0; i < head_dim; ++i) {
        std::memcpy(&bits, in + 2 * i, 2);
        out[i] = static_cast<Real>(detail::bf16_to_float(bits));
      }
      return;
    case KvType::q8_0:
      for (int b = 0; b < head_dim / kQ8_0BlockValues; ++b) {
        const std::uint8_t* block = in + b * kQ8_0BlockBytes;
        std::memcpy(&bits, block, 2);
        const float scale = detail::f16_to_float(bits);
        for (int i = 0; i < kQ8_0BlockValues; ++i) {
          out[b * kQ8_0BlockValues + i] =
              static_cast<Real>(static_cast<float>(static_cast<std::int8_t>(block[2 + i])) * scale);
        }
      }
      return;
  }
}

}  // namespace kvevict
