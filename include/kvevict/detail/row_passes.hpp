// The per-slot passes of the score-based policies over attention rows, compiled for the widest
// vector unit the CPU has.
//
// The core is header-only, so it is compiled at the consumer's baseline (x86-64: SSE2, four floats
// per instruction), where these passes cost a score-based policy most of its step. On x86 with GCC
// or Clang each pass is written once as a plain loop and also compiled, through a target attribute,
// for AVX-512 and AVX2; the first call picks one by the CPU (__builtin_cpu_supports). The passes
// are elementwise (a per-slot product rounded, then a per-slot sum: never contracted into a fused
// multiply-add) or integer reductions, so every width computes the same bits and a decision never
// depends on the CPU.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/restrict.hpp"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define KVEVICT_ROW_PASS_DISPATCH 1
#include <immintrin.h>
#else
#define KVEVICT_ROW_PASS_DISPATCH 0
#endif

namespace kvevict::detail {

/// Softmax outputs are at most 1 in exact arithmetic; the slack admits an engine's rounding (a
/// half-precision softmax is off by at most a few units of 2^-10 near 1).
inline constexpr float kMaxProbability = 1.0f + 1.0f / 256;

/// Whether `value` is an attention probability: in [0, kMaxProbability], -0.0 included.
/// Non-negative floats order as their bits; NaN, infinities and negative values (sign bit set)
/// compare above kMaxProbability's bits, -0.0 aside: an integer test, so that the pass vectorises.
[[nodiscard]] inline bool is_probability(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  return bits <= std::bit_cast<std::uint32_t>(kMaxProbability) || bits == 0x80000000u;
}

/// 1 if `value` is NaN, else 0: an integer test on the bits (exponent all ones, mantissa not
/// zero), so that a scan that flags NaN still vectorises.
[[nodiscard]] inline std::uint32_t nan_flag(float value) {
  return static_cast<std::uint32_t>((std::bit_cast<std::uint32_t>(value) & 0x7fffffffu) >
                                    0x7f800000u);
}

namespace row_pass {

// GCC 12 contracts a product and a sum into a fused multiply-add across statements in C++
// (-ffp-contract=fast, whatever -std says) wherever the target has one (AVX-512 here): off for
// these passes. Clang contracts only within an expression (its default), which the separate
// statements below rule out.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

#if KVEVICT_ROW_PASS_DISPATCH
#define KVEVICT_ROW_PASS_INLINE [[gnu::always_inline]] inline
#else
#define KVEVICT_ROW_PASS_INLINE inline
#endif

KVEVICT_ROW_PASS_INLINE bool all_probabilities(const float* KVEVICT_RESTRICT row, std::size_t n) {
  std::uint32_t all = 1;
  for (std::size_t s = 0; s < n; ++s) all &= static_cast<std::uint32_t>(is_probability(row[s]));
  return all != 0;
}

// The flag of add_scaled: the exponent all ones is NaN or an infinity.
KVEVICT_ROW_PASS_INLINE std::uint32_t not_finite(float value) {
  return static_cast<std::uint32_t>((std::bit_cast<std::uint32_t>(value) & 0x7fffffffu) >=
                                    0x7f800000u);
}

KVEVICT_ROW_PASS_INLINE bool add_scaled(const float* KVEVICT_RESTRICT row, std::size_t n,
                                        float weight, float* KVEVICT_RESTRICT sum) {
  std::uint32_t flag = 0;
  for (std::size_t s = 0; s < n; ++s) {
    flag |= not_finite(row[s]);
    const float scaled = weight * row[s];  // its own statement: never fused into the sum
    sum[s] += scaled;
  }
  return flag == 0;
}

// Four rows in one pass over `sum`, added in their order: the same operations, in the same order
// per slot, as four add_scaled calls, with one read and one write of `sum` instead of four.
KVEVICT_ROW_PASS_INLINE bool add_scaled4(const float* KVEVICT_RESTRICT r0,
                                         const float* KVEVICT_RESTRICT r1,
                                         const float* KVEVICT_RESTRICT r2,
                                         const float* KVEVICT_RESTRICT r3, std::size_t n,
                                         float weight, float* KVEVICT_RESTRICT sum) {
  std::uint32_t flag = 0;
  for (std::size_t s = 0; s < n; ++s) {
    flag |= not_finite(r0[s]) | not_finite(r1[s]) | not_finite(r2[s]) | not_finite(r3[s]);
    const float p0 = weight * r0[s];
    const float p1 = weight * r1[s];
    const float p2 = weight * r2[s];
    const float p3 = weight * r3[s];
    float acc = sum[s];
    acc += p0;
    acc += p1;
    acc += p2;
    acc += p3;
    sum[s] = acc;
  }
  return flag == 0;
}

// The candidate a budget rule evicts when one must go: the index i in [first, last) whose
// scores[order[i]] is the lowest, the later among equals (candidates come oldest first, and ties
// keep the lower original position); NaN scores are skipped and flagged. `index` is meaningful
// only when first < last and no NaN was seen.
struct Worst {
  int index = -1;
  bool nan = false;
};

KVEVICT_ROW_PASS_INLINE Worst worst_in_order(const std::int32_t* order, int first, int last,
                                             const float* scores) {
  int worst = first;
  float worst_score = std::numeric_limits<float>::infinity();
  std::uint32_t nan = 0;
  for (int i = first; i < last; ++i) {
    const float score = scores[order[i]];
    nan |= nan_flag(score);
    if (score <= worst_score) {  // `<=`: the later of equals
      worst_score = score;
      worst = i;
    }
  }
  return {worst, nan != 0};
}

// The first index i in [from, last) whose scores[order[i]] is not above `bound` (at most it, or
// NaN), or `last`: a scan for a few lowest candidates skips the rest with it.
KVEVICT_ROW_PASS_INLINE int first_not_above(const std::int32_t* order, int from, int last,
                                            const float* scores, float bound) {
  int i = from;
  while (i < last && scores[order[i]] > bound) ++i;
  return i;
}

#if KVEVICT_ROW_PASS_DISPATCH
#if defined(__clang__)
#define KVEVICT_TARGET_AVX512 [[gnu::target("avx512f")]]
#else  // GCC's generic tuning would otherwise keep AVX-512 code at 256-bit vectors
#define KVEVICT_TARGET_AVX512 [[gnu::target("avx512f,prefer-vector-width=512")]]
#endif
#define KVEVICT_TARGET_AVX2 [[gnu::target("avx2")]]

KVEVICT_TARGET_AVX512 inline bool all_probabilities_avx512(const float* row, std::size_t n) {
  return all_probabilities(row, n);
}
KVEVICT_TARGET_AVX2 inline bool all_probabilities_avx2(const float* row, std::size_t n) {
  return all_probabilities(row, n);
}
KVEVICT_TARGET_AVX512 inline bool add_scaled_avx512(const float* row, std::size_t n, float weight,
                                                    float* sum) {
  return add_scaled(row, n, weight, sum);
}
KVEVICT_TARGET_AVX2 inline bool add_scaled_avx2(const float* row, std::size_t n, float weight,
                                                float* sum) {
  return add_scaled(row, n, weight, sum);
}
KVEVICT_TARGET_AVX512 inline bool add_scaled4_avx512(const float* const* rows, std::size_t n,
                                                     float weight, float* sum) {
  return add_scaled4(rows[0], rows[1], rows[2], rows[3], n, weight, sum);
}
KVEVICT_TARGET_AVX2 inline bool add_scaled4_avx2(const float* const* rows, std::size_t n,
                                                 float weight, float* sum) {
  return add_scaled4(rows[0], rows[1], rows[2], rows[3], n, weight, sum);
}
// The lanes of a 16-wide step at index i that lie before `last`.
inline __mmask16 lanes_before(int i, int last) {
  return last - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (last - i)) - 1u);
}
// worst_in_order with 16 lanes: each lane keeps the lowest score it saw and its latest index
// (`<=`, as the scalar loop), gathering the scores through `order`; then the lowest of the lanes
// and, among the lanes holding it, the latest index: the scalar loop's answer.
KVEVICT_TARGET_AVX512 inline Worst worst_in_order_avx512(const std::int32_t* order, int first,
                                                         int last, const float* scores) {
  const __m512 infinity = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512i sixteen = _mm512_set1_epi32(16);
  __m512 best = infinity;
  __m512i best_at = _mm512_set1_epi32(-1);
  __m512i at =
      _mm512_add_epi32(_mm512_set1_epi32(first),
                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __mmask16 nan = 0;
  for (int i = first; i < last; i += 16) {
    const __mmask16 lanes = lanes_before(i, last);
    const __m512i slots = _mm512_maskz_loadu_epi32(lanes, order + i);
    const __m512 score = _mm512_mask_i32gather_ps(infinity, lanes, slots, scores, 4);
    nan |= _mm512_mask_cmp_ps_mask(lanes, score, score, _CMP_UNORD_Q);
    const __mmask16 better = _mm512_mask_cmp_ps_mask(lanes, score, best, _CMP_LE_OQ);
    best = _mm512_mask_mov_ps(best, better, score);
    best_at = _mm512_mask_mov_epi32(best_at, better, at);
    at = _mm512_add_epi32(at, sixteen);
  }
  // The lanes, reduced in order (GCC 12's _mm512_reduce_* trip -Wuninitialized).
  alignas(64) float lane_best[16];
  alignas(64) std::int32_t lane_at[16];
  _mm512_store_ps(lane_best, best);
  _mm512_store_si512(lane_at, best_at);
  int index = -1;
  float lowest = std::numeric_limits<float>::infinity();
  for (int lane = 0; lane < 16; ++lane) {
    if (lane_at[lane] < 0) continue;  // saw no score (NaN only, or past the end)
    if (lane_best[lane] < lowest || (lane_best[lane] == lowest && lane_at[lane] > index)) {
      lowest = lane_best[lane];
      index = lane_at[lane];
    }
  }
  return {index < first ? first : index, nan != 0};
}
KVEVICT_TARGET_AVX512 inline int first_not_above_avx512(const std::int32_t* order, int from,
                                                        int last, const float* scores,
                                                        float bound) {
  const __m512 limit = _mm512_set1_ps(bound);
  for (int i = from; i < last; i += 16) {
    const __mmask16 lanes = lanes_before(i, last);
    const __m512i slots = _mm512_maskz_loadu_epi32(lanes, order + i);
    const __m512 score = _mm512_mask_i32gather_ps(limit, lanes, slots, scores, 4);
    // Not greater, or unordered (NaN): where the scalar loop stops.
    const __mmask16 stop = _mm512_mask_cmp_ps_mask(lanes, score, limit, _CMP_NGT_UQ);
    if (stop != 0) return i + std::countr_zero(static_cast<unsigned>(stop));
  }
  return last;
}
#undef KVEVICT_TARGET_AVX512
#undef KVEVICT_TARGET_AVX2
#endif
#undef KVEVICT_ROW_PASS_INLINE
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

enum class Width { baseline, avx2, avx512 };

/// The widest of the compiled widths the CPU runs; decided once.
[[nodiscard]] inline Width width() {
#if KVEVICT_ROW_PASS_DISPATCH
  static const Width chosen = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return Width::avx512;
    if (__builtin_cpu_supports("avx2")) return Width::avx2;
    return Width::baseline;
  }();
  return chosen;
#else
  return Width::baseline;
#endif
}

}  // namespace row_pass

