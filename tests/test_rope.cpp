// RoPE: hand-computed rotations, composition, inverse, relative-position property, bounded drift.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <kvevict/rope.hpp>
#include <random>
#include <string>
#include <vector>

namespace {

using kvevict::Rope;
using kvevict::RopeConfig;
using kvevict::RopeLayout;

std::vector<float> random_row(std::mt19937& rng, int dim) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> row(static_cast<std::size_t>(dim));
  for (float& x : row) x = normal(rng);
  return row;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += static_cast<double>(a[i]) * b[i];
  return sum;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return worst;
}

// head_dim 4, theta 10000: pair frequencies are 10000^0 = 1 and 10000^(-2/4) = 0.01.
TEST(Rope, HalfSplitPairsDimensionIWithIPlusHalf) {
  const Rope rope(RopeConfig{4, 0, 10000.0, RopeLayout::half_split});
  std::vector<float> e0{1, 0, 0, 0};
  rope.rotate(e0.data(), 1);  // pair (0, 2) turns by 1 rad
  EXPECT_NEAR(e0[0], std::cos(1.0), 1e-7);
  EXPECT_NEAR(e0[2], std::sin(1.0), 1e-7);
  EXPECT_EQ(e0[1], 0.0f);
  EXPECT_EQ(e0[3], 0.0f);
  std::vector<float> e1{0, 1, 0, 0};
  rope.rotate(e1.data(), 3);  // pair (1, 3) turns by 3 * 0.01 rad
  EXPECT_NEAR(e1[1], std::cos(0.03), 1e-7);
  EXPECT_NEAR(e1[3], std::sin(0.03), 1e-7);
}

TEST(Rope, InterleavedPairsAdjacentDimensions) {
  const Rope rope(RopeConfig{4, 0, 10000.0, RopeLayout::interleaved});
  std::vector<float> x{1, 0, 0, 1};
  rope.rotate(x.data(), 2);
  // pair (0, 1): (1, 0) by 2 rad; pair (2, 3): (0, 1) by 0.02 rad -> (-sin, cos).
  EXPECT_NEAR(x[0], std::cos(2.0), 1e-7);
  EXPECT_NEAR(x[1], std::sin(2.0), 1e-7);
  EXPECT_NEAR(x[2], -std::sin(0.02), 1e-7);
  EXPECT_NEAR(x[3], std::cos(0.02), 1e-7);
}

TEST(Rope, PartialRotaryLeavesTrailingDimensionsAlone) {
  const Rope rope(RopeConfig{8, 4, 10000.0, RopeLayout::half_split});
  std::mt19937 rng(1);
  std::vector<float> x = random_row(rng, 8);
  const std::vector<float> before = x;
  rope.rotate(x.data(), 17);
  for (int d = 4; d < 8; ++d)
    EXPECT_EQ(x[static_cast<std::size_t>(d)], before[static_cast<std::size_t>(d)]);
  EXPECT_GT(max_abs_diff(x, before), 1e-3);
}

class RopeProperty : public ::testing::TestWithParam<RopeLayout> {};

// R(a) R(b) = R(a + b), and R(-p) R(p) = I, over many random rows and positions.
TEST_P(RopeProperty, ComposesAndInverts) {
  const Rope rope(RopeConfig{64, 0, 10000.0, GetParam()});
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> position(-5000, 5000);
  for (int trial = 0; trial < 500; ++trial) {
    const std::vector<float> x = random_row(rng, 64);
    const int a = position(rng);
    const int b = position(rng);
    std::vector<float> two_steps = x;
    rope.rotate(two_steps.data(), a);
    rope.rotate(two_steps.data(), b);
    std::vector<float> one_step = x;
    rope.rotate(one_step.data(), std::int64_t{a} + b);
    EXPECT_LT(max_abs_diff(two_steps, one_step), 2e-6);
    std::vector<float> back = x;
    rope.rotate(back.data(), a);
    rope.rotate(back.data(), -a);
    EXPECT_LT(max_abs_diff(back, x), 2e-6);
  }
}

// The defining property of RoPE: <R(m) q, R(n) k> depends only on m - n.
TEST_P(RopeProperty, ScoresDependOnlyOnRelativePosition) {
  const Rope rope(RopeConfig{32, 0, 10000.0, GetParam()});
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<float> q = random_row(rng, 32);
    const std::vector<float> k = random_row(rng, 32);
    const int m = static_cast<int>(rng() % 3000);
    const int n = static_cast<int>(rng() % 3000);
    const int shift = static_cast<int>(rng() % 3000);
    std::vector<float> q1 = q, k1 = k, q2 = q, k2 = k;
    rope.rotate(q1.data(), m);
    rope.rotate(k1.data(), n);
    rope.rotate(q2.data(), m + shift);
    rope.rotate(k2.data(), n + shift);
    EXPECT_NEAR(dot(q1, k1), dot(q2, k2), 1e-4 * std::sqrt(dot(q, q) * dot(k, k)));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, RopeProperty,
                         ::testing::Values(RopeLayout::half_split, RopeLayout::interleaved),
                         [](const ::testing::TestParamInfo<RopeLayout>& info) {
                           return std::string(info.param == RopeLayout::half_split ? "half_split"
                                                                                   : "interleaved");
                         });

