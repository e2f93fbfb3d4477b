// K/V storage types (kvevict/kv_type.hpp): exact bytes per type, one rounding per store and per
// fold, the attention kernels over stored rows on every SIMD target, the decoder on every type, and
// the drift of stored keys kept through 10,000 evictions under every position mode.
#include <gtest/gtest.h>
#include <kvevict/c_api.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <kvevict/kv_type.hpp>
#include <kvevict/kvevict.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/random_model.hpp>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "eval/config.hpp"
#include "harness/policy_setup.hpp"
#include "model/kernels/kernels.hpp"
#include "model/kernels/kv_kernels.hpp"
#include "support/expect_error.hpp"
#include "support/policy_harness.hpp"

namespace {

using kvevict::test::observe_attention;

using kvevict::KvType;
using kvevict::PolicyParams;
using kvevict::PositionMode;
using kvevict::test::expect_error;

constexpr KvType kTypes[] = {KvType::f32, KvType::f16, KvType::bf16, KvType::q8_0};

std::string name(KvType type) { return std::string(kvevict::to_string(type)); }

std::vector<float> normal_values(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

std::vector<float> round_trip(KvType type, const std::vector<float>& values) {
  const int n = static_cast<int>(values.size());
  std::vector<std::uint8_t> bytes(kvevict::kv_row_bytes(type, n));
  kvevict::encode_kv_row(type, values.data(), n, bytes.data());
  std::vector<float> out(values.size());
  kvevict::decode_kv_row(type, bytes.data(), n, out.data());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Bytes and roundings
// ---------------------------------------------------------------------------------------------

// f32 4 bytes a value, f16 / bf16 2, Q8_0 34 per block of 32 (an f16 scale and 32 int8).
// kvevict/detail/half.hpp keeps its own conversions, not Eigen::half / Eigen::bfloat16, because
// kv_type.hpp serves the C API and kvevict::core, which must build without Eigen. They must be
// Eigen's bit for bit: every f16 and bf16 widened, and floats narrowed over a sweep of all bit
// patterns (every 251st, plus the rounding boundaries' neighbourhood of each exponent). The one
// intended difference: a NaN narrowed to bf16 keeps its top payload bits (Eigen canonicalises it).
TEST(HalfConversions, AreEigensBitForBit) {
  using kvevict::detail::bits_to_float;
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const auto u = static_cast<std::uint16_t>(bits);
    const float f16 = kvevict::detail::f16_to_float(u);
    const float eigen_f16 = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(u));
    const float bf16 = kvevict::detail::bf16_to_float(u);
    const float eigen_bf16 = static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(u));
    if (std::isnan(eigen_f16)) {
      EXPECT_TRUE(std::isnan(f16)) << bits;
    } else {
      ASSERT_EQ(kvevict::detail::float_to_bits(f16), kvevict::detail::float_to_bits(eigen_f16))
          << bits;
    }
    if (std::isnan(eigen_bf16)) {
      EXPECT_TRUE(std::isnan(bf16)) << bits;
    } else {
      ASSERT_EQ(kvevict::detail::float_to_bits(bf16), kvevict::detail::float_to_bits(eigen_bf16))
          << bits;
    }
  }
  const auto check = [](std::uint32_t bits) {
    const float value = bits_to_float(bits);
    ASSERT_EQ(kvevict::detail::float_to_f16(value),
              Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(value)))
        << bits;
    if (!std::isnan(value)) {
      ASSERT_EQ(kvevict::detail::float_to_bf16(value),
                Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(value)))
          << bits;
    }
  };
  for (std::uint64_t bits = 0; bits <= 0xffffffffu; bits += 251)
    check(static_cast<std::uint32_t>(bits));
  for (std::uint32_t exponent = 0; exponent < 256; ++exponent) {
    for (std::uint32_t low = 0; low < 0x4000u; ++low) {
      check((exponent << 23) | low);                // f16 subnormal / ties region
      check((exponent << 23) | (0x7fffffu - low));  // just below the next exponent
      check((exponent << 23) | 0x8000u | low);      // bf16's rounding bit
    }
  }
}

