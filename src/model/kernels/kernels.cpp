// Highway implementation of kernels.hpp: this file is compiled once per target (foreach_target.h
// re-includes it with HWY_NAMESPACE = N_AVX3, N_AVX2, N_SSE4, ...); the exported functions at the
// end dispatch to the best target the CPU supports. The f32 products X W^T and P V are
// tiles-inl.hpp's, shared with kv_kernels.cpp.
//
// Vectors are at most 16 floats (CappedTag<float, 16>: a 512-bit register), so that a lane count
// always divides the 32 values of a Q8_0 / Q4_0 block and the 16 of a Q4_0 half-block. Scalable
// vectors (SVE, RVV) are not compiled: the tiles keep vectors in arrays, which sizeless types do
// not allow; Arm builds use NEON.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "model/kernels/kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target.h must come first.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include "kvevict/error.hpp"
#include "model/half.hpp"
#include "model/kernels/kernels.hpp"
#include "model/kernels/tiles-inl.hpp"

HWY_BEFORE_NAMESPACE();
namespace kvevict::model::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// One f16 scale (of a Q8_0 / Q4_0 block) as f32, through the target's conversion (F16C on AVX2).
HWY_INLINE float block_scale(const std::uint8_t* block) {
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<hwy::float16_t, decltype(d1)> dh1;
  return hn::GetLane(
      hn::PromoteTo(d1, hn::LoadU(dh1, reinterpret_cast<const hwy::float16_t*>(block))));
}

// The same in every lane of a vector (a broadcast and a vector conversion).
HWY_INLINE V broadcast_scale(D d, const std::uint8_t* block) {
  std::uint16_t bits;
  std::memcpy(&bits, block, 2);
  return hn::PromoteTo(d, hn::BitCast(hn::Rebind<hwy::float16_t, D>(),
                                      hn::Set(hn::Rebind<std::uint16_t, D>(), bits)));
}

// --- Element types: f32, f16, bf16 --------------------------------------------------------------

HWY_INLINE V load_weights(D d, const float* p) { return hn::LoadU(d, p); }
HWY_INLINE V load_weights(D d, const hwy::float16_t* p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, D>(), p));
}
HWY_INLINE V load_weights(D d, const hwy::bfloat16_t* p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::bfloat16_t, D>(), p));
}
HWY_INLINE float weight_value(const float* p) { return *p; }
HWY_INLINE float weight_value(const hwy::float16_t* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return f16_to_float(bits);
}
HWY_INLINE float weight_value(const hwy::bfloat16_t* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bf16_to_float(bits);
}

// W[r] . x for one row, read front to back with four accumulators, the bytes kAheadBytes
// further on prefetched while they lie before `limit` (the end of the rows this call reads: no
// pointer past them is formed). The hardware prefetcher alone did not keep a core's reads of a
// large F16 matrix going (docs/kernels.md, "Why decoding reads one row at a time").
constexpr std::int64_t kAheadBytes = 4096;

template <typename T>
HWY_INLINE float dot_row(const T* w, std::int64_t cols, const float* x, const char* limit) {
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const auto step_bytes = 4 * lanes * static_cast<std::int64_t>(sizeof(T));
  V acc0 = hn::Zero(d);
  V acc1 = hn::Zero(d);
  V acc2 = hn::Zero(d);
  V acc3 = hn::Zero(d);
  std::int64_t j = 0;
  for (; j + 4 * lanes <= cols; j += 4 * lanes) {
    const auto* here = reinterpret_cast<const char*>(w + j);
    if (limit - here > kAheadBytes + step_bytes) {
      for (std::int64_t b = 0; b < step_bytes; b += 64) hwy::Prefetch(here + kAheadBytes + b);
    }
    acc0 = hn::MulAdd(load_weights(d, w + j), hn::LoadU(d, x + j), acc0);
    acc1 = hn::MulAdd(load_weights(d, w + j + lanes), hn::LoadU(d, x + j + lanes), acc1);
    acc2 = hn::MulAdd(load_weights(d, w + j + 2 * lanes), hn::LoadU(d, x + j + 2 * lanes), acc2);
    acc3 = hn::MulAdd(load_weights(d, w + j + 3 * lanes), hn::LoadU(d, x + j + 3 * lanes), acc3);
  }
  for (; j + lanes <= cols; j += lanes)
    acc0 = hn::MulAdd(load_weights(d, w + j), hn::LoadU(d, x + j), acc0);
  float total = sum_lanes(d, hn::Add(hn::Add(acc0, acc1), hn::Add(acc2, acc3)));
  for (; j < cols; ++j) total += weight_value(w + j) * x[j];
  return total;
}

