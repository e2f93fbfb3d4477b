// Highway implementation of attention_kernels.hpp: compiled once per target (foreach_target.h
// re-includes this file with HWY_NAMESPACE = N_AVX3, N_AVX2, N_SSE4, ...), the exported functions
// at the end dispatching to the best target the CPU supports.
//
// The q.K tile is src/model/kernels/tiles-inl.hpp's key_tile over a tile of gathered K rows: kR
// query rows against kLanes / kR keys, kLanes independent accumulators whose sums across lanes are
// formed together. Vectors are capped at 16 floats (a 512-bit register), so that a lane count
// divides a Q8_0 block of 32; scalable vectors (SVE, RVV) are not compiled, as the tiles keep
// vectors in arrays.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "llama/attention_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target.h must come first.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <kvevict/detail/half.hpp>

#include "llama/attention_kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace kvevict::llama::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::CappedTag<float, 16>;
using V = hn::Vec<D>;

constexpr std::int64_t kQ8_0Values = 32;  // ggml's block_q8_0: an f16 scale, 32 int8 values
constexpr std::size_t kQ8_0Bytes = 34;

HWY_INLINE std::uint16_t bits_at(const std::uint8_t* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

// A row reader: values [j, j + lanes) of a K row as f32, and value j alone (the scalar path).
struct F32Row {
  static HWY_INLINE V load(D d, const std::uint8_t* row, std::int64_t j) {
    return hn::LoadU(d, reinterpret_cast<const float*>(row) + j);
  }
  static HWY_INLINE float value(const std::uint8_t* row, std::int64_t j) {
    float v;
    std::memcpy(&v, row + 4 * j, 4);
    return v;
  }
};

struct F16Row {
  static HWY_INLINE V load(D d, const std::uint8_t* row, std::int64_t j) {
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, D>(),
                                      reinterpret_cast<const hwy::float16_t*>(row) + j));
  }
  static HWY_INLINE float value(const std::uint8_t* row, std::int64_t j) {
    return detail::f16_to_float(bits_at(row + 2 * j));
  }
};

struct BF16Row {
  static HWY_INLINE V load(D d, const std::uint8_t* row, std::int64_t j) {
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::bfloat16_t, D>(),
                                      reinterpret_cast<const hwy::bfloat16_t*>(row) + j));
  }
  static HWY_INLINE float value(const std::uint8_t* row, std::int64_t j) {
    return detail::bf16_to_float(bits_at(row + 2 * j));
  }
};

// A vector never straddles two blocks (its lane count divides 32).
struct Q8_0Row {
  static HWY_INLINE V load(D d, const std::uint8_t* row, std::int64_t j) {
    const std::uint8_t* block = row + static_cast<std::size_t>(j / kQ8_0Values) * kQ8_0Bytes;
    const auto* q = reinterpret_cast<const std::int8_t*>(block + 2) + j % kQ8_0Values;
    const V values = hn::ConvertTo(d, hn::PromoteTo(hn::Rebind<std::int32_t, D>(),
                                                    hn::LoadU(hn::Rebind<std::int8_t, D>(), q)));
    return hn::Mul(values, hn::Set(d, detail::f16_to_float(bits_at(block))));
  }
  static HWY_INLINE float value(const std::uint8_t* row, std::int64_t j) {
    const std::uint8_t* block = row + static_cast<std::size_t>(j / kQ8_0Values) * kQ8_0Bytes;
    return static_cast<float>(static_cast<std::int8_t>(block[2 + j % kQ8_0Values])) *
           detail::f16_to_float(bits_at(block));
  }
};

// Y[r][s] = X[r] . K[cells[s]], one key at a time (rows whose length is not a multiple of the
// lanes, and the scalar target).
template <class Row>
void scores_by_value(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const CellRows& keys,
                     const std::int32_t* cells, std::int64_t n, std::int64_t k, float* y,
                     std::ptrdiff_t y_stride) {
  for (std::int64_t s = 0; s < n; ++s) {
    const std::uint8_t* row = keys.base + static_cast<std::size_t>(cells[s]) * keys.row_bytes;
    for (std::int64_t r = 0; r < m; ++r) {
      float total = 0.0f;
      for (std::int64_t j = 0; j < k; ++j) total += x[r * x_stride + j] * Row::value(row, j);
      y[r * y_stride + s] = total;
    }
  }
}

#if HWY_TARGET != HWY_SCALAR
constexpr std::size_t kLanes = hn::MaxLanes(D());

