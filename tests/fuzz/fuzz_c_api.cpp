// Fuzz target: sequences of C API calls (include/kvevict/c_api.h). The input picks a policy, its
// parameters (from --budget arithmetic or as free text), a configuration (small, or one of the
// values at the edges of int) and backend callbacks that may fail, then a series of calls: some
// well-formed forwards, and the rest arbitrary: chunks of any length (negative, NULL, longer than
// max_chunk), heads and slots out of range, attention rows of any shape over valid buffers, with
// NaN, infinite or negative scores, calls out of order.
//
// Properties, checked after every call:
// - nothing crashes and no exception escapes (the C API's own promise);
// - every failed call leaves a message in kvevict_last_error(), and every successful one "";
// - the engine's mirror agrees with kvevict: a chunk's slots are free slots in [0, capacity), an
//   evicted slot is one the mirror holds, rotated keys are live, live(layer, head) is the mirror's
//   count, and live <= slot_limit <= capacity == what reserve() was last asked;
// - key runs are sorted, disjoint, inside [0, slot_limit) and cover every live slot once;
// - a live slot's position lies in [0, tokens fed (+ an open catalyst));
// - a well-formed forward of a usable sequence succeeds, also after refused calls: a refused
//   observation (NaN, infinite, negative or > 1 attention, NaN surprisal) changes nothing;
// - a failed callback fails its call with KVEVICT_BACKEND_ERROR, and after one every call that
//   changes the sequence fails.
//
// Pool mode (an input whose first byte is 0xC0 or more; the rest is read as any other input): the
// sequence joins a KV pool (kvevict_pool_*) with a neighbour (a window sequence, metadata only),
// the pool about half as large as the two at full length. Every well-formed forward is preceded
// by make_room for it and one neighbour token, and four more calls are drawn: make_room with
// arbitrary feeds (ids out of range, left, destroyed; tokens outside [0, max_chunk]; members fed
// twice), shrink_to, leaving and joining again, and the neighbour destroyed before it left (or
// the pool destroyed before its members). Further properties:
// - a make_room for a well-formed forward of a usable, idle member succeeds, and after every
//   successful make_room the step's peak (cells held plus tokens fed) fits the pool and no member
//   was cut below its minimum; a refused make_room changes nothing (cells used, steps);
// - a feed naming a destroyed member fails saying so, until leave releases its id;
// - the mirror still agrees after every cut (cuts reach the engine through apply()).
#include <kvevict/c_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <kvevict/error.hpp>
#include <kvevict/policy_params.hpp>
#include <kvevict/policy_registry.hpp>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "fuzz_input.hpp"

namespace {

using kvevict::fuzz::property_failed;

// The input, read front to back; zeros once it is exhausted.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  [[nodiscard]] bool empty() const { return position_ >= size_; }
  std::uint8_t byte() { return empty() ? 0 : data_[position_++]; }
  std::uint32_t u32() {
    std::uint32_t value = 0;
    for (int i = 0; i < 4; ++i) value |= std::uint32_t{byte()} << (8 * i);
    return value;
  }
  /// An integer in [0, n).
  int below(int n) { return n <= 1 ? 0 : byte() % n; }
  /// Mostly an integer in [low, high]; one time in 16 a value at the edge of int.
  int size(int low, int high) {
    const std::uint8_t selector = byte();
    if (selector >= 240) {
      static constexpr std::array<int, 10> kEdges{-1,
                                                  0,
                                                  1,
                                                  std::numeric_limits<int>::max(),
                                                  std::numeric_limits<int>::min(),
                                                  1 << 20,
                                                  (1 << 20) + 1,
                                                  1 << 28,
                                                  (1 << 28) + 1,
                                                  65537};
      return kEdges[static_cast<std::size_t>(selector - 240) % kEdges.size()];
    }
    return low + selector % (high - low + 1);
  }
  float score() {
    switch (byte() % 8) {
      case 0:
        return std::numeric_limits<float>::quiet_NaN();
      case 1:
        return std::numeric_limits<float>::infinity();
      case 2:
        return -1.0f;
      case 3:
        return 1e30f;
      default:
        return static_cast<float>(byte()) / 255.0f;
    }
  }

  std::string text(std::size_t most) {
    const std::size_t length = std::min<std::size_t>(below(static_cast<int>(most) + 1),
                                                     size_ > position_ ? size_ - position_ : 0);
    std::string out(reinterpret_cast<const char*>(data_ + position_), length);
    position_ += length;
    return out;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t position_ = 0;
};

// A backend callback made a call that failed on purpose: the call that triggered the callback
// succeeds with that message still in kvevict_last_error() (the message of the last failed call).
bool callback_call_failed = false;

// Checks the status of one call against the message it left.
kvevict_status checked_status(kvevict_status status, const char* call) {
  const std::string_view message = kvevict_last_error();
  if (status < KVEVICT_OK || status > KVEVICT_BACKEND_ERROR) {
    property_failed(std::string(call) + " returned an unknown status " + std::to_string(status));
  }
  if (status != KVEVICT_OK && message.empty()) {
    property_failed(std::string(call) + " failed (status " + std::to_string(status) +
                    ") without a message");
  }
  const bool nested_message = std::exchange(callback_call_failed, false);
  if (status == KVEVICT_OK && !message.empty() && !nested_message) {
    property_failed(std::string(call) + " succeeded but left the message \"" +
                    std::string(message) + "\"");
  }
  if (status == KVEVICT_INTERNAL_ERROR) {
    property_failed(std::string(call) + " failed with an internal error: " + std::string(message));
  }
  return status;
}

// The engine: which slots of every (layer, KV head) hold a token, as far as the calls told it.
struct Engine {
  int layers = 0;
  int kv_heads = 0;
  int capacity = 0;                             // the last reserve()
  std::vector<std::vector<std::uint8_t>> held;  // [head][capacity]
  bool fail_reserve = false;
  bool fail_apply = false;
  bool callback_failed = false;  // since the last call the session checked
  bool can_grow = true;          // the backend has a reserve callback

  std::vector<std::uint8_t>& head(int layer, int kv_head) {
    return held[static_cast<std::size_t>(layer) * kv_heads + kv_head];
  }
  [[nodiscard]] int count(int layer, int kv_head) const {
    const std::vector<std::uint8_t>& h = held[static_cast<std::size_t>(layer) * kv_heads + kv_head];
    return static_cast<int>(std::count(h.begin(), h.end(), std::uint8_t{1}));
  }

