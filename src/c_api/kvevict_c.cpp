// kvevict C API (include/kvevict/c_api.h): a thin layer over kvevict::Sequence and kvevict::KvPool.
// Every entry point runs inside guarded(), which turns any exception into a status and a
// thread-local message, so nothing ever unwinds into C.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <kvevict/engine.hpp>
#include <kvevict/kv_pool.hpp>
#include <kvevict/kv_type.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/version.hpp>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/c_api.h"

// The C view of an evicted slot is kvevict::EvictedSlot itself.
static_assert(sizeof(kvevict_evicted) == sizeof(kvevict::EvictedSlot) &&
              offsetof(kvevict_evicted, slot) == offsetof(kvevict::EvictedSlot, slot) &&
              offsetof(kvevict_evicted, original_position) ==
                  offsetof(kvevict::EvictedSlot, original_position) &&
              offsetof(kvevict_evicted, position) == offsetof(kvevict::EvictedSlot, position));

// kvevict_sequence_signals hands Signal's bits through unchanged.
static_assert(KVEVICT_SIGNAL_ATTENTION_ROWS ==
                  static_cast<std::uint32_t>(kvevict::Signal::attention_rows) &&
              KVEVICT_SIGNAL_LAST_ATTENTION_ROW ==
                  static_cast<std::uint32_t>(kvevict::Signal::last_attention_row) &&
              KVEVICT_SIGNAL_CATALYST_ATTENTION ==
                  static_cast<std::uint32_t>(kvevict::Signal::catalyst_attention) &&
              KVEVICT_SIGNAL_KEYS == static_cast<std::uint32_t>(kvevict::Signal::keys));

namespace {

thread_local std::string last_error;

/// A backend callback failed.
class BackendError : public kvevict::Error {
 public:
  using Error::Error;
};

template <class Body>
kvevict_status guarded(Body&& body) noexcept {
  try {
    last_error.clear();
    body();
    return KVEVICT_OK;
  } catch (const BackendError& error) {
    last_error = error.what();
    return KVEVICT_BACKEND_ERROR;
  } catch (const kvevict::Error& error) {
    last_error = error.what();
    return KVEVICT_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    last_error = "out of memory";
    return KVEVICT_OUT_OF_MEMORY;
  } catch (const std::exception& error) {
    last_error = std::string("internal error: ") + error.what();
    return KVEVICT_INTERNAL_ERROR;
  } catch (...) {
    last_error = "internal error: unknown exception";
    return KVEVICT_INTERNAL_ERROR;
  }
}

// The engine's callbacks as a kvevict::KvBackend.
class CallbackBackend final : public kvevict::KvBackend {
 public:
  explicit CallbackBackend(const kvevict_backend& callbacks) : callbacks_(callbacks) {}
  void reserve(int capacity) override {
    if (callbacks_.reserve == nullptr) {
      // The engine's buffers cannot grow: like a failed reserve, this leaves the sequence unusable.
      if (reserved_ != 0 && capacity > reserved_) {
        failed_ = true;
        throw BackendError("the sequence needs " + std::to_string(capacity) +
                           " slots per head, more than the " + std::to_string(reserved_) +
                           " it started with, and the backend has no reserve callback: give it "
                           "one, or a larger max_chunk");
      }
      reserved_ = std::max(reserved_, capacity);
      return;
    }
    const int status = callbacks_.reserve(callbacks_.user_data, capacity);
    if (status != 0) {
      failed_ = true;
      throw BackendError("the backend's reserve(" + std::to_string(capacity) + ") returned " +
                         std::to_string(status));
    }
    reserved_ = capacity;
  }
  void apply(const kvevict::AppliedDecision& decision) override {
    if (callbacks_.apply == nullptr) return;
    const int status = callbacks_.apply(callbacks_.user_data,
                                        reinterpret_cast<const kvevict_decision*>(&decision));
    if (status != 0) {
      failed_ = true;
      throw BackendError("the backend's apply() returned " + std::to_string(status));
    }
  }
  /// A callback failed (or the sequence outgrew a backend without reserve): the sequence that
  /// uses this backend is unusable.
  [[nodiscard]] bool failed() const { return failed_; }