// Lane c of the result is the sum of the lanes of sums[c], c in [0, kLanes).
#if HWY_TARGET <= HWY_AVX3
// On AVX-512 the first two levels add within each 128-bit block (unpacks, the cheapest shuffles),
// the last two across blocks: 24 of the 30 shuffles stay in their block, where ConcatEven /
// ConcatOdd (below) are lane-crossing two-source permutes at every level (bench_llama --kernels:
// the q.K pass about 4% faster at 4K cells).
HWY_INLINE V sum_each(D /*d*/, V* sums) {
  static_assert(kLanes == 16);
  // Level 1, pairs (a, b): per block [a0 + a2, b0 + b2, a1 + a3, b1 + b3].
  __m512 pairs[8];
  for (int c = 0; c < 8; ++c) {
    const __m512 a = sums[2 * c].raw;
    const __m512 b = sums[2 * c + 1].raw;
    pairs[c] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  // Level 2, pairs of pairs (ab, cd): per block [a, b, c, d], the block's share of each sum.
  __m512 quads[4];
  for (int c = 0; c < 4; ++c) {
    const __m512d ab = _mm512_castps_pd(pairs[2 * c]);
    const __m512d cd = _mm512_castps_pd(pairs[2 * c + 1]);
    quads[c] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
  }
  // Level 3, blocks: [abcd of blocks 0 + 2, 1 + 3, efgh of 0 + 2, 1 + 3].
  __m512 halves[2];
  for (int c = 0; c < 2; ++c) {
    const __m512 lo = quads[2 * c];
    const __m512 hi = quads[2 * c + 1];
    halves[c] = _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Level 4: [abcd, efgh, ijkl, mnop].
  return V{_mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)))};
}
#else
// The vectors added pairwise, even lanes to odd lanes, halving their number at each level
// (tiles-inl.hpp).
HWY_INLINE V sum_each(D d, V* sums) {
  for (std::size_t width = kLanes; width > 1; width /= 2) {
    for (std::size_t c = 0; c < width / 2; ++c) {
      sums[c] = hn::Add(hn::ConcatEven(d, sums[2 * c + 1], sums[2 * c]),
                        hn::ConcatOdd(d, sums[2 * c + 1], sums[2 * c]));
    }
  }
  return sums[0];
}
#endif

// Y[r][g] = X[r] . K_g for the kR rows of X and the kLanes / kR K rows keys[g] of a tile, over
// k = kVecs vectors (kVecs 0: k / lanes, known at run time only); the first `count` results of
// each row are stored (the tile's other keys repeat a real one).
template <class Row, int kR, int kVecs>
HWY_INLINE void key_tile(const float* x, std::ptrdiff_t x_stride, const std::uint8_t* const* keys,
                         std::int64_t k, float* y, std::ptrdiff_t y_stride, int count) {
  constexpr int kKeys = static_cast<int>(kLanes) / kR;
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t vecs = kVecs > 0 ? kVecs : k / lanes;
  V sums[kLanes];
  for (V& sum : sums) sum = hn::Zero(d);
#pragma GCC unroll 8
  for (std::int64_t jv = 0; jv < vecs; ++jv) {
    V kv[kKeys];
    for (int g = 0; g < kKeys; ++g) kv[g] = Row::load(d, keys[g], jv * lanes);
    for (int r = 0; r < kR; ++r) {
      const V xv = hn::LoadU(d, x + r * x_stride + jv * lanes);
      for (int g = 0; g < kKeys; ++g) {
        sums[r * kKeys + g] = hn::MulAdd(xv, kv[g], sums[r * kKeys + g]);
      }
    }
  }
  const V result = sum_each(d, sums);
#if HWY_TARGET <= HWY_AVX3
  if (kR == 4 && count == kKeys) {  // the common case: each row's 4 scores are a 128-bit block
    const __m512 v = result.raw;
    _mm_storeu_ps(y, _mm512_castps512_ps128(v));
    _mm_storeu_ps(y + y_stride, _mm512_extractf32x4_ps(v, 1));
    _mm_storeu_ps(y + 2 * y_stride, _mm512_extractf32x4_ps(v, 2));
    _mm_storeu_ps(y + 3 * y_stride, _mm512_extractf32x4_ps(v, 3));
    return;
  }
#endif
  HWY_ALIGN float tile[kLanes];
  hn::Store(result, d, tile);
  if (count == kKeys) {  // the common case: a fixed-size copy per row
    for (int r = 0; r < kR; ++r) std::memcpy(y + r * y_stride, tile + r * kKeys, sizeof tile / kR);
  } else {
    for (int r = 0; r < kR; ++r) std::copy_n(tile + r * kKeys, count, y + r * y_stride);
  }
}

