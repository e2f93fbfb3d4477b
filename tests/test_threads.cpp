// Several sequences at once (docs/reliability.md): threads that each run their own decoder and
// cache over one shared model, and threads that each drive their own C API sequence, decide and
// compute exactly what the same work does alone on one thread. A decoder only reads the model, a
// sequence owns all of its state and the C API's last error is per thread; run under
// ThreadSanitizer (the tsan preset), this test is what checks that no hidden state is shared.
#include <gtest/gtest.h>
#include <kvevict/c_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <kvevict/detail/stream_order.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policy_registry.hpp>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace {

using kvevict::model::DecodeActivations;
using kvevict::model::Decoder;
using kvevict::model::DecoderOptions;
using kvevict::model::ForwardRequest;
using kvevict::model::Model;
using kvevict::model::ModelConfig;

Model shared_model() {
  ModelConfig config;
  config.dim = 32;
  config.hidden_dim = 64;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.vocab_size = 260;
  config.context_length = 256;
  return kvevict::model::make_random_model(config, /*seed=*/3);
}

// Deterministic byte tokens (an LCG), different per stream.
std::vector<std::int32_t> stream(int count, std::uint32_t seed) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(count));
  std::uint32_t state = seed;
  for (std::int32_t& token : out) {
    state = state * 1664525u + 1013904223u;
    token = static_cast<std::int32_t>((state >> 8) % 256u);
  }
  return out;
}

// run(i) for i in [0, count), each on a thread of its own, all at once; the results in order.
template <class Result, class Run>
std::vector<Result> on_threads(int count, Run run) {
  std::vector<Result> results(static_cast<std::size_t>(count));
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&, i] { results[static_cast<std::size_t>(i)] = run(i); });
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

// The same number of floats with the same bits.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// What one decoder produced: the logits of every token fed, and what its cache holds at the end.
struct DecoderRun {
  std::vector<float> logits;
  std::int64_t evicted_slots = 0;
  std::int64_t live = 0;
  std::string error;
};

// Policies that read every kind of signal: none, all attention rows, the last row, surprisal with
// turns, and the catalyst prompt.
const std::vector<std::string> kPolicies = {"streaming_llm", "h2o", "tova", "sirllm", "infinipot"};

DecoderRun run_decoder(const Model& model, const std::string& policy, std::uint32_t seed,
                       int decoder_threads = 1,
                       DecodeActivations activations = DecodeActivations::f32) {
  DecoderRun run;
  try {
    DecoderOptions options;
    // 8-bit activations are for one-row products: then every token is fed alone.
    options.max_chunk = activations == DecodeActivations::q8_0 ? 1 : 8;
    options.threads = decoder_threads;
    options.decode_activations = activations;
    Decoder decoder(model, kvevict::make_policy(policy, kvevict::budget_params(policy, 24, 2)),
                    options);
    if (policy == "infinipot") decoder.set_catalyst(stream(4, 99));
    const std::vector<std::int32_t> tokens = stream(96, seed);
    for (std::size_t begin = 0; begin < tokens.size(); begin += 24) {
      // Every 24 tokens a turn starts (SirLLM evicts only then).
      const auto result = decoder.feed(std::span(tokens).subspan(begin, 24),
                                       ForwardRequest{/*turn_start=*/true, /*all_logits=*/true});
      run.logits.insert(run.logits.end(), result.logits.begin(), result.logits.end());
    }
    run.evicted_slots = decoder.cache().sequence().stats().evicted_slots;
    run.live = decoder.cache().sequence().slots().total_live();
  } catch (const std::exception& error) {
    run.error = error.what();
  }
  return run;
}

