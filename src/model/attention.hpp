// Attention of the query heads of one KV head over its cached slots, the way an evicting cache lays
// them out: slots [0, slot_limit) in slot order (not stream order), free slots skipped, and keys
// carrying a pending rotation per run of slots (kvevict::SlotTable::for_each_key_run). Keys and
// values are read as the store holds them (f32, f16, bf16, Q8_0: kernels/kv_kernels.hpp); the
// softmax and RoPE are kernels (kernels/kernels.hpp).
//
// For post-RoPE keys stored rotated to key position p_k - d (d: the run's pending rotation), the
// score of a query at position p_q is (R(p_q) q) . (R(p_k) k) = (R(p_q - d) q) . (R(p_k - d) k):
// the query is rotated once per pending rotation instead of rotating every key. Pre-RoPE keys
// arrive already rotated to their positions (d = 0 for the whole range).
#pragma once

#include <cstddef>
#include <cstdint>
#include <kvevict/kv_type.hpp>
#include <kvevict/rope.hpp>
#include <span>
#include <vector>

#include "kernels/kv_kernels.hpp"

namespace kvevict::model {

/// A range [begin, end) of live slots whose keys need the same query rotation: the query of
/// position p is rotated to p - rotation.
struct KeyRun {
  int begin = 0;
  int end = 0;
  std::int64_t rotation = 0;
};

/// Rotations of queries by many positions, each cos/sin evaluated once per forward: the same
/// position recurs for every query head and layer.
class QueryAngles {
 public:
  explicit QueryAngles(const Rope& rope) : rope_(&rope) {}
  /// Forgets the angles of the last forward.
  void clear() {
    steps_.clear();
    values_.clear();
  }
  /// [cos x pairs, sin x pairs] for `steps`; valid until the next clear() or get().
  const double* get(std::int64_t steps);
  [[nodiscard]] const Rope& rope() const { return *rope_; }

 private:
  const Rope* rope_;
  std::vector<std::int64_t> steps_;  // computed steps outside the rope's table
  std::vector<double> values_;       // [steps][2 * pairs]
  std::vector<double> scratch_;
};

/// The query heads of one KV head (a GQA group) over that KV head's slots. The group's queries
/// are stacked into one [group * n, head_dim] block, row h * n + i for head h of the group and
/// query i, so that every K and V row is read once for the whole group.
struct GroupAttention {
  const float* queries = nullptr;  ///< pre-RoPE; query i of head h at queries + i * query_stride
                                   ///< + h * head_dim
  std::ptrdiff_t query_stride = 0;
  int heads = 1;                                  ///< query heads in the group
  std::span<const std::int64_t> query_positions;  ///< [n] RoPE position of query i
  /// Slot of each query's own token: query i must not see the slots of queries j > i.
  std::span<const std::int32_t> query_slots;
  StoredRows keys;    ///< rows [0, slot_limit), head_dim values each, as stored
  StoredRows values;  ///< rows [0, slot_limit), head_dim values each, as stored
  int slot_limit = 0;
  int head_dim = 0;
  std::span<const KeyRun> runs;  ///< the live slots
  /// A chunk of more than 32 queries in consecutive slots leaves out the products of each block of
  /// 32 queries with the chunk's slots after the block (masked: exact zeros either way). Tests turn
  /// it off to compare the bits.
  bool skip_masked = true;
  /// Columns of floats indexed by slot over [0, slot_limit) that the caller reads and writes after
  /// attend() (a policy's scores, summed from the rows): asked for from memory while P V reads the
  /// same slots' values, so that they are in cache when the caller's pass reaches them. A hint: no
  /// effect on any result.
  std::span<const float* const> warm_columns;
};

/// Scratch of attend(), grown on demand.
struct AttentionBuffers {
  /// [rotations][heads * n, head_dim] the group's queries rotated for each pending rotation met
  std::vector<float> rotated;
  std::vector<std::int64_t> rotations;  ///< the rotation of each block of `rotated`
  std::vector<float> output;            ///< [heads * n, head_dim] the group's attention outputs
  std::vector<KeyRun> gaps;             ///< the free slots between (and after) the runs
  std::vector<KeyRun> live;             ///< the runs that touch, merged: live slot ranges
  std::vector<kernels::QueryRun> query_runs;  ///< each run's end in its range, and its queries
  std::vector<std::size_t> range_runs;        ///< each live range's first entry of query_runs
};

/// probabilities = softmax(q K^T / sqrt(head_dim)) over the live slots (exact zeros at free slots
/// and masked chunk tokens): row h * n + i (head h, query i) holds slots [0, slot_limit) at
/// probabilities + (h * n + i) * probability_stride (probability_stride >= slot_limit; the floats
/// past slot_limit are not written); out = that times V, query i of head h written at out + i *
/// out_stride + h * head_dim.
void attend(const GroupAttention& group, QueryAngles& angles, float* probabilities,
            std::ptrdiff_t probability_stride, float* out, std::ptrdiff_t out_stride,
            AttentionBuffers& buffers);

}  // namespace kvevict::model
