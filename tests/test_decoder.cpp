// Reference decoder: the decoder against a naive loop implementation (on every SIMD target the CPU
// has, for every weight type), the kernels against plain loops at sizes with tails, cached decoding
// against recomputation, every policy without eviction against the full cache (bitwise), pre-
// against post-RoPE keys under eviction, bounded memory on a long stream, the signals a policy
// receives, and the errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <kvevict/kvevict.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/model/random_model.hpp>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "model/attention.hpp"
#include "model/half.hpp"
#include "model/kernels/kernels.hpp"
#include "model/kernels/weight_product.hpp"
#include "model/matmul.hpp"
#include "model/quant.hpp"
#include "support/expect_error.hpp"
#include "support/policy_harness.hpp"

namespace {

using kvevict::KeyStorage;
using kvevict::PolicyParams;
using kvevict::RopeLayout;
using kvevict::model::Decoder;
using kvevict::model::DecoderOptions;
using kvevict::model::DType;
using kvevict::model::ForwardRequest;
using kvevict::model::ForwardResult;
using kvevict::model::Model;
using kvevict::model::ModelConfig;
using kvevict::model::WeightMatrix;

constexpr int kVocab = 300;

ModelConfig small_config(RopeLayout layout, int kv_heads = 2, int rotary_dim = 0,
                         bool tied = false) {
  ModelConfig config;
  config.dim = 64;
  config.hidden_dim = 96;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = kv_heads;
  config.vocab_size = kVocab;
  config.context_length = 512;
  config.rope_theta = 10000.0;
  config.rope_layout = layout;
  config.rotary_dim = rotary_dim;
  config.tied_embeddings = tied;
  return config;
}

// Deterministic token stream over the byte ids (no specials unless asked).
std::vector<std::int32_t> tokens_for(int count, std::uint32_t seed = 1) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(count));
  std::uint32_t state = seed;
  for (std::int32_t& token : out) {
    state = state * 1664525u + 1013904223u;
    token = static_cast<std::int32_t>((state >> 8) % 256u);
  }
  return out;
}

std::unique_ptr<kvevict::Policy> full_policy() {
  return kvevict::make_policy("full", PolicyParams());
}

// ---------------------------------------------------------------------------------------------
// Naive reference: plain loops in double, no Eigen, no cache; every position from the whole prefix.
// ---------------------------------------------------------------------------------------------

// Q8_0 / Q4_0 blocks of 32 along a row: an f16 scale d, then 32 int8 q (weight q d) or 16 bytes
// of nibbles (byte j: values j and j + 16, weight (nibble - 8) d). The stored integer (Q4_0: the
// nibble) and the scale of the block holding (r, c):
const std::byte* block_of(const WeightMatrix& w, std::int64_t r, std::int64_t c) {
  return w.data + static_cast<std::size_t>(r) * w.row_bytes() +
         static_cast<std::size_t>(c / 32) * (w.dtype == DType::q8_0 ? 34 : 18);
}
std::int32_t stored(const WeightMatrix& w, std::int64_t r, std::int64_t c) {
  const std::byte* block = block_of(w, r, c);
  const auto j = static_cast<std::size_t>(c % 32);
  if (w.dtype == DType::q8_0) return static_cast<std::int8_t>(block[2 + j]);
  const int byte = std::to_integer<int>(block[2 + j % 16]);
  return j < 16 ? byte & 0xf : byte >> 4;
}
float block_scale(const WeightMatrix& w, std::int64_t r, std::int64_t c) {
  std::uint16_t bits;
  std::memcpy(&bits, block_of(w, r, c), 2);
  return kvevict::model::f16_to_float(bits);
}

// Weight (r, c) read from the bytes as model.hpp describes each type.
double weight(const WeightMatrix& w, std::int64_t r, std::int64_t c) {
  const std::size_t index = static_cast<std::size_t>(r * w.cols + c);
  if (w.dtype == DType::q8_0 || w.dtype == DType::q4_0) {
    return (stored(w, r, c) - (w.dtype == DType::q4_0 ? 8 : 0)) * double{block_scale(w, r, c)};
  }
  if (w.dtype == DType::f32) {
    float value;
    std::memcpy(&value, w.data + 4 * index, 4);
    return value;
  }
  std::uint16_t bits;
  std::memcpy(&bits, w.data + 2 * index, 2);
  return w.dtype == DType::f16 ? kvevict::model::f16_to_float(bits)
                               : kvevict::model::bf16_to_float(bits);
}

std::vector<double> naive_matvec(const WeightMatrix& w, const std::vector<double>& x) {
  std::vector<double> y(static_cast<std::size_t>(w.rows), 0.0);
  for (std::int64_t r = 0; r < w.rows; ++r) {
    double sum = 0.0;
    for (std::int64_t c = 0; c < w.cols; ++c) sum += weight(w, r, c) * x[static_cast<size_t>(c)];
    y[static_cast<std::size_t>(r)] = sum;
  }
  return y;
}

std::vector<double> naive_rmsnorm(const std::vector<double>& x, const std::vector<float>& w,
                                  double eps) {
  double squares = 0.0;
  for (double v : x) squares += v * v;
  const double inverse = 1.0 / std::sqrt(squares / static_cast<double>(x.size()) + eps);
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = x[i] * inverse * w[i];
  return out;
}

// Rotates the head_dim values at `v` to `position`.
void naive_rope(double* v, const ModelConfig& config, std::int64_t position) {
  const int head_dim = config.head_dim();
  const int rotary = config.rotary_dim == 0 ? head_dim : config.rotary_dim;
  for (int i = 0; i < rotary / 2; ++i) {
    const double frequency = std::pow(config.rope_theta, -2.0 * i / rotary);
    const double angle = static_cast<double>(position) * frequency;
    const int a = config.rope_layout == RopeLayout::interleaved ? 2 * i : i;
    const int b = config.rope_layout == RopeLayout::interleaved ? 2 * i + 1 : i + rotary / 2;
    const double xa = v[a];
    const double xb = v[b];
    v[a] = xa * std::cos(angle) - xb * std::sin(angle);
    v[b] = xb * std::cos(angle) + xa * std::sin(angle);
  }
}

