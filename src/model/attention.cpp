#include "attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

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

void attend(const HeadAttention& head, QueryAngles& angles,
            Eigen::Ref<AttentionMatrix> probabilities, float* out, std::ptrdiff_t out_stride,
            AttentionMatrix& rotated) {
  const auto n = static_cast<Eigen::Index>(head.query_positions.size());
  const Eigen::Index head_dim = head.head_dim;
  const Eigen::Map<const AttentionMatrix> keys(head.keys, head.slot_limit, head_dim);
  const Eigen::Map<const AttentionMatrix> values(head.values, head.slot_limit, head_dim);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (rotated.rows() < n || rotated.cols() != head_dim) rotated.resize(n, head_dim);

  // Scores q . k of every query and live slot, the query rotated once per run.   // [n, limit]
  probabilities.setConstant(-std::numeric_limits<float>::infinity());
  for (const KeyRun& run : head.runs) {
    for (Eigen::Index i = 0; i < n; ++i) {
      rotated.row(i) =
          Eigen::Map<const Eigen::RowVectorXf>(head.queries + i * head.query_stride, head_dim);
      angles.rope().rotate_with(
          rotated.row(i).data(),
          angles.get(head.query_positions[static_cast<std::size_t>(i)] - run.rotation));
    }
    probabilities.middleCols(run.begin, run.end - run.begin).noalias() =
        rotated.topRows(n) * keys.middleRows(run.begin, run.end - run.begin).transpose();
  }
  // Softmax of (q . k) / sqrt(head_dim) over each row's live, visible slots.
  for (Eigen::Index i = 0; i < n; ++i) {
    auto row = probabilities.row(i);
    // Causal mask inside the chunk: query i does not see the tokens after it.
    for (std::size_t j = static_cast<std::size_t>(i) + 1; j < head.query_slots.size(); ++j) {
      row(head.query_slots[j]) = -std::numeric_limits<float>::infinity();
    }
    const float max = row.maxCoeff();
    row = ((row.array() - max) * scale).exp().matrix();
    // Exact zeros where the score was -inf (a vectorised exp may leave a denormal there): the
    // free slots between runs and the masked chunk tokens.
    int next = 0;
    for (const KeyRun& run : head.runs) {
      row.segment(next, run.begin - next).setZero();
      next = run.end;
    }
    row.tail(head.slot_limit - next).setZero();
    for (std::size_t j = static_cast<std::size_t>(i) + 1; j < head.query_slots.size(); ++j) {
      row(head.query_slots[j]) = 0.0f;
    }
    row /= row.sum();
  }
  // Weighted sum of the values.                                                   // [n, head_dim]
  Eigen::Map<AttentionMatrix, 0, Eigen::OuterStride<>>(out, n, head_dim,
                                                       Eigen::OuterStride<>(out_stride))
      .noalias() = probabilities * values;
}

}  // namespace kvevict::model
