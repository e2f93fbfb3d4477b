#include "attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "kernels/kernels.hpp"
#include "kernels/kv_kernels.hpp"

namespace kvevict::model {

const double* QueryAngles::get(std::int64_t steps) {
  const int pairs = rope_->pairs();
  scratch_.resize(2 * static_cast<std::size_t>(pairs));
  const double* angles = rope_->angles(steps, scratch_.data());
  if (angles != scratch_.data()) return angles;  // from the rope's table: nothing to keep
  // Computed: keep it for the other heads and layers of this forward.
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    if (steps_[i] == steps) return values_.data() + i * 2 * static_cast<std::size_t>(pairs);
  }
  steps_.push_back(steps);
  values_.insert(values_.end(), scratch_.begin(), scratch_.end());
  return values_.data() + (steps_.size() - 1) * 2 * static_cast<std::size_t>(pairs);
}

void attend(const GroupAttention& group, QueryAngles& angles, float* probabilities, float* out,
            std::ptrdiff_t out_stride, AttentionBuffers& buffers) {
  const auto n = static_cast<std::int64_t>(group.query_positions.size());
  const std::int64_t rows = group.heads * n;  // the group's stacked queries
  const std::int64_t head_dim = group.head_dim;
  const std::int64_t limit = group.slot_limit;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const bool interleaved = angles.rope().config().layout == RopeLayout::interleaved;
  const int pairs = angles.rope().pairs();
  buffers.rotated.resize(static_cast<std::size_t>(rows * head_dim));
  buffers.output.assign(static_cast<std::size_t>(rows * head_dim), 0.0f);
  float* rotated = buffers.rotated.data();  // [heads * n, head_dim]
  const auto row_of = [&](std::int64_t r) { return probabilities + r * limit; };

  // Scores q . k of every stacked query and live slot, the queries rotated once per run. // [rows,
  // limit]
  for (const KeyRun& run : group.runs) {
    for (std::int64_t i = 0; i < n; ++i) {
      const double* cos_sin =
          angles.get(group.query_positions[static_cast<std::size_t>(i)] - run.rotation);
      for (int h = 0; h < group.heads; ++h) {
        float* target = rotated + (h * n + i) * head_dim;
        std::copy_n(group.queries + i * group.query_stride + h * head_dim, head_dim, target);
        kernels::rotate(target, head_dim, 1, cos_sin, pairs, interleaved);
      }
    }
    kernels::stored_scores(rotated, head_dim, rows, group.keys, run.begin, run.end - run.begin,
                           head_dim, row_of(0) + run.begin, limit);
  }
  // Softmax of (q . k) / sqrt(head_dim) over each row's live, visible slots.
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = row_of(r);
    const auto i = static_cast<std::size_t>(r % n);
    // Causal mask inside the chunk: query i does not see the tokens after it.
    for (std::size_t j = i + 1; j < group.query_slots.size(); ++j)
      row[group.query_slots[j]] = kMasked;
    float max = kMasked;
    for (const KeyRun& run : group.runs) {
      max = std::max(max, kernels::max(row + run.begin, run.end - run.begin));
    }
    for (const KeyRun& run : group.runs) {
      kernels::exp_shifted(row + run.begin, run.end - run.begin, max, scale);
    }
    // Exact zeros at the free slots between runs and at the masked chunk tokens.
    int next = 0;
    for (const KeyRun& run : group.runs) {
      std::fill(row + next, row + run.begin, 0.0f);
      next = run.end;
    }
    std::fill(row + next, row + limit, 0.0f);
    for (std::size_t j = i + 1; j < group.query_slots.size(); ++j) row[group.query_slots[j]] = 0.0f;
    float total = 0.0f;
    for (const KeyRun& run : group.runs)
      total += kernels::sum(row + run.begin, run.end - run.begin);
    kernels::scale(row, limit, 1.0f / total);
  }
  // Weighted sum of the values, each V row read once for the group.              // [rows,
  // head_dim]
  for (const KeyRun& run : group.runs) {
    kernels::add_weighted_stored_rows(row_of(0) + run.begin, limit, rows, group.values, run.begin,
                                      run.end - run.begin, head_dim, buffers.output.data(),
                                      head_dim);
  }
  for (int h = 0; h < group.heads; ++h) {
    for (std::int64_t i = 0; i < n; ++i) {
      std::copy_n(buffers.output.data() + (h * n + i) * head_dim, head_dim,
                  out + i * out_stride + h * head_dim);
    }
  }
}

}  // namespace kvevict::model