 private:
  kvevict_backend callbacks_;
  int reserved_ = 0;
  bool failed_ = false;
};

const kvevict::AppliedDecision& decision_of(const kvevict_decision* decision) {
  KVEVICT_REQUIRE(decision != nullptr, "decision is NULL");
  return *reinterpret_cast<const kvevict::AppliedDecision*>(decision);
}

void check_decision_head(const kvevict::AppliedDecision& decision, int layer, int kv_head) {
  KVEVICT_REQUIRE(layer >= 0 && layer < decision.layout.layers() && kv_head >= 0 &&
                      kv_head < decision.layout.kv_heads(),
                  "head (" + std::to_string(layer) + ", " + std::to_string(kv_head) +
                      ") is outside the decision's " + std::to_string(decision.layout.layers()) +
                      " layers x " + std::to_string(decision.layout.kv_heads()) + " KV heads");
}

}  // namespace

struct kvevict_sequence {
  kvevict_sequence(const kvevict::SequenceConfig& config, std::unique_ptr<kvevict::Policy> policy,
                   const kvevict_backend* callbacks)
      : backend(callbacks != nullptr ? std::make_unique<CallbackBackend>(*callbacks) : nullptr),
        sequence(config, std::move(policy), backend.get()) {}

  /// Every call that changes the sequence fails from now on (a backend callback failed).
  [[nodiscard]] bool unusable() const { return backend != nullptr && backend->failed(); }

  std::unique_ptr<CallbackBackend> backend;  // declared before `sequence`, which uses it
  kvevict::Sequence sequence;
  kvevict_pool* pool = nullptr;  // the pool it is a member of, if any
  int member = -1;               // its member id there
};

// A kvevict::KvPool and the C handles of its members. Member ids are the C API's own: a member
// whose sequence is destroyed leaves `pool` at once, but its id stays reserved (so that later
// calls naming it say what happened) until kvevict_pool_leave releases it; `pool`'s own ids may
// then differ from them.
struct kvevict_pool {
  struct Member {
    kvevict_sequence* sequence = nullptr;  // nullptr: destroyed while a member
    int inner = -1;                        // its id in `pool`
  };

  explicit kvevict_pool(std::int64_t cells) : pool(cells) {}

  /// `sequence` (member `id`) is being destroyed: it leaves the pool, its id stays reserved.
  void orphan(int id) noexcept {
    std::optional<Member>& m = members[static_cast<std::size_t>(id)];
    try {
      pool.leave(m->inner);
    } catch (...) {  // never: the member is in the pool
    }
    m->sequence = nullptr;
    m->inner = -1;
  }

  kvevict::KvPool pool;
  std::vector<std::optional<Member>> members;  // by member id; nullopt: a free id
  std::vector<kvevict::KvPool::Feed> feeds;    // make_room scratch, in `pool`'s ids
  std::vector<std::uint8_t> fed;               // make_room scratch, by member id
};

