// own_buffers: an engine that keeps keys and values in its own buffer and lets kvevict decide which
// tokens stay, through the engine view (kvevict/engine.hpp; the protocol: docs/design.md). Links
// kvevict::core only (the standard library; no Eigen).
//
// The engine's buffer is token-major, [slots][layers][kv_heads][head_dim]: row s holds slot s of
// every head. Keys are stored after RoPE, rotated when written to Sequence::key_position;
// attention rotates each query once per key run (Sequence::key_runs) and skips free slots.
//
// It runs StreamingLLM and H2O over a random "model" (random K/V and queries), checks that the
// engine's buffer holds exactly the tokens kvevict keeps, and prints what each policy kept.
//
//   own_buffers
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <kvevict/engine.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policies/streaming_llm.hpp>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kLayers = 2;
constexpr int kQueryHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kGroup = kQueryHeads / kKvHeads;
constexpr int kHeadDim = 32;
constexpr int kBudget = 24;
constexpr int kTokens = 200;

// The engine's side: its buffer, and the two things kvevict may ask of it.
class Engine final : public kvevict::KvBackend {
 public:
  explicit Engine(const kvevict::Rope& rope) : rope_(rope) {}

  // Every head's slots are [0, capacity): grow the buffer, keeping rows (slot s stays row s).
  void reserve(int capacity) override {
    const std::size_t row = static_cast<std::size_t>(kLayers) * kKvHeads * kHeadDim;
    keys_.resize(static_cast<std::size_t>(capacity) * row, 0.0f);
    values_.resize(static_cast<std::size_t>(capacity) * row, 0.0f);
    tokens_.resize(static_cast<std::size_t>(capacity) * kLayers * kKvHeads, -1);
  }
  // A decision kvevict made: the evicted slots are free (nothing to move); keys it folds a pending
  // rotation into are rotated in place.
  void apply(const kvevict::AppliedDecision& decision) override {
    std::vector<double> angles(static_cast<std::size_t>(rope_.pairs()) * 2);
    for (int l = 0; l < kLayers; ++l) {
      for (int g = 0; g < kKvHeads; ++g) {
        for (const kvevict::EvictedSlot& evicted : decision.evicted(l, g)) {
          token(evicted.slot, l, g) = -1;  // bookkeeping for the check below, not needed
        }
        for (const kvevict::KeyRotation& rotation : decision.rotations(l, g)) {
          const double* cos_sin = rope_.angles(rotation.delta, angles.data());
          for (const std::int32_t slot : rotation.slots)
            rope_.rotate_with(key(slot, l, g), cos_sin);
        }
      }
    }
  }

  float* key(std::int32_t slot, int l, int g) { return keys_.data() + offset(slot, l, g); }
  float* value(std::int32_t slot, int l, int g) { return values_.data() + offset(slot, l, g); }
  std::int64_t& token(std::int32_t slot, int l, int g) {
    return tokens_[(static_cast<std::size_t>(slot) * kLayers + l) * kKvHeads + g];
  }

 private:
  static std::size_t offset(std::int32_t slot, int l, int g) {
    return ((static_cast<std::size_t>(slot) * kLayers + l) * kKvHeads + g) * kHeadDim;
  }

  const kvevict::Rope& rope_;
  std::vector<float> keys_;           // [slots][layers][kv_heads][head_dim]
  std::vector<float> values_;         // [slots][layers][kv_heads][head_dim]
  std::vector<std::int64_t> tokens_;  // [slots][layers][kv_heads]: which token a row holds
};

// softmax(q . K / sqrt(d)) over the live slots of head (l, g), the query at `position`; free slots
// get 0. Writes the probabilities to `p` ([slot_limit]) and returns p . V in `out`.
void attend(const kvevict::Sequence& sequence, Engine& engine, const kvevict::Rope& rope, int l,
            int g, const std::vector<float>& query, std::int64_t position, std::vector<float>& p,
            std::vector<float>& out) {
  const int limit = sequence.slot_limit(l, g);
  p.assign(static_cast<std::size_t>(limit), -INFINITY);
  std::vector<float> rotated(query.size());
  for (const kvevict::KeyRun& run : sequence.key_runs(l, g)) {
    rotated = query;
    rope.rotate(rotated.data(), position - run.rotation);  // one rotation per run, not per key
    for (int s = run.begin; s < run.end; ++s) {
      const float* k = engine.key(s, l, g);
      float dot = 0;
      for (int c = 0; c < kHeadDim; ++c) dot += k[c] * rotated[static_cast<std::size_t>(c)];
      p[static_cast<std::size_t>(s)] = dot / std::sqrt(static_cast<float>(kHeadDim));
    }
  }
  const float max = *std::max_element(p.begin(), p.end());
  float sum = 0;
  for (float& x : p) sum += x = std::isinf(x) ? 0.0f : std::exp(x - max);
  out.assign(kHeadDim, 0.0f);
  for (int s = 0; s < limit; ++s) {
    p[static_cast<std::size_t>(s)] /= sum;
    const float* v = engine.value(s, l, g);
    for (int c = 0; c < kHeadDim; ++c)
      out[static_cast<std::size_t>(c)] += p[static_cast<std::size_t>(s)] * v[c];
  }
}

