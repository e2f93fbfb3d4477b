// KvBackend: what an engine implements over its own key/value memory so that kvevict can apply a
// decision to it in one step. kvevict's own KvStore implements it too.
//
// kvevict gives every token of every head a slot in [0, capacity) (Sequence::chunk_slots) and the
// engine keeps that token's key and value wherever slot s of that head maps to in its buffers.
// Eviction frees slots; the next tokens take them, so nothing moves and most engines have nothing
// to do on an eviction. The two things a backend may have to do:
//   - grow when kvevict needs more slots (reserve), for policies without a bound;
//   - with keys stored after RoPE and cache_index / reset_on_compact positions, rotate some stored
//     keys when kvevict folds pending rotations into them (AppliedDecision::rotations). Engines
//     that rotate every query per run of slots (Sequence::for_each_key_run) see such folds rarely;
//     engines that cannot (SequenceConfig::max_pending_rotations = 0) see one per decision.
// Engines that own their slot allocation (llama.cpp's cells) remove the evicted tokens here
// (AppliedDecision::evicted gives their original and current positions).
// The backend's storage type is its own: kvevict never reads K/V. A backend keeping keys in f16,
// bf16 or Q8_0 (kv_type.hpp; kvevict's KvStore does) rotates a folded key from its stored form and
// rounds it once; a key then carries at most 2 + capacity roundings (kv_store.hpp).
#pragma once

#include "kvevict/decision.hpp"

namespace kvevict {

class KvBackend {
 public:
  virtual ~KvBackend() = default;
  /// From now on every head's slots are [0, capacity): make room, keeping contents. Called before
  /// the first token and whenever the policy needs more slots; capacity never shrinks.
  virtual void reserve(int capacity) = 0;
  /// A decision kvevict has applied to its metadata: free `evicted` slots, and rotate the stored
  /// keys `rotations` name (post-RoPE storage only). Called once per decision, never empty. An
  /// exception leaves the sequence unusable (kvevict's metadata has changed already).
  virtual void apply(const AppliedDecision& decision) = 0;
};

}  // namespace kvevict
