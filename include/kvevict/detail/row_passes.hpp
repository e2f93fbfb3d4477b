// The per-slot passes of the score-based policies over attention rows, and the rotation of f32
// keys that a fold applies, compiled for the widest vector unit the CPU has.
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

// The flag of add_rows: 1 unless `value` is an attention probability (is_probability's integer
// tests, negated and combined with `&` rather than `||`: `!is_probability` in the sum's pass
// measured slower, 1.02-1.26% of an H2O 4K step's samples against 0.90%).
KVEVICT_ROW_PASS_INLINE std::uint32_t not_probability(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  return static_cast<std::uint32_t>(bits > std::bit_cast<std::uint32_t>(kMaxProbability)) &
         static_cast<std::uint32_t>(bits != 0x80000000u);
}

// Where each sum of add_rows starts: the output itself, another column, or zero.
enum class SumStart { in_place, from, zero };

// Asks for the 64-byte lines of [p, p + bytes) ahead of their use, for reading or for writing (a
// hint: no effect on any result).
KVEVICT_ROW_PASS_INLINE void prefetch_lines(const void* p, std::size_t bytes, bool for_write) {
#if defined(__GNUC__) || defined(__clang__)
  const auto* bytes_at = static_cast<const char*>(p);
  for (std::size_t b = 0; b < bytes; b += 64) {
    if (for_write) {
      __builtin_prefetch(bytes_at + b, 1);
    } else {
      __builtin_prefetch(bytes_at + b, 0);
    }
  }
#else
  (void)p, (void)bytes, (void)for_write;
#endif
}

// K rows (K <= 4; r0 stands in for the unused ones) over slots [0, n): to[s] = start + weight *
// r0[s] + ... + weight * r(K-1)[s], each product rounded before it is added, the rows added in
// their order. Returns the flag of not_probability over every value read.
template <int K, SumStart kStart>
KVEVICT_ROW_PASS_INLINE std::uint32_t add_rows_span(
    const float* KVEVICT_RESTRICT r0, const float* KVEVICT_RESTRICT r1,
    const float* KVEVICT_RESTRICT r2, const float* KVEVICT_RESTRICT r3, std::size_t n, float weight,
    const float* KVEVICT_RESTRICT from, float* KVEVICT_RESTRICT to) {
  std::uint32_t flag = 0;
  for (std::size_t s = 0; s < n; ++s) {
    float acc = 0.0f;
    if constexpr (kStart == SumStart::in_place) acc = to[s];
    if constexpr (kStart == SumStart::from) acc = from[s];
    flag |= not_probability(r0[s]);
    const float p0 = weight * r0[s];  // its own statement: never fused into the sum
    acc += p0;
    if constexpr (K > 1) {
      flag |= not_probability(r1[s]);
      const float p1 = weight * r1[s];
      acc += p1;
    }
    if constexpr (K > 2) {
      flag |= not_probability(r2[s]);
      const float p2 = weight * r2[s];
      acc += p2;
    }
    if constexpr (K > 3) {
      flag |= not_probability(r3[s]);
      const float p3 = weight * r3[s];
      acc += p3;
    }
    to[s] = acc;
  }
  return flag;
}

// add_rows_span in one pass over the output: the same operations per slot as K passes of one row
// each, with one read and one write of the sums instead of K. Returns false if a row held a value
// that is not an attention probability.
template <int K, SumStart kStart>
KVEVICT_ROW_PASS_INLINE bool add_rows_of(const float* r0, const float* r1, const float* r2,
                                         const float* r3, std::size_t n, float weight,
                                         const float* from, float* to) {
  static_assert(K >= 1 && K <= 4);
  // The rows were just written, but the score columns come from memory at every step (a model's
  // weights pass through the caches between two steps), and a stream prefetcher stops at each
  // 4 KiB page: blocks of slots ask for their columns kAhead floats ahead.
  constexpr std::size_t kBlock = 64;    // four lines of floats
  constexpr std::size_t kAhead = 1024;  // 4 KiB
  std::uint32_t flag = 0;
  std::size_t s = 0;
  for (; n - s >= kAhead + kBlock; s += kBlock) {
    if constexpr (kStart == SumStart::from) {
      prefetch_lines(from + s + kAhead, kBlock * sizeof(float), /*for_write=*/false);
    }
    prefetch_lines(to + s + kAhead, kBlock * sizeof(float), /*for_write=*/true);
    flag |= add_rows_span<K, kStart>(r0 + s, r1 + s, r2 + s, r3 + s, kBlock, weight,
                                     kStart == SumStart::from ? from + s : from, to + s);
  }
  flag |= add_rows_span<K, kStart>(r0 + s, r1 + s, r2 + s, r3 + s, n - s, weight,
                                   kStart == SumStart::from ? from + s : from, to + s);
  return flag == 0;
}

