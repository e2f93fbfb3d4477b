// Attention of one query head over one KV head's cached slots, the way an evicting cache lays them
// out: slots [0, slot_limit) in slot order (not stream order), free slots skipped, and keys
// carrying a pending rotation per run of slots (kvevict::SlotTable::for_each_key_run).
//
// For post-RoPE keys stored rotated to key position p_k - d (d: the run's pending rotation), the
// score of a query at position p_q is (R(p_q) q) . (R(p_k) k) = (R(p_q - d) q) . (R(p_k - d) k):
// the query is rotated once per run instead of rotating every key. Pre-RoPE keys arrive already
// rotated to their positions (d = 0 for the whole range).
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <kvevict/rope.hpp>
#include <span>
#include <vector>

namespace kvevict::model {

using AttentionMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

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

struct HeadAttention {
  const float* queries = nullptr;  ///< [n, head_dim] pre-RoPE, row i at queries + i * stride
  std::ptrdiff_t query_stride = 0;
  std::span<const std::int64_t> query_positions;  ///< [n] RoPE position of query i
  /// Slot of each query's own token: query i must not see the slots of queries j > i.
  std::span<const std::int32_t> query_slots;
  const float* keys = nullptr;    ///< [slot_limit, head_dim] row-major
  const float* values = nullptr;  ///< [slot_limit, head_dim] row-major
  int slot_limit = 0;
  int head_dim = 0;
  std::span<const KeyRun> runs;  ///< the live slots
};

/// probabilities = softmax(q K^T / sqrt(head_dim)) over the live slots (0 elsewhere), [n,
/// slot_limit]; out = probabilities V, [n, head_dim] at out + i * out_stride. `rotated` is scratch.
void attend(const HeadAttention& head, QueryAngles& angles,
            Eigen::Ref<AttentionMatrix> probabilities, float* out, std::ptrdiff_t out_stride,
            AttentionMatrix& rotated);

}  // namespace kvevict::model
