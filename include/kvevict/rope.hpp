// Rotary position embedding (RoPE): rotate keys to a position, re-rotate them by a delta.
//
// RoPE rotates each pair of dimensions (x_a, x_b) of a query or key by the angle p * f_i, where p
// is the token's position and f_i = theta^(-2i / rotary_dim). Rotations compose, R(a) R(b) = R(a +
// b), and R(-p) inverts R(p), so a key stored after RoPE at position `old` moves to position `new`
// by one rotation with the delta `new - old`; nothing has to be recomputed from the pre-RoPE key.
//
// Precision: angles are formed in double from integer positions (never accumulated), the rotation
// is done in double and rounded once to the storage type. A re-rotated key therefore carries at
// most one extra rounding per re-rotation; see docs/design.md for why the number of re-rotations
// per key is bounded in every position mode kvevict offers.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/detail/row_passes.hpp"
#include "kvevict/error.hpp"

namespace kvevict {

/// Which dimensions form a rotated pair.
enum class RopeLayout {
  /// Pairs (i, i + rotary_dim / 2): Hugging Face Llama, GPT-NeoX ("rotate_half").
  half_split,
  /// Pairs (2i, 2i + 1): GPT-J, Meta's original Llama code, llama.cpp's GGUF tensors.
  interleaved,
};

struct RopeConfig {
  int head_dim = 0;
  /// Leading dimensions that are rotated; 0 means all of head_dim. Must be even.
  int rotary_dim = 0;
  double theta = 10000.0;
  RopeLayout layout = RopeLayout::half_split;
  /// Positions [0, table_positions) use a precomputed cos/sin table (double); others are computed
  /// on the fly. Pure speed knob: results are identical either way.
  int table_positions = 0;
};

class Rope {
 public:
  Rope() = default;

  explicit Rope(const RopeConfig& config) : config_(config) {
    KVEVICT_REQUIRE(config.head_dim > 0,
                    "RoPE: head_dim must be positive, got " + std::to_string(config.head_dim));
    if (config_.rotary_dim == 0) config_.rotary_dim = config_.head_dim;
    KVEVICT_REQUIRE(config_.rotary_dim > 0 && config_.rotary_dim % 2 == 0,
                    "RoPE: rotary_dim must be a positive even number, got " +
                        std::to_string(config_.rotary_dim));
    KVEVICT_REQUIRE(config_.rotary_dim <= config_.head_dim,
                    "RoPE: rotary_dim (" + std::to_string(config_.rotary_dim) +
                        ") exceeds head_dim (" + std::to_string(config_.head_dim) + ")");
    KVEVICT_REQUIRE(std::isfinite(config_.theta) && config_.theta > 1.0,
                    "RoPE: theta must be finite and > 1, got " + std::to_string(config_.theta));
    KVEVICT_REQUIRE(config_.table_positions >= 0, "RoPE: table_positions must be >= 0");
    const int pairs = config_.rotary_dim / 2;
    inverse_frequency_.resize(static_cast<std::size_t>(pairs));
    for (int i = 0; i < pairs; ++i) {
      inverse_frequency_[static_cast<std::size_t>(i)] =
          std::pow(config_.theta, -2.0 * i / static_cast<double>(config_.rotary_dim));
    }
    table_.resize(static_cast<std::size_t>(config_.table_positions) * pairs * 2);
    for (int p = 0; p < config_.table_positions; ++p) {
      fill_cos_sin(p, table_.data() + static_cast<std::size_t>(p) * pairs * 2);
    }
  }

  [[nodiscard]] const RopeConfig& config() const { return config_; }
  [[nodiscard]] int head_dim() const { return config_.head_dim; }
  [[nodiscard]] int rotary_dim() const { return config_.rotary_dim; }
  [[nodiscard]] int pairs() const { return config_.rotary_dim / 2; }

  /// Rotates one row of head_dim values by `steps` positions: to position `steps` if the row is
  /// unrotated, or by a delta if it was already rotated. Negative steps rotate backwards.
  template <class Scalar>
  void rotate(Scalar* row, std::int64_t steps) const {
    thread_local std::vector<double> scratch;
    scratch.resize(static_cast<std::size_t>(pairs()) * 2);
    rotate_with(row, angles(steps, scratch.data()));
  }