template <SumStart kStart>
KVEVICT_ROW_PASS_INLINE bool add_rows_from(const float* const* rows, int count, std::size_t n,
                                           float weight, const float* from, float* to) {
  const float* r0 = rows[0];
  switch (count) {
    case 1:
      return add_rows_of<1, kStart>(r0, r0, r0, r0, n, weight, from, to);
    case 2:
      return add_rows_of<2, kStart>(r0, rows[1], r0, r0, n, weight, from, to);
    case 3:
      return add_rows_of<3, kStart>(r0, rows[1], rows[2], r0, n, weight, from, to);
    default:
      return add_rows_of<4, kStart>(r0, rows[1], rows[2], rows[3], n, weight, from, to);
  }
}

// rows[0, count) (count in [1, 4]) added to `from` into `to`: in place when from == to, from
// zeros when from is null.
KVEVICT_ROW_PASS_INLINE bool add_rows(const float* const* rows, int count, std::size_t n,
                                      float weight, const float* from, float* to) {
  if (from == to) return add_rows_from<SumStart::in_place>(rows, count, n, weight, nullptr, to);
  if (from == nullptr) return add_rows_from<SumStart::zero>(rows, count, n, weight, nullptr, to);
  return add_rows_from<SumStart::from>(rows, count, n, weight, from, to);
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

// The lowest of scores[0, n) (NaN skipped) and whether one was NaN: with first_equal, the worst
// of a unit's slots found in slot order, where a policy that rewrites its column whole (TOVA) has
// it in cache right after its last sum of a forward (KnownWorst, selection.hpp).
struct Lowest {
  float value = std::numeric_limits<float>::infinity();
  bool nan = false;
};

KVEVICT_ROW_PASS_INLINE Lowest lowest_of(const float* scores, int n) {
  float lowest = std::numeric_limits<float>::infinity();
  std::uint32_t nan = 0;
  for (int s = 0; s < n; ++s) {
    const float score = scores[s];
    nan |= nan_flag(score);
    lowest = score < lowest ? score : lowest;
  }
  return {lowest, nan != 0};
}

// The first index i in [from, n) with scores[i] == value, or n.
KVEVICT_ROW_PASS_INLINE int first_equal(const float* scores, int from, int n, float value) {
  int i = from;
  while (i < n && !(scores[i] == value)) ++i;
  return i;
}

// The first index i in [from, last) whose scores[order[i]] is not above `bound` (at most it, or
// NaN), or `last`: a scan for a few lowest candidates skips the rest with it.
KVEVICT_ROW_PASS_INLINE int first_not_above(const std::int32_t* order, int from, int last,
                                            const float* scores, float bound) {
  int i = from;
  while (i < last && scores[order[i]] > bound) ++i;
  return i;
}

// The first index i in [from, last) with values[i] != value, or `last`: where a run of equal
// values ends (a SlotTable's group ids, read by attention at every step).
KVEVICT_ROW_PASS_INLINE int first_other(const std::int32_t* values, int from, int last,
                                        std::int32_t value) {
  int i = from;
  while (i < last && values[i] == value) ++i;
  return i;
}

// A RoPE rotation of f32 pairs (a, b) -> (a cos - b sin, b cos + a sin), computed in double
// (each product rounded, then the difference or sum: never fused) and rounded once to float:
// pairs (first[i], second[i]) for half_split, (row[2i], row[2i + 1]) for interleaved.
KVEVICT_ROW_PASS_INLINE void rotate_half_split(float* KVEVICT_RESTRICT first,
                                               float* KVEVICT_RESTRICT second, int pairs,
                                               const double* KVEVICT_RESTRICT cos,
                                               const double* KVEVICT_RESTRICT sin) {
  for (int i = 0; i < pairs; ++i) {
    const double a = first[i];
    const double b = second[i];
    const double a_cos = a * cos[i];
    const double b_sin = b * sin[i];
    const double b_cos = b * cos[i];
    const double a_sin = a * sin[i];
    first[i] = static_cast<float>(a_cos - b_sin);
    second[i] = static_cast<float>(b_cos + a_sin);
  }
}
KVEVICT_ROW_PASS_INLINE void rotate_interleaved(float* KVEVICT_RESTRICT row, int pairs,
                                                const double* KVEVICT_RESTRICT cos,
                                                const double* KVEVICT_RESTRICT sin) {
  for (int i = 0; i < pairs; ++i) {
    const double a = row[2 * i];
    const double b = row[2 * i + 1];
    const double a_cos = a * cos[i];
    const double b_sin = b * sin[i];
    const double b_cos = b * cos[i];
    const double a_sin = a * sin[i];
    row[2 * i] = static_cast<float>(a_cos - b_sin);
    row[2 * i + 1] = static_cast<float>(b_cos + a_sin);
  }
}

// Rows of `row_floats` floats at rows + slot * row_floats, taken in the order of a list of slots:
// KeyDiff's unit vectors, as many as the K cache, which come from memory at every step. Each row
// asks for the one kAheadRows further on, since the slots, and so the rows, may be scattered.
inline constexpr int kAheadRows = 24;
KVEVICT_ROW_PASS_INLINE const float* row_at(const float* rows, std::size_t row_floats,
                                            std::int32_t slot) {
  return rows + static_cast<std::size_t>(slot) * row_floats;
}

// KeyDiff's score of one row u (heads pieces of head_dim): see score_rows below. Eight partial
// sums per head, lane l taking d = l, l + 8, ..., so that a row's products go eight at a time at
// any vector width (one AVX-512 register, two AVX2, four SSE2) with the same bits.
KVEVICT_ROW_PASS_INLINE float score_row(const float* KVEVICT_RESTRICT u, int heads, int head_dim,
                                        const double* KVEVICT_RESTRICT anchor,
                                        const double* KVEVICT_RESTRICT inverse_norms) {
  constexpr int kLanes = 8;
  double total = 0.0;
  for (int h = 0; h < heads; ++h) {
    const float* piece = u + static_cast<std::size_t>(h) * static_cast<std::size_t>(head_dim);
    const double* a = anchor + static_cast<std::size_t>(h) * static_cast<std::size_t>(head_dim);
    double lane[kLanes] = {};
    int d = 0;
    for (; d + kLanes <= head_dim; d += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const double product = static_cast<double>(piece[d + l]) * a[d + l];  // rounded first
        lane[l] += product;
      }
    }
    for (int l = 0; d + l < head_dim; ++l) {
      const double product = static_cast<double>(piece[d + l]) * a[d + l];
      lane[l] += product;
    }
    const double dot =
        ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    const double weighted = dot * inverse_norms[h];
    total += weighted;
  }
  return static_cast<float>(-total / heads);
}