// One block of gathered K rows against rows [0, m) of X: Y[r][g] = X[r] . *rows[g] for g in
// [0, count), count = kLanes unless kPartial; tiles of four rows of X (or one).
template <class Row, int kVecs, bool kPartial>
HWY_INLINE void key_block(const float* x, std::ptrdiff_t x_stride, std::int64_t m,
                          const std::uint8_t* const* rows, std::int64_t k, float* y,
                          std::ptrdiff_t y_stride, int count) {
  constexpr int kRows = kLanes >= 4 ? 4 : static_cast<int>(kLanes);
  constexpr int kTileKeys = static_cast<int>(kLanes) / kRows;
  if (!kPartial) count = static_cast<int>(kLanes);
  std::int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    for (int g = 0; g < count; g += kTileKeys) {
      key_tile<Row, kRows, kVecs>(x + i * x_stride, x_stride, rows + g, k, y + i * y_stride + g,
                                  y_stride, kPartial ? std::min(kTileKeys, count - g) : kTileKeys);
    }
  }
  for (; i < m; ++i) {
    key_tile<Row, 1, kVecs>(x + i * x_stride, x_stride, rows, k, y + i * y_stride, y_stride, count);
  }
}

// Y[r][s] = X[r] . K[cells[s]], k a multiple of the lanes: blocks of kLanes gathered K rows (read
// from memory once, then from L1 by every group of four rows of X). Full blocks have their count
// at compile time, only the last, partial one at run time: with a run-time count in every block,
// the row addresses and tile bounds took about an eighth of the pass (bench_llama --kernels). Not
// prefetched in software, as tiles-inl.hpp's key_blocks are: the cells were read by llama.cpp's
// flash-attention kernel just before, and the prefetches cost more than they saved (docs/
// benchmarks.md).
template <class Row, int kVecs>
void key_blocks(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const CellRows& keys,
                const std::int32_t* cells, std::int64_t n, std::int64_t k, float* y,
                std::ptrdiff_t y_stride) {
  constexpr auto kBlock = static_cast<std::int64_t>(kLanes);
  const std::size_t row_bytes = keys.row_bytes;
  const std::uint8_t* rows[kLanes];
  std::int64_t c = 0;
  for (; c + kBlock <= n; c += kBlock) {
    for (std::int64_t g = 0; g < kBlock; ++g) {
      rows[g] = keys.base + static_cast<std::size_t>(cells[c + g]) * row_bytes;
    }
    key_block<Row, kVecs, false>(x, x_stride, m, rows, k, y + c, y_stride, 0);
  }
  if (c < n) {  // the other keys of the tile repeat the last one
    const auto count = static_cast<int>(n - c);
    for (int g = 0; g < static_cast<int>(kBlock); ++g) {
      rows[g] = keys.base + static_cast<std::size_t>(cells[c + std::min(g, count - 1)]) * row_bytes;
    }
    key_block<Row, kVecs, true>(x, x_stride, m, rows, k, y + c, y_stride, count);
  }
}
#endif

template <class Row>
void scores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const CellRows& keys,
            const std::int32_t* cells, std::int64_t n, std::int64_t k, float* y,
            std::ptrdiff_t y_stride) {
#if HWY_TARGET != HWY_SCALAR
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(D()));
  if (k % lanes == 0) {
    switch (k / lanes) {
      case 4:
        return key_blocks<Row, 4>(x, x_stride, m, keys, cells, n, k, y, y_stride);
      case 8:
        return key_blocks<Row, 8>(x, x_stride, m, keys, cells, n, k, y, y_stride);
      case 16:
        return key_blocks<Row, 16>(x, x_stride, m, keys, cells, n, k, y, y_stride);
      default:
        return key_blocks<Row, 0>(x, x_stride, m, keys, cells, n, k, y, y_stride);
    }
  }
#endif
  scores_by_value<Row>(x, x_stride, m, keys, cells, n, k, y, y_stride);
}

void GatheredScores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const CellRows& keys,
                    const std::int32_t* cells, std::int64_t n, std::int64_t k, float* y,
                    std::ptrdiff_t y_stride) {
  switch (keys.type) {
    case CellType::f32:
      return scores<F32Row>(x, x_stride, m, keys, cells, n, k, y, y_stride);
    case CellType::f16:
      return scores<F16Row>(x, x_stride, m, keys, cells, n, k, y, y_stride);
    case CellType::bf16:
      return scores<BF16Row>(x, x_stride, m, keys, cells, n, k, y, y_stride);
    case CellType::q8_0:
      return scores<Q8_0Row>(x, x_stride, m, keys, cells, n, k, y, y_stride);
  }
}