// Logits at every position of `tokens` ([T][vocab]).
std::vector<std::vector<double>> naive_logits(const Model& model,
                                              const std::vector<std::int32_t>& tokens) {
  const ModelConfig& c = model.config;
  const std::size_t n = tokens.size();
  const int hd = c.head_dim();
  const int group = c.heads / c.kv_heads;
  std::vector<std::vector<double>> x(n, std::vector<double>(static_cast<std::size_t>(c.dim)));
  for (std::size_t t = 0; t < n; ++t) {
    for (int i = 0; i < c.dim; ++i)
      x[t][static_cast<size_t>(i)] = weight(model.token_embedding, tokens[t], i);
  }
  for (int l = 0; l < c.layers; ++l) {
    const kvevict::model::LayerWeights& w = model.layers[static_cast<std::size_t>(l)];
    std::vector<std::vector<double>> q(n), k(n), v(n);
    for (std::size_t t = 0; t < n; ++t) {
      const std::vector<double> xb = naive_rmsnorm(x[t], w.attention_norm, c.norm_eps);
      q[t] = naive_matvec(w.wq, xb);
      k[t] = naive_matvec(w.wk, xb);
      v[t] = naive_matvec(w.wv, xb);
      for (int h = 0; h < c.heads; ++h)
        naive_rope(q[t].data() + h * hd, c, static_cast<std::int64_t>(t));
      for (int g = 0; g < c.kv_heads; ++g)
        naive_rope(k[t].data() + g * hd, c, static_cast<std::int64_t>(t));
    }
    for (std::size_t t = 0; t < n; ++t) {
      std::vector<double> out(static_cast<std::size_t>(c.heads * hd), 0.0);
      for (int h = 0; h < c.heads; ++h) {
        const int g = h / group;
        std::vector<double> scores(t + 1);
        double max = -1e300;
        for (std::size_t s = 0; s <= t; ++s) {
          double dot = 0.0;
          for (int d = 0; d < hd; ++d)
            dot += q[t][static_cast<size_t>(h * hd + d)] * k[s][static_cast<size_t>(g * hd + d)];
          scores[s] = dot / std::sqrt(static_cast<double>(hd));
          max = std::max(max, scores[s]);
        }
        double sum = 0.0;
        for (double& score : scores) sum += (score = std::exp(score - max));
        for (std::size_t s = 0; s <= t; ++s) {
          for (int d = 0; d < hd; ++d) {
            out[static_cast<size_t>(h * hd + d)] +=
                scores[s] / sum * v[s][static_cast<size_t>(g * hd + d)];
          }
        }
      }
      const std::vector<double> projected = naive_matvec(w.wo, out);
      for (int i = 0; i < c.dim; ++i)
        x[t][static_cast<size_t>(i)] += projected[static_cast<size_t>(i)];
      const std::vector<double> xb = naive_rmsnorm(x[t], w.ffn_norm, c.norm_eps);
      std::vector<double> gate = naive_matvec(w.w_gate, xb);
      const std::vector<double> up = naive_matvec(w.w_up, xb);
      for (std::size_t i = 0; i < gate.size(); ++i)
        gate[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      const std::vector<double> down = naive_matvec(w.w_down, gate);
      for (int i = 0; i < c.dim; ++i) x[t][static_cast<size_t>(i)] += down[static_cast<size_t>(i)];
    }
  }
  std::vector<std::vector<double>> logits(n);
  for (std::size_t t = 0; t < n; ++t) {
    logits[t] = naive_matvec(model.output, naive_rmsnorm(x[t], model.final_norm, c.norm_eps));
  }
  return logits;
}

// ---------------------------------------------------------------------------------------------
// Helpers over the decoder
// ---------------------------------------------------------------------------------------------

// Feeds `tokens` as forwards of the sizes in `chunks` (cycled) and returns every position's logits,
// [T * vocab]. `turn_every`: chunk index multiples that start a turn (0 = never).
std::vector<float> all_logits(Decoder& decoder, const std::vector<std::int32_t>& tokens,
                              const std::vector<int>& chunks, int turn_every = 0) {
  const std::size_t vocab = static_cast<std::size_t>(decoder.model().config.vocab_size);
  std::vector<float> out;
  out.reserve(tokens.size() * vocab);
  std::size_t offset = 0;
  for (std::size_t chunk = 0; offset < tokens.size(); ++chunk) {
    const std::size_t n = std::min<std::size_t>(
        static_cast<std::size_t>(chunks[chunk % chunks.size()]), tokens.size() - offset);
    const bool turn = turn_every > 0 && chunk % static_cast<std::size_t>(turn_every) == 0;
    const ForwardResult result = decoder.forward(std::span(tokens).subspan(offset, n),
                                                 ForwardRequest{turn, /*all_logits=*/true});
    EXPECT_EQ(result.rows, static_cast<int>(n));
    out.insert(out.end(), result.logits.begin(), result.logits.end());
    offset += n;
  }
  return out;
}

// Largest |a - b| over a row divided by the row's largest |b|, over all rows of `vocab` values.
double max_relative_difference(std::span<const float> a, std::span<const float> b,
                               std::size_t vocab) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (std::size_t row = 0; row * vocab < std::min(a.size(), b.size()); ++row) {
    double scale = 0.0;
    double diff = 0.0;
    for (std::size_t i = row * vocab; i < (row + 1) * vocab; ++i) {
      scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
      diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

struct ModelCase {
  const char* name;
  RopeLayout layout;
  int kv_heads;
  int rotary_dim;
  bool tied;
  DType dtype;
};

const ModelCase kModelCases[] = {
    {"half_split_gqa_f32", RopeLayout::half_split, 2, 0, false, DType::f32},
    {"interleaved_gqa_f32_tied", RopeLayout::interleaved, 2, 0, true, DType::f32},
    {"half_split_mha_f16_partial_rotary", RopeLayout::half_split, 4, 8, false, DType::f16},
    {"interleaved_mqa_bf16", RopeLayout::interleaved, 1, 0, false, DType::bf16},
    {"interleaved_gqa_f16_partial_rotary", RopeLayout::interleaved, 2, 10, true, DType::f16},
    {"interleaved_gqa_q8_0", RopeLayout::interleaved, 2, 0, false, DType::q8_0},
    {"half_split_mqa_q4_0_tied", RopeLayout::half_split, 1, 0, true, DType::q4_0},
};

Model model_for(const ModelCase& c, std::uint64_t seed = 42) {
  return kvevict::model::make_random_model(small_config(c.layout, c.kv_heads, c.rotary_dim, c.tied),
                                           seed, c.dtype);
}

// ---------------------------------------------------------------------------------------------
// Random model
// ---------------------------------------------------------------------------------------------

TEST(RandomModel, DeterministicAndDtypesAgree) {
  const ModelConfig config = small_config(RopeLayout::half_split);
  const Model a = kvevict::model::make_random_model(config, 7, DType::f32);
  const Model b = kvevict::model::make_random_model(config, 7, DType::f32);
  const Model other = kvevict::model::make_random_model(config, 8, DType::f32);
  const Model half = kvevict::model::make_random_model(config, 7, DType::f16);
  const Model brain = kvevict::model::make_random_model(config, 7, DType::bf16);
  ASSERT_EQ(a.layers.size(), 2u);
  EXPECT_EQ(
      std::memcmp(a.layers[1].w_down.data, b.layers[1].w_down.data, a.layers[1].w_down.bytes()), 0);
  EXPECT_NE(
      std::memcmp(a.layers[1].w_down.data, other.layers[1].w_down.data, a.layers[1].w_down.bytes()),
      0);
  EXPECT_EQ(half.layers[0].wq.dtype, DType::f16);
  EXPECT_EQ(half.layers[0].wq.bytes() * 2, a.layers[0].wq.bytes());
  // The same draws, rounded: f16 keeps ~11 bits, bf16 ~8.
  double sum = 0.0;
  double square = 0.0;
  for (std::int64_t r = 0; r < a.layers[0].wq.rows; ++r) {
    for (std::int64_t c = 0; c < a.layers[0].wq.cols; ++c) {
      const double exact = weight(a.layers[0].wq, r, c);
      EXPECT_NEAR(weight(half.layers[0].wq, r, c), exact, std::fabs(exact) * 1e-3 + 1e-7);
      EXPECT_NEAR(weight(brain.layers[0].wq, r, c), exact, std::fabs(exact) * 8e-3 + 1e-30);
      sum += exact;
      square += exact * exact;
    }
  }
  const double count = static_cast<double>(a.layers[0].wq.rows * a.layers[0].wq.cols);
  EXPECT_NEAR(sum / count, 0.0, 0.01);
  EXPECT_NEAR(std::sqrt(square / count), 1.0 / std::sqrt(64.0), 0.01);  // std = 1 / sqrt(fan_in)
  EXPECT_EQ(a.tokenizer.bos_id, 256);
  EXPECT_EQ(a.tokenizer.eos_id, 257);
  EXPECT_EQ(a.tokenizer.anchor_id, 258);
  EXPECT_EQ(a.format, "random");
  const Model tied = kvevict::model::make_random_model(
      small_config(RopeLayout::half_split, 2, 0, /*tied=*/true), 7, DType::f32);
  EXPECT_EQ(tied.output.data, tied.token_embedding.data);
  EXPECT_LT(tied.weight_bytes(), a.weight_bytes());
}

// ---------------------------------------------------------------------------------------------
// The Eigen decoder against the naive loops
// ---------------------------------------------------------------------------------------------

class DecoderVsNaive : public ::testing::TestWithParam<ModelCase> {};

TEST_P(DecoderVsNaive, FullCacheMatchesAtEveryPosition) {
  const Model model = model_for(GetParam());
  const std::vector<std::int32_t> tokens = tokens_for(40);
  const std::vector<std::vector<double>> expected = naive_logits(model, tokens);
  std::vector<float> flat;
  for (const std::vector<double>& row : expected) flat.insert(flat.end(), row.begin(), row.end());

  for (KeyStorage storage : {KeyStorage::pre_rope, KeyStorage::post_rope}) {
    for (const std::vector<int>& chunks :
         {std::vector<int>{1}, std::vector<int>{40}, std::vector<int>{3, 1, 7, 1, 16}}) {
      DecoderOptions options;
      options.key_storage = storage;
      options.max_chunk = 40;
      Decoder decoder(model, full_policy(), options);
      const std::vector<float> logits = all_logits(decoder, tokens, chunks);
      const double error = max_relative_difference(logits, flat, kVocab);
      std::printf("  %s %s chunks[0]=%d: max |logit - naive| / max |naive logit| = %.2e\n",
                  GetParam().name, std::string(kvevict::to_string(storage)).c_str(), chunks[0],
                  error);
      EXPECT_LT(error, 1e-5);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DecoderVsNaive, ::testing::ValuesIn(kModelCases),
                         [](const ::testing::TestParamInfo<ModelCase>& info) {
                           return std::string(info.param.name);
                         });

// ---------------------------------------------------------------------------------------------
// Every SIMD target the CPU has (forced one at a time), and the kernels at sizes with tails
// ---------------------------------------------------------------------------------------------

namespace kernels = kvevict::model::kernels;

// Runs `body` once per available target, forced; restores the best one after.
template <class Body>
void for_each_target(Body&& body) {
  const std::vector<std::int64_t> targets = kernels::available_targets();
  ASSERT_FALSE(targets.empty());
  for (const std::int64_t target : targets) {
    kernels::force_target(target);
    ASSERT_EQ(kernels::active_target(), kernels::target_name(target));
    SCOPED_TRACE(kernels::target_name(target));
    body(kernels::target_name(target));
  }
  kernels::force_target(0);
}

TEST(DecoderTargets, EveryTargetMatchesTheNaiveLoops) {
  const std::vector<std::int32_t> tokens = tokens_for(24);
  for (const ModelCase& model_case : kModelCases) {
    const Model model = model_for(model_case);
    std::vector<float> expected;
    for (const std::vector<double>& row : naive_logits(model, tokens)) {
      expected.insert(expected.end(), row.begin(), row.end());
    }
    for_each_target([&](const std::string& target) {
      DecoderOptions options;
      options.max_chunk = 24;
      Decoder decoder(model, full_policy(), options);
      const double error =
          max_relative_difference(all_logits(decoder, tokens, {5, 1, 18}), expected, kVocab);
      std::printf("  %s on %s: %.2e\n", model_case.name, target.c_str(), error);
      EXPECT_LT(error, 1e-5) << model_case.name;
    });
  }
}

// Values in [-1, 1) from a fixed recurrence.
std::vector<float> test_values(std::size_t count, std::uint32_t seed) {
  std::vector<float> out(count);
  for (float& value : out) {
    seed = seed * 1664525u + 1013904223u;
    value = static_cast<float>(seed >> 8) * 0x1.0p-23f - 1.0f;
  }
  return out;
}

// Sizes that are not multiples of any vector width (7 rows, 37 columns...): every tail path.
TEST(DecoderTargets, KernelsEqualPlainLoopsWithTails) {
  for_each_target([](const std::string&) {
    // matvec for the element types (one row at a time): rows 7, 37 columns (no multiple of a
    // lane count).
    for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
      ModelConfig config = small_config(RopeLayout::half_split);
      const Model model = kvevict::model::make_random_model(config, 3, dtype);
      WeightMatrix w = model.layers[0].w_gate;  // [96, 64]: read as [7, 37] over its first bytes
      w.rows = 7;
      w.cols = 37;
      const std::vector<float> x = test_values(37, 5);
      std::vector<float> y(7);
      kernels::matvec(w, x.data(), y.data(), 0, 7);
      for (std::int64_t r = 0; r < 7; ++r) {
        double expected = 0.0;
        for (std::int64_t c = 0; c < 37; ++c)
          expected += weight(w, r, c) * x[static_cast<std::size_t>(c)];
        EXPECT_NEAR(y[static_cast<std::size_t>(r)], expected, 1e-5)
            << kvevict::model::to_string(dtype);
      }
    }
    // matvec for the block types, four rows at a time: rows 7 (a group of 4 and one of 3 that
    // repeats its last row), 96 columns (3 blocks), from every first row (a split between
    // threads). Each product is within (k + 2) eps of the magnitude of what the kernel adds: the
    // products of the stored values (Q4_0's nibbles, 0-15) with x, and Q4_0's 8 * x.
    for (const DType dtype : {DType::q8_0, DType::q4_0}) {
      ModelConfig config = small_config(RopeLayout::half_split);
      const Model model = kvevict::model::make_random_model(config, 3, dtype);
      WeightMatrix w = model.layers[0].w_gate;  // [96, 64]: read as [7, 96] over its first bytes
      w.rows = 7;
      w.cols = 96;
      const std::vector<float> x = test_values(96, 5);
      for (std::int64_t first = 0; first < 7; ++first) {
        std::vector<float> y(7, -1.0f);
        kernels::matvec(w, x.data(), y.data(), first, 7);
        for (std::int64_t r = 0; r < 7; ++r) {
          if (r < first) {
            EXPECT_EQ(y[static_cast<std::size_t>(r)], -1.0f) << "row " << r << " was written";
            continue;
          }
          double expected = 0.0;
          double magnitude = 0.0;
          for (std::int64_t c = 0; c < 96; ++c) {
            const double xc = x[static_cast<std::size_t>(c)];
            expected += weight(w, r, c) * xc;
            magnitude += std::fabs(double{block_scale(w, r, c)} * xc) *
                         (std::abs(stored(w, r, c)) + (dtype == DType::q4_0 ? 8 : 0));
          }
          EXPECT_NEAR(y[static_cast<std::size_t>(r)], expected, 98 * 0x1p-24 * magnitude)
              << kvevict::model::to_string(dtype) << " row " << r << " from " << first;
        }
      }
    }
    // Y = X W^T with m = 5, n = 6, k = 19, strides wider than the rows.
    const std::vector<float> x = test_values(5 * 20, 7);
    const std::vector<float> w = test_values(6 * 21, 9);
    std::vector<float> y(5 * 8, -1.0f);
    kernels::matmul_transposed(x.data(), 20, 5, w.data(), 21, 6, 19, y.data(), 8);
    for (int i = 0; i < 5; ++i) {
      for (int c = 0; c < 6; ++c) {
        double expected = 0.0;
        for (int t = 0; t < 19; ++t) expected += double{x[i * 20 + t]} * w[c * 21 + t];
        EXPECT_NEAR(y[static_cast<std::size_t>(i * 8 + c)], expected, 1e-5);
      }
    }
    // A decode step's few rows of X (m <= 8): blocks of one vector's lane count of W rows, summed
    // across lanes together, with the rows of W left over one at a time (n = 37 leaves some on
    // every target); k = 32, 64 and 128 are unrolled, 48 and 80 not, 44 is no multiple of a lane
    // count of 8 or 16 (one row at a time).
    for (const int k : {32, 44, 48, 64, 80, 128}) {
      for (const int m : {1, 3, 4, 6}) {
        const int n = 37;
        const std::vector<float> xs = test_values(static_cast<std::size_t>(m * k), 23);
        const std::vector<float> ws = test_values(static_cast<std::size_t>(n * (k + 3)), 25);
        std::vector<float> ys(static_cast<std::size_t>(m * (n + 2)), -1.0f);
        kernels::matmul_transposed(xs.data(), k, m, ws.data(), k + 3, n, k, ys.data(), n + 2);
        for (int i = 0; i < m; ++i) {
          for (int c = 0; c < n; ++c) {
            double expected = 0.0;
            double magnitude = 0.0;  // f32 summation in any order is within (k + 1) eps of it
            for (int t = 0; t < k; ++t) {
              const double product = double{xs[static_cast<std::size_t>(i * k + t)]} *
                                     ws[static_cast<std::size_t>(c * (k + 3) + t)];
              expected += product;
              magnitude += std::fabs(product);
            }
            EXPECT_NEAR(ys[static_cast<std::size_t>(i * (n + 2) + c)], expected,
                        (k + 1) * 0x1p-24 * magnitude)
                << "k " << k << " m " << m << " row " << i << " column " << c;
          }
        }
      }
    }
    // Y += P V with m = 3, n = 5, k = 21.
    const std::vector<float> p = test_values(3 * 5, 11);
    const std::vector<float> v = test_values(5 * 21, 13);
    std::vector<float> out = test_values(3 * 21, 15);
    const std::vector<float> before = out;
    kernels::add_weighted_rows(p.data(), 5, 3, v.data(), 21, 5, 21, out.data(), 21);
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 21; ++j) {
        double expected = before[static_cast<std::size_t>(i * 21 + j)];
        for (int s = 0; s < 5; ++s) expected += double{p[i * 5 + s]} * v[s * 21 + j];
        EXPECT_NEAR(out[static_cast<std::size_t>(i * 21 + j)], expected, 1e-5);
      }
    }
    // Y += P V over more rows of V than one block of them (64) and a part of one, m = 4.
    {
      const int rows = 150;
      const std::vector<float> pl = test_values(4 * rows, 27);
      const std::vector<float> vl = test_values(rows * 64, 29);
      std::vector<float> yl = test_values(4 * 64, 31);
      const std::vector<float> start = yl;
      kernels::add_weighted_rows(pl.data(), rows, 4, vl.data(), 64, rows, 64, yl.data(), 64);
      for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 64; ++j) {
          double expected = start[static_cast<std::size_t>(i * 64 + j)];
          double magnitude = std::fabs(expected);
          for (int s = 0; s < rows; ++s) {
            const double product = double{pl[static_cast<std::size_t>(i * rows + s)]} *
                                   vl[static_cast<std::size_t>(s * 64 + j)];
            expected += product;
            magnitude += std::fabs(product);
          }
          EXPECT_NEAR(yl[static_cast<std::size_t>(i * 64 + j)], expected,
                      (rows + 2) * 0x1p-24 * magnitude);
        }
      }
    }
    // Softmax pieces and SwiGLU over 23 values.
    std::vector<float> row = test_values(23, 17);
    row[4] = -std::numeric_limits<float>::infinity();  // a masked score
    const std::vector<float> scores = row;
    EXPECT_EQ(kernels::max(row.data(), 23), *std::max_element(scores.begin(), scores.end()));
    kernels::exp_shifted(row.data(), 23, 0.5f, 0.25f);
    for (std::size_t i = 0; i < 23; ++i) {
      EXPECT_NEAR(row[i], std::exp((double{scores[i]} - 0.5) * 0.25), 1e-6);
    }
    std::vector<float> gate = test_values(23, 19);
    gate[0] = -200.0f;  // exp(200) overflows f32: silu is 0 there
    const std::vector<float> up = test_values(23, 21);
    const std::vector<float> gate_before = gate;
    kernels::swiglu(gate.data(), up.data(), 23);
    for (std::size_t i = 0; i < 23; ++i) {
      const double g = gate_before[i];
      EXPECT_NEAR(gate[i], g / (1.0 + std::exp(-g)) * up[i], 1e-6);
    }
  });
}

