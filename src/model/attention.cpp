#include "attention.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <kvevict/detail/row_passes.hpp>
#include <limits>
#include <span>

#include "kernels/kernels.hpp"
#include "kernels/kv_kernels.hpp"

namespace kvevict::model {

namespace {
// Rotated queries kept in one attend(): 256 KiB, a decode step's queries under hundreds of
// rotations.
constexpr std::int64_t kKeptQueryFloats = std::int64_t{1} << 16;
}  // namespace

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

void attend(const GroupAttention& group, QueryAngles& angles, float* probabilities,
            std::ptrdiff_t probability_stride, float* out, std::ptrdiff_t out_stride,
            AttentionBuffers& buffers) {
  const auto n = static_cast<std::int64_t>(group.query_positions.size());
  const std::int64_t rows = group.heads * n;  // the group's stacked queries
  const std::int64_t head_dim = group.head_dim;
  const std::int64_t limit = group.slot_limit;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const bool interleaved = angles.rope().config().layout == RopeLayout::interleaved;
  const int pairs = angles.rope().pairs();
  buffers.output.assign(static_cast<std::size_t>(rows * head_dim), 0.0f);
  const std::ptrdiff_t stride = probability_stride;
  const auto row_of = [&](std::int64_t r) { return probabilities + r * stride; };

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

  // Scores q . k of every stacked query and live slot, in slot order (the keys stream from
  // memory), the queries rotated once per pending rotation: under cache_index a unit holds a few
  // rotations (max_pending_rotations + 1) over many more runs, since freed slots are refilled by
  // newer tokens. Rotated blocks are kept up to kKeptQueryFloats; past that (a long chunk over many
  // rotations) the last block is rotated again for each run that needs it.
  // [rows, limit] at `stride`
  const std::int64_t block = rows * head_dim;
  const auto max_blocks =
      static_cast<std::size_t>(std::max<std::int64_t>(1, kKeptQueryFloats / block));
  // The group's queries rotated to p - rotation into `target`: [heads * n, head_dim].
  const auto rotate_queries = [&](std::int64_t rotation, float* target) {
    for (std::int64_t i = 0; i < n; ++i) {
      for (int h = 0; h < group.heads; ++h) {
        std::copy_n(group.queries + i * group.query_stride + h * head_dim, head_dim,
                    target + (h * n + i) * head_dim);
      }
      // Query i of every head: rows n * head_dim apart.
      kernels::rotate(target + i * head_dim, n * head_dim, group.heads,
                      angles.get(group.query_positions[static_cast<std::size_t>(i)] - rotation),
                      pairs, interleaved);
    }
  };
  std::vector<std::int64_t>& kept = buffers.rotations;
  kept.clear();
  // Room for every block kept, so that the queries' addresses stay valid as blocks are added.
  buffers.rotated.reserve(max_blocks * static_cast<std::size_t>(block));
  // The block of each rotation met, direct-mapped by its low bits in front of the search of `kept`:
  // under cache_index the runs take turns among their rotations, one lookup per run.
  constexpr std::size_t kRecent = 64;
  struct Recent {
    std::int64_t rotation = 0;
    const float* queries = nullptr;  // none
  };
  std::array<Recent, kRecent> recent{};
  // The group's queries rotated by `rotation`, kept in a block of buffers.rotated; nullptr when
  // every block is in use by another rotation and `reuse` is false (with it, the last block is
  // rotated again and its old rotation forgotten).
  const auto rotated_by = [&](std::int64_t rotation, bool reuse) -> const float* {
    Recent& entry = recent[static_cast<std::uint64_t>(rotation) % kRecent];
    if (entry.queries != nullptr && entry.rotation == rotation) return entry.queries;
    const auto found = std::find(kept.begin(), kept.end(), rotation);
    auto at = static_cast<std::int64_t>(found - kept.begin());
    if (found == kept.end()) {
      if (kept.size() < max_blocks) {
        kept.push_back(rotation);
        buffers.rotated.resize(kept.size() * static_cast<std::size_t>(block));
      } else if (!reuse) {
        return nullptr;
      } else {
        recent.fill(Recent{});
      }
      at = static_cast<std::int64_t>(kept.size()) - 1;
      kept[static_cast<std::size_t>(at)] = rotation;
      rotate_queries(rotation, buffers.rotated.data() + at * block);
    }
    entry = {rotation, buffers.rotated.data() + at * block};
    return entry.queries;
  };
  // One pass over the runs: the live ranges (runs that touch, merged whatever their rotations;
  // p.V and the softmax's gaps read them) and, for whole rows (no causal blocks), each run's end
  // and queries, so that q.K takes a range in one call (`stored_scores_by_run`: the bits of a call
  // per run). A range's runs are query_runs[range_runs[i], range_runs[i + 1]).
  std::vector<KeyRun>& live = buffers.live;
  std::vector<kernels::QueryRun>& query_runs = buffers.query_runs;
  std::vector<std::size_t>& range_runs = buffers.range_runs;
  live.clear();
  query_runs.clear();
  range_runs.clear();
  bool by_range = !causal_blocks;
  for (const KeyRun& run : group.runs) {
    if (live.empty() || live.back().end != run.begin) {
      live.push_back({run.begin, run.end, 0});
      range_runs.push_back(query_runs.size());
    } else {
      live.back().end = run.end;
    }
    if (!by_range) continue;
    const float* queries = rotated_by(run.rotation, /*reuse=*/false);
    by_range = queries != nullptr;
    query_runs.push_back({run.end - live.back().begin, queries});
  }
  range_runs.push_back(query_runs.size());
  if (by_range) {
    for (std::size_t i = 0; i < live.size(); ++i) {
      const KeyRun& range = live[i];
      const std::span<const kernels::QueryRun> runs(query_runs.data() + range_runs[i],
                                                    range_runs[i + 1] - range_runs[i]);
      if (runs.size() == 1) {
        kernels::stored_scores(runs[0].x, head_dim, rows, group.keys, range.begin,
                               range.end - range.begin, head_dim, row_of(0) + range.begin, stride);
      } else {
        kernels::stored_scores_by_run(runs, head_dim, rows, group.keys, range.begin,
                                      range.end - range.begin, head_dim, row_of(0) + range.begin,
                                      stride);
      }
    }
  } else {
    for (const KeyRun& run : group.runs) {
      const float* rotated = rotated_by(run.rotation, /*reuse=*/true);
      for_each_visible(
          run, [&](std::int64_t r0, std::int64_t count, std::int64_t begin, std::int64_t end) {
            kernels::stored_scores(rotated + r0 * head_dim, head_dim, count, group.keys, begin,
                                   end - begin, head_dim, row_of(r0) + begin, stride);
          });
    }
  }
  // Softmax of (q . k) / sqrt(head_dim) over each row's live, visible slots.
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  // The slots of the chunk's tokens after query i get -inf.
  const auto mask_later = [&](float* row, std::size_t i) {
    if (consecutive) {
      std::fill(row + first + static_cast<std::int64_t>(i) + 1, row + first + n, kMasked);
      return;
    }
    for (std::size_t j = i + 1; j < slots.size(); ++j) row[slots[j]] = kMasked;
  };
  // Over the whole row at once, the free slots between runs (and masked chunk tokens) at -inf: exp
  // makes them exact zeros, and a probability does not depend on how the live slots fall into runs.
  // The free slots, as ranges [begin, end): found once for all rows (runs outnumber them).
  std::vector<KeyRun>& gaps = buffers.gaps;
  gaps.clear();
  int next = 0;
  for (const KeyRun& range : live) {
    if (next < range.begin) gaps.push_back({next, range.begin, 0});
    next = range.end;
  }
  if (next < limit) gaps.push_back({next, static_cast<int>(limit), 0});
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = row_of(r);
    const auto i = static_cast<std::size_t>(r % n);
    for (const KeyRun& gap : gaps) std::fill(row + gap.begin, row + gap.end, kMasked);
    // Causal mask inside the chunk: query i does not see the tokens after it.
    mask_later(row, i);
    kernels::exp_shifted(row, limit, kernels::max(row, limit), scale);
    kernels::scale(row, limit, 1.0f / kernels::sum(row, limit));
  }
  // Weighted sum of the values, each V row read once for the group.        // [rows, head_dim]
  // With columns to warm, P V runs in pieces of kWarmPiece slots and asks for each piece's lines of
  // the columns (2 KiB each) before reading its values (36-128 KiB: Q8_0 to f32 at head_dim 64):
  // the columns come from memory, since a step's weights and K/V pass through every cache between
  // two of their reads. P V adds its terms into the output in slot order, so the pieces give the
  // bits of one call; for the same reason it runs over the live ranges, not the runs (values are
  // not rotated).
  constexpr std::int64_t kWarmPiece = 512;
  const std::int64_t piece = group.warm_columns.empty() ? limit : kWarmPiece;
  for (const KeyRun& range : live) {
    for_each_visible(
        range, [&](std::int64_t r0, std::int64_t count, std::int64_t begin, std::int64_t end) {
          for (std::int64_t b = begin; b < end; b += piece) {
            const std::int64_t e = std::min(end, b + piece);
            for (const float* column : group.warm_columns) {
              kvevict::detail::row_pass::prefetch_lines(
                  column + b, sizeof(float) * static_cast<std::size_t>(e - b),
                  /*for_write=*/true);
            }
            kernels::add_weighted_stored_rows(row_of(r0) + b, stride, count, group.values, b, e - b,
                                              head_dim, buffers.output.data() + r0 * head_dim,
                                              head_dim);
          }
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