template <typename T>
void matvec_elements(const T* w, std::int64_t cols, const float* x, float* y, std::int64_t begin,
                     std::int64_t end) {
  const auto* limit = reinterpret_cast<const char*>(w + end * cols);
  for (std::int64_t r = begin; r < end; ++r) y[r] = dot_row(w + r * cols, cols, x, limit);
}

template <typename T>
void dequantize_elements(const T* w, std::int64_t cols, std::int64_t begin, std::int64_t end,
                         float* out) {
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t count = (end - begin) * cols;
  const T* source = w + begin * cols;
  std::int64_t j = 0;
  for (; j + lanes <= count; j += lanes) hn::StoreU(load_weights(d, source + j), d, out + j);
  for (; j < count; ++j) out[j] = weight_value(source + j);
}

// --- Block types: Q8_0, Q4_0 --------------------------------------------------------------------
// A format reads the 32 values of a block times x (unscaled: the block's scale multiplies the sum
// once) and dequantises a block.

struct Q8_0 {
  static constexpr std::size_t kBlockBytes = 34;
  static constexpr bool kNibbles = false;
  // Value j of the block as stored.
  static std::int32_t stored(const std::uint8_t* block, int j) {
    return static_cast<std::int8_t>(block[2 + j]);
  }
  // What dot() starts from for the block of x at `x`: nothing to add.
  static HWY_INLINE V dot_start(D d, const float*) { return hn::Zero(d); }
  // start + sum over the block of q[j] * x[j], as lanes to be added.
  static HWY_INLINE V dot(D d, const std::uint8_t* block, const float* x, V start) {
    const hn::Rebind<std::int32_t, D> di;
    const hn::Rebind<std::int8_t, D> d8;
    const auto* q = reinterpret_cast<const std::int8_t*>(block + 2);
    V total = start;
    for (std::size_t j = 0; j < 32; j += hn::Lanes(d)) {
      const V values = hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, q + j)));
      total = hn::MulAdd(values, hn::LoadU(d, x + j), total);
    }
    return total;
  }
  static HWY_INLINE void dequantize(D d, const std::uint8_t* block, float* out) {
    const hn::Rebind<std::int32_t, D> di;
    const hn::Rebind<std::int8_t, D> d8;
    const V scale = broadcast_scale(d, block);
    const auto* q = reinterpret_cast<const std::int8_t*>(block + 2);
    for (std::size_t j = 0; j < 32; j += hn::Lanes(d)) {
      hn::StoreU(hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, q + j))), scale), d,
                 out + j);
    }
  }
};

struct Q4_0 {
  static constexpr std::size_t kBlockBytes = 18;
  static constexpr bool kNibbles = true;
  // Byte j holds value j (low nibble) and value j + 16 (high nibble), both offset by 8.
  // Nibble j of the block as stored (value j + 8).
  static std::int32_t stored(const std::uint8_t* block, int j) {
    return j < 16 ? block[2 + j] & 0xf : block[2 + j - 16] >> 4;
  }
  // f(j, nibbles j.., nibbles 16 + j..) over the block, the nibbles as floats 0-15 (value + 8).
  template <class F>
  static HWY_INLINE void for_each_half(D d, const std::uint8_t* block, F&& f) {
    const hn::Rebind<std::int32_t, D> di;
    const hn::Rebind<std::uint8_t, D> d8;
    const auto low_mask = hn::Set(di, 0xf);
    for (std::size_t j = 0; j < 16; j += hn::Lanes(d)) {
      const auto bytes = hn::BitCast(
          di, hn::PromoteTo(hn::Rebind<std::uint32_t, D>(), hn::LoadU(d8, block + 2 + j)));
      f(j, hn::ConvertTo(d, hn::And(bytes, low_mask)), hn::ConvertTo(d, hn::ShiftRight<4>(bytes)));
    }
  }
  // The offset of 8 in every stored nibble, taken out once for all rows that read this block of
  // x: -8 * x[j], added into lanes as dot() adds the products.
  static HWY_INLINE V dot_start(D d, const float* x) {
    V sum = hn::LoadU(d, x);
    for (std::size_t j = hn::Lanes(d); j < 32; j += hn::Lanes(d))
      sum = hn::Add(sum, hn::LoadU(d, x + j));
    return hn::Mul(sum, hn::Set(d, -8.0f));
  }
  static HWY_INLINE V dot(D d, const std::uint8_t* block, const float* x, V start) {
    V total = start;
    for_each_half(d, block, [&](std::size_t j, V low, V high) {
      total = hn::MulAdd(low, hn::LoadU(d, x + j), total);
      total = hn::MulAdd(high, hn::LoadU(d, x + 16 + j), total);
    });
    return total;
  }
  static HWY_INLINE void dequantize(D d, const std::uint8_t* block, float* out) {
    const V scale = broadcast_scale(d, block);
    const V offset = hn::Set(d, 8.0f);
    for_each_half(d, block, [&](std::size_t j, V low, V high) {
      hn::StoreU(hn::Mul(hn::Sub(low, offset), scale), d, out + j);
      hn::StoreU(hn::Mul(hn::Sub(high, offset), scale), d, out + 16 + j);
    });
  }
};