TEST(KvTypes, RowBytesAreExactScalesIncluded) {
  for (const int head_dim : {32, 64, 128}) {
    const auto n = static_cast<std::size_t>(head_dim);
    EXPECT_EQ(kvevict::kv_row_bytes(KvType::f32, head_dim), 4 * n);
    EXPECT_EQ(kvevict::kv_row_bytes(KvType::f16, head_dim), 2 * n);
    EXPECT_EQ(kvevict::kv_row_bytes(KvType::bf16, head_dim), 2 * n);
    EXPECT_EQ(kvevict::kv_row_bytes(KvType::q8_0, head_dim), n / 32 * 34);
  }
}

TEST(KvTypes, BadTypesAndValuesAreErrorsNamingThem) {
  for (const KvType type : kTypes) EXPECT_EQ(kvevict::parse_kv_type(name(type)), type);
  expect_error([] { (void)kvevict::parse_kv_type("q4_0"); },
               "unknown K/V storage type 'q4_0' (expected f32, f16, bf16 or q8_0)");
  expect_error([] { (void)kvevict::kv_row_bytes(KvType::q8_0, 48); },
               "q8_0 needs head_dim a multiple of 32, got 48");
  std::vector<float> big(32, 1.0f);
  big[3] = 70000.0f;  // past f16's largest finite value, 65504
  expect_error([&] { (void)round_trip(KvType::f16, big); }, "f16 cannot hold a key or value");
  big[3] = std::nanf("");
  expect_error([&] { (void)round_trip(KvType::q8_0, big); }, "q8_0 cannot hold a key or value");
  big[3] = 1.0e7f;  // a Q8_0 scale of 1e7 / 127 is past f16's range
  expect_error([&] { (void)round_trip(KvType::q8_0, big); }, "q8_0 cannot hold a key or value");
  // bf16 has f32's range: 1e7 lies in [2^23, 2^24), where bf16's 8 significant bits are 2^16
  // apart, and rounds to 153 * 2^16.
  EXPECT_EQ(round_trip(KvType::bf16, big)[3], 153.0f * 65536.0f);
}

// One store is one rounding: every value within kv_rounding_unit of itself (f16 / bf16 relative,
// Q8_0 relative to its block's largest magnitude), and storing a stored row again changes nothing.
TEST(KvTypes, OneStoreIsOneRoundingAndStoringAgainChangesNothing) {
  const std::vector<float> values = normal_values(4096, 3, 2.0f);
  for (const KvType type : kTypes) {
    SCOPED_TRACE(name(type));
    const double u = kvevict::kv_rounding_unit(type);
    const std::vector<float> stored = round_trip(type, values);
    for (std::size_t block = 0; block < values.size(); block += 32) {
      float block_max = 0.0f;
      for (std::size_t i = block; i < block + 32; ++i) {
        block_max = std::max(block_max, std::fabs(values[i]));
      }
      for (std::size_t i = block; i < block + 32; ++i) {
        const double error = std::fabs(static_cast<double>(stored[i]) - values[i]);
        const double bound =
            type == KvType::q8_0 ? u * block_max : u * std::fabs(values[i]) + 0x1p-25;
        ASSERT_LE(error, bound) << "value " << values[i];
      }
    }
    EXPECT_EQ(round_trip(type, stored), stored);
  }
}