  /// The rotation by `steps` as [cos x pairs, sin x pairs]: from the table when it covers |steps|,
  /// else computed into `scratch` (2 * pairs() doubles). Reuse it for many rows (rotate_with).
  [[nodiscard]] const double* angles(std::int64_t steps, double* scratch) const {
    return cos_sin_for(steps, scratch);
  }
  /// Rotates one row by the rotation `cos_sin` (from angles()).
  template <class Scalar>
  void rotate_with(Scalar* row, const double* cos_sin) const {
    apply(row, cos_sin, cos_sin + pairs());
  }

  /// Rotates row r of a row-major block (row r starts at data + r * row_stride) by steps[r].
  /// Consecutive rows with equal steps share one cos/sin evaluation (the common case when a
  /// compaction shifts a run of keys by the same delta).
  template <class Scalar>
  void rotate_rows(Scalar* data, std::ptrdiff_t row_stride,
                   std::span<const std::int64_t> steps) const {
    thread_local std::vector<double> scratch;
    scratch.resize(static_cast<std::size_t>(pairs()) * 2);
    const double* cos_sin = nullptr;
    std::int64_t current_steps = 0;
    for (std::size_t r = 0; r < steps.size(); ++r) {
      if (steps[r] == 0) continue;  // R(0) is the identity: skip, and add no rounding.
      if (cos_sin == nullptr || steps[r] != current_steps) {
        cos_sin = cos_sin_for(steps[r], scratch.data());
        current_steps = steps[r];
      }
      apply(data + static_cast<std::ptrdiff_t>(r) * row_stride, cos_sin, cos_sin + pairs());
    }
  }

 private:
  // [cos_0 .. cos_{pairs-1}, sin_0 .. sin_{pairs-1}] for `steps`, written to `out`.
  void fill_cos_sin(std::int64_t steps, double* out) const {
    const int n = pairs();
    for (int i = 0; i < n; ++i) {
      const double angle =
          static_cast<double>(steps) * inverse_frequency_[static_cast<std::size_t>(i)];
      out[i] = std::cos(angle);
      out[n + i] = std::sin(angle);
    }
  }

  // cos/sin block for `steps`: from the table when it covers |steps| (negative steps negate the
  // sines), else computed into `scratch` (2 * pairs doubles).
  const double* cos_sin_for(std::int64_t steps, double* scratch) const {
    const int n = pairs();
    const std::int64_t magnitude = steps < 0 ? -steps : steps;
    if (magnitude < config_.table_positions) {
      const double* entry = table_.data() + static_cast<std::size_t>(magnitude) * n * 2;
      if (steps >= 0) return entry;
      for (int i = 0; i < n; ++i) {
        scratch[i] = entry[i];
        scratch[n + i] = -entry[n + i];
      }
      return scratch;
    }
    fill_cos_sin(steps, scratch);
    return scratch;
  }

  // The rotation computed in double, rounded once to Scalar. f32 rows (stored keys, queries) take
  // the passes compiled at the CPU's vector width (detail/row_passes.hpp): the same bits at every
  // width.
  template <class Scalar>
  void apply(Scalar* row, const double* cos, const double* sin) const {
    const int half = pairs();
    if constexpr (std::is_same_v<Scalar, float>) {
      if (config_.layout == RopeLayout::half_split) {
        detail::rotate_half_split(row, row + half, half, cos, sin);
      } else {
        detail::rotate_interleaved(row, half, cos, sin);
      }
    } else if (config_.layout == RopeLayout::half_split) {
      Scalar* first = row;
      Scalar* second = row + half;
      for (int i = 0; i < half; ++i) {
        const double a = static_cast<double>(first[i]);
        const double b = static_cast<double>(second[i]);
        first[i] = static_cast<Scalar>(a * cos[i] - b * sin[i]);
        second[i] = static_cast<Scalar>(b * cos[i] + a * sin[i]);
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const double a = static_cast<double>(row[2 * i]);
        const double b = static_cast<double>(row[2 * i + 1]);
        row[2 * i] = static_cast<Scalar>(a * cos[i] - b * sin[i]);
        row[2 * i + 1] = static_cast<Scalar>(b * cos[i] + a * sin[i]);
      }
    }
  }

  RopeConfig config_{};
  std::vector<double> inverse_frequency_;
  std::vector<double> table_;  // [table_positions][cos x pairs, sin x pairs]
};

}  // namespace kvevict