// y[r] = W[r] . x for rows [begin, end), four rows at a time, block by block: the four rows'
// products are independent chains (one row's would wait on each block's before it, and its sum
// across lanes on all of them), and a block of x's start (Q4_0's offset) serves the four.
template <class Format>
void matvec_blocks(const std::uint8_t* w, std::int64_t cols, const float* x, float* y,
                   std::int64_t begin, std::int64_t end) {
  constexpr std::int64_t kRows = 4;
  constexpr std::int64_t kPrefetchRows = 32;  // 4 was too late for Q8_0 (docs/kernels.md)
  const D d;
  const std::int64_t blocks = cols / 32;
  const std::size_t row_bytes = static_cast<std::size_t>(blocks) * Format::kBlockBytes;
  for (std::int64_t r = begin; r < end; r += kRows) {
    // A last group of fewer rows repeats its last one: every row goes through the same
    // instructions, so its bits do not depend on how the rows are split between threads.
    const std::uint8_t* rows[kRows];
    // Rows read side by side are not a stream the hardware prefetcher follows: each block is
    // prefetched kPrefetchRows rows ahead, within the range (a pointer past it is not formed).
    const std::uint8_t* ahead[kRows];
    for (std::int64_t i = 0; i < kRows; ++i) {
      rows[i] = w + static_cast<std::size_t>(std::min(r + i, end - 1)) * row_bytes;
      ahead[i] = w + static_cast<std::size_t>(std::min(r + i + kPrefetchRows, end - 1)) * row_bytes;
    }
    V acc[kRows];
    for (V& a : acc) a = hn::Zero(d);
    for (std::int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + 32 * b;
      const V start = Format::dot_start(d, xb);
      const std::size_t at = static_cast<std::size_t>(b) * Format::kBlockBytes;
      for (std::int64_t i = 0; i < kRows; ++i) {
        hwy::Prefetch(ahead[i] + at);
        acc[i] = hn::MulAdd(broadcast_scale(d, rows[i] + at),
                            Format::dot(d, rows[i] + at, xb, start), acc[i]);
      }
    }
    for (std::int64_t i = 0; i < std::min(kRows, end - r); ++i) y[r + i] = sum_lanes(d, acc[i]);
  }
}

template <class Format>
void dequantize_blocks(const std::uint8_t* w, std::int64_t cols, std::int64_t begin,
                       std::int64_t end, float* out) {
  const D d;
  const std::int64_t blocks = (end - begin) * (cols / 32);
  const std::uint8_t* source =
      w + begin * (cols / 32) * static_cast<std::int64_t>(Format::kBlockBytes);
  for (std::int64_t b = 0; b < blocks; ++b) {
    Format::dequantize(d, source + b * static_cast<std::int64_t>(Format::kBlockBytes),
                       out + 32 * b);
  }
}

// --- Integer products: Q8_0 / Q4_0 weights times 8-bit activations ------------------------------