// Exact byte accounting of the cache per type: live and peak K/V bytes are slots times
// 2 * kv_row_bytes, and the reservation is the capacity's rows plus the slot metadata.
TEST(KvTypes, CacheBytesFollowTheStorageType) {
  std::map<KvType, std::size_t> peak;
  for (const KvType type : kTypes) {
    SCOPED_TRACE(name(type));
    kvevict::CacheConfig c;
    c.shape = kvevict::CacheShape{2, 4, 2, 64};
    c.sequence.key_storage = kvevict::KeyStorage::post_rope;
    c.kv_type = type;
    c.sequence.max_chunk = 8;
    kvevict::EvictingCache cache(
        c, kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 2).set("recent", 6)));
    const std::size_t row = kvevict::kv_row_bytes(type, 64);
    EXPECT_EQ(cache.store().kv_bytes_per_slot(), 2 * row);
    // 8 retained + one chunk of 8 slots, in 2 layers x 2 KV heads; metadata of 17 bytes a slot
    // (original position 8, token id 4, group id 4, flags 1; no score column), once per unit
    // (token granularity: one unit).
    EXPECT_EQ(cache.memory().reserved_bytes, 16 * 4 * 2 * row + 16 * 17);
    const kvevict::EvictingCache::Matrix rows = kvevict::EvictingCache::Matrix::Random(3, 64);
    for (int step = 0; step < 20; ++step) {
      cache.sequence().begin_chunk(std::vector<std::int32_t>(3, 0));
      for (int l = 0; l < 2; ++l) {
        for (int g = 0; g < 2; ++g) cache.write_chunk(l, g, rows, rows);
      }
      cache.sequence().end_forward();
    }
    EXPECT_EQ(cache.memory().live_kv_bytes, 8u * 4 * 2 * row);
    EXPECT_EQ(cache.memory().peak_kv_bytes, 11u * 4 * 2 * row);  // 8 kept + a chunk of 3
    peak[type] = cache.memory().peak_kv_bytes;
  }
  EXPECT_EQ(2 * peak[KvType::f16], peak[KvType::f32]);
  EXPECT_EQ(2 * peak[KvType::bf16], peak[KvType::f32]);
  EXPECT_EQ(peak[KvType::q8_0] * 256, peak[KvType::f32] * 68);  // 68 of 256 bytes a row
}

// The C API accounts for an engine's K/V in the engine's type: a window of 6 + 2 sinks over 2
// layers x 2 KV heads holds 8 slots per head after 20 tokens, 9 at its peak (one token of
// headroom), each slot a key and a value row.
TEST(KvTypes, CApiCountsTheEnginesBytesInItsType) {
  std::size_t bytes = 0;
  ASSERT_EQ(kvevict_kv_row_bytes("q8_0", 128, &bytes), KVEVICT_OK);
  EXPECT_EQ(bytes, 4u * 34);
  EXPECT_EQ(kvevict_kv_row_bytes("q4_0", 128, &bytes), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("kv_type: unknown K/V storage type 'q4_0'"),
            std::string::npos);
  EXPECT_EQ(kvevict_kv_row_bytes("q8_0", 48, &bytes), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("kv_type: K/V storage type q8_0 needs head_dim"),
            std::string::npos);
  EXPECT_EQ(kvevict_kv_row_bytes(nullptr, 64, &bytes), KVEVICT_INVALID_ARGUMENT);
  kvevict_config config;
  kvevict_config_init(&config);
  config.layers = 2;
  config.q_heads = 4;
  config.kv_heads = 2;
  kvevict_sequence* sequence = nullptr;
  ASSERT_EQ(
      kvevict_sequence_create("streaming_llm", "sinks=2 recent=6", &config, nullptr, &sequence),
      KVEVICT_OK);
  for (int t = 0; t < 20; ++t) {
    const std::int32_t id = 0;
    ASSERT_EQ(kvevict_sequence_begin_chunk(sequence, &id, 1, 0), KVEVICT_OK);
    ASSERT_EQ(kvevict_sequence_end_forward(sequence), KVEVICT_OK);
  }
  for (const KvType type : kTypes) {
    std::size_t live = 0;
    std::size_t peak = 0;
    ASSERT_EQ(kvevict_sequence_kv_bytes(sequence, name(type).c_str(), 64, &live, &peak),
              KVEVICT_OK);
    const std::size_t row = kvevict::kv_row_bytes(type, 64);
    EXPECT_EQ(live, 8u * 4 * 2 * row) << name(type);
    EXPECT_EQ(peak, 9u * 4 * 2 * row) << name(type);
  }
  EXPECT_EQ(kvevict_sequence_kv_bytes(sequence, "int4", 64, nullptr, nullptr),
            KVEVICT_INVALID_ARGUMENT);
  kvevict_sequence_destroy(sequence);
}

