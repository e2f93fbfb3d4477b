// DecoderBatch: many sequences decoded together equal each sequence decoded alone, bit for bit
// (keep-sets of every unit and logits), for the policies and granularities that serve; the pool's
// guarantees; and the errors, which leave the other sequences as they were.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <kvevict/kvevict.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/decoder_batch.hpp>
#include <kvevict/model/random_model.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "support/expect_error.hpp"

namespace {

using kvevict::test::expect_error;

using kvevict::Granularity;
using kvevict::PolicyParams;
using kvevict::model::DecoderBatch;
using kvevict::model::DecoderBatchOptions;
using kvevict::model::DecoderFeed;
using kvevict::model::DecoderOptions;
using kvevict::model::ForwardRequest;
using kvevict::model::Model;
using kvevict::model::ModelConfig;

const Model& model() {
  static const Model m = [] {
    ModelConfig config;
    config.dim = 128;
    config.hidden_dim = 192;
    config.layers = 2;
    config.heads = 4;
    config.kv_heads = 2;
    config.vocab_size = 300;
    config.context_length = 1024;
    return kvevict::model::make_random_model(config, 7);
  }();
  return m;
}

std::vector<std::int32_t> tokens(std::size_t count, std::uint32_t seed) {
  std::vector<std::int32_t> out(count);
  std::uint32_t state = seed;
  for (std::int32_t& token : out) {
    state = state * 1664525u + 1013904223u;
    token = static_cast<std::int32_t>((state >> 8) % 256u);
  }
  return out;
}

// One sequence of a case: its policy, cache options, stream, chunk, the step it joins at.
struct Stream {
  std::string policy;
  PolicyParams params;
  DecoderOptions options;
  std::vector<std::int32_t> tokens;
  int chunk = 1;
  int joins = 0;
  int turn_every = 0;  // > 0: a turn starts every this many tokens (SirLLM's decay)
  std::optional<std::vector<std::int32_t>> catalyst;
};

// What a sequence showed after each of its forwards: every unit's kept original positions, oldest
// first, then the logits it returned (bits compared).
struct Trace {
  std::vector<std::vector<std::int64_t>> kept;
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<float>> surprisal;
};

std::vector<std::int64_t> kept(const kvevict::Sequence& sequence) {
  std::vector<std::int64_t> out;
  const auto& slots = sequence.slots();
  for (int unit = 0; unit < slots.layout().units(); ++unit) {
    for (const std::int32_t slot : slots.stream_order(unit)) {
      out.push_back(slots.original_positions(unit)[static_cast<std::size_t>(slot)]);
    }
    out.push_back(-1);  // unit separator
  }
  return out;
}

bool turn_starts(const Stream& s, std::size_t offset) {
  return s.turn_every > 0 &&
         offset % static_cast<std::size_t>(s.turn_every) < static_cast<std::size_t>(s.chunk);
}

void record(Trace& trace, const DecoderBatch& batch, int id) {
  trace.kept.push_back(kept(batch.cache(id).sequence()));
  const kvevict::model::ForwardResult result = batch.result(id);
  // A step of the streams below asks for the last token's logits.
  EXPECT_EQ(result.rows, 1);
  EXPECT_EQ(result.logits.size(), static_cast<std::size_t>(model().config.vocab_size));
  trace.logits.emplace_back(result.logits.begin(), result.logits.end());
  trace.surprisal.emplace_back(result.surprisal.begin(), result.surprisal.end());
}

int open(DecoderBatch& batch, const Stream& s) {
  const int id = batch.open(kvevict::make_policy(s.policy, s.params), s.options);
  if (s.catalyst) batch.set_catalyst(id, *s.catalyst);
  return id;
}

// Runs the streams together in one batch (each joining at its step, leaving when done).
std::vector<Trace> run(const std::vector<Stream>& streams, DecoderBatchOptions options = {}) {
  DecoderBatch batch(model(), options);
  std::vector<Trace> traces(streams.size());
  std::vector<int> ids(streams.size(), -1);
  std::vector<std::size_t> offsets(streams.size(), 0);
  std::vector<DecoderFeed> feeds;
  std::vector<std::size_t> fed;
  for (int step = 0;; ++step) {
    feeds.clear();
    fed.clear();
    bool pending = false;
    for (std::size_t i = 0; i < streams.size(); ++i) {
      const Stream& s = streams[i];
      if (offsets[i] >= s.tokens.size()) {
        if (ids[i] >= 0) batch.close(std::exchange(ids[i], -2));
        continue;
      }
      pending = true;
      if (step < s.joins) continue;
      if (ids[i] == -1) ids[i] = open(batch, s);
      const std::size_t n =
          std::min(static_cast<std::size_t>(s.chunk), s.tokens.size() - offsets[i]);
      feeds.push_back({ids[i], std::span<const std::int32_t>(s.tokens).subspan(offsets[i], n),
                       ForwardRequest{turn_starts(s, offsets[i]), false}});
      fed.push_back(i);
      offsets[i] += n;
    }
    if (!pending) break;
    if (feeds.empty()) continue;
    batch.step(feeds);
    for (const std::size_t i : fed) {
      EXPECT_FALSE(batch.failed(ids[i]).has_value()) << *batch.failed(ids[i]);
      record(traces[i], batch, ids[i]);
    }
  }
  return traces;
}

void expect_same(const Trace& batched, const Trace& alone, const std::string& what) {
  ASSERT_EQ(batched.kept.size(), alone.kept.size()) << what;
  for (std::size_t f = 0; f < alone.kept.size(); ++f) {
    ASSERT_EQ(batched.kept[f], alone.kept[f]) << what << ": keep-sets differ after forward " << f;
    ASSERT_EQ(batched.logits[f].size(), alone.logits[f].size()) << what;
    ASSERT_EQ(0, std::memcmp(batched.logits[f].data(), alone.logits[f].data(),
                             alone.logits[f].size() * sizeof(float)))
        << what << ": logits differ in their bits after forward " << f;
    ASSERT_EQ(batched.surprisal[f], alone.surprisal[f]) << what << " forward " << f;
  }
}

// Three streams of different lengths and chunks (1, 5 and 16 tokens: decode and prefill rows in one
// step), one joining late, the shortest leaving early; every sequence of a case has `policy`.
std::vector<Stream> three_streams(const std::string& policy, PolicyParams params,
                                  DecoderOptions options) {
  std::vector<Stream> streams(3);
  const int chunks[] = {1, 5, 16};
  const int joins[] = {0, 0, 6};
  const std::size_t lengths[] = {90, 260, 400};
  for (std::size_t i = 0; i < 3; ++i) {
    Stream& s = streams[i];
    s.policy = policy;
    s.params = params;
    s.options = options;
    s.options.max_chunk = 16;
    s.tokens = tokens(lengths[i], static_cast<std::uint32_t>(11 + i));
    s.chunk = chunks[i];
    s.joins = joins[i];
  }
  return streams;
}

void expect_batch_equals_alone(const std::vector<Stream>& streams, const std::string& what,
                               DecoderBatchOptions options = {}) {
  const std::vector<Trace> batched = run(streams, options);
  for (std::size_t i = 0; i < streams.size(); ++i) {
    Stream alone = streams[i];
    alone.joins = 0;
    expect_same(batched[i], run({alone}, options)[0], what + ", sequence " + std::to_string(i));
  }
}

// The set: window, StreamingLLM, H2O, TOVA, SirLLM at token and block granularity (budget
// 48, so that every stream evicts), with the products on one thread and on two.
TEST(DecoderBatch, EverySequenceBatchedEqualsItselfAloneBitForBit) {
  for (const char* policy : {"window", "streaming_llm", "h2o", "tova", "sirllm"}) {
    for (const Granularity granularity : {Granularity::token, Granularity::blocks(8)}) {
      if (std::string(policy) == "sirllm" && granularity != Granularity::token) continue;
      DecoderOptions options;
      options.granularity = granularity;
      std::vector<Stream> streams =
          three_streams(policy, kvevict::budget_params(policy, 48), options);
      if (std::string(policy) == "sirllm") {
        for (Stream& s : streams) s.turn_every = 40;
      }
      const std::string what = std::string(policy) + " at " + to_string(granularity);
      expect_batch_equals_alone(streams, what);
      if (std::string(policy) == "h2o") {
        DecoderBatchOptions two_threads;
        two_threads.threads = 2;
        expect_batch_equals_alone(streams, what + " on two threads", two_threads);
      }
    }
  }
}

// Sequences of different policies, KV types and key storage in one batch, and InfiniPot's
// catalyst prompt (run alone after the step in which its pot fills).
TEST(DecoderBatch, MixedSequencesAndCatalystsEqualThemselvesAlone) {
  std::vector<Stream> streams = three_streams("h2o", kvevict::budget_params("h2o", 40), {});
  streams[0].options.kv_type = kvevict::KvType::q8_0;
  streams[1].policy = "window";
  streams[1].params = kvevict::budget_params("window", 32);
  streams[1].options.key_storage = kvevict::KeyStorage::pre_rope;
  streams[1].options.kv_type = kvevict::KvType::f16;
  streams[2].policy = "infinipot";
  streams[2].params = PolicyParams().set("pot", 48).set("keep", 24);
  streams[2].catalyst = tokens(6, 99);
  expect_batch_equals_alone(streams, "mixed");
}

// A batch of one multiplies one row with the panel kernel, a Decoder with matvec: the same
// computation summed in another order, so the logits agree to f32 rounding (random model's logits
// are of magnitude ~1) and the keep-sets of the deterministic rules are the same.
TEST(DecoderBatch, ABatchOfOneAgreesWithTheDecoderToRounding) {
  for (const char* policy : {"window", "streaming_llm"}) {
    const Stream s = three_streams(policy, kvevict::budget_params(policy, 48), {})[1];
    const Trace batched = run({s})[0];
    kvevict::model::Decoder decoder(model(), kvevict::make_policy(s.policy, s.params), s.options);
    for (std::size_t offset = 0, f = 0; offset < s.tokens.size(); offset += 5, ++f) {
      const std::size_t n = std::min<std::size_t>(5, s.tokens.size() - offset);
      const auto result =
          decoder.forward(std::span<const std::int32_t>(s.tokens).subspan(offset, n));
      ASSERT_EQ(kept(decoder.cache().sequence()), batched.kept[f]) << policy << " forward " << f;
      float largest = 0.0f;
      for (std::size_t v = 0; v < result.logits.size(); ++v) {
        largest = std::max(largest, std::abs(result.logits[v] - batched.logits[f][v]));
      }
      EXPECT_LE(largest, 1e-5f) << policy << " forward " << f;
    }
  }
}

// Sixteen sequences of growing length in a pool that holds four at full length (budget 48 + a
// chunk of 8 each; TOVA and StreamingLLM, whose minimums, 1 and 4 sinks, fit sixteen times): none
// fails, each keeps at least its minimum, and the cells held plus those fed never exceed the pool.
TEST(DecoderBatch, SixteenSequencesInAPoolForFour) {
  constexpr int kBudget = 48;
  constexpr int kChunk = 8;
  DecoderBatchOptions options;
  options.pool_cells = 4 * (kBudget + kChunk);
  DecoderBatch batch(model(), options);
  std::vector<int> ids;
  std::vector<std::vector<std::int32_t>> streams;
  for (int i = 0; i < 16; ++i) {
    DecoderOptions sequence_options;
    sequence_options.max_chunk = kChunk;
    const char* policy = i % 2 == 0 ? "tova" : "streaming_llm";
    ids.push_back(batch.open(kvevict::make_policy(policy, kvevict::budget_params(policy, kBudget)),
                             sequence_options));
    streams.push_back(tokens(200, static_cast<std::uint32_t>(100 + i)));
  }
  std::vector<std::int64_t> fed_total(16, 0);
  for (int step = 0; step < 30; ++step) {
    std::vector<DecoderFeed> feeds;
    for (int i = 0; i < 16; ++i) {
      // Sequence i speaks from step i / 2 on: the pool fills as they arrive.
      if (step < i / 2) continue;
      const int n = step == i / 2 ? kChunk : 1 + (i % 3);
      const auto offset = static_cast<std::size_t>(std::min(step * 4, 180));
      feeds.push_back({ids[static_cast<std::size_t>(i)],
                       std::span<const std::int32_t>(streams[static_cast<std::size_t>(i)])
                           .subspan(offset, static_cast<std::size_t>(n)),
                       {}});
      fed_total[static_cast<std::size_t>(i)] += n;
    }
    batch.step(feeds);
    std::int64_t held = 0;
    for (int i = 0; i < 16; ++i) {
      const int id = ids[static_cast<std::size_t>(i)];
      ASSERT_FALSE(batch.failed(id).has_value()) << *batch.failed(id);
      const int live = batch.cache(id).sequence().max_live();
      held += live;
      // Pool member i is sequence i (both take the lowest free id, opened in order).
      EXPECT_GE(live, std::min(batch.pool()->minimum(i), fed_total[static_cast<std::size_t>(i)]))
          << "sequence " << i << " step " << step;
    }
    EXPECT_LE(held, options.pool_cells) << "step " << step;
  }
  EXPECT_LE(batch.pool()->stats().peak_cells, options.pool_cells);
  EXPECT_GT(batch.pool()->stats().pressed_steps, 0) << "the pool was never full: a weak test";
}

// Bad input: a clear error, nothing changed, the other sequences go on as if it had not come.
TEST(DecoderBatch, BadInputLeavesTheOtherSequencesAlone) {
  std::vector<Stream> streams = three_streams("h2o", kvevict::budget_params("h2o", 48), {});
  const Trace alone = run({streams[1]})[0];
  DecoderBatch batch(model());
  const int a = open(batch, streams[0]);
  const int b = open(batch, streams[1]);
  const auto chunk = [&](std::size_t f) {
    return std::span<const std::int32_t>(streams[1].tokens).subspan(f * 5, 5);
  };
  std::size_t f = 0;
  const auto good_step = [&] {
    const DecoderFeed feed{b, chunk(f), {}};
    batch.step(std::span<const DecoderFeed>(&feed, 1));
    Trace trace;
    record(trace, batch, b);
    ASSERT_EQ(trace.kept[0], alone.kept[f]);
    ASSERT_EQ(0, std::memcmp(trace.logits[0].data(), alone.logits[f].data(),
                             alone.logits[f].size() * sizeof(float)));
    ++f;
  };
  good_step();
  const std::int32_t out_of_vocab[] = {1, 300};
  const std::int32_t one[] = {1};
  const std::vector<std::int32_t> too_long(17, 1);
  expect_error(
      [&] {
        batch.step(std::vector<DecoderFeed>{{b, chunk(f), {}}, {7, one, {}}});
      },
      "no open sequence 7");
  expect_error(
      [&] {
        batch.step(std::vector<DecoderFeed>{{b, chunk(f), {}}, {-1, one, {}}});
      },
      "no open sequence -1");
  expect_error(
      [&] {
        batch.step(std::vector<DecoderFeed>{{b, chunk(f), {}}, {b, one, {}}});
      },
      "sequence 1 is fed twice");
  expect_error(
      [&] {
        batch.step(std::vector<DecoderFeed>{{b, chunk(f), {}}, {a, out_of_vocab, {}}});
      },
      "token id 300 at index 1 is out of range");
  expect_error(
      [&] {
        batch.step(std::vector<DecoderFeed>{{b, chunk(f), {}}, {a, too_long, {}}});
      },
      "a chunk holds 1 to 16 tokens, got 17");
  expect_error([&] { batch.step(std::vector<DecoderFeed>{}); }, "no sequence to feed");
  good_step();
  batch.close(a);
  expect_error([&] { batch.step(std::vector<DecoderFeed>{{a, one, {}}}); }, "no open sequence 0");
  expect_error([&] { batch.close(a); }, "no open sequence 0");
  good_step();
  // The batch's settings are not a sequence's.
  DecoderOptions threads;
  threads.threads = 2;
  expect_error(
      [&] {
        batch.open(kvevict::make_policy("window", kvevict::budget_params("window", 32)), threads);
      },
      "threads are the batch's");
  DecoderOptions q8;
  q8.decode_activations = kvevict::model::DecodeActivations::q8_0;
  expect_error(
      [&] { batch.open(kvevict::make_policy("window", kvevict::budget_params("window", 32)), q8); },
      "a batch multiplies in f32");
  good_step();
}

// A sequence that fails in a step (InfiniPot's pot fills without a catalyst prompt) fails alone:
// failed() names it, it cannot be fed until closed, and the other sequence of the same steps
// decodes exactly as alone.
TEST(DecoderBatch, ASequenceThatFailsFailsAlone) {
  std::vector<Stream> streams = three_streams("h2o", kvevict::budget_params("h2o", 48), {});
  const Trace alone = run({streams[1]})[0];
  DecoderBatch batch(model());
  const int pot =
      batch.open(kvevict::make_policy("infinipot", PolicyParams().set("pot", 20).set("keep", 10)));
  const int b = open(batch, streams[1]);
  const std::vector<std::int32_t> pot_tokens = tokens(40, 5);
  bool failed = false;
  for (std::size_t f = 0; f < 10; ++f) {
    std::vector<DecoderFeed> feeds{
        {b, std::span<const std::int32_t>(streams[1].tokens).subspan(f * 5, 5), {}}};
    if (!failed)
      feeds.push_back({pot, std::span<const std::int32_t>(pot_tokens).subspan(f * 5, 5), {}});
    batch.step(feeds);
    Trace trace;
    record(trace, batch, b);
    ASSERT_EQ(trace.kept[0], alone.kept[f]) << f;
    ASSERT_EQ(0, std::memcmp(trace.logits[0].data(), alone.logits[f].data(),
                             alone.logits[f].size() * sizeof(float)))
        << f;
    if (!failed && batch.failed(pot)) {
      failed = true;
      EXPECT_NE(batch.failed(pot)->find("needs a catalyst prompt"), std::string::npos)
          << *batch.failed(pot);
      EXPECT_EQ(f, 3u) << "the pot of 20 fills with the fourth chunk of 5";
      const std::int32_t one[] = {1};
      expect_error([&] { batch.step(std::vector<DecoderFeed>{{pot, one, {}}}); }, "failed");
    }
  }
  EXPECT_TRUE(failed);
  batch.close(pot);
}

// Admission: a pool smaller than the minimums, a budget the pool can never grant, a policy with
// no bound: the sequence is not opened, the others are untouched.
TEST(DecoderBatch, APoolRefusesWhatItCannotHold) {
  DecoderBatchOptions options;
  options.pool_cells = 100;
  DecoderBatch batch(model(), options);
  DecoderOptions chunk16;
  chunk16.max_chunk = 16;
  const int a =
      batch.open(kvevict::make_policy("window", kvevict::budget_params("window", 60)), chunk16);
  expect_error([&] { batch.open(kvevict::make_policy("full"), chunk16); }, "has no bound");
  expect_error(
      [&] {
        batch.open(kvevict::make_policy("window", kvevict::budget_params("window", 90)), chunk16);
      },
      "can never grant it");
  // Window is pressable and protects nothing: charged 1 + a chunk (17). StreamingLLM with 70
  // sinks and a window of 10 fits the pool (80 + 16 <= 100) but is charged its sinks + a chunk
  // (86), more than the 83 left.
  expect_error(
      [&] {
        batch.open(
            kvevict::make_policy("streaming_llm", kvevict::budget_params("streaming_llm", 80, 70)),
            chunk16);
      },
      "cells it can never give up");
  EXPECT_TRUE(batch.is_open(a));
  EXPECT_FALSE(batch.is_open(a + 1));
  EXPECT_EQ(batch.pool()->charged(), 1 + 16);
}

}  // namespace