TEST(Threads, DecodersOverOneSharedModelComputeWhatTheyComputeAlone) {
  const Model model = shared_model();
  constexpr int kCopies = 2;  // two threads per policy, on different streams
  std::vector<DecoderRun> alone;
  for (int copy = 0; copy < kCopies; ++copy) {
    for (const std::string& policy : kPolicies) {
      alone.push_back(run_decoder(model, policy, 17u + static_cast<std::uint32_t>(copy)));
      ASSERT_EQ(alone.back().error, "") << policy;
      ASSERT_GT(alone.back().evicted_slots, 0) << policy << ": the stream should overflow 24";
    }
  }
  // Together, each decoder runs its forwards on two threads of its own (DecoderOptions::threads:
  // products split by rows, attention by KV heads), which must not change a bit either.
  const std::vector<DecoderRun> together =
      on_threads<DecoderRun>(static_cast<int>(alone.size()), [&](int i) {
        const auto index = static_cast<std::size_t>(i);
        return run_decoder(model, kPolicies[index % kPolicies.size()],
                           17u + static_cast<std::uint32_t>(index / kPolicies.size()),
                           /*decoder_threads=*/2);
      });
  for (std::size_t i = 0; i < alone.size(); ++i) {
    const std::string& policy = kPolicies[i % kPolicies.size()];
    EXPECT_EQ(together[i].error, "") << policy;
    EXPECT_EQ(together[i].evicted_slots, alone[i].evicted_slots) << policy;
    EXPECT_EQ(together[i].live, alone[i].live) << policy;
    // Same operations on the same inputs: the same bits.
    EXPECT_TRUE(same_bits(together[i].logits, alone[i].logits)) << policy;
  }
}

// Q4_0 decoding with 8-bit activations: the calling thread rounds x once and the pool's threads
// read it through a reference to the caller's buffer. Decoders on threads of their own, each
// splitting its products between two threads, compute what each computes alone.
TEST(Threads, Q4_0DecodersWith8BitActivationsComputeWhatTheyComputeAlone) {
  ModelConfig config;
  config.dim = 128;  // [2048, 128] classifier: 262,144 weights, split between threads
  config.hidden_dim = 256;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.vocab_size = 2048;
  config.context_length = 256;
  const Model model =
      kvevict::model::make_random_model(config, /*seed=*/5, kvevict::model::DType::q4_0);
  constexpr int kDecoders = 2;
  std::vector<DecoderRun> alone;
  for (int i = 0; i < kDecoders; ++i) {
    alone.push_back(
        run_decoder(model, "h2o", 17u + static_cast<std::uint32_t>(i), 1, DecodeActivations::q8_0));
    ASSERT_EQ(alone.back().error, "");
  }
  const DecoderRun f32_activations = run_decoder(model, "h2o", 17u, 1, DecodeActivations::f32);
  ASSERT_EQ(f32_activations.logits.size(), alone[0].logits.size());
  EXPECT_FALSE(same_bits(f32_activations.logits, alone[0].logits))
      << "the 8-bit activations should have been used";
  const std::vector<DecoderRun> together = on_threads<DecoderRun>(kDecoders, [&](int i) {
    return run_decoder(model, "h2o", 17u + static_cast<std::uint32_t>(i), 2,
                       DecodeActivations::q8_0);
  });
  for (std::size_t i = 0; i < alone.size(); ++i) {
    EXPECT_EQ(together[i].error, "");
    EXPECT_TRUE(same_bits(together[i].logits, alone[i].logits)) << "decoder " << i;
  }
}

// --- C API sequences ---------------------------------------------------------------------------

struct SequenceRun {
  std::vector<std::int64_t> evicted_positions;  // original positions, in the order applied
  int live = 0;
  std::string misuse_message;  // kvevict_last_error() after this thread's own bad call
  std::string error;
};

int record_evicted(void* self, const kvevict_decision* decision) {
  auto& run = *static_cast<SequenceRun*>(self);
  const kvevict_evicted* evicted = nullptr;
  int count = 0;
  if (kvevict_decision_evicted(decision, 0, 0, &evicted, &count) != KVEVICT_OK) return 1;
  for (int i = 0; i < count; ++i) run.evicted_positions.push_back(evicted[i].original_position);
  return 0;
}

int accept_reserve(void* /*self*/, int /*capacity*/) { return 0; }