// The eval harness's K/V axis: an entry without its own kv_type runs once per type of the grid's
// kv_types (labelled " kv=<type>" but for f32); bad types name their JSON path; the CLI's options
// name --kv-type.
TEST(KvTypes, EvalAxisAndCliOptionsNameTheirType) {
  const char* grid = R"({"name": "g", "model": "m", "budgets": [64],
      "kv_types": ["f32", "q8_0"],
      "policies": [{"policy": "h2o"}, {"policy": "tova", "kv_type": "bf16"}],
      "tasks": [{"task": "stream_bpb", "tokens": 512}]})";
  const kvevict::eval::EvalConfig config = kvevict::eval::parse_eval_config_text(grid, "g.json");
  ASSERT_EQ(config.policies.size(), 3u);
  EXPECT_EQ(config.policies[0].label, "h2o");
  EXPECT_EQ(config.policies[0].kv_type, "f32");
  EXPECT_EQ(config.policies[1].label, "h2o kv=q8_0");
  EXPECT_EQ(config.policies[1].options(64, 16).kv_type, "q8_0");
  EXPECT_EQ(config.policies[2].label, "tova kv=bf16");
  EXPECT_EQ(config.policies[2].kv_type, "bf16");
  expect_error(
      [] {
        (void)kvevict::eval::parse_eval_config_text(
            R"({"name": "g", "model": "m", "kv_types": ["f8"], "policies": [{"policy": "full"}],
                "tasks": [{"task": "stream_bpb"}]})",
            "g.json");
      },
      "g.json: kv_types: unknown K/V storage type 'f8'");
  kvevict::harness::PolicyOptions options;
  options.kv_type = "int8";
  expect_error([&] { kvevict::harness::validate_policy_options(options); },
               "--kv-type: unknown K/V storage type 'int8'");
  kvevict::model::ModelConfig narrow;  // head_dim 16: no whole Q8_0 block
  narrow.dim = 64;
  narrow.hidden_dim = 128;
  narrow.layers = 1;
  narrow.heads = 4;
  narrow.kv_heads = 2;
  narrow.vocab_size = 259;
  const kvevict::model::Model model =
      kvevict::model::make_random_model(narrow, 1, kvevict::model::DType::f32);
  options.kv_type = "q8_0";
  expect_error([&] { (void)kvevict::harness::make_policy_setup(options, model); },
               "--kv-type: K/V storage type q8_0 needs head_dim a multiple of 32, got 16");
}

// ---------------------------------------------------------------------------------------------
// Attention kernels over stored rows
// ---------------------------------------------------------------------------------------------