namespace {

kvevict_sequence& checked(kvevict_sequence* sequence) {
  KVEVICT_REQUIRE(sequence != nullptr, "sequence is NULL");
  return *sequence;
}
const kvevict_sequence& checked(const kvevict_sequence* sequence) {
  KVEVICT_REQUIRE(sequence != nullptr, "sequence is NULL");
  return *sequence;
}

kvevict_pool& checked(kvevict_pool* pool) {
  KVEVICT_REQUIRE(pool != nullptr, "pool is NULL");
  return *pool;
}
const kvevict_pool& checked(const kvevict_pool* pool) {
  KVEVICT_REQUIRE(pool != nullptr, "pool is NULL");
  return *pool;
}

// Member `id` of `pool` as `call` needs it: in the pool, its sequence alive.
const kvevict_pool::Member& checked_member(const kvevict_pool& pool, int id, const char* call) {
  const std::string who = std::string("KV pool: ") + call + ": member " + std::to_string(id);
  KVEVICT_REQUIRE(id >= 0 && static_cast<std::size_t>(id) < pool.members.size() &&
                      pool.members[static_cast<std::size_t>(id)].has_value(),
                  who + " is not in the pool (it left, or never joined)");
  const kvevict_pool::Member& member = *pool.members[static_cast<std::size_t>(id)];
  KVEVICT_REQUIRE(member.sequence != nullptr,
                  who +
                      "'s sequence was destroyed while it was in the pool "
                      "(kvevict_sequence_destroy before kvevict_pool_leave): it has left; "
                      "kvevict_pool_leave(pool, " +
                      std::to_string(id) + ") releases its id");
  return member;
}

bool valid_head(const kvevict_sequence* sequence, int layer, int kv_head) {
  return sequence != nullptr && layer >= 0 && layer < sequence->sequence.config().layers &&
         kv_head >= 0 && kv_head < sequence->sequence.config().kv_heads;
}

// A span of `count` elements at `data`, which may be NULL only when count is 0.
template <class T>
std::span<const T> array_argument(const T* data, int count, const char* what) {
  KVEVICT_REQUIRE(count >= 0,
                  std::string(what) + ": count must be >= 0, got " + std::to_string(count));
  KVEVICT_REQUIRE(count == 0 || data != nullptr, std::string(what) + " is NULL");
  return {data, static_cast<std::size_t>(count)};
}

}  // namespace