// H2O over 1 layer x 1 KV head with attention rows that favour every third slot, fed through the
// C API; every few steps the thread makes a call that fails, with a message naming `thread`.
SequenceRun run_sequence(int thread) {
  SequenceRun run;
  kvevict_config config;
  kvevict_config_init(&config);
  config.layers = 1;
  config.q_heads = 2;
  config.kv_heads = 1;
  config.max_chunk = 1;
  const kvevict_backend backend{&run, &accept_reserve, &record_evicted};
  kvevict_sequence* sequence = nullptr;
  if (kvevict_sequence_create("h2o", "heavy=8 recent=8", &config, &backend, &sequence) !=
      KVEVICT_OK) {
    run.error = kvevict_last_error();
    return run;
  }
  std::vector<float> rows;
  for (int step = 0; step < 120 && run.error.empty(); ++step) {
    const std::int32_t id = step % 256;
    if (kvevict_sequence_begin_chunk(sequence, &id, 1, 0) != KVEVICT_OK) break;
    const int limit = kvevict_sequence_slot_limit(sequence, 0, 0);
    rows.assign(2 * static_cast<std::size_t>(limit), 0.0f);
    for (int slot = 0; slot < limit; ++slot) {
      std::int64_t position = 0;
      if (kvevict_sequence_position(sequence, 0, 0, slot, &position, nullptr) != KVEVICT_OK) {
        continue;  // a free slot
      }
      const float weight = position % 3 == 0 ? 0.3f : 0.1f;  // probabilities, as Sequence checks
      rows[static_cast<std::size_t>(slot)] = weight;
      rows[static_cast<std::size_t>(limit + slot)] = weight;
    }
    if (kvevict_sequence_observe_attention(sequence, 0, rows.data(), 1, limit) != KVEVICT_OK ||
        kvevict_sequence_end_forward(sequence) != KVEVICT_OK) {
      break;
    }
    if (step % 10 == 0) {
      // This thread's own failure; other threads' failures and successes must not touch it.
      const std::vector<float> surprisal(1, 0.0f);
      (void)kvevict_sequence_observe_surprisal(sequence, surprisal.data(), -thread - 1);
      run.misuse_message = kvevict_last_error();
      std::this_thread::yield();
      if (run.misuse_message != kvevict_last_error()) run.error = "last error changed";
    }
  }
  if (run.error.empty() && kvevict_sequence_tokens_fed(sequence) != 120) {
    run.error = kvevict_last_error();
  }
  run.live = kvevict_sequence_live(sequence, 0, 0);
  kvevict_sequence_destroy(sequence);
  return run;
}

TEST(Threads, CApiSequencesDecideAsAloneAndKeepTheirOwnLastError) {
  const SequenceRun alone = run_sequence(0);
  ASSERT_EQ(alone.error, "");
  ASSERT_FALSE(alone.evicted_positions.empty());
  EXPECT_EQ(alone.live, 8 + 8);  // heavy + recent once the stream passed them
  constexpr int kThreads = 6;
  const std::vector<SequenceRun> together = on_threads<SequenceRun>(kThreads, run_sequence);
  for (int t = 0; t < kThreads; ++t) {
    const SequenceRun& run = together[static_cast<std::size_t>(t)];
    EXPECT_EQ(run.error, "") << "thread " << t;
    EXPECT_EQ(run.evicted_positions, alone.evicted_positions) << "thread " << t;
    EXPECT_EQ(run.live, alone.live) << "thread " << t;
    EXPECT_NE(run.misuse_message.find("got " + std::to_string(-t - 1)), std::string::npos)
        << "thread " << t << ": " << run.misuse_message;
  }
}

// A stream order with a removal gap open reads the same on threads that list it at once: view()
// copies it into one span once (under a lock), the pieces are read in place.
TEST(Threads, StreamOrderViewsAtOnceReadTheSameEntries) {
  kvevict::detail::StreamOrder order;
  std::vector<std::int32_t> list;
  order.reserve(1000);
  for (std::int32_t slot = 0; slot < 1000; ++slot) {
    order.push_back(slot);
    list.push_back(slot);
  }
  for (int round = 0; round < 20; ++round) {
    // The first removal after a view closes its gap; the second opens one, away from both ends:
    // the views are a copy.
    const int at = 300 + 7 * round;
    for (int removal = 0; removal < 2; ++removal) {
      order.erase(at);
      list.erase(list.begin() + at);
    }
    ASSERT_FALSE(order.pieces().back.empty());
    std::vector<int> same(4, 0);
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < same.size(); ++t) {
      threads.emplace_back([&, t] {
        const std::span<const std::int32_t> view = order.view();
        const kvevict::detail::StreamOrderPieces pieces = order.pieces();
        bool equal = std::equal(view.begin(), view.end(), list.begin(), list.end());
        for (int i = 0; i < pieces.size(); ++i) {
          equal = equal && pieces[i] == list[static_cast<std::size_t>(i)];
        }
        same[t] = equal ? 1 : 0;
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (std::size_t t = 0; t < same.size(); ++t) EXPECT_EQ(same[t], 1) << "round " << round;
  }
}

}  // namespace
