// AnLLM: the REDUCTION of Algorithm 1 (Pang et al. §3.3) on hand-made token streams, the cap
// (kvevict's extension), positions and configuration errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <kvevict/kvevict.hpp>
#include <memory>
#include <numeric>
#include <vector>

#include "support/policy_harness.hpp"

namespace {

using kvevict::PolicyParams;
using Ids = std::vector<std::int32_t>;
using Positions = std::vector<std::int64_t>;

constexpr std::int32_t kBos = 1;
constexpr std::int32_t kPeriod = 13;  // the anchor of these tests (AnLLM-EP's "."), unless told
constexpr std::int32_t kAc = 32001;   // AnLLM-AC's <AC>

class Stream {
 public:
  explicit Stream(std::unique_ptr<kvevict::Policy> policy)
      : sequence_(config(), std::move(policy)) {}

  // One forward of these token ids.
  void feed(const Ids& ids) {
    sequence_.begin_chunk(ids);
    sequence_.end_forward();
  }

  [[nodiscard]] Positions kept(int l = 0, int g = 0) const {
    return kvevict::test::kept_positions(sequence_.slots(), sequence_.unit_of(l, g));
  }
  [[nodiscard]] Positions positions(int l = 0, int g = 0) const {
    return kvevict::test::rope_positions(sequence_.slots(), sequence_.unit_of(l, g));
  }
  void expect_uniform() const {
    for (int l = 0; l < 2; ++l) {
      for (int g = 0; g < 2; ++g) EXPECT_EQ(kept(l, g), kept());
    }
  }
  [[nodiscard]] const kvevict::SequenceStats& stats() const { return sequence_.stats(); }

 private:
  static kvevict::SequenceConfig config() {
    kvevict::SequenceConfig c;
    c.layers = 2;
    c.q_heads = 2;
    c.kv_heads = 2;
    c.max_chunk = 64;
    return c;
  }