  static int reserve(void* self, int capacity) {
    Engine& engine = *static_cast<Engine*>(self);
    if (engine.fail_reserve) {
      engine.callback_failed = true;
      return 3;
    }
    if (capacity < engine.capacity) {
      property_failed("reserve(" + std::to_string(capacity) + ") shrinks the capacity " +
                      std::to_string(engine.capacity));
    }
    engine.capacity = capacity;
    for (std::vector<std::uint8_t>& h : engine.held) h.resize(static_cast<std::size_t>(capacity));
    return 0;
  }

  static int apply(void* self, const kvevict_decision* decision) {
    Engine& engine = *static_cast<Engine*>(self);
    if (engine.fail_apply) {
      engine.callback_failed = true;
      return 5;
    }
    for (int l = 0; l < engine.layers; ++l) {
      for (int g = 0; g < engine.kv_heads; ++g) {
        std::vector<std::uint8_t>& h = engine.head(l, g);
        const kvevict_evicted* evicted = nullptr;
        int count = -1;
        checked_status(kvevict_decision_evicted(decision, l, g, &evicted, &count),
                       "kvevict_decision_evicted");
        if (count < 0 || (count > 0 && evicted == nullptr)) property_failed("bad evicted list");
        for (int i = 0; i < count; ++i) {
          const kvevict_evicted& e = evicted[i];
          if (e.slot < 0 || e.slot >= engine.capacity || h[static_cast<std::size_t>(e.slot)] == 0) {
            property_failed("evicted slot " + std::to_string(e.slot) + " is not held");
          }
          if (i > 0 && e.original_position <= evicted[i - 1].original_position) {
            property_failed("evicted tokens are not listed oldest first");
          }
          if (e.position < 0 || e.position > e.original_position) {
            property_failed("evicted position " + std::to_string(e.position) + " outside [0, " +
                            std::to_string(e.original_position) + "]");
          }
          h[static_cast<std::size_t>(e.slot)] = 0;
        }
        const int rotations = kvevict_decision_rotation_count(decision, l, g);
        if (rotations < 0) property_failed("negative rotation count for a valid head");
        for (int r = 0; r < rotations; ++r) {
          std::int64_t delta = 0;
          const std::int32_t* slots = nullptr;
          int n = -1;
          checked_status(kvevict_decision_rotation(decision, l, g, r, &delta, &slots, &n),
                         "kvevict_decision_rotation");
          for (int i = 0; i < n; ++i) {
            if (slots[i] < 0 || slots[i] >= engine.capacity ||
                h[static_cast<std::size_t>(slots[i])] == 0) {
              property_failed("rotated key of slot " + std::to_string(slots[i]) + " is not held");
            }
          }
        }
        if (kvevict_decision_rotation(decision, l, g, rotations, nullptr, nullptr, nullptr) ==
            KVEVICT_OK) {
          property_failed("rotation index past the end accepted");
        }
      }
    }
    if (checked_status(kvevict_decision_evicted(decision, engine.layers, 0, nullptr, nullptr),
                       "kvevict_decision_evicted") == KVEVICT_OK) {
      property_failed("a decision's head out of range accepted");
    }
    callback_call_failed = true;
    return 0;
  }
};

// Parameters whose numbers stay below 65536: larger budgets are valid requests for memory in
// proportion (2^28 slots is the stated limit), not what this target looks for.
bool modest(const std::string& params) {
  try {
    const kvevict::PolicyParams parsed = kvevict::PolicyParams::parse(params);
    for (const auto& [key, value] : parsed.values()) {
      if (const auto* number = std::get_if<double>(&value)) {
        if (std::fabs(*number) > 65536) return false;
      } else if (const auto* list = std::get_if<std::vector<std::int64_t>>(&value)) {
        if (list->size() > 64) return false;
      }
    }
  } catch (const kvevict::Error&) {
  }
  return true;
}

// Pool mode: the pool, the fuzzed sequence's membership and its neighbour.
struct PoolSide {
  kvevict_pool* pool = nullptr;
  std::int64_t cells = 0;
  int max_chunk = 1;
  int neighbour_recent = 1;
  kvevict_sequence* neighbour = nullptr;  // a window, metadata only
  int neighbour_id = -1;                  // its member id, -1 when not a member
  int member = -1;                        // the fuzzed sequence's member id, -1 when not a member
  std::vector<int> orphans;               // ids of members destroyed before they left

  PoolSide() = default;
  PoolSide(const PoolSide&) = delete;
  PoolSide& operator=(const PoolSide&) = delete;
  ~PoolSide() {
    kvevict_pool_destroy(pool);
    kvevict_sequence_destroy(neighbour);
  }

  void create_pool() {
    if (checked_status(kvevict_pool_create(cells, &pool), "kvevict_pool_create") != KVEVICT_OK) {
      property_failed("a pool of " + std::to_string(cells) + " cells refused");
    }
  }

  // A new neighbour, joined to the pool: its charge (1 + a chunk) always fits.
  void add_neighbour() {
    kvevict_config config;
    kvevict_config_init(&config);
    config.layers = 1;
    config.q_heads = 1;
    config.kv_heads = 1;
    config.max_chunk = max_chunk;
    const std::string params = "recent=" + std::to_string(neighbour_recent);
    if (checked_status(
            kvevict_sequence_create("window", params.c_str(), &config, nullptr, &neighbour),
            "kvevict_sequence_create") != KVEVICT_OK) {
      property_failed("the neighbour window refused");
    }
    if (checked_status(kvevict_pool_join(pool, neighbour, 0, &neighbour_id), "kvevict_pool_join") !=
        KVEVICT_OK) {
      property_failed(std::string("the neighbour's join failed: ") + kvevict_last_error());
    }
  }