extern "C" {

const char* kvevict_last_error(void) { return last_error.c_str(); }

const char* kvevict_version(void) { return kvevict::kVersionString; }

kvevict_status kvevict_budget_params(const char* policy, int budget, int sinks, char* out,
                                     size_t size) {
  return guarded([&] {
    KVEVICT_REQUIRE(policy != nullptr, "policy name is NULL");
    KVEVICT_REQUIRE(out != nullptr && size > 0, "output buffer is NULL or empty");
    out[0] = '\0';
    const std::string text = kvevict::budget_params(policy, budget, sinks).to_string();
    KVEVICT_REQUIRE(text.size() < size, "output buffer of " + std::to_string(size) +
                                            " bytes is too small for \"" + text + "\"");
    std::memcpy(out, text.c_str(), text.size() + 1);
  });
}

void kvevict_config_init(kvevict_config* config) {
  if (config == nullptr) return;
  *config = kvevict_config{};
  config->max_chunk = 1;
  config->post_rope_keys = 1;
  config->max_pending_rotations = kvevict::SequenceConfig{}.max_pending_rotations;
  config->pyramid_beta = kvevict::SequenceConfig{}.pyramid_beta;
  config->adaptive_floor = kvevict::SequenceConfig{}.adaptive_floor;
}

kvevict_status kvevict_decision_evicted(const kvevict_decision* decision, int layer, int kv_head,
                                        const kvevict_evicted** evicted, int* count) {
  return guarded([&] {
    const kvevict::AppliedDecision& applied = decision_of(decision);
    check_decision_head(applied, layer, kv_head);
    const std::span<const kvevict::EvictedSlot> slots = applied.evicted(layer, kv_head);
    if (evicted != nullptr) *evicted = reinterpret_cast<const kvevict_evicted*>(slots.data());
    if (count != nullptr) *count = static_cast<int>(slots.size());
  });
}

int kvevict_decision_rotation_count(const kvevict_decision* decision, int layer, int kv_head) {
  if (decision == nullptr) return -1;
  const kvevict::AppliedDecision& applied = decision_of(decision);
  if (layer < 0 || layer >= applied.layout.layers() || kv_head < 0 ||
      kv_head >= applied.layout.kv_heads()) {
    return -1;
  }
  return static_cast<int>(applied.rotations(layer, kv_head).size());
}

kvevict_status kvevict_decision_rotation(const kvevict_decision* decision, int layer, int kv_head,
                                         int index, int64_t* delta, const int32_t** slots,
                                         int* count) {
  return guarded([&] {
    const kvevict::AppliedDecision& applied = decision_of(decision);
    check_decision_head(applied, layer, kv_head);
    const std::span<const kvevict::KeyRotation> rotations = applied.rotations(layer, kv_head);
    KVEVICT_REQUIRE(index >= 0 && static_cast<std::size_t>(index) < rotations.size(),
                    "rotation index " + std::to_string(index) + " outside [0, " +
                        std::to_string(rotations.size()) + ")");
    const kvevict::KeyRotation& rotation = rotations[static_cast<std::size_t>(index)];
    if (delta != nullptr) *delta = rotation.delta;
    if (slots != nullptr) *slots = rotation.slots.data();
    if (count != nullptr) *count = static_cast<int>(rotation.slots.size());
  });
}

kvevict_status kvevict_sequence_create(const char* policy, const char* params,
                                       const kvevict_config* config, const kvevict_backend* backend,
                                       kvevict_sequence** out) {
  return guarded([&] {
    KVEVICT_REQUIRE(out != nullptr, "out is NULL");
    *out = nullptr;
    KVEVICT_REQUIRE(policy != nullptr, "policy name is NULL");
    KVEVICT_REQUIRE(config != nullptr, "config is NULL (fill one with kvevict_config_init)");
    kvevict::SequenceConfig sequence_config;
    sequence_config.layers = config->layers;
    sequence_config.q_heads = config->q_heads;
    sequence_config.kv_heads = config->kv_heads;
    sequence_config.max_chunk = config->max_chunk;
    sequence_config.head_dim = config->head_dim;
    if (config->position_mode != nullptr) {
      sequence_config.position_mode = kvevict::parse_position_mode(config->position_mode);
    }
    if (config->granularity != nullptr) {
      sequence_config.granularity = kvevict::parse_granularity(config->granularity);
    }
    sequence_config.key_storage = config->post_rope_keys != 0 ? kvevict::KeyStorage::post_rope
                                                              : kvevict::KeyStorage::pre_rope;
    sequence_config.max_pending_rotations = config->max_pending_rotations;
    if (config->slot_reuse != nullptr) {
      const std::string_view reuse(config->slot_reuse);
      KVEVICT_REQUIRE(reuse == "newest_freed_first" || reuse == "lowest_first",
                      "slot_reuse must be \"newest_freed_first\" or \"lowest_first\", got \"" +
                          std::string(reuse) + "\"");
      sequence_config.slot_reuse = reuse == "lowest_first" ? kvevict::SlotReuse::lowest_first
                                                           : kvevict::SlotReuse::newest_freed_first;
    }
    sequence_config.budget_tokens = config->budget_tokens;
    sequence_config.budget_bytes = config->budget_bytes;
    if (config->budget_bytes > 0) {
      KVEVICT_REQUIRE(config->head_dim > 0,
                      "budget_bytes needs head_dim (the bytes of a row depend on it)");
      sequence_config.token_bytes = static_cast<std::int64_t>(
          2 * kvevict::kv_row_bytes(
                  kvevict::parse_kv_type(config->kv_type != nullptr ? config->kv_type : "f32"),
                  config->head_dim));
    }
    if (config->allocation != nullptr) {
      sequence_config.allocation = kvevict::parse_allocation(config->allocation);
    }
    sequence_config.pyramid_beta = config->pyramid_beta;
    sequence_config.adaptive_floor = config->adaptive_floor;
    const kvevict::PolicyParams parsed =
        kvevict::PolicyParams::parse(params != nullptr ? params : "");
    *out = new kvevict_sequence(sequence_config, kvevict::make_policy(policy, parsed), backend);
  });
}

void kvevict_sequence_destroy(kvevict_sequence* sequence) {
  if (sequence == nullptr) return;
  if (sequence->pool != nullptr) sequence->pool->orphan(sequence->member);
  delete sequence;
}

uint32_t kvevict_sequence_signals(const kvevict_sequence* sequence) {
  return sequence != nullptr ? sequence->sequence.policy().signals().bits() : 0u;
}

int kvevict_sequence_retained_limit(const kvevict_sequence* sequence) {
  if (sequence == nullptr) return -1;
  return sequence->sequence.policy().retained_limit().value_or(-1);
}

int kvevict_sequence_capacity(const kvevict_sequence* sequence) {
  return sequence != nullptr ? sequence->sequence.capacity() : -1;
}

int kvevict_sequence_live(const kvevict_sequence* sequence, int layer, int kv_head) {
  return valid_head(sequence, layer, kv_head) ? sequence->sequence.live(layer, kv_head) : -1;
}

int kvevict_sequence_slot_limit(const kvevict_sequence* sequence, int layer, int kv_head) {
  return valid_head(sequence, layer, kv_head) ? sequence->sequence.slot_limit(layer, kv_head) : -1;
}

int64_t kvevict_sequence_tokens_fed(const kvevict_sequence* sequence) {
  return sequence != nullptr ? sequence->sequence.stats().tokens_fed : -1;
}

int kvevict_sequence_max_live(const kvevict_sequence* sequence) {
  return sequence != nullptr ? sequence->sequence.max_live() : -1;
}

kvevict_status kvevict_sequence_shrink_to(kvevict_sequence* sequence, int max_live) {
  return guarded([&] { checked(sequence).sequence.shrink_to(max_live); });
}

namespace {

// Bytes of one row of head_dim values stored as kv_type; errors name kv_type.
std::size_t kv_row_bytes(const char* kv_type, int head_dim) {
  KVEVICT_REQUIRE(kv_type != nullptr, "kv_type is NULL");
  KVEVICT_REQUIRE(head_dim > 0, "head_dim must be positive, got " + std::to_string(head_dim));
  try {
    return kvevict::kv_row_bytes(kvevict::parse_kv_type(kv_type), head_dim);
  } catch (const kvevict::Error& error) {
    throw kvevict::Error(std::string("kv_type: ") + error.what());
  }
}

}  // namespace

kvevict_status kvevict_kv_row_bytes(const char* kv_type, int head_dim, size_t* bytes) {
  return guarded([&] {
    KVEVICT_REQUIRE(bytes != nullptr, "bytes is NULL");
    *bytes = kv_row_bytes(kv_type, head_dim);
  });
}

kvevict_status kvevict_sequence_kv_bytes(const kvevict_sequence* sequence, const char* kv_type,
                                         int head_dim, size_t* live_bytes, size_t* peak_bytes) {
  return guarded([&] {
    const kvevict::SlotTable& slots = checked(sequence).sequence.slots();
    const std::size_t slot_bytes = 2 * kv_row_bytes(kv_type, head_dim);
    if (live_bytes != nullptr) {
      *live_bytes = static_cast<std::size_t>(slots.total_live()) * slot_bytes;
    }
    if (peak_bytes != nullptr) {
      *peak_bytes = static_cast<std::size_t>(slots.peak_total_live()) * slot_bytes;
    }
  });
}

kvevict_status kvevict_sequence_begin_chunk(kvevict_sequence* sequence, const int32_t* token_ids,
                                            int count, int turn_start) {
  return guarded([&] {
    kvevict_sequence& handle = checked(sequence);
    KVEVICT_REQUIRE(count > 0, "begin_chunk needs at least one token id");
    handle.sequence.begin_chunk(array_argument(token_ids, count, "token ids"), turn_start != 0);
  });
}

kvevict_status kvevict_sequence_chunk_slots(const kvevict_sequence* sequence, int layer,
                                            int kv_head, const int32_t** slots, int* count) {
  return guarded([&] {
    const std::span<const std::int32_t> chunk =
        checked(sequence).sequence.chunk_slots(layer, kv_head);
    if (slots != nullptr) *slots = chunk.data();
    if (count != nullptr) *count = static_cast<int>(chunk.size());
  });
}

kvevict_status kvevict_sequence_position(const kvevict_sequence* sequence, int layer, int kv_head,
                                         int32_t slot, int64_t* position, int64_t* key_position) {
  return guarded([&] {
    const kvevict::Sequence& s = checked(sequence).sequence;
    KVEVICT_REQUIRE(s.slots().is_live(s.unit_of(layer, kv_head), slot),
                    "slot " + std::to_string(slot) + " of head (" + std::to_string(layer) + ", " +
                        std::to_string(kv_head) + ") is not live");
    if (position != nullptr) *position = s.position(layer, kv_head, slot);
    if (key_position != nullptr) *key_position = s.key_position(layer, kv_head, slot);
  });
}

kvevict_status kvevict_sequence_key_runs(const kvevict_sequence* sequence, int layer, int kv_head,
                                         const kvevict_key_run** runs, int* count) {
  static_assert(sizeof(kvevict_key_run) == sizeof(kvevict::KeyRun) &&
                offsetof(kvevict_key_run, begin) == offsetof(kvevict::KeyRun, begin) &&
                offsetof(kvevict_key_run, end) == offsetof(kvevict::KeyRun, end) &&
                offsetof(kvevict_key_run, rotation) == offsetof(kvevict::KeyRun, rotation));
  return guarded([&] {
    KVEVICT_REQUIRE(runs != nullptr && count != nullptr, "runs or count is NULL");
    const std::span<const kvevict::KeyRun> view =
        checked(sequence).sequence.key_runs(layer, kv_head);
    *runs = reinterpret_cast<const kvevict_key_run*>(view.data());
    *count = static_cast<int>(view.size());
  });
}

kvevict_status kvevict_sequence_live_mask(const kvevict_sequence* sequence, int layer, int kv_head,
                                          const uint8_t** mask, int* count) {
  return guarded([&] {
    KVEVICT_REQUIRE(mask != nullptr && count != nullptr, "mask or count is NULL");
    const std::span<const std::uint8_t> view = checked(sequence).sequence.live_mask(layer, kv_head);
    *mask = view.data();
    *count = static_cast<int>(view.size());
  });
}

kvevict_status kvevict_sequence_observe_attention(kvevict_sequence* sequence, int layer,
                                                  const float* rows, int queries,
                                                  ptrdiff_t row_stride) {
  return guarded(
      [&] { checked(sequence).sequence.observe_attention(layer, rows, queries, row_stride); });
}

int kvevict_sequence_attention_per_kv_head(const kvevict_sequence* sequence) {
  return sequence != nullptr && sequence->sequence.attention_per_kv_head() ? 1 : 0;
}

kvevict_status kvevict_sequence_observe_attention_heads(kvevict_sequence* sequence, int layer,
                                                        int kv_head_begin, int kv_head_end,
                                                        const float* rows, int queries,
                                                        ptrdiff_t row_stride) {
  return guarded([&] {
    checked(sequence).sequence.observe_attention(layer, kv_head_begin, kv_head_end, rows, queries,
                                                 row_stride);
  });
}

kvevict_status kvevict_sequence_observe_surprisal(kvevict_sequence* sequence,
                                                  const float* surprisal, int count) {
  return guarded([&] {
    checked(sequence).sequence.observe_surprisal(array_argument(surprisal, count, "surprisal"));
  });
}

kvevict_status kvevict_sequence_observe_keys(kvevict_sequence* sequence, int layer,
                                             const float* keys, ptrdiff_t row_stride) {
  return guarded([&] { checked(sequence).sequence.observe_keys(layer, keys, row_stride); });
}

kvevict_status kvevict_sequence_end_forward(kvevict_sequence* sequence) {
  return guarded([&] { checked(sequence).sequence.end_forward(); });
}

int kvevict_sequence_pot_room(const kvevict_sequence* sequence) {
  if (sequence == nullptr) return -1;
  return sequence->sequence.pot_room().value_or(-1);
}

int kvevict_sequence_catalyst_pending(const kvevict_sequence* sequence) {
  return sequence != nullptr && sequence->sequence.catalyst_pending() ? 1 : 0;
}

kvevict_status kvevict_sequence_begin_catalyst(kvevict_sequence* sequence, const int32_t* token_ids,
                                               int count) {
  return guarded([&] {
    checked(sequence).sequence.begin_catalyst(
        array_argument(token_ids, count, "catalyst token ids"));
  });
}

kvevict_status kvevict_sequence_observe_catalyst(kvevict_sequence* sequence, int layer,
                                                 const float* rows, int queries,
                                                 ptrdiff_t row_stride) {
  return guarded(
      [&] { checked(sequence).sequence.observe_catalyst(layer, rows, queries, row_stride); });
}

kvevict_status kvevict_sequence_end_catalyst(kvevict_sequence* sequence) {
  return guarded([&] { checked(sequence).sequence.end_catalyst(); });
}

kvevict_status kvevict_pool_create(int64_t cells, kvevict_pool** out) {
  return guarded([&] {
    KVEVICT_REQUIRE(out != nullptr, "out is NULL");
    *out = nullptr;
    *out = new kvevict_pool(cells);
  });
}

void kvevict_pool_destroy(kvevict_pool* pool) {
  if (pool == nullptr) return;
  for (const std::optional<kvevict_pool::Member>& member : pool->members) {
    if (member && member->sequence != nullptr) {
      member->sequence->pool = nullptr;
      member->sequence->member = -1;
    }
  }
  delete pool;
}

kvevict_status kvevict_pool_join(kvevict_pool* pool, kvevict_sequence* sequence, int minimum,
                                 int* member) {
  return guarded([&] {
    KVEVICT_REQUIRE(member != nullptr, "member is NULL");
    *member = -1;
    kvevict_pool& p = checked(pool);
    kvevict_sequence& s = checked(sequence);
    KVEVICT_REQUIRE(s.pool == nullptr,
                    "KV pool: join: the sequence is already member " + std::to_string(s.member) +
                        " of " + (s.pool == pool ? "this pool" : "another pool") +
                        " (a sequence belongs to one pool at a time: kvevict_pool_leave first)");
    KVEVICT_REQUIRE(!s.unusable(),
                    "KV pool: join: the sequence is unusable (its backend failed): destroy it");
    const auto free_id = std::find_if(p.members.begin(), p.members.end(),
                                      [](const auto& m) { return !m.has_value(); });
    const auto id = static_cast<std::size_t>(free_id - p.members.begin());
    if (free_id == p.members.end()) p.members.emplace_back();  // before join: may throw
    const int inner = p.pool.join(s.sequence, minimum);
    p.members[id] = kvevict_pool::Member{&s, inner};
    s.pool = &p;
    s.member = static_cast<int>(id);
    *member = static_cast<int>(id);
  });
}

kvevict_status kvevict_pool_leave(kvevict_pool* pool, int member) {
  return guarded([&] {
    kvevict_pool& p = checked(pool);
    KVEVICT_REQUIRE(member >= 0 && static_cast<std::size_t>(member) < p.members.size() &&
                        p.members[static_cast<std::size_t>(member)].has_value(),
                    "KV pool: leave: member " + std::to_string(member) +
                        " is not in the pool (it left, or never joined)");
    std::optional<kvevict_pool::Member>& m = p.members[static_cast<std::size_t>(member)];
    if (m->sequence != nullptr) {  // else destroyed while a member: it has left already
      p.pool.leave(m->inner);
      m->sequence->pool = nullptr;
      m->sequence->member = -1;
    }
    m.reset();
  });
}

kvevict_status kvevict_pool_make_room(kvevict_pool* pool, const kvevict_pool_feed* feeds,
                                      size_t count) {
  return guarded([&] {
    kvevict_pool& p = checked(pool);
    KVEVICT_REQUIRE(count == 0 || feeds != nullptr, "feeds is NULL");
    // Every member between steps and usable: a cut needs both, and make_room refuses before it
    // cuts anyone.
    for (std::size_t id = 0; id < p.members.size(); ++id) {
      const std::optional<kvevict_pool::Member>& m = p.members[id];
      if (!m || m->sequence == nullptr) continue;
      const std::string who = "KV pool: make_room: member " + std::to_string(id);
      KVEVICT_REQUIRE(!m->sequence->unusable(),
                      who +
                          "'s sequence is unusable (its backend failed): kvevict_pool_leave it "
                          "and destroy it");
      KVEVICT_REQUIRE(m->sequence->sequence.idle(),
                      who + " is inside a forward (end it first: make_room runs between steps)");
    }
    p.feeds.clear();
    p.fed.assign(p.members.size(), 0);
    for (std::size_t i = 0; i < count; ++i) {
      const kvevict_pool_feed& feed = feeds[i];
      const kvevict_pool::Member& m = checked_member(p, feed.member, "make_room");
      const int chunk = m.sequence->sequence.config().max_chunk;
      KVEVICT_REQUIRE(feed.tokens >= 0 && feed.tokens <= chunk,
                      "KV pool: make_room: member " + std::to_string(feed.member) + " is fed " +
                          std::to_string(feed.tokens) + " tokens, outside [0, " +
                          std::to_string(chunk) + "] (its max_chunk)");
      std::uint8_t& fed = p.fed[static_cast<std::size_t>(feed.member)];
      KVEVICT_REQUIRE(fed == 0, "KV pool: make_room: member " + std::to_string(feed.member) +
                                    " is fed twice in one step");
      fed = 1;
      p.feeds.push_back({m.inner, feed.tokens});
    }
    try {
      p.pool.make_room(p.feeds);
    } catch (const kvevict::KvPool::CutFailure& failure) {
      // Name the member by its C id; a failed apply() is the backend's error.
      for (std::size_t id = 0; id < p.members.size(); ++id) {
        const std::optional<kvevict_pool::Member>& m = p.members[id];
        if (!m || m->inner != failure.member()) continue;
        const std::string message = "KV pool: make_room: member " + std::to_string(id) +
                                    ", cut to make room: " + failure.reason();
        try {
          std::rethrow_exception(failure.cause());
        } catch (const BackendError&) {
          throw BackendError(message +
                             " (the sequence is unusable: kvevict_pool_leave it and destroy it)");
        } catch (...) {
          throw kvevict::Error(message);
        }
      }
      throw;
    }
  });
}

int64_t kvevict_pool_cells(const kvevict_pool* pool) {
  return pool != nullptr ? pool->pool.cells() : -1;
}

int64_t kvevict_pool_used(const kvevict_pool* pool) {
  return pool != nullptr ? pool->pool.used() : -1;
}

int64_t kvevict_pool_charged(const kvevict_pool* pool) {
  return pool != nullptr ? pool->pool.charged() : -1;
}

int kvevict_pool_is_member(const kvevict_pool* pool, int member) {
  if (pool == nullptr || member < 0 || static_cast<std::size_t>(member) >= pool->members.size()) {
    return 0;
  }
  const std::optional<kvevict_pool::Member>& m = pool->members[static_cast<std::size_t>(member)];
  return m && m->sequence != nullptr ? 1 : 0;
}

kvevict_status kvevict_pool_minimum(const kvevict_pool* pool, int member, int64_t* minimum) {
  return guarded([&] {
    KVEVICT_REQUIRE(minimum != nullptr, "minimum is NULL");
    const kvevict_pool& p = checked(pool);
    *minimum = p.pool.minimum(checked_member(p, member, "minimum").inner);
  });
}

kvevict_status kvevict_pool_get_stats(const kvevict_pool* pool, kvevict_pool_stats* stats) {
  return guarded([&] {
    KVEVICT_REQUIRE(stats != nullptr, "stats is NULL");
    const kvevict::PoolStats& s = checked(pool).pool.stats();
    *stats = kvevict_pool_stats{s.steps, s.pressed_steps, s.cuts, s.peak_cells};
  });
}

}  // extern "C"