void QuantizeRow(const float* x, std::int64_t n, std::int8_t* values, float* scales,
                 float* nibble_offsets) {
  const D d;
  const hn::Rebind<std::int32_t, D> di;
  const hn::Rebind<std::int8_t, D> d8;
  const std::size_t lanes = hn::Lanes(d);
  for (std::int64_t b = 0; b < n / 32; ++b) {
    const float* block = x + 32 * b;
    std::int8_t* rounded = values + 32 * b;
    V largest = hn::Zero(d);
    auto finite = hn::IsFinite(largest);
    for (std::size_t j = 0; j < 32; j += lanes) {
      const V v = hn::LoadU(d, block + j);
      largest = hn::Max(largest, hn::Abs(v));
      finite = hn::And(finite, hn::IsFinite(v));
    }
    const float scale = hn::GetLane(hn::MaxOfLanes(d, largest)) / 127.0f;
    if (!hn::AllTrue(d, finite) || scale == 0.0f) {  // NaN / inf, or all (nearly) zero
      scales[b] = nibble_offsets[b] = hn::AllTrue(d, finite) ? 0.0f : std::nanf("");
      std::memset(rounded, 0, 32);
      continue;
    }
    // A division rather than a multiplication by 127 / max: that overflows for tiny maxima.
    const V divisor = hn::Set(d, scale);
    auto sum = hn::Zero(di);
    for (std::size_t j = 0; j < 32; j += lanes) {
      const auto q = hn::NearestInt(hn::Div(hn::LoadU(d, block + j), divisor));
      sum = hn::Add(sum, q);
      hn::StoreU(hn::DemoteTo(d8, q), d8, rounded + j);
    }
    scales[b] = scale;
    nibble_offsets[b] = 8.0f * scale * static_cast<float>(hn::GetLane(hn::SumOfLanes(di, sum)));
  }
}

// One row, block by block (kernels.hpp's formula; the rows left over by the 8-row kernel, and
// every row on targets without it).
template <class Format>
float dot_quantized_row(const std::uint8_t* row, std::int64_t blocks, const QuantizedRow& x) {
  float total = 0.0f;
  float offset = 0.0f;
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::uint8_t* block = row + static_cast<std::size_t>(b) * Format::kBlockBytes;
    const std::int8_t* a = x.values.data() + 32 * b;
    std::int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += Format::stored(block, j) * a[j];
    const float weight_scale = block_scale(block);
    total = std::fma(weight_scale * x.scales[b], static_cast<float>(sum), total);
    if constexpr (Format::kNibbles) offset = std::fma(weight_scale, x.nibble_offsets[b], offset);
  }
  return total - offset;
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
// AVX2 and AVX-512 targets: Highway 1.0.3 has no multiply-add of 8-bit values, so these use
// AVX2's maddubs (unsigned times signed bytes, pairs added into 16 bits) directly, in 256 bits on
// both targets (llama.cpp's Q4_0 products are 256 bits wide on AVX-512 too).

// A block's 32 weights times 32 activations `a`: 8 lanes whose sum is the block's sum.
template <class Format>
HWY_INLINE __m256i block_products(const std::uint8_t* block, __m256i a) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Format::kNibbles) {
    // Low nibbles are values 0-15, high nibbles 16-31: 32 bytes 0..15 in value order.
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                                             _mm256_set1_epi8(0x0f));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles, a), ones);  // pairs: <= 2 * 15 * 127
  } else {
    // |w| times a with w's sign (pairs: <= 2 * 128 * 127, no saturation).
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)),
                             ones);
  }
}

// [sum of v[0]'s lanes, ..., sum of v[7]'s lanes].
HWY_INLINE __m256i sum_each_of_8(const __m256i* v) {
  // h0 = [lanes 0-3 of rows 0-3 | lanes 4-7 of rows 0-3], h1 the same for rows 4-7.
  const __m256i h0 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h1 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                          _mm256_permute2x128_si256(h0, h1, 0x31));
}

HWY_INLINE std::uint16_t scale_bits(const std::uint8_t* block) {
  std::uint16_t bits;
  std::memcpy(&bits, block, 2);
  return bits;
}