  // One neighbour token: a forward that needs no signal.
  void feed_neighbour() {
    const std::int32_t id = 1;
    if (checked_status(kvevict_sequence_begin_chunk(neighbour, &id, 1, 0), "begin_chunk") !=
            KVEVICT_OK ||
        checked_status(kvevict_sequence_end_forward(neighbour), "end_forward") != KVEVICT_OK) {
      property_failed(std::string("a neighbour forward failed: ") + kvevict_last_error());
    }
  }
};

class Session {
 public:
  Session(Bytes& in, kvevict_sequence* sequence, Engine& engine, const kvevict_config& config,
          PoolSide* pool = nullptr)
      : in_(in), s_(sequence), engine_(engine), config_(config), pool_(pool) {}

  void run() {
    for (int step = 0; step < 200 && !in_.empty(); ++step) {
      // Pool mode draws from four more calls; other inputs decode as they always have.
      switch (in_.below(pool_ != nullptr ? 16 : 12)) {
        case 0:
        case 1:
        case 2:
          well_formed_forward();
          break;
        case 3:
          begin_chunk();
          break;
        case 4:
          observe_attention(/*catalyst=*/false);
          break;
        case 5:
          observe_surprisal();
          break;
        case 6:
          call_end(checked(kvevict_sequence_end_forward(s_), "end_forward"), State::forward);
          break;
        case 7:
          begin_catalyst();
          break;
        case 8:
          observe_attention(/*catalyst=*/true);
          break;
        case 9:
          call_end(checked(kvevict_sequence_end_catalyst(s_), "end_catalyst"), State::catalyst);
          break;
        case 10:
          read_head();
          break;
        case 11:
          engine_.fail_reserve = in_.below(8) == 0;
          engine_.fail_apply = in_.below(8) == 0;
          break;
        case 12:
          arbitrary_make_room();
          break;
        case 13:
          shrink_to();
          break;
        case 14:
          leave_or_join();
          break;
        case 15:
          wrong_order();
          break;
      }
      check_invariants();
      check_pool();
    }
  }

 private:
  enum class State { idle, forward, catalyst, unknown };

  [[nodiscard]] bool usable() const { return !backend_failed_; }

  // checked_status, and the backend's promise: a failed callback fails the call that made it with
  // KVEVICT_BACKEND_ERROR (so does a sequence outgrowing a backend without reserve), and the
  // sequence is unusable from then on.
  kvevict_status checked(kvevict_status status, const char* call) {
    checked_status(status, call);
    const bool callback_failed = std::exchange(engine_.callback_failed, false);
    if (callback_failed && status != KVEVICT_BACKEND_ERROR) {
      property_failed(std::string(call) + " returned status " + std::to_string(status) +
                      " after a backend callback failed");
    }
    if (status == KVEVICT_BACKEND_ERROR) {
      if (!callback_failed && engine_.can_grow) {
        property_failed(std::string(call) + " reported a backend error no callback made");
      }
      backend_failed_ = true;
    }
    return status;
  }

  // After a backend failure the sequence refuses every change.
  void expect_refused(kvevict_status status, const char* call) const {
    if (backend_failed_ && status == KVEVICT_OK) {
      property_failed(std::string(call) + " succeeded on a sequence whose backend failed");
    }
  }