TEST(Rope, TableAndOnTheFlyAgreeExactly) {
  RopeConfig config{64, 0, 500000.0, RopeLayout::half_split};
  const Rope plain(config);
  config.table_positions = 1024;
  const Rope tabled(config);
  std::mt19937 rng(3);
  for (std::int64_t steps : {0, 1, -1, 17, -900, 1023, -1023, 1024, 50000}) {
    std::vector<float> a = random_row(rng, 64);
    std::vector<float> b = a;
    plain.rotate(a.data(), steps);
    tabled.rotate(b.data(), steps);
    EXPECT_EQ(a, b) << "steps " << steps;
  }
}

TEST(Rope, RotateRowsUsesEachRowsOwnSteps) {
  const Rope rope(RopeConfig{8, 0, 10000.0, RopeLayout::interleaved});
  std::mt19937 rng(5);
  std::vector<float> block;
  std::vector<std::vector<float>> rows;
  for (int r = 0; r < 5; ++r) {
    rows.push_back(random_row(rng, 8));
    block.insert(block.end(), rows.back().begin(), rows.back().end());
  }
  const std::vector<std::int64_t> steps{3, 3, 0, -2, 7};
  rope.rotate_rows(block.data(), 8, std::span<const std::int64_t>(steps));
  for (int r = 0; r < 5; ++r) {
    rope.rotate(rows[static_cast<std::size_t>(r)].data(), steps[static_cast<std::size_t>(r)]);
    const std::vector<float> got(block.begin() + r * 8, block.begin() + (r + 1) * 8);
    EXPECT_EQ(got, rows[static_cast<std::size_t>(r)]);
  }
}

// Bounded drift. A post-RoPE key is re-rotated once per compaction that lowers its position, each
// time rounded once to float. In every kvevict position mode a key's position only falls, so the
// number of re-rotations is at most its first position (< the cache capacity). Here a key takes the
// worst case for a 4096-slot cache, 4095 single-step shifts from position 4095 down to 0, and must
// come back to the unrotated key. Per shift the rounding error is at most half an ulp per element
// (2^-24 relative); its sum is a random walk, ~sqrt(4095) * 2^-24 ~ 4e-6 relative, far inside the
// worst-case linear bound 4095 * 2^-24 ~ 2.4e-4.
TEST(Rope, DriftAfterThousandsOfShiftsStaysBounded) {
  for (RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
    const Rope rope(RopeConfig{128, 0, 10000.0, layout});
    std::mt19937 rng(13);
    double worst_relative = 0;
    for (int trial = 0; trial < 8; ++trial) {
      const std::vector<float> original = random_row(rng, 128);
      std::vector<float> key = original;
      rope.rotate(key.data(), 4095);
      for (int shift = 0; shift < 4095; ++shift) rope.rotate(key.data(), -1);
      worst_relative = std::max(worst_relative,
                                max_abs_diff(key, original) / std::sqrt(dot(original, original)));
    }
    std::printf("[ measured ] %s: worst relative drift after 4095 shifts %.3g\n",
                layout == RopeLayout::half_split ? "half_split" : "interleaved", worst_relative);
    EXPECT_LT(worst_relative, 2e-5);
    EXPECT_LT(worst_relative, 4095 * std::ldexp(1.0, -24));  // never beyond the linear bound
  }
}

TEST(Rope, RejectsBadConfigurations) {
  EXPECT_THROW(Rope(RopeConfig{0, 0, 10000.0}), kvevict::Error);
  EXPECT_THROW(Rope(RopeConfig{8, 3, 10000.0}), kvevict::Error);   // odd rotary dims
  EXPECT_THROW(Rope(RopeConfig{7, 0, 10000.0}), kvevict::Error);   // odd head_dim, full rotary
  EXPECT_THROW(Rope(RopeConfig{8, 10, 10000.0}), kvevict::Error);  // rotary > head_dim
  EXPECT_THROW(Rope(RopeConfig{8, 0, 1.0}), kvevict::Error);
  EXPECT_THROW(Rope(RopeConfig{8, 0, std::nan("")}), kvevict::Error);
  try {
    Rope(RopeConfig{8, 5, 10000.0});
    FAIL() << "expected kvevict::Error";
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find("even"), std::string::npos) << error.what();
  }
}

}  // namespace