// Eight rows at a time, a lane per row: each block's activations are loaded once for the eight,
// the eight weight scales converted together, and no sum across lanes is left at the end.
template <class Format>
std::int64_t matvec_quantized_8_rows(const std::uint8_t* w, std::int64_t blocks,
                                     const QuantizedRow& x, float* y, std::int64_t begin,
                                     std::int64_t end) {
  const std::size_t row_bytes = static_cast<std::size_t>(blocks) * Format::kBlockBytes;
  std::int64_t r = begin;
  for (; r + 8 <= end; r += 8) {
    const std::uint8_t* rows = w + static_cast<std::size_t>(r) * row_bytes;
    // The next eight rows, or the range's last eight (a pointer past it is not formed).
    const std::uint8_t* next = w + static_cast<std::size_t>(std::min(r + 8, end - 8)) * row_bytes;
    __m256 total = _mm256_setzero_ps();
    __m256 offset = _mm256_setzero_ps();
    for (std::int64_t b = 0; b < blocks; ++b) {
      const __m256i a =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.values.data() + 32 * b));
      const std::size_t at = static_cast<std::size_t>(b) * Format::kBlockBytes;
      const std::uint8_t* block = rows + at;
      __m256i products[8];
      for (int i = 0; i < 8; ++i) {
        // The next eight rows' block b: eight rows read side by side are not a stream the
        // hardware prefetcher follows (without this Q8_0 decodes at half the speed).
        _mm_prefetch(reinterpret_cast<const char*>(next + at + i * row_bytes), _MM_HINT_T0);
        products[i] = block_products<Format>(block + i * row_bytes, a);
      }
      const __m256 weight_scales = _mm256_cvtph_ps(
          _mm_setr_epi16(scale_bits(block), scale_bits(block + row_bytes),
                         scale_bits(block + 2 * row_bytes), scale_bits(block + 3 * row_bytes),
                         scale_bits(block + 4 * row_bytes), scale_bits(block + 5 * row_bytes),
                         scale_bits(block + 6 * row_bytes), scale_bits(block + 7 * row_bytes)));
      const __m256 sums = _mm256_cvtepi32_ps(sum_each_of_8(products));
      total =
          _mm256_fmadd_ps(_mm256_mul_ps(weight_scales, _mm256_set1_ps(x.scales[b])), sums, total);
      if constexpr (Format::kNibbles) {
        offset = _mm256_fmadd_ps(weight_scales, _mm256_set1_ps(x.nibble_offsets[b]), offset);
      }
    }
    _mm256_storeu_ps(y + r, _mm256_sub_ps(total, offset));
  }
  return r;
}
#else
template <class Format>
std::int64_t matvec_quantized_8_rows(const std::uint8_t*, std::int64_t, const QuantizedRow&, float*,
                                     std::int64_t begin, std::int64_t) {
  return begin;  // no 8-row kernel: every row goes through dot_quantized_row
}
#endif

template <class Format>
void matvec_quantized(const std::uint8_t* w, std::int64_t cols, const QuantizedRow& x, float* y,
                      std::int64_t begin, std::int64_t end) {
  const std::int64_t blocks = cols / 32;
  const std::size_t row_bytes = static_cast<std::size_t>(blocks) * Format::kBlockBytes;
  for (std::int64_t r = matvec_quantized_8_rows<Format>(w, blocks, x, y, begin, end); r < end; ++r)
    y[r] = dot_quantized_row<Format>(w + static_cast<std::size_t>(r) * row_bytes, blocks, x);
}

void MatvecQuantized(const WeightMatrix& w, const QuantizedRow& x, float* y, std::int64_t begin,
                     std::int64_t end) {
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(w.data);
  if (w.dtype == DType::q8_0) return matvec_quantized<Q8_0>(bytes, w.cols, x, y, begin, end);
  return matvec_quantized<Q4_0>(bytes, w.cols, x, y, begin, end);
}

// --- Dispatch on the weight type ----------------------------------------------------------------

void Matvec(const WeightMatrix& w, const float* x, float* y, std::int64_t begin, std::int64_t end) {
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(w.data);
  switch (w.dtype) {
    case DType::f32:
      return matvec_elements(reinterpret_cast<const float*>(bytes), w.cols, x, y, begin, end);
    case DType::f16:
      return matvec_elements(reinterpret_cast<const hwy::float16_t*>(bytes), w.cols, x, y, begin,
                             end);
    case DType::bf16:
      return matvec_elements(reinterpret_cast<const hwy::bfloat16_t*>(bytes), w.cols, x, y, begin,
                             end);
    case DType::q8_0:
      return matvec_blocks<Q8_0>(bytes, w.cols, x, y, begin, end);
    case DType::q4_0:
      return matvec_blocks<Q4_0>(bytes, w.cols, x, y, begin, end);
  }
}

void DequantizeRows(const WeightMatrix& w, std::int64_t begin, std::int64_t end, float* out) {
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(w.data);
  switch (w.dtype) {
    case DType::f32:
      return dequantize_elements(reinterpret_cast<const float*>(bytes), w.cols, begin, end, out);
    case DType::f16:
      return dequantize_elements(reinterpret_cast<const hwy::float16_t*>(bytes), w.cols, begin, end,
                                 out);
    case DType::bf16:
      return dequantize_elements(reinterpret_cast<const hwy::bfloat16_t*>(bytes), w.cols, begin,
                                 end, out);
    case DType::q8_0:
      return dequantize_blocks<Q8_0>(bytes, w.cols, begin, end, out);
    case DType::q4_0:
      return dequantize_blocks<Q4_0>(bytes, w.cols, begin, end, out);
  }
}