// Prefill's products with W in every type (kernels::weight_product): m rows of X against panels of
// W's rows, m and the row ranges chosen to leave partial tiles and partial panels on every target
// (panels of 48 rows at AVX-512, 16 at AVX2, 8 at SSE4; tiles of 8 or 6 rows of X). Each output is
// within (k + 1) eps of the exact sum, and a split of W's rows gives the same bits as the whole.
TEST(DecoderTargets, WeightProductsWithPartialTilesAndPanels) {
  for_each_target([](const std::string&) {
    for (const DType dtype : {DType::f32, DType::f16, DType::bf16, DType::q8_0, DType::q4_0}) {
      const Model model =
          kvevict::model::make_random_model(small_config(RopeLayout::half_split), 3, dtype);
      const WeightMatrix& w = model.layers[0].w_gate;  // [96, 64]
      const std::int64_t n = w.rows;
      const std::int64_t k = w.cols;
      for (const std::int64_t m : {1, 5, 8, 9, 13}) {
        SCOPED_TRACE(std::string(kvevict::model::to_string(dtype)) + " m " + std::to_string(m));
        const std::vector<float> x = test_values(static_cast<std::size_t>(m * (k + 1)), 41);
        const std::ptrdiff_t y_stride = n + 3;
        std::vector<float> whole(static_cast<std::size_t>(m * y_stride), -1.0f);
        kernels::weight_product(w, 0, n, x.data(), k + 1, m, whole.data(), y_stride);
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t r = 0; r < n; ++r) {
            double expected = 0.0;
            double magnitude = 0.0;
            for (std::int64_t t = 0; t < k; ++t) {
              const double product = weight(w, r, t) * x[static_cast<std::size_t>(i * (k + 1) + t)];
              expected += product;
              magnitude += std::fabs(product);
            }
            EXPECT_NEAR(whole[static_cast<std::size_t>(i * y_stride + r)], expected,
                        (k + 1) * 0x1p-24 * magnitude)
                << "row " << i << " output " << r;
          }
          EXPECT_EQ(whole[static_cast<std::size_t>(i * y_stride + n)], -1.0f);  // not written
        }
        // Rows [0, 37), [37, 59), [59, 96) as three threads might take them.
        std::vector<float> split(whole.size(), -1.0f);
        for (const auto& [begin, end] :
             {std::pair<std::int64_t, std::int64_t>{0, 37}, {37, 59}, {59, n}}) {
          kernels::weight_product(w, begin, end, x.data(), k + 1, m, split.data(), y_stride);
        }
        EXPECT_EQ(std::memcmp(split.data(), whole.data(), whole.size() * sizeof(float)), 0);
      }
    }
  });
}

// A product of several rows of X over several of weight_product's slices of k (128 values), k not
// a multiple of any vector width (f32 / f16 / bf16: 300 = 128 + 128 + 44; blocks: 288), rows of X
// that fill no tile or two (1, 16, 21, 40), and panels cut by the thread ranges: every output must
// be one f32 chain over t = 0, 1, ... k - 1, acc = x[t] w[t] + acc with one rounding per term
// (fused multiply-add) or two (targets without FMA), from acc = 0: the same bits whatever m, the
// slices, the tiles and the split of W's rows (weight_product.hpp).
TEST(DecoderTargets, WeightProductIsOneMultiplyAddChainPerOutput) {
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16, DType::q8_0, DType::q4_0}) {
    const bool blocks = dtype == DType::q8_0 || dtype == DType::q4_0;
    const std::int64_t n = 100;
    const std::int64_t k = blocks ? 288 : 300;
    const std::vector<float> values = test_values(static_cast<std::size_t>(n * k), 61);
    std::vector<std::byte> bytes;
    if (blocks) {
      bytes = kvevict::model::quantize(values, dtype);
    } else {
      const std::size_t size = kvevict::model::dtype_bytes(dtype, n * k);
      bytes.resize(size);
      for (std::size_t i = 0; i < values.size(); ++i) {
        if (dtype == DType::f32) {
          std::memcpy(bytes.data() + 4 * i, &values[i], 4);
        } else {
          const std::uint16_t bits = dtype == DType::f16 ? kvevict::model::float_to_f16(values[i])
                                                         : kvevict::model::float_to_bf16(values[i]);
          std::memcpy(bytes.data() + 2 * i, &bits, 2);
        }
      }
    }
    WeightMatrix w;
    w.dtype = dtype;
    w.rows = n;
    w.cols = k;
    w.data = bytes.data();
    for (const std::int64_t m : {1, 16, 21, 40}) {
      const std::ptrdiff_t x_stride = k + 5;
      const std::vector<float> x = test_values(static_cast<std::size_t>(m * x_stride), 67);
      // Both chains for every output.
      std::vector<float> fused(static_cast<std::size_t>(m * n));
      std::vector<float> unfused(fused.size());
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t r = 0; r < n; ++r) {
          float with_fma = 0.0f;
          float without = 0.0f;
          for (std::int64_t t = 0; t < k; ++t) {
            const auto w_value = static_cast<float>(weight(w, r, t));
            const float x_value = x[static_cast<std::size_t>(i * x_stride + t)];
            with_fma = std::fma(x_value, w_value, with_fma);
            const float product = x_value * w_value;
            without = product + without;
          }
          fused[static_cast<std::size_t>(i * n + r)] = with_fma;
          unfused[static_cast<std::size_t>(i * n + r)] = without;
        }
      }
      for_each_target([&](const std::string& target) {
        SCOPED_TRACE(std::string(kvevict::model::to_string(dtype)) + " m " + std::to_string(m));
        std::vector<float> whole(fused.size(), -1.0f);
        kernels::weight_product(w, 0, n, x.data(), x_stride, m, whole.data(), n);
        std::vector<float> split(fused.size(), -1.0f);
        for (const auto& [begin, end] :
             {std::pair<std::int64_t, std::int64_t>{0, 37}, {37, 59}, {59, n}}) {
          kernels::weight_product(w, begin, end, x.data(), x_stride, m, split.data(), n);
        }
        const auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
          return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
        };
        // x86's AVX2 and AVX-512 targets have FMA; SSE4 / SSSE3 round the product apart.
        if (target.rfind("AVX", 0) == 0) {
          EXPECT_TRUE(same_bits(whole, fused));
        } else {
          EXPECT_TRUE(same_bits(whole, fused) || same_bits(whole, unfused));
        }
        EXPECT_TRUE(same_bits(split, whole));
      });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 8-bit decode activations (DecodeActivations::q8_0): kernels::quantize_row and