/// Whether every value of row[0, n) is an attention probability (is_probability).
[[nodiscard]] inline bool all_probabilities(const float* row, std::size_t n) {
#if KVEVICT_ROW_PASS_DISPATCH
  switch (row_pass::width()) {
    case row_pass::Width::avx512:
      return row_pass::all_probabilities_avx512(row, n);
    case row_pass::Width::avx2:
      return row_pass::all_probabilities_avx2(row, n);
    case row_pass::Width::baseline:
      break;
  }
#endif
  return row_pass::all_probabilities(row, n);
}

/// sum[s] += weight * row[s] for s in [0, n) (the product rounded, then the sum: the same bits at
/// every width). Returns false if the row held NaN or an infinity. `row` and `sum` must not
/// overlap.
[[nodiscard]] inline bool add_scaled(const float* row, std::size_t n, float weight, float* sum) {
#if KVEVICT_ROW_PASS_DISPATCH
  switch (row_pass::width()) {
    case row_pass::Width::avx512:
      return row_pass::add_scaled_avx512(row, n, weight, sum);
    case row_pass::Width::avx2:
      return row_pass::add_scaled_avx2(row, n, weight, sum);
    case row_pass::Width::baseline:
      break;
  }
#endif
  return row_pass::add_scaled(row, n, weight, sum);
}