// --- f32 products -------------------------------------------------------------------------------

void MatmulTransposed(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const float* w,
                      std::ptrdiff_t w_stride, std::int64_t n, std::int64_t k, float* y,
                      std::ptrdiff_t y_stride) {
  scores<F32Row>(x, x_stride, m, reinterpret_cast<const std::uint8_t*>(w),
                 static_cast<std::size_t>(w_stride) * sizeof(float), n, k, y, y_stride);
}

void AddWeightedRows(const float* p, std::ptrdiff_t p_stride, std::int64_t m, const float* v,
                     std::ptrdiff_t v_stride, std::int64_t n, std::int64_t k, float* y,
                     std::ptrdiff_t y_stride) {
  weighted<F32Row>(p, p_stride, m, reinterpret_cast<const std::uint8_t*>(v),
                   static_cast<std::size_t>(v_stride) * sizeof(float), n, k, y, y_stride);
}

// --- Element-wise -------------------------------------------------------------------------------

// f(v, j) for every full vector at j, then g(t) for the t left over.
template <class F, class G>
HWY_INLINE void for_each_vector(std::int64_t n, F&& f, G&& g) {
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t j = 0;
  for (; j + lanes <= n; j += lanes) f(j);
  for (; j < n; ++j) g(j);
}

float Sum(const float* x, std::int64_t n) {
  const D d;
  V total = hn::Zero(d);
  float tail = 0.0f;
  for_each_vector(
      n, [&](std::int64_t j) { total = hn::Add(total, hn::LoadU(d, x + j)); },
      [&](std::int64_t t) { tail += x[t]; });
  return sum_lanes(d, total) + tail;
}

void RmsNorm(const float* x, const float* weight, std::int64_t n, float eps, float* out) {
  const D d;
  V squares = hn::Zero(d);
  float tail = 0.0f;
  for_each_vector(
      n,
      [&](std::int64_t j) {
        const V v = hn::LoadU(d, x + j);
        squares = hn::MulAdd(v, v, squares);
      },
      [&](std::int64_t t) { tail += x[t] * x[t]; });
  const float mean_square = (sum_lanes(d, squares) + tail) / static_cast<float>(n);
  const float inverse_rms = 1.0f / std::sqrt(mean_square + eps);
  const V factor = hn::Set(d, inverse_rms);
  for_each_vector(
      n,
      [&](std::int64_t j) {
        hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(d, x + j), factor), hn::LoadU(d, weight + j)), d,
                   out + j);
      },
      [&](std::int64_t t) { out[t] = x[t] * inverse_rms * weight[t]; });
}

void Swiglu(float* gate, const float* up, std::int64_t n) {
  const D d;
  // exp(-g) overflows past 88: clamp there (silu(g) is then g / 1.6e38, i.e. 0).
  const V limit = hn::Set(d, 88.0f);
  const V one = hn::Set(d, 1.0f);
  for_each_vector(
      n,
      [&](std::int64_t j) {
        const V g = hn::LoadU(d, gate + j);
        const V e = hn::Exp(d, hn::Min(hn::Neg(g), limit));
        hn::StoreU(hn::Mul(hn::Div(g, hn::Add(one, e)), hn::LoadU(d, up + j)), d, gate + j);
      },
      [&](std::int64_t t) { gate[t] = gate[t] / (1.0f + std::exp(-gate[t])) * up[t]; });
}

void Add(float* x, const float* y, std::int64_t n) {
  const D d;
  for_each_vector(
      n,
      [&](std::int64_t j) {
        hn::StoreU(hn::Add(hn::LoadU(d, x + j), hn::LoadU(d, y + j)), d, x + j);
      },
      [&](std::int64_t t) { x[t] += y[t]; });
}

float Max(const float* x, std::int64_t n) {
  const D d;
  V best = hn::Set(d, -std::numeric_limits<float>::infinity());
  float tail = -std::numeric_limits<float>::infinity();
  for_each_vector(
      n, [&](std::int64_t j) { best = hn::Max(best, hn::LoadU(d, x + j)); },
      [&](std::int64_t t) { tail = std::max(tail, x[t]); });
  return std::max(hn::GetLane(hn::MaxOfLanes(d, best)), tail);
}