// kernels::matvec_quantized against their definitions in kernels.hpp, on every target.
// ---------------------------------------------------------------------------------------------

// Blocks of 32: ordinary values, all zero, one NaN, one infinity, values around 1e-41 (subnormal:
// 127 / max overflows, the definition's division does not), and ties x / scale = k + 0.5.
std::vector<float> activation_blocks() {
  std::vector<float> x = test_values(6 * 32, 51);
  std::fill(x.begin() + 32, x.begin() + 64, 0.0f);
  x[64 + 7] = std::numeric_limits<float>::quiet_NaN();
  x[96 + 30] = -std::numeric_limits<float>::infinity();
  for (int j = 128; j < 160; ++j) x[static_cast<std::size_t>(j)] *= 1e-41f;
  // Block 5: max 127 (scale exactly 1), so 2.5 and -3.5 are ties: rounded to even, 2 and -4.
  x[160] = 127.0f;
  x[161] = 2.5f;
  x[162] = -3.5f;
  return x;
}

TEST(DecoderTargets, QuantizedRowFollowsItsDefinition) {
  const std::vector<float> x = activation_blocks();
  for_each_target([&](const std::string&) {
    kernels::QuantizedRow q;
    kernels::quantize_row(x.data(), static_cast<std::int64_t>(x.size()), q);
    ASSERT_EQ(q.values.size(), x.size());
    ASSERT_EQ(q.scales.size(), 6u);
    for (std::size_t b = 0; b < 6; ++b) {
      SCOPED_TRACE("block " + std::to_string(b));
      float largest = 0.0f;
      bool finite = true;
      for (std::size_t j = 32 * b; j < 32 * b + 32; ++j) {
        finite = finite && std::isfinite(x[j]);
        largest = std::max(largest, std::fabs(x[j]));
      }
      if (!finite) {
        EXPECT_TRUE(std::isnan(q.scales[b]));
        EXPECT_TRUE(std::isnan(q.nibble_offsets[b]));
      }
      const float scale = finite ? largest / 127.0f : 0.0f;
      if (finite) {
        EXPECT_EQ(q.scales[b], scale);
      }
      int sum = 0;
      for (std::size_t j = 32 * b; j < 32 * b + 32; ++j) {
        const float expected = scale == 0.0f ? 0.0f : std::nearbyint(x[j] / scale);
        EXPECT_EQ(q.values[j], static_cast<std::int8_t>(expected)) << "value " << j;
        EXPECT_LE(std::abs(int{q.values[j]}), 127);
        sum += q.values[j];
      }
      if (finite) {
        EXPECT_EQ(q.nibble_offsets[b], 8.0f * scale * static_cast<float>(sum));
      }
    }
    EXPECT_EQ(q.values[161], 2);
    EXPECT_EQ(q.values[162], -4);
    EXPECT_EQ(q.values[160], 127);
  });
  kernels::QuantizedRow q;
  kvevict::test::expect_error([&] { kernels::quantize_row(x.data(), 33, q); },
                              "not whole blocks of 32");
}

// The products follow kernels.hpp's formula to the bit (integer block sums, then the f32 fma
// chain in block order) on every target and for any split of the rows (the 8-row kernel and the
// row-at-a-time one compute the same), and stay within the rounding of the activations of the
// f32 product: |W x - W x'| <= sum over blocks of (scale / 2) * sum |w| (|x - x'| <= scale / 2).
TEST(DecoderTargets, QuantizedProductsFollowTheirFormula) {
  ModelConfig config = small_config(RopeLayout::half_split);
  config.dim = 96;  // w_gate [96, 96]: 3 blocks per row
  const std::vector<float> x = test_values(96, 61);
  kernels::QuantizedRow q;
  kernels::quantize_row(x.data(), 96, q);
  for (const DType dtype : {DType::q8_0, DType::q4_0}) {
    SCOPED_TRACE(std::string(kvevict::model::to_string(dtype)));
    const Model model = kvevict::model::make_random_model(config, 3, dtype);
    const WeightMatrix& w = model.layers[0].w_gate;
    ASSERT_EQ(w.cols, 96);
    std::vector<float> expected(static_cast<std::size_t>(w.rows));
    for (std::int64_t r = 0; r < w.rows; ++r) {
      float total = 0.0f;
      float offset = 0.0f;
      double exact = 0.0;
      double bound = 0.0;
      for (std::int64_t b = 0; b < 3; ++b) {
        std::int32_t sum = 0;
        double weight_magnitude = 0.0;
        for (std::int64_t c = 32 * b; c < 32 * b + 32; ++c) {
          sum += stored(w, r, c) * q.values[static_cast<std::size_t>(c)];
          exact += weight(w, r, c) * x[static_cast<std::size_t>(c)];
          weight_magnitude += std::fabs(weight(w, r, c));
        }
        const float scale = block_scale(w, r, 32 * b);
        const auto bi = static_cast<std::size_t>(b);
        total = std::fma(scale * q.scales[bi], static_cast<float>(sum), total);
        if (dtype == DType::q4_0) offset = std::fma(scale, q.nibble_offsets[bi], offset);
        bound += q.scales[bi] / 2 * weight_magnitude;
      }
      expected[static_cast<std::size_t>(r)] = total - offset;
      EXPECT_NEAR(total - offset, exact, bound * (1 + 1e-5)) << "row " << r;
    }
    for_each_target([&](const std::string&) {
      std::vector<float> whole(expected.size(), -1.0f);
      kernels::matvec_quantized(w, q, whole.data(), 0, w.rows);
      EXPECT_EQ(std::memcmp(whole.data(), expected.data(), whole.size() * sizeof(float)), 0);
      // [0, 5), [5, 18), [18, 96): groups of 8 from odd starts, and rows left over.
      std::vector<float> split(expected.size(), -1.0f);
      for (const auto& [begin, end] :
           {std::pair<std::int64_t, std::int64_t>{0, 5}, {5, 18}, {18, w.rows}}) {
        kernels::matvec_quantized(w, q, split.data(), begin, end);
      }
      EXPECT_EQ(std::memcmp(split.data(), expected.data(), split.size() * sizeof(float)), 0);
    });
  }
  // A non-finite activation gives NaN, not a number.
  const Model model = kvevict::model::make_random_model(config, 3, DType::q4_0);
  std::vector<float> bad = x;
  bad[40] = std::numeric_limits<float>::infinity();
  kernels::quantize_row(bad.data(), 96, q);
  std::vector<float> y(96);
  kernels::matvec_quantized(model.layers[0].w_gate, q, y.data(), 0, 96);
  for (const float value : y) EXPECT_TRUE(std::isnan(value));
}

// RoPE over every dimension of a head (the defaults otherwise).
kvevict::Rope rope_over(int head_dim) {
  kvevict::RopeConfig config;
  config.head_dim = head_dim;
  config.rotary_dim = head_dim;
  return kvevict::Rope(config);
}

// One KV head's attention over f32 rows: queries [n][heads][head_dim] (n = positions.size()), keys
// and values [limit][head_dim]. Fills the probabilities [heads * n, limit] (attention writes them
// with a wider row stride) and the outputs [n][heads][head_dim].
struct GroupRows {
  const kvevict::Rope& rope;
  int heads = 0;
  int head_dim = 0;
  int limit = 0;
  const std::vector<float>& queries;
  const std::vector<float>& keys;
  const std::vector<float>& values;
  std::span<const std::int64_t> positions;
  std::span<const std::int32_t> slots;

  void attend(std::span<const kvevict::model::KeyRun> runs, bool skip_masked,
              std::vector<float>& probabilities, std::vector<float>& outputs) const {
    const auto n = static_cast<int>(positions.size());
    kvevict::model::GroupAttention group;
    group.queries = queries.data();
    group.query_stride = heads * head_dim;
    group.heads = heads;
    group.query_positions = positions;
    group.query_slots = slots;
    group.keys = {reinterpret_cast<const std::uint8_t*>(keys.data()), kvevict::KvType::f32,
                  head_dim * sizeof(float)};
    group.values = {reinterpret_cast<const std::uint8_t*>(values.data()), kvevict::KvType::f32,
                    head_dim * sizeof(float)};
    group.slot_limit = limit;
    group.head_dim = head_dim;
    group.runs = runs;
    group.skip_masked = skip_masked;
    kvevict::model::QueryAngles angles(rope);
    kvevict::model::AttentionBuffers buffers;
    // Rows written kPad floats apart beyond the slots (as into a layer's widest row): the padding
    // must stay untouched.
    constexpr int kPad = 5;
    constexpr float kUntouched = -7.0f;
    const int stride = limit + kPad;
    std::vector<float> padded(static_cast<std::size_t>(heads * n * stride), kUntouched);
    outputs.assign(static_cast<std::size_t>(n * heads * head_dim), -1.0f);
    kvevict::model::attend(group, angles, padded.data(), stride, outputs.data(), heads * head_dim,
                           buffers);
    probabilities.resize(static_cast<std::size_t>(heads * n * limit));
    for (int r = 0; r < heads * n; ++r) {
      const auto row = padded.begin() + static_cast<std::ptrdiff_t>(r) * stride;
      std::copy_n(row, limit, probabilities.begin() + static_cast<std::ptrdiff_t>(r) * limit);
      EXPECT_TRUE(std::all_of(row + limit, row + stride, [](float p) { return p == kUntouched; }))
          << "row " << r << ": written past its slots";
    }
  }
};

// A long chunk's attention leaves out each block of queries' products with the chunk's later
// slots; the probabilities and outputs must be those of whole rows, bit for bit: two query heads
// of one KV head, 70 queries in consecutive slots [10, 80) after 10 older slots and before 5
// younger ones (a chunk in a gap), the slots in two runs of different pending rotation.
TEST(DecoderTargets, SkippedMaskedProductsChangeNoBit) {
  const int head_dim = 16;
  const int heads = 2;
  const int n = 70;
  const int limit = 85;
  const kvevict::Rope rope = rope_over(head_dim);
  const std::vector<float> queries =
      test_values(static_cast<std::size_t>(n * heads * head_dim), 51);
  const std::vector<float> keys = test_values(static_cast<std::size_t>(limit * head_dim), 53);
  const std::vector<float> values = test_values(static_cast<std::size_t>(limit * head_dim), 55);
  std::vector<std::int64_t> positions(n);
  std::vector<std::int32_t> slots(n);
  for (int i = 0; i < n; ++i) {
    positions[static_cast<std::size_t>(i)] = 15 + i;
    slots[static_cast<std::size_t>(i)] = 10 + i;
  }
  const std::vector<kvevict::model::KeyRun> runs{{0, 40, 0}, {40, limit, 3}};
  const GroupRows group{rope, heads, head_dim, limit, queries, keys, values, positions, slots};
  for_each_target([&](const std::string&) {
    std::vector<float> probabilities[2];
    std::vector<float> outputs[2];
    for (const bool skip : {false, true}) {
      group.attend(runs, skip, probabilities[skip ? 1 : 0], outputs[skip ? 1 : 0]);
    }
    EXPECT_EQ(std::memcmp(probabilities[0].data(), probabilities[1].data(),
                          probabilities[0].size() * sizeof(float)),
              0);
    EXPECT_EQ(std::memcmp(outputs[0].data(), outputs[1].data(), outputs[0].size() * sizeof(float)),
              0);
    // Query i sees the 10 older slots, the chunk up to its own slot and the 5 younger ones.
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < n; i += 23) {
        const float* row = probabilities[1].data() + static_cast<std::size_t>((h * n + i) * limit);
        EXPECT_GT(row[10 + i], 0.0f);
        if (10 + i + 1 < 80) {
          EXPECT_EQ(row[10 + i + 1], 0.0f);
        }
        EXPECT_GT(row[80], 0.0f);
        EXPECT_NEAR(std::accumulate(row, row + limit, 0.0), 1.0, 1e-5);
      }
    }
  });
}