  std::vector<std::int32_t> token_ids(int count) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(std::max(count, 0)));
    for (std::int32_t& id : ids) {
      id = in_.below(4) == 0 ? static_cast<std::int32_t>(in_.u32()) : in_.below(8);
    }
    return ids;
  }

  // Mirrors the slots of the chunk (or catalyst) that just began.
  void take_chunk_slots(int count) {
    for (int l = 0; l < config_.layers; ++l) {
      for (int g = 0; g < config_.kv_heads; ++g) {
        const std::int32_t* slots = nullptr;
        int n = -1;
        checked(kvevict_sequence_chunk_slots(s_, l, g, &slots, &n), "chunk_slots");
        if (n != count) {
          property_failed("chunk_slots lists " + std::to_string(n) + " slots for " +
                          std::to_string(count) + " tokens");
        }
        std::vector<std::uint8_t>& held = engine_.head(l, g);
        for (int i = 0; i < n; ++i) {
          if (slots[i] < 0 || slots[i] >= engine_.capacity ||
              (usable() && held[static_cast<std::size_t>(slots[i])] != 0)) {
            property_failed("chunk slot " + std::to_string(slots[i]) +
                            " is outside the capacity or already held");
          }
          held[static_cast<std::size_t>(slots[i])] = 1;
        }
      }
    }
  }

  void begin_chunk() {
    const int count = in_.size(0, config_.max_chunk + 2);
    const bool null_ids = in_.below(16) == 0;
    const std::vector<std::int32_t> ids = token_ids(std::min(count, 4 * config_.max_chunk + 8));
    const int passed = std::min<int>(count, static_cast<int>(ids.size()));
    const kvevict_status status =
        checked(kvevict_sequence_begin_chunk(s_, null_ids ? nullptr : ids.data(),
                                             count < 0 ? count : passed, in_.below(2)),
                "begin_chunk");
    expect_refused(status, "begin_chunk");
    if (status == KVEVICT_OK) {
      take_chunk_slots(passed);
      state_ = State::forward;
      chunk_ = passed;
      catalyst_ = 0;
    }
  }

  void begin_catalyst() {
    const int count = in_.size(0, config_.max_chunk + 2);
    const std::vector<std::int32_t> ids = token_ids(std::min(count, 4 * config_.max_chunk + 8));
    const int passed = std::min<int>(count, static_cast<int>(ids.size()));
    const kvevict_status status =
        checked(kvevict_sequence_begin_catalyst(s_, ids.data(), count < 0 ? count : passed),
                "begin_catalyst");
    expect_refused(status, "begin_catalyst");
    if (status == KVEVICT_OK) {
      take_chunk_slots(passed);
      state_ = State::catalyst;
      chunk_ = passed;
      catalyst_ = passed;
    }
  }

  void call_end(kvevict_status status, State from) {
    expect_refused(status, "end");
    if (status == KVEVICT_OK) {
      state_ = State::idle;
      catalyst_ = 0;
    } else if (state_ == from) {
      state_ = State::unknown;  // a failed decision may have ended it
    }
  }

  // Attention rows of one layer over a valid buffer of [q_heads][queries][stride] floats, or of
  // its KV heads [kv_begin, kv_end) only (observe_attention_heads) when kv_end >= 0.
  kvevict_status attend(int layer, int queries, std::ptrdiff_t stride, bool catalyst, bool uniform,
                        int kv_begin = 0, int kv_end = -1) {
    const int group = config_.q_heads / config_.kv_heads;
    const bool some_heads = kv_end >= 0;
    const int q_heads = some_heads ? (kv_end - kv_begin) * group : config_.q_heads;
    const std::size_t floats = static_cast<std::size_t>(q_heads) * std::max(queries, 0) *
                               std::max<std::ptrdiff_t>(stride, 0);
    rows_.assign(std::max<std::size_t>(floats, 1), 0.0f);
    for (int row_head = 0; row_head < q_heads; ++row_head) {
      const int h = (some_heads ? kv_begin * group : 0) + row_head;
      const bool valid_layer = layer >= 0 && layer < config_.layers;
      const std::vector<std::uint8_t>* held =
          valid_layer ? &engine_.head(layer, h / group) : nullptr;
      const int live = valid_layer ? engine_.count(layer, h / group) : 0;
      for (int q = 0; q < queries; ++q) {
        for (std::ptrdiff_t k = 0; k < stride; ++k) {
          float& value = rows_[(static_cast<std::size_t>(row_head) * queries + q) * stride + k];
          if (uniform) {
            const bool is_held = held != nullptr && static_cast<std::size_t>(k) < held->size() &&
                                 (*held)[static_cast<std::size_t>(k)] != 0;
            value = is_held ? 1.0f / static_cast<float>(live) : 0.0f;
          } else {
            value = in_.score();
          }
        }
      }
    }
    if (some_heads) {
      return kvevict_sequence_observe_attention_heads(s_, layer, kv_begin, kv_end, rows_.data(),
                                                      queries, stride);
    }
    return catalyst ? kvevict_sequence_observe_catalyst(s_, layer, rows_.data(), queries, stride)
                    : kvevict_sequence_observe_attention(s_, layer, rows_.data(), queries, stride);
  }

  [[nodiscard]] int widest_slot_limit(int layer) const {
    int widest = 0;
    for (int g = 0; g < config_.kv_heads; ++g) {
      widest = std::max(widest, kvevict_sequence_slot_limit(s_, layer, g));
    }
    return widest;
  }

  void observe_attention(bool catalyst) {
    const int layer =
        in_.below(4) == 0 ? in_.size(-1, config_.layers + 1) : in_.below(config_.layers);
    const int queries = in_.below(2) == 0 ? std::max(chunk_, 1)
                                          : std::clamp(in_.size(0, config_.max_chunk + 2), -1, 16);
    const int widest = widest_slot_limit(std::clamp(layer, 0, config_.layers - 1));
    const std::ptrdiff_t stride = std::max(widest + std::clamp(in_.size(-2, 3), -2, 3), 0);
    const bool uniform = in_.below(2) == 0;
    const kvevict_status status = checked(attend(layer, queries, stride, catalyst, uniform),
                                          catalyst ? "observe_catalyst" : "observe_attention");
    expect_refused(status, "observe");
  }

  void observe_surprisal() {
    const int count = in_.size(0, chunk_ + 1);
    std::vector<float> values(static_cast<std::size_t>(std::clamp(count, 1, 1 << 12)));
    for (float& value : values) value = in_.score();
    const bool null_values = in_.below(16) == 0;
    const kvevict_status status =
        checked(kvevict_sequence_observe_surprisal(
                    s_, null_values ? nullptr : values.data(),
                    count < 0 ? count : std::min<int>(count, static_cast<int>(values.size()))),
                "observe_surprisal");
    expect_refused(status, "observe_surprisal");
  }

  // Queries about one head, valid or not.
  void read_head() {
    const int layer = in_.size(-1, config_.layers);
    const int kv_head = in_.size(-1, config_.kv_heads);
    const bool valid =
        layer >= 0 && layer < config_.layers && kv_head >= 0 && kv_head < config_.kv_heads;
    const int live = kvevict_sequence_live(s_, layer, kv_head);
    if (!valid && live != -1) property_failed("live() of an invalid head is not -1");
    const std::int32_t slot = in_.size(-1, std::max(widest_slot_limit(std::max(layer, 0)), 1));
    std::int64_t position = -1;
    std::int64_t key_position = -1;
    const kvevict_status status = checked(
        kvevict_sequence_position(s_, layer, kv_head, slot, &position, &key_position), "position");
    if (status == KVEVICT_OK) {
      if (!valid) property_failed("position() of an invalid head succeeded");
      if (engine_.head(layer, kv_head)[static_cast<std::size_t>(slot)] == 0) {
        property_failed("position() of a slot the engine does not hold succeeded");
      }
      const std::int64_t fed = kvevict_sequence_tokens_fed(s_) + catalyst_;
      if (position < 0 || position >= fed) {
        property_failed("position " + std::to_string(position) + " outside [0, " +
                        std::to_string(fed) + ")");
      }
    }
    const kvevict_key_run* runs = nullptr;
    int runs_count = -1;
    const kvevict_status runs_status =
        checked(kvevict_sequence_key_runs(s_, layer, kv_head, in_.below(8) == 0 ? nullptr : &runs,
                                          &runs_count),
                "key_runs");
    if (runs_status == KVEVICT_OK && !valid) property_failed("key_runs of an invalid head");
  }

  // Ends whatever is open as a recovering engine would: the signals of every layer (failures
  // allowed), then end_forward or end_catalyst. False when the sequence's state is still unknown.
  bool recover() {
    if (state_ == State::idle) return true;
    if (state_ != State::catalyst) {
      for (int l = 0; l < config_.layers; ++l) {
        const int queries = std::max(chunk_, 1);
        if (checked(attend(l, queries, widest_slot_limit(l), false, true), "observe_attention") ==
                KVEVICT_OK ||
            kvevict_sequence_attention_per_kv_head(s_) == 0) {
          continue;
        }
        // A layer left part-observed by KV head: the rest of its heads, in order.
        for (int g = 0; g < config_.kv_heads; ++g) {
          checked(attend(l, queries, widest_slot_limit(l), false, true, g, g + 1),
                  "observe_attention_heads");
        }
      }
      std::vector<float> surprisal(static_cast<std::size_t>(std::max(chunk_, 1)), 1.0f);
      checked(kvevict_sequence_observe_surprisal(s_, surprisal.data(), chunk_),
              "observe_surprisal");
      const kvevict_status status = kvevict_sequence_end_forward(s_);
      call_end(checked(status, "end_forward"), state_);
      if (status == KVEVICT_OK) return true;
      if (std::string_view(kvevict_last_error()).find("no forward is open") == std::string::npos) {
        return false;
      }
    }
    for (int l = 0; l < config_.layers; ++l) {
      checked(attend(l, std::max(catalyst_, 1), widest_slot_limit(l), true, true),
              "observe_catalyst");
    }
    const kvevict_status status = kvevict_sequence_end_catalyst(s_);
    checked(status, "end_catalyst");
    if (status == KVEVICT_OK ||
        std::string_view(kvevict_last_error()).find("no catalyst prompt is open") !=
            std::string::npos) {
      state_ = State::idle;
      catalyst_ = 0;
      return true;
    }
    state_ = State::unknown;
    return false;
  }

  // What a correct engine does: a forward with every signal the policy wants, or the catalyst
  // when it is pending. It must succeed on a usable sequence with working callbacks.
  void well_formed_forward() {
    if (!recover()) return;
    // Without a reserve callback a sequence that must grow fails, with a message naming the fix.
    const bool strict =
        usable() && engine_.can_grow && !engine_.fail_reserve && !engine_.fail_apply;
    const auto require_ok = [&](kvevict_status status, const char* call) {
      checked(status, call);
      // SirLLM and its baselines refuse a turn longer than their budget (the cache cannot make
      // room for it): a documented precondition on the engine, not a failure.
      const bool turn_too_long =
          std::string_view(kvevict_last_error()).find("tokens is longer than") !=
          std::string_view::npos;
      if (strict && status != KVEVICT_OK && !turn_too_long) {
        property_failed(std::string("a well-formed ") + call + " failed: " + kvevict_last_error());
      }
      return status == KVEVICT_OK;
    };
    const std::uint32_t signals = kvevict_sequence_signals(s_);
    if (kvevict_sequence_catalyst_pending(s_) != 0) {
      const int n = 1 + in_.below(config_.max_chunk);
      const std::vector<std::int32_t> ids = token_ids(n);
      if (!require_ok(kvevict_sequence_begin_catalyst(s_, ids.data(), n), "begin_catalyst")) return;
      take_chunk_slots(n);
      state_ = State::catalyst;
      catalyst_ = n;
      chunk_ = n;
      if ((signals & KVEVICT_SIGNAL_CATALYST_ATTENTION) != 0) {
        for (int l = 0; l < config_.layers; ++l) {
          if (!require_ok(attend(l, n, widest_slot_limit(l), true, true), "observe_catalyst")) {
            return;
          }
        }
      }
      call_end(checked(kvevict_sequence_end_catalyst(s_), "end_catalyst"), State::catalyst);
      if (strict && state_ != State::idle) {
        property_failed(std::string("a well-formed end_catalyst failed: ") + kvevict_last_error());
      }
      return;
    }
    int n = 1 + in_.below(config_.max_chunk);
    const int room = kvevict_sequence_pot_room(s_);
    if (room > 0) n = std::min(n, room);
    if (pool_ != nullptr && !make_room_for(n, strict)) return;
    const std::vector<std::int32_t> ids = token_ids(n);
    if (!require_ok(kvevict_sequence_begin_chunk(s_, ids.data(), n, in_.below(2)), "begin_chunk")) {
      return;
    }
    take_chunk_slots(n);
    state_ = State::forward;
    chunk_ = n;
    catalyst_ = 0;
    const bool all_rows = (signals & KVEVICT_SIGNAL_ATTENTION_ROWS) != 0;
    // Every other forward of a policy that takes them apart hands the rows a KV head at a time
    // (no byte of the input decides it, so inputs decode as before).
    const bool per_kv_head =
        ++well_formed_forwards_ % 2 == 0 && kvevict_sequence_attention_per_kv_head(s_) != 0;
    if (all_rows || (signals & KVEVICT_SIGNAL_LAST_ATTENTION_ROW) != 0) {
      for (int l = 0; l < config_.layers; ++l) {
        for (int g = 0; g < (per_kv_head ? config_.kv_heads : 1); ++g) {
          // KV head g alone, or the whole layer (kv_end -1).
          if (!require_ok(attend(l, all_rows ? n : 1, widest_slot_limit(l), false, true, g,
                                 per_kv_head ? g + 1 : -1),
                          "observe_attention")) {
            return;
          }
        }
      }
    }
    if ((signals & KVEVICT_SIGNAL_KEYS) != 0) {
      // [kv_heads][n][head_dim] finite values from the input, every layer.
      std::vector<float> keys(static_cast<std::size_t>(config_.kv_heads) * n * config_.head_dim);
      for (int l = 0; l < config_.layers; ++l) {
        for (float& value : keys) value = static_cast<float>(in_.byte()) / 16.0f - 8.0f;
        if (!require_ok(kvevict_sequence_observe_keys(s_, l, keys.data(), config_.head_dim),
                        "observe_keys")) {
          return;
        }
      }
    }
    if ((signals & KVEVICT_SIGNAL_SURPRISAL) != 0) {
      std::vector<float> surprisal(static_cast<std::size_t>(n));
      for (float& value : surprisal) value = static_cast<float>(in_.byte()) / 16.0f;
      if (!require_ok(kvevict_sequence_observe_surprisal(s_, surprisal.data(), n),
                      "observe_surprisal")) {
        return;
      }
    }
    call_end(checked(kvevict_sequence_end_forward(s_), "end_forward"), State::forward);
    if (strict && state_ != State::idle) {
      property_failed(std::string("a well-formed end_forward failed: ") + kvevict_last_error());
    }
  }

  // --- pool mode ---------------------------------------------------------------------------------

  [[nodiscard]] kvevict_pool_stats pool_stats() const {
    kvevict_pool_stats stats{};
    if (checked_status(kvevict_pool_get_stats(pool_->pool, &stats), "kvevict_pool_get_stats") !=
        KVEVICT_OK) {
      property_failed("kvevict_pool_get_stats failed");
    }
    return stats;
  }

  [[nodiscard]] std::int64_t member_minimum() const {
    std::int64_t minimum = -1;
    if (checked_status(kvevict_pool_minimum(pool_->pool, pool_->member, &minimum),
                       "kvevict_pool_minimum") != KVEVICT_OK) {
      property_failed(std::string("minimum of a member failed: ") + kvevict_last_error());
    }
    return minimum;
  }

  // make_room, checked: a successful one fits the step in the pool and cuts no member below its
  // minimum; a refused one changes nothing.
  kvevict_status make_room(const std::vector<kvevict_pool_feed>& feeds) {
    const std::int64_t used = kvevict_pool_used(pool_->pool);
    const std::int64_t steps = pool_stats().steps;
    const int before = kvevict_sequence_max_live(s_);
    const std::int64_t minimum = pool_->member >= 0 ? member_minimum() : 0;
    const kvevict_status status = checked(
        kvevict_pool_make_room(pool_->pool, feeds.empty() ? nullptr : feeds.data(), feeds.size()),
        "kvevict_pool_make_room");
    make_room_message_ = kvevict_last_error();  // pool_stats() clears it
    const kvevict_pool_stats stats = pool_stats();
    if (status == KVEVICT_OK) {
      if (stats.steps != steps + 1) property_failed("a make_room was not counted");
      if (stats.peak_cells > pool_->cells) {
        property_failed("a step's peak of " + std::to_string(stats.peak_cells) +
                        " cells exceeds the pool's " + std::to_string(pool_->cells));
      }
      const int after = kvevict_sequence_max_live(s_);
      if (pool_->member >= 0 && after < std::min<std::int64_t>(before, minimum)) {
        property_failed("a member holding " + std::to_string(before) + " cells was cut to " +
                        std::to_string(after) + ", below its minimum " + std::to_string(minimum));
      }
    } else if (status == KVEVICT_BACKEND_ERROR) {
      if (make_room_message_.find("cut to make room") == std::string::npos) {
        property_failed("a failed cut does not name its member: " + make_room_message_);
      }
    } else if (stats.steps != steps || kvevict_pool_used(pool_->pool) != used) {
      property_failed("a refused make_room changed the pool");
    }
    return status;
  }

  // Before a well-formed forward of n tokens: make room for it and a neighbour token, as a correct
  // engine does (a member whose backend failed leaves first). False when the forward cannot go on.
  bool make_room_for(int n, bool strict) {
    if (pool_->member >= 0 && !usable()) {
      if (checked_status(kvevict_pool_leave(pool_->pool, pool_->member), "kvevict_pool_leave") !=
          KVEVICT_OK) {
        property_failed("a member could not leave");
      }
      pool_->member = -1;
    }
    std::vector<kvevict_pool_feed> feeds;
    if (pool_->member >= 0) feeds.push_back({pool_->member, n});
    if (pool_->neighbour_id >= 0) feeds.push_back({pool_->neighbour_id, 1});
    const kvevict_status status = make_room(feeds);
    if (status != KVEVICT_OK) {
      if (strict) {
        property_failed("a well-formed make_room failed: " + make_room_message_);
      }
      return false;
    }
    if (pool_->neighbour_id >= 0) pool_->feed_neighbour();
    return true;
  }

  void arbitrary_make_room() {
    std::vector<kvevict_pool_feed> feeds(static_cast<std::size_t>(in_.below(4)));
    for (kvevict_pool_feed& feed : feeds) {
      switch (in_.below(4)) {
        case 0:
          feed.member = pool_->member;
          break;
        case 1:
          feed.member = pool_->neighbour_id;
          break;
        case 2:
          feed.member = pool_->orphans.empty() ? -1 : pool_->orphans.back();
          break;
        default:
          feed.member = in_.size(-1, 4);
      }
      feed.tokens = in_.size(-1, config_.max_chunk + 1);
    }
    const bool names_orphan = std::any_of(feeds.begin(), feeds.end(), [&](const auto& feed) {
      return std::find(pool_->orphans.begin(), pool_->orphans.end(), feed.member) !=
             pool_->orphans.end();
    });
    const kvevict_status status = make_room(feeds);
    if (names_orphan && status == KVEVICT_OK) {
      property_failed("make_room fed a member whose sequence was destroyed");
    }
  }

  void shrink_to() {
    const int before = kvevict_sequence_max_live(s_);
    const int max_live = in_.size(-1, std::max(before, 0) + 1);
    const kvevict_status status =
        checked(kvevict_sequence_shrink_to(s_, max_live), "kvevict_sequence_shrink_to");
    expect_refused(status, "shrink_to");
    if (status == KVEVICT_OK && kvevict_sequence_max_live(s_) > before) {
      property_failed("shrink_to grew the sequence");
    }
  }

  void leave_or_join() {
    if (pool_->member >= 0) {
      if (checked_status(kvevict_pool_leave(pool_->pool, pool_->member), "kvevict_pool_leave") !=
          KVEVICT_OK) {
        property_failed("a member could not leave");
      }
      if (kvevict_pool_leave(pool_->pool, pool_->member) == KVEVICT_OK) {
        property_failed("a member left twice");
      }
      pool_->member = -1;
      return;
    }
    int id = -2;
    const kvevict_status status = checked_status(
        kvevict_pool_join(pool_->pool, s_, in_.size(0, 8), &id), "kvevict_pool_join");
    if (status == KVEVICT_OK) {
      if (id < 0 || kvevict_pool_is_member(pool_->pool, id) != 1) property_failed("a bad id");
      pool_->member = id;
    } else if (id != -1) {
      property_failed("a failed join left the id " + std::to_string(id));
    }
  }

  // Destroys in the wrong order: the neighbour before it left, or the pool before its members;
  // or releases the ids of destroyed members.
  void wrong_order() {
    switch (in_.below(3)) {
      case 0: {
        if (pool_->neighbour_id < 0) return;
        const int id = pool_->neighbour_id;
        kvevict_sequence_destroy(pool_->neighbour);
        pool_->neighbour = nullptr;
        pool_->neighbour_id = -1;
        pool_->orphans.push_back(id);
        if (kvevict_pool_is_member(pool_->pool, id) != 0) {
          property_failed("a destroyed sequence is still a member");
        }
        // (make_room may name another reason first: a member inside a forward.)
        const kvevict_pool_feed feed{id, 0};
        std::int64_t minimum = 0;
        if (checked_status(kvevict_pool_make_room(pool_->pool, &feed, 1),
                           "kvevict_pool_make_room") == KVEVICT_OK ||
            checked_status(kvevict_pool_minimum(pool_->pool, id, &minimum),
                           "kvevict_pool_minimum") == KVEVICT_OK ||
            std::string_view(kvevict_last_error()).find("was destroyed") ==
                std::string_view::npos) {
          property_failed("a destroyed member was not refused as such");
        }
        pool_->add_neighbour();
        if (std::find(pool_->orphans.begin(), pool_->orphans.end(), pool_->neighbour_id) !=
            pool_->orphans.end()) {
          property_failed("a destroyed member's id was given to a join");
        }
        return;
      }
      case 1:
        for (const int id : pool_->orphans) {
          if (checked_status(kvevict_pool_leave(pool_->pool, id), "kvevict_pool_leave") !=
              KVEVICT_OK) {
            property_failed("the id of a destroyed member could not be released");
          }
        }
        pool_->orphans.clear();
        return;
      default:
        kvevict_pool_destroy(pool_->pool);
        pool_->pool = nullptr;
        pool_->orphans.clear();
        pool_->create_pool();
        pool_->neighbour_id = -1;
        if (checked_status(
                kvevict_pool_join(pool_->pool, pool_->neighbour, 0, &pool_->neighbour_id),
                "kvevict_pool_join") != KVEVICT_OK) {
          property_failed(std::string("a former member could not join a new pool: ") +
                          kvevict_last_error());
        }
        if (pool_->member >= 0) {
          pool_->member = -1;
          if (checked_status(kvevict_pool_join(pool_->pool, s_, 0, &pool_->member),
                             "kvevict_pool_join") != KVEVICT_OK &&
              std::string_view(kvevict_last_error()).find("already member") !=
                  std::string_view::npos) {
            property_failed("a destroyed pool kept its member");
          }
        }
    }
  }

  void check_pool() const {
    if (pool_ == nullptr) return;
    const std::int64_t charged = kvevict_pool_charged(pool_->pool);
    if (charged < 0 || charged > pool_->cells || kvevict_pool_cells(pool_->pool) != pool_->cells) {
      property_failed("charged " + std::to_string(charged) + " of a pool of " +
                      std::to_string(kvevict_pool_cells(pool_->pool)));
    }
    if (pool_->member >= 0) {
      if (kvevict_pool_is_member(pool_->pool, pool_->member) != 1) {
        property_failed("the sequence is no member");
      }
      (void)member_minimum();
    }
  }

  void check_invariants() const {
    if (!usable()) return;  // the sequence changed, the engine did not: nothing to compare
    const int capacity = kvevict_sequence_capacity(s_);
    if (capacity != engine_.capacity) {
      property_failed("capacity " + std::to_string(capacity) + ", the backend reserved " +
                      std::to_string(engine_.capacity));
    }
    for (int l = 0; l < config_.layers; ++l) {
      for (int g = 0; g < config_.kv_heads; ++g) {
        const int live = kvevict_sequence_live(s_, l, g);
        const int limit = kvevict_sequence_slot_limit(s_, l, g);
        if (live != engine_.count(l, g)) {
          property_failed("head (" + std::to_string(l) + ", " + std::to_string(g) + ") has " +
                          std::to_string(live) + " live slots, the engine holds " +
                          std::to_string(engine_.count(l, g)));
        }
        if (live < 0 || live > limit || limit > capacity) {
          property_failed("live " + std::to_string(live) + ", slot limit " + std::to_string(limit) +
                          ", capacity " + std::to_string(capacity));
        }
        check_key_runs(l, g, limit);
      }
    }
  }

  // During a forward the runs and the mask cover exactly the live slots below the limit, runs
  // sorted and disjoint; between forwards both are refused.
  void check_key_runs(int layer, int kv_head, int limit) const {
    const kvevict_key_run* runs = nullptr;
    int count = -1;
    const kvevict_status runs_status = kvevict_sequence_key_runs(s_, layer, kv_head, &runs, &count);
    const std::uint8_t* mask = nullptr;
    int mask_size = -1;
    const kvevict_status mask_status =
        kvevict_sequence_live_mask(s_, layer, kv_head, &mask, &mask_size);
    if (state_ == State::idle) {
      if (runs_status == KVEVICT_OK || mask_status == KVEVICT_OK) {
        property_failed("key_runs / live_mask succeeded between forwards");
      }
      return;
    }
    checked_status(runs_status, "key_runs");
    checked_status(mask_status, "live_mask");
    if (mask_size != limit) {
      property_failed("live_mask has " + std::to_string(mask_size) + " bytes, slot limit " +
                      std::to_string(limit));
    }
    const std::vector<std::uint8_t>& held = engine_.head(layer, kv_head);
    std::vector<std::uint8_t> covered(static_cast<std::size_t>(limit), 0);
    std::int32_t previous_end = 0;
    for (int r = 0; r < count; ++r) {
      const kvevict_key_run& run = runs[r];
      if (run.begin < previous_end || run.begin >= run.end || run.end > limit) {
        property_failed("key run [" + std::to_string(run.begin) + ", " + std::to_string(run.end) +
                        ") is unsorted, empty or past the slot limit " + std::to_string(limit));
      }
      std::fill(covered.begin() + run.begin, covered.begin() + run.end, std::uint8_t{1});
      previous_end = run.end;
    }
    for (int slot = 0; slot < limit; ++slot) {
      const auto s = static_cast<std::size_t>(slot);
      if ((held[s] != 0) != (covered[s] != 0) || covered[s] != mask[s]) {
        property_failed("slot " + std::to_string(slot) + ": held " + std::to_string(held[s]) +
                        ", in a key run " + std::to_string(covered[s]) + ", live_mask " +
                        std::to_string(mask[s]));
      }
    }
  }

  Bytes& in_;
  kvevict_sequence* s_;
  Engine& engine_;
  const kvevict_config& config_;
  State state_ = State::idle;
  bool backend_failed_ = false;  // a call returned KVEVICT_BACKEND_ERROR: the sequence is unusable
  int chunk_ = 0;                // tokens of the open chunk or catalyst
  int catalyst_ = 0;             // tokens of the open catalyst (positions run past tokens_fed)
  std::vector<float> rows_;
  int well_formed_forwards_ = 0;
  PoolSide* pool_;                 // pool mode, else nullptr
  std::string make_room_message_;  // the last make_room's kvevict_last_error()
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // Pool mode: a first byte no committed input before it had (they start with a policy index).
  const bool pool_mode = size > 0 && data[0] >= 0xC0;
  Bytes in(data + (pool_mode ? 1 : 0), size - (pool_mode ? 1 : 0));
  const std::vector<std::string_view> names = kvevict::policy_names();
  const std::string policy(
      names[static_cast<std::size_t>(in.below(static_cast<int>(names.size())))]);

  // Parameters: what --budget N means for the policy, or free text.
  std::string params;
  if (in.below(2) == 0) {
    std::array<char, 256> buffer{};
    const int budget = in.size(0, 48);
    const int sinks = in.size(0, 8);
    const std::size_t room = in.below(8) == 0 ? in.below(8) : buffer.size();
    const kvevict_status status =
        checked_status(kvevict_budget_params(policy.c_str(), budget, sinks,
                                             room == 0 ? nullptr : buffer.data(), room),
                       "kvevict_budget_params");
    if (status == KVEVICT_OK) params = buffer.data();
  } else {
    params = in.text(48);
  }
  if (!modest(params)) return 0;

  kvevict_config config;
  kvevict_config_init(&config);
  config.layers = in.size(1, 3);
  config.kv_heads = in.size(1, 3);
  const std::int64_t grouped = std::int64_t{config.kv_heads} * (1 + in.below(2));
  config.q_heads = in.below(16) == 0 ? in.size(0, 4) : static_cast<int>(grouped);
  config.max_chunk = in.size(1, 8);
  static constexpr std::array<const char*, 5> kModes{nullptr, "original", "cache_index",
                                                     "reset_on_compact", "sideways"};
  static constexpr std::array<const char*, 5> kUnits{nullptr, "head", "layer", "token", "all"};
  config.position_mode = kModes[static_cast<std::size_t>(in.below(kModes.size()))];
  config.granularity = kUnits[static_cast<std::size_t>(in.below(kUnits.size()))];
  config.post_rope_keys = in.below(2);
  config.max_pending_rotations = in.size(0, 3);
  // Key length for the policies that read keys; derived, not read, so that the inputs kept before
  // keys existed still drive the same calls.
  config.head_dim = 1 + config.max_chunk % 4;
  // Valid configurations this large are requests for memory in proportion (up to the stated
  // limits: 2^20 heads, 2^28 slots), not what this target looks for; the edges beyond are kept.
  const std::int64_t heads = std::int64_t{config.layers} * config.kv_heads;
  if (config.layers > 0 && config.kv_heads > 0 && heads > 16 && heads <= (1 << 20)) return 0;
  if (config.max_chunk > 64 && config.max_chunk <= (1 << 28)) return 0;

  Engine engine;
  const int backend_kind = in.below(8);  // 0: no backend; 1: no reserve callback
  engine.fail_reserve = in.below(16) == 0;
  const kvevict_backend backend{&engine, backend_kind == 1 ? nullptr : &Engine::reserve,
                                &Engine::apply};
  if (config.layers > 0 && config.kv_heads > 0 && heads <= 16) {
    engine.layers = config.layers;
    engine.kv_heads = config.kv_heads;
    engine.held.resize(static_cast<std::size_t>(heads));
  }

  kvevict_sequence* sequence = nullptr;
  const kvevict_status created =
      checked_status(kvevict_sequence_create(policy.c_str(), params.c_str(), &config,
                                             backend_kind == 0 ? nullptr : &backend, &sequence),
                     "kvevict_sequence_create");
  if (created != KVEVICT_OK) {
    if (sequence != nullptr) property_failed("a failed create left a sequence");
    return 0;
  }
  if (sequence == nullptr) property_failed("create succeeded without a sequence");
  const int limit = kvevict_sequence_retained_limit(sequence);
  if (limit < -1) property_failed("retained_limit() is " + std::to_string(limit));
  // The engine's mirror needs the callbacks; without them, only the C API's own promises are
  // checked (the mirror stays at the sequence's capacity, reserved by nobody).
  if (backend_kind == 0) {
    kvevict_sequence_destroy(sequence);
    return 0;
  }
  if (engine.layers == 0) property_failed("create accepted layers * kv_heads outside [1, 16]");
  if (config.q_heads > 64) {  // valid, but the rows this target hands over would be huge
    kvevict_sequence_destroy(sequence);
    return 0;
  }
  if (backend_kind == 1) {  // the engine sized its buffers for the sequence's capacity
    engine.can_grow = false;
    const bool fail = engine.fail_reserve;
    engine.fail_reserve = false;
    Engine::reserve(&engine, kvevict_sequence_capacity(sequence));
    engine.fail_reserve = fail;
  }
  if (!pool_mode) {
    Session(in, sequence, engine, config).run();
    kvevict_sequence_destroy(sequence);
    return 0;
  }
  // The pool: the sequence at its bound (or 8 tokens when unbounded) plus a neighbour window two
  // tokens longer, each with one chunk, in about half of what the two need at full length; the
  // charges (at most the bound plus a chunk, and 1 plus a chunk) always fit.
  PoolSide side;
  side.max_chunk = config.max_chunk;
  const std::int64_t bound = limit >= 0 ? limit : 8;
  side.cells = bound + 2 * std::int64_t{config.max_chunk} + 2;
  side.neighbour_recent = static_cast<int>(bound + config.max_chunk + 2);
  side.create_pool();
  side.add_neighbour();
  const kvevict_status joined =
      checked_status(kvevict_pool_join(side.pool, sequence, 0, &side.member), "kvevict_pool_join");
  if (joined != KVEVICT_OK && side.member != -1) property_failed("a failed join left an id");
  Session(in, sequence, engine, config, &side).run();
  // The wrong order: the sequence destroyed while a member, the pool after it.
  kvevict_sequence_destroy(sequence);
  if (side.member >= 0 && kvevict_pool_is_member(side.pool, side.member) != 0) {
    property_failed("a destroyed sequence is still a member");
  }
  return 0;
}