void ExpShifted(float* x, std::int64_t n, float shift, float scale) {
  const D d;
  const V shift_v = hn::Set(d, shift);
  const V scale_v = hn::Set(d, scale);
  // Highway's Exp is defined from -FLT_MAX: -inf (masked scores) is raised to it, giving 0.
  const V lowest = hn::Set(d, std::numeric_limits<float>::lowest());
  for_each_vector(
      n,
      [&](std::int64_t j) {
        const V arg = hn::Max(hn::Mul(hn::Sub(hn::LoadU(d, x + j), shift_v), scale_v), lowest);
        hn::StoreU(hn::Exp(d, arg), d, x + j);
      },
      [&](std::int64_t t) { x[t] = std::exp((x[t] - shift) * scale); });
}

void Scale(float* x, std::int64_t n, float factor) {
  const D d;
  const V f = hn::Set(d, factor);
  for_each_vector(
      n, [&](std::int64_t j) { hn::StoreU(hn::Mul(hn::LoadU(d, x + j), f), d, x + j); },
      [&](std::int64_t t) { x[t] *= factor; });
}

void Rotate(float* data, std::ptrdiff_t row_stride, std::int64_t rows, const double* cos_sin,
            int pairs, bool interleaved) {
  const D d;
  const auto lanes = static_cast<int>(hn::Lanes(d));
  // The angles as f32, laid out like the row: [cos or sin of pair i] at the lanes of pair i.
  thread_local std::vector<float> cosines;
  thread_local std::vector<float> sines;
  const int width = 2 * pairs;
  cosines.resize(static_cast<std::size_t>(width));
  sines.resize(static_cast<std::size_t>(width));
  for (int i = 0; i < pairs; ++i) {
    const auto c = static_cast<float>(cos_sin[i]);
    const auto s = static_cast<float>(cos_sin[pairs + i]);
    if (interleaved) {  // (a, b) -> (a c - b s, b c + a s): out = x cos + swap(x) (-s, s)
      cosines[2 * i] = cosines[2 * i + 1] = c;
      sines[2 * i] = -s;
      sines[2 * i + 1] = s;
    } else {  // first half a, second half b
      cosines[i] = cosines[pairs + i] = c;
      sines[i] = -s;
      sines[pairs + i] = s;
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = data + r * row_stride;
    int j = 0;
    if (interleaved && lanes % 2 == 0) {
      for (; j + lanes <= width; j += lanes) {
        const V x = hn::LoadU(d, row + j);
        const V swapped = hn::Reverse2(d, x);
        hn::StoreU(hn::MulAdd(x, hn::LoadU(d, cosines.data() + j),
                              hn::Mul(swapped, hn::LoadU(d, sines.data() + j))),
                   d, row + j);
      }
    } else if (!interleaved) {
      for (; j + lanes <= pairs; j += lanes) {
        const V a = hn::LoadU(d, row + j);
        const V b = hn::LoadU(d, row + pairs + j);
        const V c = hn::LoadU(d, cosines.data() + j);
        const V s = hn::LoadU(d, sines.data() + pairs + j);
        hn::StoreU(hn::NegMulAdd(b, s, hn::Mul(a, c)), d, row + j);
        hn::StoreU(hn::MulAdd(a, s, hn::Mul(b, c)), d, row + pairs + j);
      }
    }
    // The pairs left over, one at a time.
    for (int i = interleaved ? j / 2 : j; i < pairs; ++i) {
      const int first = interleaved ? 2 * i : i;
      const int second = interleaved ? 2 * i + 1 : pairs + i;
      const float a = row[first];
      const float b = row[second];
      const float c = cosines[static_cast<std::size_t>(first)];
      const float s = sines[static_cast<std::size_t>(second)];
      row[first] = a * c - b * s;
      row[second] = b * c + a * s;
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace kvevict::model::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvevict::model::kernels {

HWY_EXPORT(Matvec);
HWY_EXPORT(QuantizeRow);
HWY_EXPORT(MatvecQuantized);
HWY_EXPORT(DequantizeRows);
HWY_EXPORT(MatmulTransposed);
HWY_EXPORT(AddWeightedRows);
HWY_EXPORT(RmsNorm);
HWY_EXPORT(Swiglu);
HWY_EXPORT(Add);
HWY_EXPORT(Max);
HWY_EXPORT(ExpShifted);
HWY_EXPORT(Sum);
HWY_EXPORT(Scale);
HWY_EXPORT(Rotate);

void matvec(const WeightMatrix& w, const float* x, float* y, std::int64_t row_begin,
            std::int64_t row_end) {
  HWY_DYNAMIC_DISPATCH(Matvec)(w, x, y, row_begin, row_end);
}
void quantize_row(const float* x, std::int64_t n, QuantizedRow& out) {
  KVEVICT_REQUIRE(n % 32 == 0,
                  "quantize_row: " + std::to_string(n) + " values: not whole blocks of 32");
  const auto blocks = static_cast<std::size_t>(n / 32);
  out.values.resize(32 * blocks);
  out.scales.resize(blocks);
  out.nibble_offsets.resize(blocks);
  HWY_DYNAMIC_DISPATCH(QuantizeRow)
  (x, n, out.values.data(), out.scales.data(), out.nibble_offsets.data());
}
void matvec_quantized(const WeightMatrix& w, const QuantizedRow& x, float* y,
                      std::int64_t row_begin, std::int64_t row_end) {
  KVEVICT_REQUIRE(w.dtype == DType::q8_0 || w.dtype == DType::q4_0,
                  "matvec_quantized: weights must be Q8_0 or Q4_0");
  KVEVICT_REQUIRE(static_cast<std::int64_t>(x.values.size()) == w.cols,
                  "matvec_quantized: the quantized row's length is not the weights' width");
  HWY_DYNAMIC_DISPATCH(MatvecQuantized)(w, x, y, row_begin, row_end);
}
void dequantize_rows(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                     float* out) {
  HWY_DYNAMIC_DISPATCH(DequantizeRows)(w, row_begin, row_end, out);
}
void matmul_transposed(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const float* w,
                       std::ptrdiff_t w_stride, std::int64_t n, std::int64_t k, float* y,
                       std::ptrdiff_t y_stride) {
  HWY_DYNAMIC_DISPATCH(MatmulTransposed)(x, x_stride, m, w, w_stride, n, k, y, y_stride);
}
void add_weighted_rows(const float* p, std::ptrdiff_t p_stride, std::int64_t m, const float* v,
                       std::ptrdiff_t v_stride, std::int64_t n, std::int64_t k, float* y,
                       std::ptrdiff_t y_stride) {
  HWY_DYNAMIC_DISPATCH(AddWeightedRows)(p, p_stride, m, v, v_stride, n, k, y, y_stride);
}
void rmsnorm(const float* x, const float* weight, std::int64_t n, float eps, float* out) {
  HWY_DYNAMIC_DISPATCH(RmsNorm)(x, weight, n, eps, out);
}
void swiglu(float* gate, const float* up, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(Swiglu)(gate, up, n);
}
void add(float* x, const float* y, std::int64_t n) { HWY_DYNAMIC_DISPATCH(Add)(x, y, n); }
float max(const float* x, std::int64_t n) { return HWY_DYNAMIC_DISPATCH(Max)(x, n); }
void exp_shifted(float* x, std::int64_t n, float shift, float scale) {
  HWY_DYNAMIC_DISPATCH(ExpShifted)(x, n, shift, scale);
}
float sum(const float* x, std::int64_t n) { return HWY_DYNAMIC_DISPATCH(Sum)(x, n); }
void scale(float* x, std::int64_t n, float factor) { HWY_DYNAMIC_DISPATCH(Scale)(x, n, factor); }
void rotate(float* data, std::ptrdiff_t row_stride, std::int64_t rows, const double* cos_sin,
            int pairs, bool interleaved) {
  HWY_DYNAMIC_DISPATCH(Rotate)(data, row_stride, rows, cos_sin, pairs, interleaved);
}

std::vector<std::int64_t> available_targets() {
  std::vector<std::int64_t> targets;
  const std::int64_t supported = hwy::SupportedTargets();
  for (int index = 0; index < 63; ++index) {
    const std::int64_t bit = std::int64_t{1} << index;
    if ((HWY_TARGETS & bit) != 0 && (supported & bit) != 0) targets.push_back(bit);
  }
  return targets;  // lower bits are the better targets
}

std::string target_name(std::int64_t target) { return hwy::TargetName(target); }

std::string active_target() {
  const std::int64_t supported = hwy::SupportedTargets() & HWY_TARGETS;
  return target_name(supported & -supported);  // the lowest bit: the best target
}

void force_target(std::int64_t target) { hwy::SetSupportedTargetsForTest(target); }

}  // namespace kvevict::model::kernels
#endif  // HWY_ONCE