// The kernels read each stored row converted to f32 exactly (f16, bf16 and int8 times an f16 scale
// are all f32 values), so they differ from a double-precision product of the decoded rows only by
// f32 accumulation: at most (k + 1) 2^-24 sum |x_j k_j| for a sum of k products. Checked on every
// SIMD target, with row counts and widths that leave tails.
TEST(KvKernels, ProductsOfStoredRowsMatchTheDecodedRowsOnEveryTarget) {
  namespace kernels = kvevict::model::kernels;
  for (const std::int64_t target : kernels::available_targets()) {
    kernels::force_target(target);
    for (const KvType type : kTypes) {
      for (const int k : {32, 64, 40}) {
        // m: a decode step's few queries (read row by row) and a prefill's (tiles).
        for (const std::int64_t m : {2, 5}) {
          if (type == KvType::q8_0 && k % 32 != 0) continue;
          SCOPED_TRACE(kernels::target_name(target) + " " + name(type) + " k " + std::to_string(k) +
                       " m " + std::to_string(m));
          const std::int64_t rows = 41;
          const std::int64_t first = 3;
          const std::int64_t n = rows - first;
          const std::size_t row_bytes = kvevict::kv_row_bytes(type, k);
          std::vector<float> stored_words((rows * row_bytes + 3) / 4);
          auto* bytes = reinterpret_cast<std::uint8_t*>(stored_words.data());
          std::vector<float> decoded(static_cast<std::size_t>(rows * k));
          const std::vector<float> source = normal_values(decoded.size(), 7);
          for (std::int64_t s = 0; s < rows; ++s) {
            kvevict::encode_kv_row(type, source.data() + s * k, k, bytes + s * row_bytes);
            kvevict::decode_kv_row(type, bytes + s * row_bytes, k, decoded.data() + s * k);
          }
          const kvevict::StoredRows stored{bytes, type, row_bytes};
          const std::vector<float> x = normal_values(static_cast<std::size_t>(m * k), 9);
          std::vector<float> scores(static_cast<std::size_t>(m * n));
          kernels::stored_scores(x.data(), k, m, stored, first, n, k, scores.data(), n);
          for (std::int64_t i = 0; i < m; ++i) {
            for (std::int64_t s = 0; s < n; ++s) {
              double exact = 0.0;
              double magnitude = 0.0;
              for (int j = 0; j < k; ++j) {
                const double product =
                    static_cast<double>(x[i * k + j]) * decoded[(first + s) * k + j];
                exact += product;
                magnitude += std::fabs(product);
              }
              ASSERT_LE(std::fabs(scores[i * n + s] - exact), (k + 1) * 0x1p-24 * magnitude);
            }
          }
          // P V over the same rows: output starts at 1 (the kernel adds to it).
          const std::vector<float> p = normal_values(static_cast<std::size_t>(m * n), 11);
          std::vector<float> out(static_cast<std::size_t>(m * k), 1.0f);
          kernels::add_weighted_stored_rows(p.data(), n, m, stored, first, n, k, out.data(), k);
          for (std::int64_t i = 0; i < m; ++i) {
            for (int j = 0; j < k; ++j) {
              double exact = 1.0;
              double magnitude = 1.0;
              for (std::int64_t s = 0; s < n; ++s) {
                const double product =
                    static_cast<double>(p[i * n + s]) * decoded[(first + s) * k + j];
                exact += product;
                magnitude += std::fabs(product);
              }
              ASSERT_LE(std::fabs(out[i * k + j] - exact), (n + 2) * 0x1p-24 * magnitude);
            }
          }
        }
      }
    }
  }
  kernels::force_target(0);
}

// stored_scores_by_run scores each key with its run's rows in one call; each score must be the
// bits of stored_scores over that run alone (the attention's many short runs under cache_index go
// through one call, and a probability must not depend on how the live slots fall into runs). Runs
// of 1-9 keys and one of 50, rows that fill the tiles (4), leave rows over (1, 5) and span two
// blocks of 64 (70), row widths that are multiples of the lanes or not (40), on every target.
TEST(KvKernels, ScoresByRunAreTheBitsOfAScoreCallPerRun) {
  namespace kernels = kvevict::model::kernels;
  for (const std::int64_t target : kernels::available_targets()) {
    kernels::force_target(target);
    for (const KvType type : kTypes) {
      for (const int k : {32, 64, 40}) {
        if (type == KvType::q8_0 && k % 32 != 0) continue;
        for (const std::int64_t m : {1, 4, 5, 70}) {
          SCOPED_TRACE(kernels::target_name(target) + " " + name(type) + " k " + std::to_string(k) +
                       " m " + std::to_string(m));
          // Runs of 1-9 keys, then one of 50, each with its own rows of X.
          std::vector<std::int64_t> ends;
          std::int64_t n = 0;
          for (int r = 0; r < 25; ++r) ends.push_back(n += 1 + (r * 5) % 9);
          ends.push_back(n += 50);
          const std::int64_t first = 2;
          const std::size_t row_bytes = kvevict::kv_row_bytes(type, k);
          std::vector<float> stored_words(((first + n) * row_bytes + 3) / 4);
          auto* bytes = reinterpret_cast<std::uint8_t*>(stored_words.data());
          const std::vector<float> source =
              normal_values(static_cast<std::size_t>((first + n) * k), 13);
          for (std::int64_t s = 0; s < first + n; ++s) {
            kvevict::encode_kv_row(type, source.data() + s * k, k, bytes + s * row_bytes);
          }
          const kvevict::StoredRows stored{bytes, type, row_bytes};
          const std::vector<float> x =
              normal_values(ends.size() * static_cast<std::size_t>(m * k), 17);
          std::vector<kernels::QueryRun> runs;
          for (std::size_t r = 0; r < ends.size(); ++r) {
            runs.push_back({ends[r], x.data() + r * static_cast<std::size_t>(m * k)});
          }
          const std::ptrdiff_t stride = n + 3;
          std::vector<float> by_run(static_cast<std::size_t>(m * stride), -1.0f);
          std::vector<float> per_run(by_run.size(), -1.0f);
          kernels::stored_scores_by_run(runs, k, m, stored, first, n, k, by_run.data(), stride);
          std::int64_t begin = 0;
          for (const kernels::QueryRun& run : runs) {
            kernels::stored_scores(run.x, k, m, stored, first + begin, run.end - begin, k,
                                   per_run.data() + begin, stride);
            begin = run.end;
          }
          ASSERT_EQ(std::memcmp(by_run.data(), per_run.data(), by_run.size() * sizeof(float)), 0);
          // The padding past n is not written.
          for (std::int64_t i = 0; i < m; ++i) {
            EXPECT_EQ(by_run[static_cast<std::size_t>(i * stride + n)], -1.0f);
          }
        }
      }
    }
  }
  kernels::force_target(0);
}