  kvevict::Sequence sequence_;
};

std::unique_ptr<kvevict::Policy> anllm(Ids anchors, int max_slots = 0) {
  return kvevict::make_anllm(kvevict::AnLlmConfig{std::move(anchors), max_slots});
}

TEST(AnLlmPolicy, DeclaresItsSignalsTriggersAndFlags) {
  const auto policy = anllm({kPeriod, kAc});
  EXPECT_EQ(policy->name(), "anllm");
  EXPECT_TRUE(policy->signals().contains(kvevict::Signal::token_ids));
  EXPECT_TRUE(policy->triggers().contains(kvevict::Trigger::anchor));
  // The paper reduces only after a forward holding an anchor; the cap (a SlotCap decorator) also
  // acts after every other forward.
  EXPECT_FALSE(policy->triggers().contains(kvevict::Trigger::after_forward));
  EXPECT_TRUE(anllm({kPeriod}, 16)->triggers().contains(kvevict::Trigger::after_forward));
  EXPECT_EQ(policy->score_columns(), 0);
  EXPECT_EQ(policy->default_position_mode(), kvevict::PositionMode::original);
  EXPECT_EQ(policy->retained_limit(), std::nullopt);  // the paper's cache is unbounded
  EXPECT_EQ(policy->flags_for(kPeriod), kvevict::slot_flag::anchor);
  EXPECT_EQ(policy->flags_for(kAc), kvevict::slot_flag::anchor);
  EXPECT_EQ(policy->flags_for(kBos), 0);
  EXPECT_EQ(anllm({kPeriod}, 16)->retained_limit(), 16);
}

TEST(AnLlmPolicy, StreamWithoutAnchorsOnlyGrows) {
  Stream stream(anllm({kPeriod}));
  stream.feed({kBos, 100, 101, 102});
  stream.feed({103});
  stream.feed({104, 105});
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(stream.stats().evicted_slots, 0);
}

TEST(AnLlmPolicy, ReducesToAnchorsPlusTailAfterTheNewestAnchor) {
  Stream stream(anllm({kPeriod}));
  // Positions 0..7; anchors at 2 and 5 (two in one chunk). Keep both anchors and the tail after
  // the newest (6, 7); BOS (0) and the non-anchors before 5 (1, 3, 4) go.
  stream.feed({kBos, 100, kPeriod, 101, 102, kPeriod, 103, 104});
  EXPECT_EQ(stream.kept(), (Positions{2, 5, 6, 7}));
  // Positions 8..10, ending on an anchor: the tail is empty, and the earlier tail 6, 7 goes too.
  stream.feed({105, 106, kPeriod});
  EXPECT_EQ(stream.kept(), (Positions{2, 5, 10}));
  // Positions 11, 12, starting with an anchor: anchors 2 5 10 11, tail 12.
  stream.feed({kPeriod, 107});
  EXPECT_EQ(stream.kept(), (Positions{2, 5, 10, 11, 12}));
  // Token by token: 13 is no anchor (grow); 14 is one (reduce, empty tail).
  stream.feed({108});
  EXPECT_EQ(stream.kept(), (Positions{2, 5, 10, 11, 12, 13}));
  stream.feed({kPeriod});
  EXPECT_EQ(stream.kept(), (Positions{2, 5, 10, 11, 14}));
  // Original positions by default: the anchors keep the positions they were fed at.
  EXPECT_EQ(stream.positions(), (Positions{2, 5, 10, 11, 14}));
  stream.expect_uniform();
}

TEST(AnLlmPolicy, EpAndAcAnchorsAreJustAnIdSet) {
  // AC: <AC> after each sentence; "." is an ordinary token unless it is in the set.
  Stream ac(anllm({kAc}));
  ac.feed({kBos, 100, kPeriod, kAc, 101, 102});
  EXPECT_EQ(ac.kept(), (Positions{3, 4, 5}));
  // Both ids: "." at 2 and <AC> at 3 are anchors, the tail is 4, 5.
  Stream both(anllm({kPeriod, kAc}));
  both.feed({kBos, 100, kPeriod, kAc, 101, 102});
  EXPECT_EQ(both.kept(), (Positions{2, 3, 4, 5}));
}

TEST(AnLlmPolicy, CapDropsTheOldestSlots) {
  Stream stream(anllm({kPeriod}, 3));
  // Reduction gives 2 5 6 7 (see above); 4 > 3, the oldest (anchor 2) goes.
  stream.feed({kBos, 100, kPeriod, 101, 102, kPeriod, 103, 104});
  EXPECT_EQ(stream.kept(), (Positions{5, 6, 7}));
  // No anchor: 5 6 7 8 9 grows past the cap after the forward; the two oldest go.
  stream.feed({105, 106});
  EXPECT_EQ(stream.kept(), (Positions{7, 8, 9}));
  // Anchors 10 and 12: reduction keeps 10 12 13 (7 8 9 are a tail before the newest anchor).
  stream.feed({kPeriod, 107, kPeriod, 108});
  EXPECT_EQ(stream.kept(), (Positions{10, 12, 13}));
  stream.expect_uniform();
}

TEST(AnLlmPolicy, RejectsBadConfigurations) {
  EXPECT_THROW(anllm({}), kvevict::Error);
  EXPECT_THROW(anllm({-5}), kvevict::Error);
  EXPECT_THROW(anllm({kPeriod}, -1), kvevict::Error);
  // Duplicates are harmless.
  EXPECT_EQ(kvevict::AnLlmPolicy({kAc, kPeriod, kAc}).anchor_ids().size(), 2u);
}

TEST(AnLlmPolicy, RegistryReadsTheReplayParameters) {
  const auto policy =
      kvevict::make_policy("anllm", PolicyParams().set_list("anchor_ids", {29889, 32001}));
  EXPECT_EQ(policy->name(), "anllm");
  EXPECT_EQ(policy->flags_for(29889), kvevict::slot_flag::anchor);
  EXPECT_EQ(policy->retained_limit(), std::nullopt);
  EXPECT_EQ(kvevict::make_policy(
                "anllm", PolicyParams().set_list("anchor_ids", {29889}).set("max_slots", 64))
                ->retained_limit(),
            64);
  EXPECT_THROW((void)kvevict::make_policy("anllm", PolicyParams()), kvevict::Error);
  EXPECT_THROW(
      (void)kvevict::make_policy("anllm", PolicyParams().set_list("anchor_ids", {1ll << 40})),
      kvevict::Error);
  EXPECT_THROW((void)kvevict::make_policy(
                   "anllm", PolicyParams().set_list("anchor_ids", {13}).set("max_slots", -1)),
               kvevict::Error);
}

}  // namespace