// The softmax's exp. Results below 2^-126 are subnormal floats, and on x86 an instruction that
// writes a subnormal (or reads one) is finished by a microcode assist, some hundred cycles: rows
// whose logits spread over more than 87 (a peaked attention: most cells under 2^-126 of the top
// one) took 10-20 times longer. On 512-bit targets the exps are therefore formed times 2^64
// (exp_scaled, normal down to exp(-104)), and the division by the sum brings them back with
// integer operations (unscale): the exponent field lowered by 64 where the result is normal, the
// subnormal's bits from an integer conversion where not. Elsewhere Highway's Exp and a product.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr float kExpScale = 0x1p64f;

// exp(x) * 2^64 for x <= 0: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2 (Highway's
// reduction and polynomial), 2^(n + 64) applied by vscalefps; exactly 0 below -104 (exp(-104) is
// under half the least subnormal) and for -inf (a masked cell).
HWY_INLINE V exp_scaled(D d, V x) {
  const V lower = hn::Set(d, -104.0f);
  const V clamped = hn::Max(x, lower);
  const V n =
      V{_mm512_roundscale_ps(hn::Mul(clamped, hn::Set(d, 1.442695040888963407359924681f)).raw,
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  V r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), clamped);
  r = hn::MulAdd(n, hn::Set(d, -1.428606765330187045e-6f), r);
  const V r2 = hn::Mul(r, r);
  const V p01 = hn::MulAdd(hn::Set(d, +0.166666671633720397949219f), r, hn::Set(d, +0.5f));
  const V p23 = hn::MulAdd(hn::Set(d, +0.00833336077630519866943359f), r,
                           hn::Set(d, +0.0416664853692054748535156f));
  const V p45 = hn::MulAdd(hn::Set(d, +0.000198527617612853646278381f), r,
                           hn::Set(d, +0.00139304355252534151077271f));
  const V poly = hn::MulAdd(hn::MulAdd(p45, r2, p23), r2, p01);
  const V y = hn::Add(hn::MulAdd(poly, r2, r), hn::Set(d, 1.0f));
  const V e = V{_mm512_scalef_ps(y.raw, hn::Add(n, hn::Set(d, 64.0f)).raw)};
  return hn::IfThenElseZero(hn::Ge(x, lower), e);
}

// v * 2^-64 for 0 <= v <= 2^64 without a subnormal operation: v's exponent lowered by 64 where
// the result is normal (v >= 2^-62), else the subnormal whose bits are v * 2^85 rounded to an
// integer (the multiple of 2^-149 nearest v * 2^-64).
HWY_INLINE V unscale(D d, V v) {
  const hn::RebindToSigned<D> di;
  const auto normal = hn::Sub(hn::BitCast(di, v), hn::Set(di, 64 << 23));
  const auto subnormal = hn::NearestInt(hn::Mul(v, hn::Set(d, 0x1p85f)));
  return hn::BitCast(
      d, hn::IfThenElse(hn::RebindMask(di, hn::Lt(v, hn::Set(d, 0x1p-62f))), subnormal, normal));
}
#else
constexpr float kExpScale = 1.0f;

HWY_INLINE V exp_scaled(D d, V x) {
  // -inf is raised to the lowest float, whose Exp is exactly 0.
  return hn::Exp(d, hn::Max(x, hn::Set(d, std::numeric_limits<float>::lowest())));
}

HWY_INLINE V unscale(D /*d*/, V v) { return v; }
#endif