// ---------------------------------------------------------------------------------------------
// The decoder on every type
// ---------------------------------------------------------------------------------------------

// A window policy's slots do not depend on the scores, so the same stream holds the same slots on
// every type: the peak K/V bytes are in the ratio of the row sizes (head_dim 64: 256, 128, 128, 68
// bytes), and the logits stay finite.
TEST(KvTypes, DecoderStoresAndAttendsOverEveryType) {
  kvevict::model::ModelConfig config;
  config.dim = 128;
  config.hidden_dim = 256;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.vocab_size = 259;
  config.context_length = 512;
  const kvevict::model::Model model =
      kvevict::model::make_random_model(config, 5, kvevict::model::DType::f32);
  std::vector<std::int32_t> tokens(300);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<std::int32_t>(i * 7 % 256);
  std::map<KvType, std::vector<float>> logits;
  std::map<KvType, std::size_t> peak;
  for (const KvType type : kTypes) {
    SCOPED_TRACE(name(type));
    kvevict::model::DecoderOptions options;
    options.kv_type = type;
    options.max_chunk = 16;
    kvevict::model::Decoder decoder(
        model,
        kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 4).set("recent", 60)),
        options);
    const kvevict::model::ForwardResult result = decoder.feed(tokens);
    const std::span<const float> last = result.last();
    logits[type].assign(last.begin(), last.end());
    for (const float value : logits[type]) ASSERT_TRUE(std::isfinite(value));
    peak[type] = decoder.stats().peak_kv_bytes;
    EXPECT_EQ(decoder.cache().store().kv_type(), type);
  }
  EXPECT_EQ(peak[KvType::f32], 2 * peak[KvType::f16]);
  EXPECT_EQ(peak[KvType::f32], 2 * peak[KvType::bf16]);
  EXPECT_EQ(peak[KvType::f32] * 68, peak[KvType::q8_0] * 256);
  // The types are really used: rounded K/V give other logits than f32.
  for (const KvType type : {KvType::f16, KvType::bf16, KvType::q8_0}) {
    EXPECT_NE(logits[type], logits[KvType::f32]) << name(type);
  }
}

// ---------------------------------------------------------------------------------------------
// Drift of stored keys through evictions
// ---------------------------------------------------------------------------------------------

