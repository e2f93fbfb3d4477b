#include "attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

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

  // The chunk's own slots, when they are consecutive (a prefill into free slots, the usual case):
  // query i cannot see slots [first + i + 1, first + n), so a block of queries [i0, i1) skips
  // [first + i1, first + n) in q.K and in P V, about half of a long chunk's products. The skipped
  // probabilities are exact zeros, so the results are bit for bit those of whole rows (a score does
  // not depend on which keys are computed with it, and P V adds its terms in slot order either
  // way). A decode step's or a short chunk's queries stay stacked in one product.
  const std::span<const std::int32_t> slots = group.query_slots;
  bool consecutive = !slots.empty();
  for (std::size_t j = 1; consecutive && j < slots.size(); ++j) {
    consecutive = slots[j] == slots[0] + static_cast<std::int32_t>(j);
  }
  const std::int64_t first = consecutive ? slots[0] : 0;
  constexpr std::int64_t kQueryBlock = 32;
  const bool causal_blocks = group.skip_masked && consecutive && n > kQueryBlock;
  // f(r0, rows, begin, end): the stacked rows [r0, r0 + rows) against the slots [begin, end) of
  // `run` they can see (all of them without causal_blocks).
  const auto for_each_visible = [&](const KeyRun& run, auto&& f) {
    if (!causal_blocks)
      return f(std::int64_t{0}, rows, std::int64_t{run.begin}, std::int64_t{run.end});
    for (int h = 0; h < group.heads; ++h) {
      for (std::int64_t i0 = 0; i0 < n; i0 += kQueryBlock) {
        const std::int64_t i1 = std::min(n, i0 + kQueryBlock);
        // [run.begin, run.end) minus [first + i1, first + n)
        const std::int64_t before_end = std::min<std::int64_t>(run.end, first + i1);
        if (run.begin < before_end) f(h * n + i0, i1 - i0, std::int64_t{run.begin}, before_end);
        const std::int64_t after_begin = std::max<std::int64_t>(run.begin, first + n);
        if (after_begin < run.end) f(h * n + i0, i1 - i0, after_begin, std::int64_t{run.end});
      }
    }
  };

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
    for_each_visible(
        run, [&](std::int64_t r0, std::int64_t count, std::int64_t begin, std::int64_t end) {
          kernels::stored_scores(rotated + r0 * head_dim, head_dim, count, group.keys, begin,
                                 end - begin, head_dim, row_of(r0) + begin, limit);
        });
  }
  // Softmax of (q . k) / sqrt(head_dim) over each row's live, visible slots.
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  // The slots of the chunk's tokens after query i get `value`.
  const auto mask_later = [&](float* row, std::size_t i, float value) {
    if (consecutive) {
      std::fill(row + first + static_cast<std::int64_t>(i) + 1, row + first + n, value);
      return;
    }
    for (std::size_t j = i + 1; j < slots.size(); ++j) row[slots[j]] = value;
  };
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = row_of(r);
    const auto i = static_cast<std::size_t>(r % n);
    // Causal mask inside the chunk: query i does not see the tokens after it.
    mask_later(row, i, kMasked);
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
    mask_later(row, i, 0.0f);
    float total = 0.0f;
    for (const KeyRun& run : group.runs)
      total += kernels::sum(row + run.begin, run.end - run.begin);
    kernels::scale(row, limit, 1.0f / total);
  }
  // Weighted sum of the values, each V row read once for the group.              // [rows,
  // head_dim]
  for (const KeyRun& run : group.runs) {
    for_each_visible(
        run, [&](std::int64_t r0, std::int64_t count, std::int64_t begin, std::int64_t end) {
          kernels::add_weighted_stored_rows(row_of(r0) + begin, limit, count, group.values, begin,
                                            end - begin, head_dim,
                                            buffers.output.data() + r0 * head_dim, head_dim);
        });
  }
  for (int h = 0; h < group.heads; ++h) {
    for (std::int64_t i = 0; i < n; ++i) {
      std::copy_n(buffers.output.data() + (h * n + i) * head_dim, head_dim,
                  out + i * out_stride + h * head_dim);
    }
  }
}

}  // namespace kvevict::model