KVEVICT_ROW_PASS_INLINE void score_rows(const float* rows, std::size_t row_floats,
                                        const std::int32_t* slots, int count, int heads,
                                        int head_dim, const double* anchor,
                                        const double* inverse_norms, float* scores) {
  for (int k = 0; k < count; ++k) {
    if (k + kAheadRows < count) {
      prefetch_lines(row_at(rows, row_floats, slots[k + kAheadRows]), row_floats * sizeof(float),
                     /*for_write=*/false);
    }
    scores[slots[k]] =
        score_row(row_at(rows, row_floats, slots[k]), heads, head_dim, anchor, inverse_norms);
  }
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
KVEVICT_TARGET_AVX512 inline bool add_rows_avx512(const float* const* rows, int count,
                                                  std::size_t n, float weight, const float* from,
                                                  float* to) {
  return add_rows(rows, count, n, weight, from, to);
}
KVEVICT_TARGET_AVX2 inline bool add_rows_avx2(const float* const* rows, int count, std::size_t n,
                                              float weight, const float* from, float* to) {
  return add_rows(rows, count, n, weight, from, to);
}
KVEVICT_TARGET_AVX512 inline void rotate_half_split_avx512(float* first, float* second, int pairs,
                                                           const double* cos, const double* sin) {
  rotate_half_split(first, second, pairs, cos, sin);
}
KVEVICT_TARGET_AVX2 inline void rotate_half_split_avx2(float* first, float* second, int pairs,
                                                       const double* cos, const double* sin) {
  rotate_half_split(first, second, pairs, cos, sin);
}
KVEVICT_TARGET_AVX512 inline void rotate_interleaved_avx512(float* row, int pairs,
                                                            const double* cos, const double* sin) {
  rotate_interleaved(row, pairs, cos, sin);
}
KVEVICT_TARGET_AVX2 inline void rotate_interleaved_avx2(float* row, int pairs, const double* cos,
                                                        const double* sin) {
  rotate_interleaved(row, pairs, cos, sin);
}
KVEVICT_TARGET_AVX512 inline void score_rows_avx512(const float* rows, std::size_t row_floats,
                                                    const std::int32_t* slots, int count, int heads,
                                                    int head_dim, const double* anchor,
                                                    const double* inverse_norms, float* scores) {
  score_rows(rows, row_floats, slots, count, heads, head_dim, anchor, inverse_norms, scores);
}
KVEVICT_TARGET_AVX2 inline void score_rows_avx2(const float* rows, std::size_t row_floats,
                                                const std::int32_t* slots, int count, int heads,
                                                int head_dim, const double* anchor,
                                                const double* inverse_norms, float* scores) {
  score_rows(rows, row_floats, slots, count, heads, head_dim, anchor, inverse_norms, scores);
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
// lowest_of with 16 lanes: vminps(score, lowest) is `score < lowest ? score : lowest`, the scalar
// loop's step (a NaN keeps the lane's lowest); then the lowest of the lanes. (The masked form:
// GCC 12's _mm512_min_ps trips -Wmaybe-uninitialized.)
KVEVICT_TARGET_AVX512 inline Lowest lowest_of_avx512(const float* scores, int n) {
  const __m512 infinity = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 lowest = infinity;
  __mmask16 nan = 0;
  for (int i = 0; i < n; i += 16) {
    const __m512 score = _mm512_mask_loadu_ps(infinity, lanes_before(i, n), scores + i);
    nan |= _mm512_cmp_ps_mask(score, score, _CMP_UNORD_Q);
    lowest = _mm512_mask_min_ps(lowest, __mmask16{0xffff}, score, lowest);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, lowest);
  float value = lanes[0];
  for (int lane = 1; lane < 16; ++lane) value = lanes[lane] < value ? lanes[lane] : value;
  return {value, nan != 0};
}
KVEVICT_TARGET_AVX512 inline int first_equal_avx512(const float* scores, int from, int n,
                                                    float value) {
  const __m512 wanted = _mm512_set1_ps(value);
  for (int i = from; i < n; i += 16) {
    const __mmask16 lanes = lanes_before(i, n);
    const __mmask16 equal = _mm512_mask_cmp_ps_mask(lanes, _mm512_maskz_loadu_ps(lanes, scores + i),
                                                    wanted, _CMP_EQ_OQ);
    if (equal != 0) return i + std::countr_zero(static_cast<unsigned>(equal));
  }
  return n;
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
KVEVICT_TARGET_AVX512 inline int first_other_avx512(const std::int32_t* values, int from, int last,
                                                    std::int32_t value) {
  // The ids come from memory at every step (a model's weights pass through the caches between
  // two), and a stream prefetcher stops at each 4 KiB page: each line asks for the one a page on.
  constexpr int kAhead = 1024;
  const __m512i same = _mm512_set1_epi32(value);
  for (int i = from; i < last; i += 16) {
    if (last - i > kAhead) __builtin_prefetch(values + i + kAhead);
    const __mmask16 lanes = lanes_before(i, last);
    const __mmask16 other =
        _mm512_mask_cmpneq_epi32_mask(lanes, _mm512_maskz_loadu_epi32(lanes, values + i), same);
    if (other != 0) return i + std::countr_zero(static_cast<unsigned>(other));
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

/// to[s] = from[s] + weight * rows[0][s] + ... + weight * rows[count - 1][s] for s in [0, n),
/// count in [1, 4], the rows added in that order (each product rounded, then the sum: the same bits
/// at every width); in place when from == to, from zeros when from is null. Returns false if a row
/// held a value that is not an attention probability (is_probability); `to` is then not
/// meaningful. The rows must not overlap `to`, nor `from` (unless equal to it) overlap `to`.
[[nodiscard]] inline bool add_rows(const float* const* rows, int count, std::size_t n, float weight,
                                   const float* from, float* to) {
#if KVEVICT_ROW_PASS_DISPATCH
  switch (row_pass::width()) {
    case row_pass::Width::avx512:
      return row_pass::add_rows_avx512(rows, count, n, weight, from, to);
    case row_pass::Width::avx2:
      return row_pass::add_rows_avx2(rows, count, n, weight, from, to);
    case row_pass::Width::baseline:
      break;
  }
#endif
  return row_pass::add_rows(rows, count, n, weight, from, to);
}

/// Rotates the f32 pairs (first[i], second[i]), i in [0, pairs), by the angles of cos[i] and
/// sin[i] (Rope's half_split layout), in double, rounded once: the same bits at every width.
inline void rotate_half_split(float* first, float* second, int pairs, const double* cos,
                              const double* sin) {
#if KVEVICT_ROW_PASS_DISPATCH
  switch (row_pass::width()) {
    case row_pass::Width::avx512:
      return row_pass::rotate_half_split_avx512(first, second, pairs, cos, sin);
    case row_pass::Width::avx2:
      return row_pass::rotate_half_split_avx2(first, second, pairs, cos, sin);
    case row_pass::Width::baseline:
      break;
  }
#endif
  row_pass::rotate_half_split(first, second, pairs, cos, sin);
}

/// The same for the pairs (row[2i], row[2i + 1]) (Rope's interleaved layout).
inline void rotate_interleaved(float* row, int pairs, const double* cos, const double* sin) {
#if KVEVICT_ROW_PASS_DISPATCH
  switch (row_pass::width()) {
    case row_pass::Width::avx512:
      return row_pass::rotate_interleaved_avx512(row, pairs, cos, sin);
    case row_pass::Width::avx2:
      return row_pass::rotate_interleaved_avx2(row, pairs, cos, sin);
    case row_pass::Width::baseline:
      break;
  }
#endif
  row_pass::rotate_interleaved(row, pairs, cos, sin);
}

/// KeyDiff's scores of the slots slots[0, count): for slot s with row u (heads pieces of head_dim
/// floats), scores[s] = float(-(dot_0 * inverse_norms[0] + dot_1 * inverse_norms[1] + ...) /
/// heads), where dot_h, the product of u's piece h with anchor[h * head_dim, (h + 1) * head_dim),
/// is summed in eight lanes: lane l = sum over d = l, l + 8, ... in order of
/// double(u[h * head_dim + d]) * anchor[h * head_dim + d], each product rounded before it is added
/// (never fused); dot_h = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). The same bits at every
/// width, for any list of slots.
inline void score_rows(const float* rows, std::size_t row_floats, const std::int32_t* slots,
                       int count, int heads, int head_dim, const double* anchor,
                       const double* inverse_norms, float* scores) {
#if KVEVICT_ROW_PASS_DISPATCH
  switch (row_pass::width()) {
    case row_pass::Width::avx512:
      return row_pass::score_rows_avx512(rows, row_floats, slots, count, heads, head_dim, anchor,
                                         inverse_norms, scores);
    case row_pass::Width::avx2:
      return row_pass::score_rows_avx2(rows, row_floats, slots, count, heads, head_dim, anchor,
                                       inverse_norms, scores);
    case row_pass::Width::baseline:
      break;
  }
#endif
  row_pass::score_rows(rows, row_floats, slots, count, heads, head_dim, anchor, inverse_norms,
                       scores);
}

/// Reads [data, data + bytes) one cache line at a time in address order, and nothing else. A
/// selection gathers a unit's scores through its stream order, and at the start of a decision
/// both arrays are usually out of cache (the forward's weights and K/V streamed through since the
/// last one): read in order, the hardware prefetcher streams them in, where the gathers would
/// wait on their lines one after another. Changes no value.
inline void stream_into_cache(const void* data, std::size_t bytes) {
  constexpr std::size_t kLine = 64;
  const auto* bytes_of = static_cast<const unsigned char*>(data);
  std::uint32_t sum = 0;
  for (std::size_t at = 0; at < bytes; at += kLine) sum += bytes_of[at];
#if defined(__GNUC__) || defined(__clang__)
  asm volatile("" : : "r"(sum));  // the reads are all this does: keep them
#else
  static_cast<void>(*static_cast<volatile std::uint32_t*>(&sum));
#endif
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

/// The lowest of scores[0, n), NaN skipped, and whether one was NaN.
[[nodiscard]] inline row_pass::Lowest lowest_of(const float* scores, int n) {
#if KVEVICT_ROW_PASS_DISPATCH
  if (row_pass::width() == row_pass::Width::avx512) return row_pass::lowest_of_avx512(scores, n);
#endif
  return row_pass::lowest_of(scores, n);
}

/// The first index i in [from, n) with scores[i] == value, or n.
[[nodiscard]] inline int first_equal(const float* scores, int from, int n, float value) {
#if KVEVICT_ROW_PASS_DISPATCH
  if (row_pass::width() == row_pass::Width::avx512) {
    return row_pass::first_equal_avx512(scores, from, n, value);
  }
#endif
  return row_pass::first_equal(scores, from, n, value);
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

/// The first index i in [from, last) with values[i] != value, or `last`.
[[nodiscard]] inline int first_other(const std::int32_t* values, int from, int last,
                                     std::int32_t value) {
#if KVEVICT_ROW_PASS_DISPATCH
  if (row_pass::width() == row_pass::Width::avx512) {
    return row_pass::first_other_avx512(values, from, last, value);
  }
#endif
  return row_pass::first_other(values, from, last, value);
}

}  // namespace kvevict::detail