// A backend over a KvStore that counts the roundings of every stored key: one when written (by
// the test), one per fold that rotates it.
class CountingStore final : public kvevict::KvBackend {
 public:
  CountingStore(const kvevict::CacheShape& shape, const kvevict::RopeConfig& rope, KvType type)
      : store(shape, rope, kvevict::KeyStorage::post_rope, type) {}
  void reserve(int capacity) override { store.reserve(capacity); }
  void apply(const kvevict::AppliedDecision& decision) override {
    store.apply(decision);
    for (const kvevict::KeyRotation& rotation : decision.rotations()) {
      for (const std::int32_t slot : rotation.slots) ++roundings[slot];
    }
  }
  kvevict::KvStore store;
  std::map<std::int32_t, int> roundings;
};

// The bound, derived. Let rho be the largest norm of a rotation pair (x_i, x_{i + 32}) of the
// original key: rotations preserve pair norms, so every value the key ever takes (exactly rotated)
// is within rho, and so is every component of an error carried along. One rounding to the type adds
// an error whose pair norm is at most c u' (rho + E), E the pair error so far (f32 / f16 / bf16
// round each value relatively, c = 1; Q8_0 rounds each value within u times its block's largest
// magnitude, <= rho + E, so a pair's error is within sqrt(2) times that, c = sqrt(2)); u' is the
// type's rounding unit, plus 2^-24 for f16 / bf16, which round through f32. After m roundings
// E <= rho ((1 + c u')^m - 1); f16 adds 2^-25 absolute per value below its normal range. A freshly
// rotated and stored key is one rounding from the exact one (<= c u' rho per value), so a value of
// a kept key is within rho ((1 + c u')^m - 1 + c u') (+ f16's absolute term) of the fresh one.
double drift_bound(KvType type, double rho, int roundings) {
  const double c = type == KvType::q8_0 ? std::sqrt(2.0) : 1.0;
  const double u = kvevict::kv_rounding_unit(type) +
                   (type == KvType::f16 || type == KvType::bf16 ? 0x1p-24 : 0.0);
  const double absolute = type == KvType::f16 ? (roundings + 1) * std::sqrt(2.0) * 0x1p-25 : 0.0;
  return rho * (std::pow(1.0 + c * u, roundings) - 1.0 + c * u) + absolute;
}