/// add_scaled of rows[0], rows[1], rows[2] and rows[3], in that order, in one pass over `sum`.
[[nodiscard]] inline bool add_scaled4(const float* const* rows, std::size_t n, float weight,
                                      float* sum) {
#if KVEVICT_ROW_PASS_DISPATCH
  switch (row_pass::width()) {
    case row_pass::Width::avx512:
      return row_pass::add_scaled4_avx512(rows, n, weight, sum);
    case row_pass::Width::avx2:
      return row_pass::add_scaled4_avx2(rows, n, weight, sum);
    case row_pass::Width::baseline:
      break;
  }
#endif
  return row_pass::add_scaled4(rows[0], rows[1], rows[2], rows[3], n, weight, sum);
}

/// The index in [first, last) of the worst candidate of order[first, last) by `scores` (indexed by
/// slot): the lowest score, the later of equals; nan is set if a candidate's score is NaN.
[[nodiscard]] inline row_pass::Worst worst_in_order(const std::int32_t* order, int first, int last,
                                                    const float* scores) {
#if KVEVICT_ROW_PASS_DISPATCH
  if (row_pass::width() == row_pass::Width::avx512) {
    return row_pass::worst_in_order_avx512(order, first, last, scores);
  }
#endif
  return row_pass::worst_in_order(order, first, last, scores);
}

/// The first index i in [from, last) whose scores[order[i]] is not above `bound` (at most it, or
/// NaN), or `last`.
[[nodiscard]] inline int first_not_above(const std::int32_t* order, int from, int last,
                                         const float* scores, float bound) {
#if KVEVICT_ROW_PASS_DISPATCH
  if (row_pass::width() == row_pass::Width::avx512) {
    return row_pass::first_not_above_avx512(order, from, last, scores, bound);
  }
#endif
  return row_pass::first_not_above(order, from, last, scores, bound);
}

}  // namespace kvevict::detail