// Attention over a cache under cache_index: many runs of slots, few pending rotations among them,
// free slots between some runs. Each probability must be the softmax of q rotated to p - d against
// each key (d: its run's rotation), computed here in double; free slots and later chunk tokens get
// exact zeros; and the bits must not depend on how the live slots are cut into runs (each run
// split in two gives the same probabilities and outputs) nor on whether a long chunk's causal
// blocks are skipped. Chunks of 1, 40 and 1,100 queries: the last one's rotated queries exceed
// what attend() keeps, so it rotates them again per run.
TEST(DecoderTargets, ManyRunsAttendAsTheirRotatedKeys) {
  const int head_dim = 16;
  const int heads = 2;
  const kvevict::Rope rope = rope_over(head_dim);
  const std::int64_t rotations[] = {0, 3, 7, 1, 12};
  for (const int n : {1, 40, 1100}) {
    SCOPED_TRACE("queries " + std::to_string(n));
    // 60 older runs of 1-9 slots, every fourth followed by a free slot, then the chunk's own slots
    // (rotation 0, as tokens just written).
    std::vector<kvevict::model::KeyRun> runs;
    std::vector<int> free_slots;
    int slot = 0;
    for (int r = 0; r < 60; ++r) {
      const int length = 1 + (r * 7) % 9;
      runs.push_back({slot, slot + length, rotations[(r * 3) % 5]});
      slot += length;
      if (r % 4 == 3) free_slots.push_back(slot++);
    }
    const int first = slot;
    runs.push_back({first, first + n, 0});
    const int limit = first + n;
    std::vector<std::int64_t> positions(static_cast<std::size_t>(n));
    std::vector<std::int32_t> slots(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      positions[static_cast<std::size_t>(i)] = 500 + i;
      slots[static_cast<std::size_t>(i)] = first + i;
    }
    // Each run cut in two where it can be: the same slots and rotations.
    std::vector<kvevict::model::KeyRun> split_runs;
    for (const kvevict::model::KeyRun& run : runs) {
      const int middle = run.begin + (run.end - run.begin) / 2;
      if (middle > run.begin) split_runs.push_back({run.begin, middle, run.rotation});
      split_runs.push_back({middle, run.end, run.rotation});
    }
    const std::vector<float> queries =
        test_values(static_cast<std::size_t>(n * heads * head_dim), 61);
    const std::vector<float> keys = test_values(static_cast<std::size_t>(limit * head_dim), 63);
    const std::vector<float> values = test_values(static_cast<std::size_t>(limit * head_dim), 65);
    const GroupRows group{rope, heads, head_dim, limit, queries, keys, values, positions, slots};
    for_each_target([&](const std::string&) {
      std::vector<float> p;
      std::vector<float> out;
      group.attend(runs, true, p, out);
      std::vector<float> split_p;
      std::vector<float> split_out;
      group.attend(split_runs, true, split_p, split_out);
      EXPECT_EQ(std::memcmp(p.data(), split_p.data(), p.size() * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(out.data(), split_out.data(), out.size() * sizeof(float)), 0);
      // Whole rows (no causal blocks): q.K takes each range of touching runs in one call while
      // every rotation's queries are kept (40 queries), and a call per run past that (1,100).
      std::vector<float> whole_p;
      std::vector<float> whole_out;
      group.attend(runs, false, whole_p, whole_out);
      EXPECT_EQ(std::memcmp(p.data(), whole_p.data(), p.size() * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(out.data(), whole_out.data(), out.size() * sizeof(float)), 0);
      // The reference, in double, for a few queries of each head.
      for (int h = 0; h < heads; ++h) {
        for (int i = 0; i < n; i += std::max(1, n / 4)) {
          std::vector<double> expected(static_cast<std::size_t>(limit), 0.0);
          double largest = -std::numeric_limits<double>::infinity();
          for (const kvevict::model::KeyRun& run : runs) {
            std::vector<double> q(head_dim);
            for (int j = 0; j < head_dim; ++j) {
              q[static_cast<std::size_t>(j)] =
                  queries[static_cast<std::size_t>(i * heads * head_dim + h * head_dim + j)];
            }
            rope.rotate(q.data(), positions[static_cast<std::size_t>(i)] - run.rotation);
            for (int s = run.begin; s < std::min(run.end, first + i + 1); ++s) {
              double dot = 0.0;
              for (int j = 0; j < head_dim; ++j) {
                dot += q[static_cast<std::size_t>(j)] *
                       keys[static_cast<std::size_t>(s * head_dim + j)];
              }
              expected[static_cast<std::size_t>(s)] = dot / std::sqrt(double{head_dim});
              largest = std::max(largest, expected[static_cast<std::size_t>(s)]);
            }
          }
          double total = 0.0;
          for (const kvevict::model::KeyRun& run : runs) {
            for (int s = run.begin; s < std::min(run.end, first + i + 1); ++s) {
              expected[static_cast<std::size_t>(s)] =
                  std::exp(expected[static_cast<std::size_t>(s)] - largest);
              total += expected[static_cast<std::size_t>(s)];
            }
          }
          const float* row = p.data() + static_cast<std::size_t>((h * n + i) * limit);
          for (int s = 0; s < limit; ++s) {
            const double want = expected[static_cast<std::size_t>(s)] / total;
            if (want == 0.0) {
              ASSERT_EQ(row[s], 0.0f) << "head " << h << " query " << i << " slot " << s;
            } else {
              ASSERT_NEAR(row[s], want, 1e-6) << "head " << h << " query " << i << " slot " << s;
            }
          }
          for (const int free_slot : free_slots) EXPECT_EQ(row[free_slot], 0.0f);
        }
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Cached decoding against recomputation without a cache
// ---------------------------------------------------------------------------------------------

TEST(DecoderCache, CachedDecodingEqualsRecomputation) {
  for (const ModelCase& model_case : {kModelCases[0], kModelCases[1], kModelCases[3]}) {
    const Model model = model_for(model_case, 3);
    const std::vector<std::int32_t> tokens = tokens_for(48, 5);
    // Recomputation: a fresh decoder per prefix, the whole prefix in one forward.
    std::vector<float> recomputed;
    for (std::size_t t = 1; t <= tokens.size(); ++t) {
      DecoderOptions options;
      options.max_chunk = 48;
      Decoder fresh(model, full_policy(), options);
      const ForwardResult result = fresh.forward(std::span(tokens).first(t));
      ASSERT_EQ(result.rows, 1);
      recomputed.insert(recomputed.end(), result.last().begin(), result.last().end());
    }
    for (KeyStorage storage : {KeyStorage::pre_rope, KeyStorage::post_rope}) {
      for (const std::vector<int>& chunks :
           {std::vector<int>{1}, std::vector<int>{2, 5, 1, 1, 9, 3}}) {
        DecoderOptions options;
        options.key_storage = storage;
        options.max_chunk = 16;
        Decoder cached(model, full_policy(), options);
        const std::vector<float> logits = all_logits(cached, tokens, chunks);
        const double error = max_relative_difference(logits, recomputed, kVocab);
        std::printf("  %s %s chunks[0]=%d: cached vs recomputed %.2e\n", model_case.name,
                    std::string(kvevict::to_string(storage)).c_str(), chunks[0], error);
        EXPECT_LT(error, 1e-4);
        EXPECT_EQ(cached.stats().tokens_fed, 48);
      }
    }
  }
}

// A budget far larger than the stream reserves for the stream, not for the budget: the cache starts
// at 1,024 slots + one chunk and doubles as tokens arrive (sized for the budget, --budget 16777216
// over a 300-byte input reached 5.9 GB).
TEST(DecoderCache, MemoryFollowsTheStreamNotTheBudget) {
  const Model model = kvevict::model::make_random_model(small_config(RopeLayout::half_split), 5);
  kvevict::model::DecoderOptions options;
  options.max_chunk = 16;
  kvevict::model::Decoder decoder(
      model, kvevict::make_policy("h2o", kvevict::budget_params("h2o", 1 << 24)), options);
  EXPECT_EQ(decoder.cache().sequence().capacity(), 1024 + 16);
  std::vector<std::int32_t> tokens(3000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i % 250);
  (void)decoder.feed(tokens);
  // 3,000 tokens: 1,040 doubled once to 2,080, then to 4,160.
  EXPECT_EQ(decoder.cache().sequence().live(0, 0), 3000);
  EXPECT_EQ(decoder.cache().sequence().capacity(), 4160);
  // A budget below the cap is reserved whole, as before: it never grows.
  kvevict::model::Decoder small(
      model, kvevict::make_policy("h2o", kvevict::budget_params("h2o", 64)), options);
  EXPECT_EQ(small.cache().sequence().capacity(), 64 + 16);
}

TEST(DecoderCache, FeedSplitsAndConcatenates) {
  const Model model = model_for(kModelCases[0]);
  const std::vector<std::int32_t> tokens = tokens_for(50, 9);
  DecoderOptions options;
  options.max_chunk = 8;
  Decoder by_feed(model, full_policy(), options);
  const ForwardResult fed = by_feed.feed(tokens, ForwardRequest{false, true}, 5);
  ASSERT_EQ(fed.rows, 50);
  Decoder by_forward(model, full_policy(), options);
  const std::vector<float> expected = all_logits(by_forward, tokens, {5});
  ASSERT_EQ(fed.logits.size(), expected.size());
  EXPECT_TRUE(std::equal(fed.logits.begin(), fed.logits.end(), expected.begin()));
  EXPECT_EQ(by_feed.stats().forwards, 10);
  // Without all_logits: the last token's logits only, same values.
  Decoder last_only(model, full_policy(), options);
  const ForwardResult last = last_only.feed(tokens, {}, 5);
  ASSERT_EQ(last.rows, 1);
  EXPECT_TRUE(std::equal(last.last().begin(), last.last().end(), fed.last().begin()));
}

// ---------------------------------------------------------------------------------------------
// Every policy, with a budget larger than the stream, equals the full cache bit for bit
// ---------------------------------------------------------------------------------------------

struct PolicyCase {
  const char* name;
  PolicyParams params;
};

std::vector<PolicyCase> unevicting_policies() {
  return {
      {"window", PolicyParams().set("recent", 1000)},
      {"streaming_llm", PolicyParams().set("sinks", 4).set("recent", 1000)},
      {"h2o", PolicyParams().set("heavy", 500).set("recent", 500)},
      {"tova", PolicyParams().set("budget", 1000)},
      {"tova", PolicyParams().set("budget", 1000).set("sinks", 4).set("head_wise", 1)},
      {"sirllm", PolicyParams().set("entropy", 1000).set("decay", 0.5)},
      {"anllm", PolicyParams().set_list("anchor_ids", {299})},  // an id the stream never holds
      {"infinipot", PolicyParams().set("pot", 1000).set("keep", 500)},
      {"random_llm", PolicyParams().set("budget", 1000)},
      {"interval_llm", PolicyParams().set("budget", 1000)},
  };
}

TEST(DecoderPolicies, EveryPolicyWithoutEvictionEqualsFullBitwise) {
  const Model model = model_for(kModelCases[0]);
  const std::vector<std::int32_t> tokens = tokens_for(90, 11);
  const std::vector<int> chunks{6, 1, 1, 9, 2, 1, 12, 1};
  for (KeyStorage storage : {KeyStorage::pre_rope, KeyStorage::post_rope}) {
    DecoderOptions options;
    options.key_storage = storage;
    options.max_chunk = 12;
    Decoder full(model, full_policy(), options);
    const std::vector<float> expected = all_logits(full, tokens, chunks, /*turn_every=*/3);
    // Last-token logits too: the policies that want surprisal compute every row, the full cache
    // only the last; the last row must not depend on it.
    Decoder full_last(model, full_policy(), options);
    std::vector<float> expected_last;
    for (std::size_t offset = 0, c = 0; offset < tokens.size(); ++c) {
      const std::size_t n = std::min<std::size_t>(
          static_cast<std::size_t>(chunks[c % chunks.size()]), tokens.size() - offset);
      const ForwardResult r =
          full_last.forward(std::span(tokens).subspan(offset, n), {c % 3 == 0, false});
      expected_last.insert(expected_last.end(), r.logits.begin(), r.logits.end());
      offset += n;
    }
    for (const PolicyCase& policy : unevicting_policies()) {
      SCOPED_TRACE(std::string(policy.name) + " " + std::string(kvevict::to_string(storage)));
      Decoder decoder(model, kvevict::make_policy(policy.name, policy.params), options);
      decoder.set_catalyst({83, 117, 109});
      const std::vector<float> logits = all_logits(decoder, tokens, chunks, 3);
      ASSERT_EQ(logits.size(), expected.size());
      std::size_t mismatches = 0;
      for (std::size_t i = 0; i < logits.size(); ++i) {
        if (std::memcmp(&logits[i], &expected[i], sizeof(float)) != 0) ++mismatches;
      }
      EXPECT_EQ(mismatches, 0u) << "max relative difference "
                                << max_relative_difference(logits, expected, kVocab);
      EXPECT_EQ(decoder.cache().sequence().stats().decisions, 0);
      EXPECT_EQ(decoder.stats().catalyst_runs, 0);

      Decoder last(model, kvevict::make_policy(policy.name, policy.params), options);
      std::vector<float> last_logits;
      for (std::size_t offset = 0, c = 0; offset < tokens.size(); ++c) {
        const std::size_t n = std::min<std::size_t>(
            static_cast<std::size_t>(chunks[c % chunks.size()]), tokens.size() - offset);
        const ForwardResult r =
            last.forward(std::span(tokens).subspan(offset, n), {c % 3 == 0, false});
        ASSERT_EQ(r.rows, 1);
        last_logits.insert(last_logits.end(), r.logits.begin(), r.logits.end());
        offset += n;
      }
      EXPECT_EQ(
          std::memcmp(last_logits.data(), expected_last.data(), last_logits.size() * sizeof(float)),
          0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------------------------

// Products are split by rows of W and attention by KV heads, each value computed as on one thread:
// 1, 2 and 3 threads give the same bits, for every weight type, both key storages, and policies
// that read attention rows and evict (their decisions must not change either): H2O with a unit
// per KV head, TOVA with one per layer. One thread hands each KV head's rows to the policy apart,
// several threads the layer's at once (Sequence::attention_per_kv_head). The model is wide enough
// (output 2,048 x 128) that single-row products are split too.
TEST(DecoderThreads, LogitsAreBitIdenticalForAnyThreadCount) {
  ModelConfig config = small_config(RopeLayout::half_split);
  config.dim = 128;
  config.hidden_dim = 384;
  config.vocab_size = 2048;
  const std::vector<std::int32_t> tokens = tokens_for(70, 5);
  const std::vector<int> chunks{12, 1, 1, 7, 1};
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16, DType::q8_0, DType::q4_0}) {
    const Model model = kvevict::model::make_random_model(config, 9, dtype);
    for (const auto& [policy, params] :
         {std::pair<std::string, PolicyParams>{"h2o",
                                               PolicyParams().set("heavy", 8).set("recent", 8)},
          {"tova", PolicyParams().set("budget", 16)}}) {
      for (const KeyStorage storage : {KeyStorage::pre_rope, KeyStorage::post_rope}) {
        std::vector<float> one_thread;
        std::int64_t one_thread_evicted = 0;
        for (const int threads : {1, 2, 3}) {
          SCOPED_TRACE(std::string(kvevict::model::to_string(dtype)) + " " + policy + " " +
                       std::string(kvevict::to_string(storage)) + " threads " +
                       std::to_string(threads));
          DecoderOptions options;
          options.key_storage = storage;
          options.max_chunk = 12;
          options.threads = threads;
          Decoder decoder(model, kvevict::make_policy(policy, params), options);
          const std::vector<float> logits = all_logits(decoder, tokens, chunks);
          const std::int64_t evicted = decoder.cache().sequence().stats().evicted_slots;
          EXPECT_GT(evicted, 0);
          if (threads == 1) {
            one_thread = logits;
            one_thread_evicted = evicted;
            continue;
          }
          ASSERT_EQ(logits.size(), one_thread.size());
          EXPECT_EQ(std::memcmp(logits.data(), one_thread.data(), logits.size() * sizeof(float)), 0)
              << "max relative difference "
              << max_relative_difference(logits, one_thread,
                                         static_cast<std::size_t>(config.vocab_size));
          EXPECT_EQ(evicted, one_thread_evicted);
        }
      }
    }
  }
}

// DecodeActivations::q8_0 changes the one-row products of Q8_0 / Q4_0 weights only: a chunk's
// rows before its last (several-row products) keep their bits, every other weight type keeps all
// of them, and threads give the same bits. The rows it changes move less than rounding the
// weights to Q8_0 moves them: both round to the same step (1/127 of a block's largest value),
// and the activations' rounding reaches only the decode steps.
TEST(DecoderActivations, Q8_0ChangesOnlyTheOneRowProductsOfBlockWeights) {
  ModelConfig config = small_config(RopeLayout::half_split);
  config.dim = 128;
  config.hidden_dim = 384;
  config.vocab_size = 2048;  // wide enough that one-row products are split between threads
  const auto vocab = static_cast<std::size_t>(config.vocab_size);
  const std::vector<std::int32_t> tokens = tokens_for(40, 5);
  const std::vector<int> chunks{12, 1, 1, 7, 1};
  using kvevict::model::DecodeActivations;
  const auto logits = [&](DType dtype, DecodeActivations activations, int threads) {
    const Model model = kvevict::model::make_random_model(config, 9, dtype);
    DecoderOptions options;
    options.max_chunk = 12;
    options.threads = threads;
    options.decode_activations = activations;
    Decoder decoder(model, full_policy(), options);
    return all_logits(decoder, tokens, chunks);
  };
  // What rounding the weights to Q8_0's blocks (the same step as the activations') moves.
  const double weights_difference =
      max_relative_difference(logits(DType::q8_0, DecodeActivations::f32, 1),
                              logits(DType::f32, DecodeActivations::f32, 1), vocab);
  std::printf("  q8_0 against f32 weights %.2e\n", weights_difference);
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16, DType::q8_0, DType::q4_0}) {
    SCOPED_TRACE(std::string(kvevict::model::to_string(dtype)));
    const std::vector<float> f32 = logits(dtype, DecodeActivations::f32, 1);
    const std::vector<float> q8 = logits(dtype, DecodeActivations::q8_0, 1);
    const std::vector<float> q8_threads = logits(dtype, DecodeActivations::q8_0, 3);
    ASSERT_EQ(q8.size(), f32.size());
    EXPECT_EQ(std::memcmp(q8_threads.data(), q8.data(), q8.size() * sizeof(float)), 0);
    const bool block_weights = dtype == DType::q8_0 || dtype == DType::q4_0;
    const std::size_t unchanged = block_weights ? 11 * vocab : f32.size();
    EXPECT_EQ(std::memcmp(q8.data(), f32.data(), unchanged * sizeof(float)), 0);
    if (!block_weights) continue;
    EXPECT_NE(std::memcmp(q8.data() + unchanged, f32.data() + unchanged,
                          (f32.size() - unchanged) * sizeof(float)),
              0);
    const double difference = max_relative_difference(q8, f32, vocab);
    std::printf("  %s: q8_0 against f32 decode activations %.2e\n",
                std::string(kvevict::model::to_string(dtype)).c_str(), difference);
    EXPECT_LT(difference, weights_difference);
  }
}

TEST(DecoderThreads, ThreadCountOutsideItsRangeIsNamed) {
  const Model model = model_for(kModelCases[0]);
  for (const int threads : {0, -1, 1025}) {
    DecoderOptions options;
    options.threads = threads;
    kvevict::test::expect_error(
        [&] { Decoder decoder(model, full_policy(), options); },
        "Decoder: threads must be in [1, 1024], got " + std::to_string(threads));
  }
}

// ---------------------------------------------------------------------------------------------
// Pre- and post-RoPE key storage under real eviction
// ---------------------------------------------------------------------------------------------

TEST(DecoderRope, PreAndPostRopeAgreeUnderEviction) {
  struct Case {
    const char* name;
    PolicyParams params;
    kvevict::PositionMode mode;
  };
  const std::vector<Case> cases{
      {"streaming_llm", PolicyParams().set("sinks", 4).set("recent", 28),
       kvevict::PositionMode::cache_index},
      {"h2o", PolicyParams().set("heavy", 16).set("recent", 16), kvevict::PositionMode::original},
      {"h2o", PolicyParams().set("heavy", 16).set("recent", 16),
       kvevict::PositionMode::cache_index},
      {"infinipot", PolicyParams().set("pot", 40).set("keep", 24).set("novel", 8),
       kvevict::PositionMode::reset_on_compact},
      {"tova", PolicyParams().set("budget", 24).set("sinks", 2), kvevict::PositionMode::original},
  };
  for (const ModelCase& model_case : {kModelCases[0], kModelCases[4]}) {
    const Model model = model_for(model_case, 17);
    const std::vector<std::int32_t> tokens = tokens_for(160, 23);
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + std::string(kvevict::to_string(c.mode)) + " " +
                   model_case.name);
      std::vector<float> logits[2];
      std::int64_t compactions[2] = {0, 0};
      std::int64_t catalysts[2] = {0, 0};
      for (int s = 0; s < 2; ++s) {
        DecoderOptions options;
        options.key_storage = s == 0 ? KeyStorage::pre_rope : KeyStorage::post_rope;
        options.position_mode = c.mode;
        options.max_chunk = 8;
        Decoder decoder(model, kvevict::make_policy(c.name, c.params), options);
        decoder.set_catalyst({83, 117, 109, 109, 97, 114, 105, 122, 101});  // longer than max_chunk
        // Prefill in chunks (feed splits at the pot boundary), then decode token by token.
        const ForwardResult prefill =
            decoder.feed(std::span(tokens).first(60), ForwardRequest{false, true}, 7);
        logits[s].assign(prefill.logits.begin(), prefill.logits.end());
        for (std::size_t t = 60; t < tokens.size(); ++t) {
          const ForwardResult r = decoder.forward(std::span(tokens).subspan(t, 1));
          logits[s].insert(logits[s].end(), r.logits.begin(), r.logits.end());
        }
        compactions[s] = decoder.cache().sequence().stats().decisions;
        catalysts[s] = decoder.stats().catalyst_runs;
      }
      const double error = max_relative_difference(logits[0], logits[1], kVocab);
      std::printf("  %-13s %-16s %s: pre vs post RoPE %.2e over %lld decisions\n", c.name,
                  std::string(kvevict::to_string(c.mode)).c_str(), model_case.name, error,
                  static_cast<long long>(compactions[0]));
      EXPECT_LT(error, 1e-4);
      EXPECT_GT(compactions[0], 5);
      EXPECT_EQ(compactions[0], compactions[1]);
      EXPECT_EQ(catalysts[0], catalysts[1]);
      if (std::string(c.name) == "infinipot") {
        EXPECT_GT(catalysts[0], 3);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bounded memory
// ---------------------------------------------------------------------------------------------

TEST(DecoderMemory, BoundedPolicyKeepsPeakConstantOnALongStream) {
  const Model model = model_for(kModelCases[0]);
  const std::vector<std::int32_t> tokens = tokens_for(2000, 31);
  DecoderOptions options;
  options.max_chunk = 8;
  Decoder decoder(
      model,
      kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 4).set("recent", 60)),
      options);
  const std::size_t reserved = decoder.cache().memory().reserved_bytes;
  const std::vector<int> chunks{8, 1, 3, 1, 1, 5};
  std::size_t peak_after_warmup = 0;
  std::size_t offset = 0;
  for (std::size_t c = 0; offset < tokens.size(); ++c) {
    const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(chunks[c % chunks.size()]),
                                                tokens.size() - offset);
    (void)decoder.forward(std::span(tokens).subspan(offset, n));
    offset += n;
    if (offset >= 200 && peak_after_warmup == 0) peak_after_warmup = decoder.stats().peak_kv_bytes;
  }
  // 64 retained + one chunk of 8, in 2 layers x 2 KV heads, keys and values of 16 floats.
  const std::size_t bound = (64 + 8) * 2 * 2 * 2 * 16 * sizeof(float);
  EXPECT_EQ(decoder.stats().peak_kv_bytes, peak_after_warmup);
  EXPECT_EQ(decoder.stats().peak_kv_bytes, bound);
  EXPECT_EQ(decoder.cache().memory().reserved_bytes, reserved);
  EXPECT_EQ(decoder.stats().tokens_fed, 2000);
  EXPECT_GT(decoder.cache().sequence().stats().evicted_slots, 0);
}

// Resident bytes of this process (Linux /proc/self/statm), or -1 where it cannot be read.
long long resident_bytes() {
  std::FILE* file = std::fopen("/proc/self/statm", "r");
  if (file == nullptr) return -1;
  long long size = 0;
  long long resident = -1;
  if (std::fscanf(file, "%lld %lld", &size, &resident) != 2) resident = -1;
  std::fclose(file);
  return resident < 0 ? -1 : resident * sysconf(_SC_PAGESIZE);
}

// The buffers follow the chunks fed, not max_chunk. With toy-base's shape (dim 128,
// hidden 384, 4 layers, 4 heads, 2 KV heads of 32) and max_chunk 65,536 (the CLI's largest
// --chunk), the decoder reserved about 505 MB before its first token: activations of 65,536 rows
// of 2 x (128 + 384 + 128 + 64) floats (369 MB) and slots for 1,024 + 65,536 tokens at 2 KiB each
// (136 MB). Now it reserves at most 16 MiB of activations up front (2,978 rows here) and 2,048
// slots (4 MB), and 300 tokens need no more.
TEST(DecoderMemory, MaxChunkDoesNotSizeTheBuffers) {
  ModelConfig config = small_config(RopeLayout::half_split);
  config.dim = 128;
  config.hidden_dim = 384;
  config.layers = 4;
  const Model model = kvevict::model::make_random_model(config, 3);
  const long long before = resident_bytes();
  ASSERT_GE(before, 0) << "reads /proc/self/statm (Linux)";
  DecoderOptions options;
  options.max_chunk = 65536;
  Decoder decoder(model, full_policy(), options);
  (void)decoder.feed(tokens_for(300));
  EXPECT_LT(resident_bytes() - before, 100LL << 20);
  EXPECT_EQ(decoder.cache().sequence().capacity(), 2048);
}

TEST(DecoderMemory, InfiniPotPrefillStaysWithinPotPlusCatalyst) {
  const Model model = model_for(kModelCases[0]);
  const std::vector<std::int32_t> tokens = tokens_for(500, 37);
  DecoderOptions options;
  options.max_chunk = 32;
  Decoder decoder(model,
                  kvevict::make_policy("infinipot", PolicyParams().set("pot", 50).set("keep", 20)),
                  options);
  const std::vector<std::int32_t> catalyst{1, 2, 3, 4, 5, 6};
  decoder.set_catalyst(catalyst);
  const std::size_t reserved = decoder.cache().memory().reserved_bytes;
  (void)decoder.feed(tokens, {}, 32);
  const std::size_t slot_bytes = 2 * 2 * 2 * 16 * sizeof(float);
  EXPECT_EQ(decoder.stats().peak_kv_bytes, (50 + catalyst.size()) * slot_bytes);
  EXPECT_EQ(decoder.cache().memory().reserved_bytes, reserved);
  // The pot fills at 50, then every 30 tokens: (500 - 50) / 30 + 1 distillations.
  EXPECT_EQ(decoder.stats().catalyst_runs, 16);
}

// ---------------------------------------------------------------------------------------------
// Stage timing (DecoderOptions::observer): no thresholds on durations, only the structure
// ---------------------------------------------------------------------------------------------

TEST(DecoderTiming, StagesPartitionTheTimedWallTime) {
  const Model model = model_for(kModelCases[0]);
  const std::vector<std::int32_t> tokens = tokens_for(160, 53);
  struct Case {
    const char* name;
    PolicyParams params;
  };
  const std::vector<Case> cases{
      {"full", PolicyParams()},
      {"streaming_llm", PolicyParams().set("sinks", 4).set("recent", 28)},
      {"h2o", PolicyParams().set("heavy", 16).set("recent", 16)},
      {"tova", PolicyParams().set("budget", 32)},
      {"infinipot", PolicyParams().set("pot", 48).set("keep", 24)},
  };
  using kvevict::Stage;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    kvevict::StageClock clock;
    DecoderOptions options;
    options.max_chunk = 8;
    options.observer = &clock;
    Decoder decoder(model, kvevict::make_policy(c.name, c.params), options);
    const bool catalyst = std::string(c.name) == "infinipot";
    if (catalyst) decoder.set_catalyst({1, 2, 3, 4, 5});
    const auto wall_start = std::chrono::steady_clock::now();
    (void)decoder.feed(std::span(tokens).first(100), {}, 8);
    const kvevict::StageClock before = clock;
    for (std::size_t i = 100; i < tokens.size(); ++i)
      (void)decoder.forward(std::span(tokens).subspan(i, 1));
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();

    // The model's stages all ran; the stages are disjoint, so their sum is within the wall time.
    EXPECT_GT(clock.seconds(Stage::head), 0.0);
    EXPECT_GT(clock.seconds(Stage::attention), 0.0);
    EXPECT_GT(clock.seconds(Stage::mlp), 0.0);
    EXPECT_LE(clock.seconds(), wall);
    // Totals accumulate: the 60 single-token forwards only add.
    for (int stage = 0; stage < static_cast<int>(Stage::count); ++stage) {
      EXPECT_GE(clock.total(static_cast<Stage>(stage)), before.total(static_cast<Stage>(stage)));
    }
    if (std::string(c.name) == "full") {
      // No signal, no trigger: the policy is never consulted and nothing is applied.
      EXPECT_EQ(decoder.cache().sequence().stats().decisions, 0);
      EXPECT_EQ(clock.seconds(Stage::policy), 0.0);
      EXPECT_EQ(clock.seconds(Stage::reposition), 0.0);
    } else {
      // Every bounded policy here evicted, so it decided and its decisions were applied.
      EXPECT_GT(decoder.cache().sequence().stats().decisions, 0);
      EXPECT_GT(clock.seconds(Stage::policy), 0.0);
      EXPECT_GT(clock.seconds(Stage::reposition), 0.0);
    }
    // Only a catalyst run has catalyst time (pot 48, keep 24: runs at 48, 72, 96, ...).
    EXPECT_EQ(decoder.stats().catalyst_runs > 0, catalyst);
    if (catalyst) {
      EXPECT_GT(clock.seconds(Stage::catalyst), 0.0);
    } else {
      EXPECT_EQ(clock.seconds(Stage::catalyst), 0.0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// What the policy receives
// ---------------------------------------------------------------------------------------------

// Records the signals and checks the attention rows' contract; never evicts, except that as a pot
// policy it "distills" to its newest `keep` slots when `pot` is reached.
class RecordingPolicy final : public kvevict::Policy {
 public:
  RecordingPolicy(kvevict::SignalSet signals, int pot = 0, int keep = 0)
      : signals_(signals), pot_(pot), keep_(keep) {}
  [[nodiscard]] std::string_view name() const override { return "recording"; }
  [[nodiscard]] kvevict::SignalSet signals() const override { return signals_; }
  [[nodiscard]] kvevict::TriggerSet triggers() const override {
    if (pot_ > 0) return {kvevict::Trigger::pot_full};
    return {};
  }
  [[nodiscard]] std::optional<int> pot_room(const kvevict::SlotTable& slots) const override {
    if (pot_ == 0) return std::nullopt;
    return std::max(pot_ - slots.max_live(), 0);
  }
  void on_append(kvevict::SlotTable& /*slots*/, const kvevict::ChunkInfo& chunk) override {
    turn_starts.push_back(chunk.turn_start);
    chunk_first = chunk.first_original_position;
    chunk_size = chunk.size();
  }
  void observe_attention(kvevict::SlotTable& slots, int layer,
                         const kvevict::AttentionRows& rows) override {
    check_rows(slots, layer, rows, /*catalyst=*/false);
    ++attention_calls;
  }
  void observe_catalyst(kvevict::SlotTable& slots, int layer,
                        const kvevict::AttentionRows& rows) override {
    check_rows(slots, layer, rows, /*catalyst=*/true);
    ++catalyst_calls;
  }
  void observe_surprisal(kvevict::SlotTable& /*slots*/, const kvevict::ChunkInfo& /*chunk*/,
                         std::span<const float> values) override {
    surprisal.insert(surprisal.end(), values.begin(), values.end());
  }
  void select(const kvevict::EvictionContext& context, kvevict::Decision& decision) override {
    if (context.trigger != kvevict::Trigger::pot_full) return;
    for (int unit = 0; unit < context.slots.units(); ++unit) {
      keep_set_.begin(context.slots, unit, context.protection);
      keep_set_.keep_newest(keep_);
      keep_set_.evict_rest(decision);
    }
  }

  std::vector<bool> turn_starts;
  std::vector<float> surprisal;
  int attention_calls = 0;
  int catalyst_calls = 0;
  int failures = 0;
  std::int64_t chunk_first = 0;
  int chunk_size = 0;

 private:
  void check_rows(const kvevict::SlotTable& slots, int layer, const kvevict::AttentionRows& rows,
                  bool catalyst) {
    const bool last_only = !catalyst && !signals_.contains(kvevict::Signal::attention_rows);
    const auto fail = [&](const std::string& what) {
      ++failures;
      ADD_FAILURE() << what << " (layer " << layer << ", catalyst " << catalyst << ")";
    };
    const int n = catalyst ? rows.queries() : chunk_size;
    if (rows.queries() != (last_only ? 1 : n)) fail("query count");
    if (rows.kv_heads() != slots.layout().kv_heads()) fail("kv heads");
    if (!catalyst && rows.first_query_position() != chunk_first + (last_only ? n - 1 : 0)) {
      fail("first query position");
    }
    for (int h = 0; h < rows.q_heads(); ++h) {
      const int unit = slots.layout().unit_of(layer, h / rows.group_size());
      if (rows.keys(h) != slots.slot_limit(unit)) fail("key count");
      // Stream order: the queries are the newest rows.queries() tokens (the chunk or catalyst).
      const auto order = slots.stream_order(unit);
      for (int i = 0; i < rows.queries(); ++i) {
        const std::size_t query_index = order.size() - static_cast<std::size_t>(rows.queries() - i);
        const std::span<const float> row = rows.row(h, i);
        double sum = 0.0;
        std::vector<bool> live(row.size(), false);
        for (std::size_t k = 0; k < order.size(); ++k) {
          const float p = row[static_cast<std::size_t>(order[k])];
          live[static_cast<std::size_t>(order[k])] = true;
          if (k > query_index && p != 0.0f) fail("causally masked entry is not zero");
          if (k <= query_index && !(p > 0.0f)) fail("visible entry is not positive");
          sum += p;
        }
        for (std::size_t slot = 0; slot < row.size(); ++slot) {
          if (!live[slot] && row[slot] != 0.0f) fail("free slot is not zero");
        }
        if (std::fabs(sum - 1.0) > 1e-5) fail("row does not sum to 1");
      }
    }
  }

  kvevict::SignalSet signals_;
  int pot_;
  int keep_;
  kvevict::KeepSet keep_set_;
};

TEST(DecoderSignals, AttentionRowsSurprisalAndTurns) {
  const Model model = model_for(kModelCases[0]);
  const std::vector<std::int32_t> tokens = tokens_for(30, 41);
  DecoderOptions options;
  options.max_chunk = 8;

  auto owned = std::make_unique<RecordingPolicy>(
      kvevict::SignalSet{kvevict::Signal::attention_rows, kvevict::Signal::surprisal,
                         kvevict::Signal::turn_boundaries});
  RecordingPolicy& recording = *owned;
  Decoder decoder(model, std::move(owned), options);
  // Spans into the decoder's buffers stay valid until the next feed: copy them.
  const ForwardResult first =
      decoder.feed(std::span(tokens).first(10), ForwardRequest{true, true}, 4);
  ASSERT_EQ(first.surprisal.size(), 10u);
  std::vector<float> logits(first.logits.begin(), first.logits.end());
  std::vector<float> surprisal(first.surprisal.begin(), first.surprisal.end());
  const ForwardResult second =
      decoder.feed(std::span(tokens).subspan(10), ForwardRequest{true, true}, 8);
  ASSERT_EQ(second.surprisal.size(), 20u);
  logits.insert(logits.end(), second.logits.begin(), second.logits.end());
  surprisal.insert(surprisal.end(), second.surprisal.begin(), second.surprisal.end());
  EXPECT_EQ(recording.turn_starts, (std::vector<bool>{true, false, false, true, false, false}));
  EXPECT_EQ(recording.attention_calls, 6 * 2);
  EXPECT_EQ(recording.failures, 0);
  ASSERT_EQ(recording.surprisal.size(), 30u);
  ASSERT_EQ(logits.size(), 30u * kVocab);

  // Surprisal of token t = -log softmax(logits at t - 1)[token t]; 0 for the stream's first token.
  EXPECT_EQ(recording.surprisal[0], 0.0f);
  for (std::size_t t = 1; t < tokens.size(); ++t) {
    const float* row = logits.data() + (t - 1) * kVocab;
    double max = row[0];
    for (int i = 0; i < kVocab; ++i) max = std::max(max, static_cast<double>(row[i]));
    double sum = 0.0;
    for (int i = 0; i < kVocab; ++i) sum += std::exp(row[i] - max);
    const double expected = std::log(sum) + max - row[tokens[t]];
    EXPECT_NEAR(recording.surprisal[t], expected, 1e-4) << "token " << t;
    EXPECT_EQ(recording.surprisal[t], surprisal[t]);
  }

  // Last row only (TOVA's signal).
  auto last_owned =
      std::make_unique<RecordingPolicy>(kvevict::SignalSet{kvevict::Signal::last_attention_row});
  RecordingPolicy& last = *last_owned;
  Decoder last_decoder(model, std::move(last_owned), options);
  (void)last_decoder.feed(tokens, {}, 7);
  EXPECT_EQ(last.attention_calls, 5 * 2);
  EXPECT_EQ(last.failures, 0);
  EXPECT_TRUE(last.surprisal.empty());

  // No attention signal: no rows are built.
  auto none_owned = std::make_unique<RecordingPolicy>(kvevict::SignalSet{});
  RecordingPolicy& none = *none_owned;
  Decoder none_decoder(model, std::move(none_owned), options);
  const ForwardResult plain = none_decoder.feed(tokens, {}, 7);
  EXPECT_EQ(none.attention_calls, 0);
  EXPECT_TRUE(plain.surprisal.empty());
}

TEST(DecoderSignals, CatalystRowsCoverPotAndCatalyst) {
  const Model model = model_for(kModelCases[0]);
  const std::vector<std::int32_t> tokens = tokens_for(100, 43);
  DecoderOptions options;
  options.max_chunk = 8;
  auto owned = std::make_unique<RecordingPolicy>(
      kvevict::SignalSet{kvevict::Signal::catalyst_attention}, /*pot=*/30, /*keep=*/10);
  RecordingPolicy& recording = *owned;
  Decoder decoder(model, std::move(owned), options);
  decoder.set_catalyst({10, 20, 30, 40, 50});
  (void)decoder.feed(tokens, {}, 8);
  // Pot fills at 30, then every 20 tokens: 30, 50, 70, 90.
  EXPECT_EQ(decoder.stats().catalyst_runs, 4);
  EXPECT_EQ(recording.catalyst_calls, 4 * 2);
  EXPECT_EQ(recording.attention_calls, 0);
  EXPECT_EQ(recording.failures, 0);
  EXPECT_EQ(decoder.cache().sequence().live(0, 0), 10 + 10);
  // The catalyst is rolled back: no catalyst-flagged slot remains.
  const kvevict::SlotTable& slots = decoder.cache().sequence().slots();
  const int unit = decoder.cache().sequence().unit_of(1, 1);
  for (const std::int32_t slot : slots.stream_order(unit)) {
    EXPECT_EQ(slots.flags(unit)[static_cast<std::size_t>(slot)] & kvevict::slot_flag::catalyst, 0);
  }
}

TEST(DecoderSignals, AnchorsReachThePolicy) {
  const Model model = model_for(kModelCases[0]);
  const std::int32_t anchor = model.tokenizer.anchor_id;
  ASSERT_EQ(anchor, 258);
  std::vector<std::int32_t> tokens = tokens_for(20, 47);
  tokens[7] = anchor;
  tokens[15] = anchor;
  DecoderOptions options;
  options.max_chunk = 4;
  Decoder decoder(model,
                  kvevict::make_policy("anllm", PolicyParams().set_list("anchor_ids", {anchor})),
                  options);
  (void)decoder.feed(tokens, {}, 4);
  // After the forward holding the second anchor (tokens 12..15): both anchors remain; then 16..19.
  EXPECT_EQ(decoder.cache().sequence().live(1, 0), 2 + 4);
  EXPECT_EQ(kvevict::test::kept_positions(decoder.cache().sequence().slots(),
                                          decoder.cache().sequence().unit_of(1, 0)),
            (std::vector<std::int64_t>{7, 15, 16, 17, 18, 19}));
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

using kvevict::test::expect_error;

TEST(DecoderErrors, NamedErrors) {
  const Model model = model_for(kModelCases[0]);
  DecoderOptions options;
  options.max_chunk = 4;
  Decoder decoder(model, full_policy(), options);
  const std::vector<std::int32_t> bad{1, kVocab};
  const std::vector<std::int32_t> negative{-1};
  const std::vector<std::int32_t> empty;
  const std::vector<std::int32_t> long_chunk(5, 1);
  expect_error([&] { (void)decoder.forward(bad); },
               "token id 300 at index 1 is out of range [0, 300)");
  expect_error([&] { (void)decoder.forward(negative); }, "token id -1");
  expect_error([&] { (void)decoder.forward(empty); }, "empty chunk");
  expect_error([&] { (void)decoder.forward(long_chunk); }, "exceeds max_chunk = 4");
  expect_error([&] { (void)decoder.feed(empty); }, "no tokens");
  expect_error([&] { (void)decoder.feed(long_chunk, {}, 5); }, "chunk_size 5 outside [1, 4]");
  expect_error([&] { decoder.set_catalyst({1, 999}); }, "catalyst token id 999");
  EXPECT_EQ(decoder.stats().tokens_fed, 0);

  Decoder pot(model, kvevict::make_policy("infinipot", PolicyParams().set("pot", 8).set("keep", 4)),
              options);
  const std::vector<std::int32_t> tokens = tokens_for(12);
  expect_error([&] { (void)pot.feed(tokens); }, "needs a catalyst prompt: call set_catalyst()");

  Model broken = model_for(kModelCases[0]);
  broken.layers[1].wk.rows = 16;
  expect_error([&] { Decoder d(broken, full_policy(), options); },
               "weight layer 1 wk is [16, 64], expected [32, 64]");
  options.max_chunk = 0;
  expect_error([&] { Decoder d(model, full_policy(), options); }, "max_chunk must be positive");
}

}  // namespace