void SoftmaxRow(float* row, const float* bias, float scale, std::int64_t n) {
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  // t = scale * row + bias, and its max (four running maxima, so that the pass is not bound by
  // the latency of one).
  const V scale_v = hn::Set(d, scale);
  V max_v[4] = {hn::Set(d, -kInfinity), hn::Set(d, -kInfinity), hn::Set(d, -kInfinity),
                hn::Set(d, -kInfinity)};
  std::int64_t j = 0;
  for (; j + 4 * lanes <= n; j += 4 * lanes) {
    for (int u = 0; u < 4; ++u) {
      const V t = hn::MulAdd(hn::LoadU(d, row + j + u * lanes), scale_v,
                             hn::LoadU(d, bias + j + u * lanes));
      hn::StoreU(t, d, row + j + u * lanes);
      max_v[u] = hn::Max(max_v[u], t);
    }
  }
  for (; j + lanes <= n; j += lanes) {
    const V t = hn::MulAdd(hn::LoadU(d, row + j), scale_v, hn::LoadU(d, bias + j));
    hn::StoreU(t, d, row + j);
    max_v[0] = hn::Max(max_v[0], t);
  }
  float max = hn::GetLane(
      hn::MaxOfLanes(d, hn::Max(hn::Max(max_v[0], max_v[1]), hn::Max(max_v[2], max_v[3]))));
  for (; j < n; ++j) {
    row[j] = scale * row[j] + bias[j];
    max = std::max(max, row[j]);
  }
  // exp(t - max) * kExpScale, exactly 0 for a masked cell (-inf); summed in f32 over four vectors
  // at a time, those partial sums accumulated in double.
  const V shift = hn::Set(d, max);
  double sum = 0.0;
#if HWY_TARGET != HWY_SCALAR
  const hn::Half<D> half;
  const hn::Rebind<double, hn::Half<D>> dd;
  auto sum_v = hn::Zero(dd);
#endif
  V partial = hn::Zero(d);
  int in_partial = 0;
  for (j = 0; j + lanes <= n; j += lanes) {
    const V e = exp_scaled(d, hn::Sub(hn::LoadU(d, row + j), shift));
    hn::StoreU(e, d, row + j);
    partial = hn::Add(partial, e);
    if (++in_partial == 4) {
#if HWY_TARGET != HWY_SCALAR
      sum_v = hn::Add(sum_v, hn::Add(hn::PromoteTo(dd, hn::LowerHalf(half, partial)),
                                     hn::PromoteTo(dd, hn::UpperHalf(half, partial))));
#else
      sum += static_cast<double>(hn::GetLane(partial));
#endif
      partial = hn::Zero(d);
      in_partial = 0;
    }
  }
#if HWY_TARGET != HWY_SCALAR
  sum_v = hn::Add(sum_v, hn::Add(hn::PromoteTo(dd, hn::LowerHalf(half, partial)),
                                 hn::PromoteTo(dd, hn::UpperHalf(half, partial))));
  sum = hn::GetLane(hn::SumOfLanes(dd, sum_v));
#else
  sum += static_cast<double>(hn::GetLane(partial));
#endif
  for (; j < n; ++j) {
    row[j] = row[j] == -kInfinity ? 0.0f : std::exp(row[j] - max) * kExpScale;
    sum += static_cast<double>(row[j]);
  }
  // e / sum: kExpScale * (true e / true sum), brought back by unscale.
  const auto inverse = static_cast<float>(static_cast<double>(kExpScale) / sum);
  const V inverse_v = hn::Set(d, inverse);
  for (j = 0; j + lanes <= n; j += lanes) {
    hn::StoreU(unscale(d, hn::Mul(hn::LoadU(d, row + j), inverse_v)), d, row + j);
  }
  for (; j < n; ++j) row[j] = row[j] * inverse / kExpScale;
}

void RoundThroughF16(const float* in, float* out, std::int64_t n) {
  std::int64_t j = 0;
#if HWY_TARGET <= HWY_AVX2
  // vcvtps2ph rounds to nearest, ties to even, as ggml's conversion does on x86 (F16C), and as
  // detail::float_to_f16 (the other targets) does in software.
  const D d;
  const hn::Rebind<hwy::float16_t, D> df16;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (; j + lanes <= n; j += lanes) {
    hn::StoreU(hn::PromoteTo(d, hn::DemoteTo(df16, hn::LoadU(d, in + j))), d, out + j);
  }
#endif
  for (; j < n; ++j) out[j] = detail::f16_to_float(detail::float_to_f16(in[j]));
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace kvevict::llama::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvevict::llama::kernels {

HWY_EXPORT(GatheredScores);
HWY_EXPORT(SoftmaxRow);
HWY_EXPORT(RoundThroughF16);

void gathered_scores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const CellRows& keys,
                     const std::int32_t* cells, std::int64_t n, std::int64_t k, float* y,
                     std::ptrdiff_t y_stride) {
  HWY_DYNAMIC_DISPATCH(GatheredScores)(x, x_stride, m, keys, cells, n, k, y, y_stride);
}

void softmax_row(float* row, const float* bias, float scale, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(SoftmaxRow)(row, bias, scale, n);
}

void round_through_f16(const float* in, float* out, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(RoundThroughF16)(in, out, n);
}

}  // namespace kvevict::llama::kernels
#endif  // HWY_ONCE