// One key of a 64-wide head kept by TOVA (budget 32) through 10,000 evictions while the others
// come and go, under each position mode and storage type, folding at every decision (the worst
// case: max_pending_rotations 0, as an engine that cannot rotate queries) and with 8 pending
// rotations allowed (the default 32 never folds 33 slots: a fold needs more than 32 runs).
// Every live key, not only the kept one, is compared with a fresh rotation of its original values
// to its key position, stored once. A key's roundings never pass 1 + max(pending, 1) + capacity
// (the header's bound), so the error bound is the same after 1,000 and after 10,000 evictions.
TEST(KvDrift, KeysKeptThroughTenThousandEvictionsStayWithinABoundThatDoesNotGrow) {
  constexpr int kHeadDim = 64;
  const kvevict::CacheShape shape{1, 1, 1, kHeadDim};
  kvevict::RopeConfig rope_config;
  rope_config.head_dim = kHeadDim;
  const kvevict::Rope rope(rope_config);
  for (const PositionMode mode :
       {PositionMode::original, PositionMode::cache_index, PositionMode::reset_on_compact}) {
    for (const int pending : {0, 8}) {
      for (const KvType type : kTypes) {
        SCOPED_TRACE(std::string(kvevict::to_string(mode)) + " " + name(type) + " pending " +
                     std::to_string(pending));
        CountingStore backend(shape, rope_config, type);
        kvevict::SequenceConfig c;
        c.layers = 1;
        c.q_heads = 1;
        c.kv_heads = 1;
        c.max_chunk = 1;
        c.position_mode = mode;
        c.key_storage = kvevict::KeyStorage::post_rope;
        c.max_pending_rotations = pending;
        kvevict::Sequence s(c, kvevict::make_policy("tova", PolicyParams().set("budget", 32)),
                            &backend);
        const int capacity = s.capacity();
        std::map<std::int32_t, std::vector<double>> original;  // slot -> the key before RoPE
        std::mt19937 rng(17);
        std::normal_distribution<double> normal(0.0, 1.0);
        std::uniform_real_distribution<float> attention(0.0f, 0.5f);
        std::int32_t kept_slot = -1;
        int kept_roundings = 0;
        std::vector<double> errors;  // the largest error at 1,000 and at 10,000 evictions
        std::int64_t next_check = 1000;
        const int most_roundings = 1 + std::max(pending, 1) + capacity;
        const double worst_bound_unit = drift_bound(type, 1.0, most_roundings);
        for (std::int64_t step = 0; errors.size() < 2; ++step) {
          s.begin_chunk(std::vector<std::int32_t>{0});
          const std::int32_t slot = s.chunk_slots(0, 0)[0];
          std::vector<double>& key = original[slot];
          key.resize(kHeadDim);
          for (double& v : key) v = normal(rng);
          std::vector<double> rotated = key;
          rope.rotate(rotated.data(), s.key_position(0, 0, slot));
          backend.store.write_key(0, 0, slot, rotated.data());
          backend.roundings[slot] = 1;
          if (step == 20) kept_slot = slot;  // kept: the highest attention at every step
          kvevict::test::LayerRows rows(1);
          std::vector<float> row;
          for (const std::int32_t live : s.slots().stream_order(0)) {
            row.push_back(live == kept_slot ? 1.0f : attention(rng));
          }
          rows[0].push_back(row);
          kvevict::test::SlotRows slot_rows;
          observe_attention(s, 0, slot_rows.make(s, 0, rows, step));
          s.end_forward();
          if (s.stats().evicted_slots < next_check) continue;
          next_check = 10000;
          {
            double worst = 0.0;
            for (const std::int32_t live : s.slots().stream_order(0)) {
              const std::vector<double>& k = original[live];
              double rho = 0.0;
              for (int i = 0; i < kHeadDim / 2; ++i) {
                rho = std::max(rho, std::hypot(k[i], k[i + kHeadDim / 2]));
              }
              std::vector<double> fresh = k;
              rope.rotate(fresh.data(), s.key_position(0, 0, live));
              std::vector<std::uint8_t> bytes(backend.store.row_bytes());
              kvevict::encode_kv_row(type, fresh.data(), kHeadDim, bytes.data());
              kvevict::decode_kv_row(type, bytes.data(), kHeadDim, fresh.data());
              std::vector<double> stored(kHeadDim);
              backend.store.read_key(0, 0, live, stored.data());
              const int m = backend.roundings[live];
              ASSERT_LE(m, most_roundings);
              double error = 0.0;
              for (int i = 0; i < kHeadDim; ++i) {
                error = std::max(error, std::fabs(stored[static_cast<std::size_t>(i)] -
                                                  fresh[static_cast<std::size_t>(i)]));
              }
              ASSERT_LE(error, drift_bound(type, rho, m))
                  << "slot " << live << ", " << m << " roundings";
              worst = std::max(worst, error / rho);
            }
            EXPECT_LE(worst, worst_bound_unit);
            errors.push_back(worst);
            kept_roundings = backend.roundings[kept_slot];
          }
        }
        std::printf(
            "drift %-16s %-4s pending %2d: max error / rho %.3g at 1,000 and %.3g at "
            "10,000 evictions (bound %.3g); kept key %d roundings\n",
            std::string(kvevict::to_string(mode)).c_str(), name(type).c_str(), pending, errors[0],
            errors[1], worst_bound_unit, kept_roundings);
        // The kept key lived through all 10,000 evictions.
        ASSERT_TRUE(s.slots().is_live(0, kept_slot));
        if (mode == PositionMode::original) {
          EXPECT_EQ(kept_roundings, 1);  // never re-rotated
        } else if (pending == 0) {
          // Re-rotated as its 20 elders were evicted, but never again after, however many
          // evictions followed.
          EXPECT_GT(kept_roundings, 10);
        }
      }
    }
  }
}

}  // namespace