// Streams kTokens one at a time through `policy` (named `name`), which keeps kBudget tokens.
int run(const std::string& name, std::unique_ptr<kvevict::Policy> policy) {
  const kvevict::Rope rope(
      kvevict::RopeConfig{kHeadDim, 0, 10000.0, kvevict::RopeLayout::half_split});
  Engine engine(rope);
  kvevict::SequenceConfig config;
  config.layers = kLayers;
  config.q_heads = kQueryHeads;
  config.kv_heads = kKvHeads;
  config.max_chunk = 1;
  kvevict::Sequence sequence(config, std::move(policy), &engine);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> p, out, query(kHeadDim);
  std::vector<float> rows;  // [q_heads][1][stride] for a policy that reads attention
  for (std::int64_t t = 0; t < kTokens; ++t) {
    const std::int32_t id = static_cast<std::int32_t>(rng() % 1000);
    sequence.begin_chunk(std::span<const std::int32_t>(&id, 1));
    for (int l = 0; l < kLayers; ++l) {
      // The model's keys and values for this token: random here. Written at the token's slot, the
      // key rotated to the position kvevict names.
      for (int g = 0; g < kKvHeads; ++g) {
        const std::int32_t slot = sequence.chunk_slots(l, g)[0];
        for (int c = 0; c < kHeadDim; ++c) {
          engine.key(slot, l, g)[c] = normal(rng);
          engine.value(slot, l, g)[c] = normal(rng);
        }
        rope.rotate(engine.key(slot, l, g), sequence.key_position(l, g, slot));
        engine.token(slot, l, g) = t;
      }
      // Attention of every query head over its KV head's live slots; rows to the policy.
      int stride = 0;
      for (int g = 0; g < kKvHeads; ++g) stride = std::max(stride, sequence.slot_limit(l, g));
      rows.assign(static_cast<std::size_t>(kQueryHeads) * stride, 0.0f);
      for (int h = 0; h < kQueryHeads; ++h) {
        const int g = h / kGroup;
        const std::int32_t own = sequence.chunk_slots(l, g)[0];
        for (float& x : query) x = normal(rng);
        attend(sequence, engine, rope, l, g, query, sequence.position(l, g, own), p, out);
        std::copy(p.begin(), p.end(), rows.begin() + static_cast<std::ptrdiff_t>(h) * stride);
      }
      // One token per forward: attention_queries() is 1 for H2O and TOVA alike.
      if (sequence.wants_attention()) sequence.observe_attention(l, rows.data(), 1, stride);
    }
    sequence.end_forward();
  }
  // The engine's buffer holds exactly the tokens kvevict keeps, in every head.
  for (int l = 0; l < kLayers; ++l) {
    for (int g = 0; g < kKvHeads; ++g) {
      const int unit = sequence.unit_of(l, g);
      std::vector<std::int64_t> kept;
      for (const std::int32_t slot : sequence.slots().stream_order(unit)) {
        kept.push_back(sequence.slots().original_positions(unit)[static_cast<std::size_t>(slot)]);
        if (engine.token(slot, l, g) != kept.back()) {
          std::fprintf(stderr, "own_buffers: slot %d of head (%d, %d) holds token %lld, not %lld\n",
                       slot, l, g, static_cast<long long>(engine.token(slot, l, g)),
                       static_cast<long long>(kept.back()));
          return 1;
        }
      }
      if (static_cast<int>(kept.size()) != kBudget) {
        std::fprintf(stderr, "own_buffers: head (%d, %d) holds %zu tokens, budget %d\n", l, g,
                     kept.size(), kBudget);
        return 1;
      }
      if (l == 0) {
        std::printf("%-13s head (0, %d) keeps:", name.c_str(), g);
        for (const std::int64_t token : kept) std::printf(" %lld", static_cast<long long>(token));
        std::printf("\n");
      }
    }
  }
  const kvevict::SequenceStats& stats = sequence.stats();
  std::printf("%-13s %lld tokens, %lld evicted (all heads), %lld keys re-rotated, slots used %d\n",
              name.c_str(), static_cast<long long>(stats.tokens_fed),
              static_cast<long long>(stats.evicted_slots),
              static_cast<long long>(stats.rotated_keys), sequence.capacity());
  return 0;
}

}  // namespace

int main() {
  try {
    // Each policy from its own header: 4 sinks + the newest; the newest half + the top half by
    // accumulated attention.
    if (const int status = run("streaming_llm", kvevict::make_streaming_llm({4, kBudget - 4}));
        status != 0) {
      return status;
    }
    return run("h2o", kvevict::make_h2o({kBudget / 2, kBudget - kBudget / 2}));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "own_buffers: error: %s\n", error.what());
    return 2;
  }
}
