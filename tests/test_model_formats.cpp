// Model files: GGUF, safetensors (+ config.json) and llama2.c round trips for every dtype, Q8_0
// within its derived error bound, the Q/K row permutation between RoPE layouts (checked through
// RoPE itself), and one test per class of malformed file, each asserting a kvevict::Error whose
// message names the problem. Every proper prefix of a small valid file must throw kvevict::Error
// (never crash, never another exception), and so must random byte corruptions unless they load.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/rope.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/gguf.hpp"
#include "model/half.hpp"
#include "model/llama2c.hpp"
#include "model/model_io.hpp"
#include "model/safetensors.hpp"
#include "support/expect_error.hpp"

namespace {

namespace fs = std::filesystem;
using kvevict::Error;
using kvevict::Rope;
using kvevict::RopeConfig;
using kvevict::RopeLayout;
using kvevict::model::DType;
using kvevict::model::Model;
using kvevict::model::ModelConfig;
using kvevict::model::Tokenizer;
using kvevict::model::WeightMatrix;
using kvevict::model::detail::TensorRole;
using nlohmann::json;
using Bytes = std::vector<std::byte>;
namespace gguf = kvevict::model::gguf;
namespace llama2c = kvevict::model::llama2c;
namespace detail = kvevict::model::detail;

// --- Tiny models built by hand
// --------------------------------------------------------------------

// GQA (4 query heads, 2 KV heads), head_dim 16, widths that are multiples of 32 except
// hidden_dim 48 (so w_down's rows of 48 are not Q8_0-quantisable and keep their dtype).
ModelConfig small_config() {
  ModelConfig config;
  config.dim = 64;
  config.hidden_dim = 48;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.vocab_size = 260;
  config.context_length = 32;
  config.rope_theta = 10000.0;
  config.norm_eps = 1e-5f;
  config.rope_layout = RopeLayout::half_split;
  config.tied_embeddings = false;
  return config;
}

// Small enough that every prefix of its files can be loaded in a test.
ModelConfig micro_config() {
  ModelConfig config;
  config.dim = 8;
  config.hidden_dim = 12;
  config.layers = 1;
  config.heads = 2;
  config.kv_heads = 1;
  config.vocab_size = 12;
  config.context_length = 4;
  config.rope_layout = RopeLayout::interleaved;
  config.tied_embeddings = true;
  return config;
}

Tokenizer byte_tokenizer() {
  Tokenizer tokenizer;
  tokenizer.kind = Tokenizer::Kind::byte_level;
  tokenizer.bos_id = 256;
  tokenizer.eos_id = 257;
  tokenizer.anchor_id = 258;
  return tokenizer;
}

// 12 pieces: unknown, BOS, EOS, two byte pieces, normal pieces and "<AC>".
Tokenizer micro_sentencepiece() {
  Tokenizer tokenizer;
  tokenizer.kind = Tokenizer::Kind::sentencepiece;
  tokenizer.pieces = {"<unk>",
                      "<s>",
                      "</s>",
                      "<0x0A>",
                      "<0xC3>",
                      "\xe2\x96\x81",
                      "a",
                      "b",
                      "ab",
                      "\xe2\x96\x81"
                      "ab",
                      "<AC>",
                      "c"};
  tokenizer.scores = {0, 0, 0, 0, 0, -1, -2, -3, -0.5f, -0.25f, 0, -4};
  tokenizer.types = {2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 4, 1};
  tokenizer.bos_id = 1;
  tokenizer.eos_id = 2;
  tokenizer.anchor_id = 10;
  return tokenizer;
}

struct BufferOwner {
  std::vector<std::byte> bytes;
};

// Weights ~ N(0, 0.5) drawn from `seed`, stored as `dtype`; norms around 1; a -0.0 and an f32
// subnormal in the embedding prove the round trips are bit-exact.
Model make_model(const ModelConfig& config, DType dtype, std::uint32_t seed, Tokenizer tokenizer) {
  Model model;
  model.config = config;
  model.format = "test";
  model.tokenizer = std::move(tokenizer);
  model.tokenizer.vocab_size = config.vocab_size;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  const auto matrix = [&](std::vector<std::int64_t> shape) {
    const auto rows = shape[0];
    const auto cols = shape[1];
    auto owner = std::make_shared<BufferOwner>();
    const std::size_t count = static_cast<std::size_t>(rows * cols);
    owner->bytes.resize(count * kvevict::model::dtype_size(dtype));
    for (std::size_t i = 0; i < count; ++i) {
      const float value = normal(rng);
      if (dtype == DType::f32) {
        std::memcpy(owner->bytes.data() + 4 * i, &value, 4);
      } else {
        const std::uint16_t half = dtype == DType::f16 ? kvevict::model::float_to_f16(value)
                                                       : kvevict::model::float_to_bf16(value);
        std::memcpy(owner->bytes.data() + 2 * i, &half, 2);
      }
    }
    model.storage.push_back(owner);
    return WeightMatrix{dtype, rows, cols, owner->bytes.data()};
  };
  const auto norm = [&] {
    std::vector<float> values(static_cast<std::size_t>(config.dim));
    for (float& value : values) value = 1.0f + 0.1f * normal(rng);
    return values;
  };
  model.token_embedding = matrix(detail::expected_shape(config, TensorRole::token_embedding));
  if (dtype == DType::f32) {
    auto* first = const_cast<std::byte*>(model.token_embedding.data);
    const float special[] = {-0.0f, 1e-40f};
    std::memcpy(first, special, sizeof special);
  }
  model.layers.resize(static_cast<std::size_t>(config.layers));
  for (int layer = 0; layer < config.layers; ++layer) {
    for (const TensorRole role : detail::kLayerRoles) {
      if (detail::is_norm(role)) {
        detail::norm_of(model, role, layer) = norm();
      } else {
        detail::matrix_of(model, role, layer) = matrix(detail::expected_shape(config, role));
      }
    }
  }
  model.final_norm = norm();
  model.output = config.tied_embeddings
                     ? model.token_embedding
                     : matrix(detail::expected_shape(config, TensorRole::output));
  return model;
}

Model small_model(DType dtype, RopeLayout layout = RopeLayout::half_split, bool tied = false) {
  ModelConfig config = small_config();
  config.rope_layout = layout;
  config.tied_embeddings = tied;
  return make_model(config, dtype, 7, byte_tokenizer());
}

Model micro_model() { return make_model(micro_config(), DType::f32, 3, micro_sentencepiece()); }

// --- Comparisons ---------------------------------------------------------------------------------

Bytes bytes_of(const WeightMatrix& matrix) { return {matrix.data, matrix.data + matrix.bytes()}; }

void expect_same_matrix(const WeightMatrix& a, const WeightMatrix& b, const std::string& what) {
  EXPECT_EQ(a.dtype, b.dtype) << what;
  EXPECT_EQ(a.rows, b.rows) << what;
  EXPECT_EQ(a.cols, b.cols) << what;
  if (a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols) {
    EXPECT_TRUE(bytes_of(a) == bytes_of(b)) << what << " differs";
  }
}

void expect_same_norm(const std::vector<float>& a, const std::vector<float>& b,
                      const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << " differs";
}

// Every weight bit-exact, including Q and K (callers compare models of the same RoPE layout).
void expect_same_weights(const Model& a, const Model& b) {
  expect_same_matrix(a.token_embedding, b.token_embedding, "token_embedding");
  for (int layer = 0; layer < a.config.layers; ++layer) {
    for (const TensorRole role : detail::kLayerRoles) {
      const std::string what =
          "layer " + std::to_string(layer) + " role " + std::to_string(static_cast<int>(role));
      if (detail::is_norm(role)) {
        expect_same_norm(detail::norm_of(a, role, layer), detail::norm_of(b, role, layer), what);
      } else {
        expect_same_matrix(detail::matrix_of(a, role, layer), detail::matrix_of(b, role, layer),
                           what);
      }
    }
  }
  expect_same_norm(a.final_norm, b.final_norm, "final_norm");
  expect_same_matrix(a.output, b.output, "output");
}

void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.hidden_dim, b.hidden_dim);
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(a.heads, b.heads);
  EXPECT_EQ(a.kv_heads, b.kv_heads);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.context_length, b.context_length);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_layout, b.rope_layout);
  EXPECT_EQ(a.rotary_dim, b.rotary_dim);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.tied_embeddings, b.tied_embeddings);
}

void expect_same_tokenizer(const Tokenizer& a, const Tokenizer& b) {
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.pieces, b.pieces);
  EXPECT_EQ(a.scores, b.scores);
  EXPECT_EQ(a.types, b.types);
  EXPECT_EQ(a.bos_id, b.bos_id);
  EXPECT_EQ(a.eos_id, b.eos_id);
  EXPECT_EQ(a.anchor_id, b.anchor_id);
}

// The rows of a half_split Q/K matrix in the order interleaved RoPE needs, written out from the
// definition (not through permute_rope_rows): per head, new row 2i = old row i and new row 2i+1 =
// old row i + r/2 for i < r/2; rows from r on stay.
Bytes interleaved_rows(const WeightMatrix& half_split, int heads, int head_dim, int rotary_dim) {
  const std::size_t row_bytes =
      static_cast<std::size_t>(half_split.cols) * kvevict::model::dtype_size(half_split.dtype);
  Bytes out(half_split.bytes());
  const auto copy_row = [&](int to, int from) {
    std::memcpy(out.data() + static_cast<std::size_t>(to) * row_bytes,
                half_split.data + static_cast<std::size_t>(from) * row_bytes, row_bytes);
  };
  for (int head = 0; head < heads; ++head) {
    const int base = head * head_dim;
    for (int i = 0; i < rotary_dim / 2; ++i) {
      copy_row(base + 2 * i, base + i);
      copy_row(base + 2 * i + 1, base + i + rotary_dim / 2);
    }
    for (int row = rotary_dim; row < head_dim; ++row) copy_row(base + row, base + row);
  }
  return out;
}

std::span<const std::byte> as_bytes(const std::string& text) {
  return {reinterpret_cast<const std::byte*>(text.data()), text.size()};
}

// --- Errors --------------------------------------------------------------------------------------

// Runs `action`, which must throw kvevict::Error mentioning `word`. Other exception types escape
// and fail the test.
using kvevict::test::expect_error;

// Every proper prefix of `file` must be rejected with kvevict::Error.
template <class Load>
void expect_every_prefix_fails(const Bytes& file, Load&& load) {
  for (std::size_t length = 0; length < file.size(); ++length) {
    try {
      (void)load(std::span<const std::byte>(file.data(), length));
      ADD_FAILURE() << "prefix of " << length << " of " << file.size() << " bytes loaded";
      return;
    } catch (const Error&) {
    }
  }
}

// Random corruptions either load or throw kvevict::Error (anything else escapes and fails the
// test; ASan / UBSan catch the rest). Half of them hit the first `header_bytes` bytes, where the
// structure is.
template <class Load>
void expect_corruptions_handled(const Bytes& file, std::size_t header_bytes, int trials,
                                Load&& load) {
  std::mt19937 rng(1234);
  int loaded = 0;
  for (int trial = 0; trial < trials; ++trial) {
    Bytes corrupt = file;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int flip = 0; flip < flips; ++flip) {
      const std::size_t range = trial % 2 == 0 ? std::min(header_bytes, file.size()) : file.size();
      const std::size_t position = rng() % range;
      corrupt[position] = static_cast<std::byte>(rng() & 0xff);
    }
    try {
      const Model model = load(std::span<const std::byte>(corrupt));
      EXPECT_GT(model.weight_bytes(), 0u);
      ++loaded;
    } catch (const Error&) {
    }
  }
  std::printf("corruptions: %d of %d still loaded (weights or ignored fields)\n", loaded, trials);
}

// Byte patching of files in place.
std::size_t find_text(const Bytes& file, std::string_view text) {
  const auto* begin = reinterpret_cast<const char*>(file.data());
  const std::string_view haystack(begin, file.size());
  return haystack.find(text);
}
void put_u32(Bytes& file, std::size_t position, std::uint32_t value) {
  std::memcpy(file.data() + position, &value, 4);
}
void put_u64(Bytes& file, std::size_t position, std::uint64_t value) {
  std::memcpy(file.data() + position, &value, 8);
}
void put_i32(Bytes& file, std::size_t position, std::int32_t value) {
  std::memcpy(file.data() + position, &value, 4);
}
// Offset of the text of the GGUF string (u64 length + text) that is exactly `text`.
std::size_t find_gguf_string(const Bytes& file, std::string_view text) {
  std::string pattern(8, '\0');
  const std::uint64_t length = text.size();
  std::memcpy(pattern.data(), &length, 8);
  pattern += text;
  const std::size_t position = find_text(file, pattern);
  EXPECT_NE(position, std::string::npos) << text;
  return position == std::string::npos ? 0 : position + 8;
}
// Offset just past that string.
std::size_t after_gguf_string(const Bytes& file, std::string_view text) {
  return find_gguf_string(file, text) + text.size();
}
// Offset of the value of GGUF metadata `key` (after its type field).
std::size_t gguf_value(const Bytes& file, std::string_view key) {
  return after_gguf_string(file, key) + 4;
}
// Offsets of the fields of the tensor info named `name`.
struct TensorInfoFields {
  std::size_t n_dims, dims, type, offset;
};
TensorInfoFields gguf_tensor_info(const Bytes& file, std::string_view name) {
  TensorInfoFields fields{};
  fields.n_dims = after_gguf_string(file, name);
  std::uint32_t n_dims = 0;
  std::memcpy(&n_dims, file.data() + fields.n_dims, 4);
  fields.dims = fields.n_dims + 4;
  fields.type = fields.dims + 8 * n_dims;
  fields.offset = fields.type + 4;
  return fields;
}

Bytes encode(const std::function<void(detail::ByteWriter&)>& write) {
  detail::ByteWriter out;
  write(out);
  return out.buffer();
}

// --- Temporary directories
// -------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / ("kvevict_formats_" + std::to_string(::getpid()) + "_" +
                                         test->test_suite_name() + "_" + test->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code error;
    fs::remove_all(path_, error);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write_bytes(const fs::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

constexpr DType kAllDTypes[] = {DType::f32, DType::f16, DType::bf16};

// =================================================================================================
// Contract basics
// =================================================================================================

TEST(ModelContract, DTypeSizesAndNames) {
  EXPECT_EQ(kvevict::model::dtype_size(DType::f32), 4u);
  EXPECT_EQ(kvevict::model::dtype_size(DType::f16), 2u);
  EXPECT_EQ(kvevict::model::dtype_size(DType::bf16), 2u);
  EXPECT_EQ(kvevict::model::to_string(DType::f32), "f32");
  EXPECT_EQ(kvevict::model::to_string(DType::f16), "f16");
  EXPECT_EQ(kvevict::model::to_string(DType::bf16), "bf16");
}

TEST(ModelContract, RowToF32WidensEveryDType) {
  // 1.5 and -2.25 are exact in f16 and bf16.
  const std::uint16_t f16[] = {kvevict::model::float_to_f16(1.5f),
                               kvevict::model::float_to_f16(-2.25f)};
  const std::uint16_t bf16[] = {kvevict::model::float_to_bf16(1.5f),
                                kvevict::model::float_to_bf16(-2.25f)};
  const float f32[] = {1.5f, -2.25f};
  const std::pair<DType, const void*> cases[] = {
      {DType::f16, f16}, {DType::bf16, bf16}, {DType::f32, f32}};
  for (const auto& [dtype, data] : cases) {
    const WeightMatrix matrix{dtype, 2, 1, static_cast<const std::byte*>(data)};
    float value = 0;
    matrix.row_to_f32(1, &value);
    EXPECT_EQ(value, -2.25f) << kvevict::model::to_string(dtype);
    matrix.row_to_f32(0, &value);
    EXPECT_EQ(value, 1.5f);
    expect_error([&] { matrix.row_to_f32(2, &value); }, "out of range");
  }
}

TEST(ModelContract, ValidateNamesTheFirstProblem) {
  const auto with = [](const std::function<void(ModelConfig&)>& edit) {
    ModelConfig config = small_config();
    edit(config);
    return config;
  };
  EXPECT_NO_THROW(small_config().validate());
  expect_error([&] { with([](ModelConfig& c) { c.dim = 0; }).validate(); }, "dim must be positive");
  expect_error([&] { with([](ModelConfig& c) { c.layers = -1; }).validate(); },
               "layers must be positive");
  expect_error([&] { with([](ModelConfig& c) { c.dim = 66; }).validate(); },
               "not divisible by heads");
  expect_error([&] { with([](ModelConfig& c) { c.kv_heads = 3; }).validate(); },
               "not divisible by kv_heads");
  expect_error(
      [&] {
        with([](ModelConfig& c) {
          c.dim = 12;
          c.heads = 4;
          c.kv_heads = 4;
        }).validate();
      },
      "odd");
  expect_error([&] { with([](ModelConfig& c) { c.dim = 1 << 21; }).validate(); }, "absurd");
  expect_error([&] { with([](ModelConfig& c) { c.vocab_size = (1 << 22) + 1; }).validate(); },
               "vocab_size");
  expect_error([&] { with([](ModelConfig& c) { c.layers = 4097; }).validate(); }, "absurd");
  expect_error([&] { with([](ModelConfig& c) { c.rotary_dim = 6 * 16; }).validate(); },
               "rotary_dim");
  expect_error([&] { with([](ModelConfig& c) { c.rope_theta = 0.5; }).validate(); }, "rope_theta");
  expect_error([&] { with([](ModelConfig& c) { c.norm_eps = 0; }).validate(); }, "norm_eps");
  expect_error([&] { with([](ModelConfig& c) { c.context_length = -1; }).validate(); },
               "context_length");
}

TEST(ModelContract, WeightBytesCountsEveryMatrixAndNormOnce) {
  for (const bool tied : {false, true}) {
    const Model model = small_model(DType::f16, RopeLayout::half_split, tied);
    const ModelConfig& c = model.config;
    const std::size_t kv_rows = static_cast<std::size_t>(c.kv_heads * c.head_dim());
    const std::size_t per_layer =
        2 * static_cast<std::size_t>(c.dim * c.dim) + 2 * kv_rows * c.dim +
        3 * static_cast<std::size_t>(c.dim) * static_cast<std::size_t>(c.hidden_dim);
    const std::size_t matrices = (tied ? 1 : 2) * static_cast<std::size_t>(c.vocab_size * c.dim) +
                                 static_cast<std::size_t>(c.layers) * per_layer;
    const std::size_t norms = static_cast<std::size_t>((2 * c.layers + 1) * c.dim);
    EXPECT_EQ(model.weight_bytes(), matrices * 2 + norms * 4) << "tied " << tied;
  }
}

// =================================================================================================
// Round trips
// =================================================================================================

TEST(GgufRoundTrip, EveryDTypeBitExact) {
  for (const DType dtype : kAllDTypes) {
    for (const bool tied : {false, true}) {
      SCOPED_TRACE(std::string(kvevict::model::to_string(dtype)) + (tied ? " tied" : " untied"));
      const Model original = small_model(dtype, RopeLayout::interleaved, tied);
      const Model loaded = kvevict::model::load_gguf(kvevict::model::serialize_gguf(original));
      EXPECT_EQ(loaded.format, "gguf");
      expect_same_config(original.config, loaded.config);
      expect_same_weights(original, loaded);
      expect_same_tokenizer(original.tokenizer, loaded.tokenizer);
      if (tied) {
        EXPECT_EQ(loaded.output.data, loaded.token_embedding.data);
      }
      EXPECT_EQ(loaded.weight_bytes(), original.weight_bytes());
      // f16 / bf16 stay raw in the file buffer, aligned to the default 32 bytes.
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(loaded.layers[0].wq.data) % 32, 0u);
    }
  }
}

TEST(GgufRoundTrip, SentencePieceTokenizerAndMetadata) {
  Model original = micro_model();
  original.config.rope_theta = 500000.0;  // exact in the f32 GGUF stores
  original.config.norm_eps = 1e-6f;
  original.config.context_length = 4096;
  const Bytes file = kvevict::model::serialize_gguf(original);
  const Model loaded = kvevict::model::load_gguf(file);
  expect_same_config(original.config, loaded.config);
  expect_same_tokenizer(original.tokenizer, loaded.tokenizer);
  expect_same_weights(original, loaded);
  EXPECT_EQ(loaded.tokenizer.vocab_size, 12);
  const gguf::File parsed = gguf::parse(file);
  EXPECT_EQ(parsed.version, 3u);
  EXPECT_EQ(parsed.get_string("general.architecture"), "llama");
  EXPECT_EQ(parsed.get_uint("llama.attention.head_count_kv"), 1u);
  EXPECT_EQ(parsed.find_tensor("output.weight"), nullptr);  // tied: no classifier tensor
}

TEST(GgufRoundTrip, OtherAlignmentsIncludingMisalignedTensors) {
  for (const std::uint32_t alignment : {1u, 2u, 64u, 256u}) {
    SCOPED_TRACE(alignment);
    const Model original = small_model(DType::f32, RopeLayout::interleaved);
    kvevict::model::GgufWriteOptions options;
    options.alignment = alignment;
    const Bytes file = kvevict::model::serialize_gguf(original, options);
    const gguf::File parsed = gguf::parse(file);
    EXPECT_EQ(parsed.alignment, alignment);
    EXPECT_EQ(parsed.data_offset % alignment, 0u);
    const Model loaded = kvevict::model::load_gguf(file);
    expect_same_weights(original, loaded);
    // With alignment 1 or 2 some f32 tensors start off a 4-byte boundary: they are copied.
    for (const auto& layer : loaded.layers) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(layer.wk.data) % 4, 0u);
    }
  }
  expect_error(
      [] {
        kvevict::model::GgufWriteOptions options;
        options.alignment = 48;
        (void)kvevict::model::serialize_gguf(micro_model(), options);
      },
      "power of two");
}

// Q8_0: per block of 32, d = the smallest f16 with 127 d >= max|x| and q = round(x / d), so
// |x - q d| <= d / 2. For a normal f16 d, rounding up loses at most one ulp (relative 2^-10), so
// d <= max|x| / 127 * (1 + 2^-10) and the bound below is independent of the implementation.
// Q4_0 (llama.cpp's quantiser): |d| = max|x| / 8 rounded to f16 (relative 2^-11), values
// (q - 8) d with q in [0, 15]: within |d| / 2 of x, except values of the sign opposite to the
// extreme near its magnitude, clamped at 7 |d|: within |d|. The matrices load in their own type
// (resident bytes = tensor bytes) and read back through the scalar dequantiser.
TEST(GgufRoundTrip, QuantisedWithinTheirBound) {
  for (const DType quantised_type : {DType::q8_0, DType::q4_0}) {
    for (const DType dtype : kAllDTypes) {
      SCOPED_TRACE(std::string(kvevict::model::to_string(dtype)) + " as " +
                   std::string(kvevict::model::to_string(quantised_type)));
      const Model original = small_model(dtype, RopeLayout::interleaved);
      kvevict::model::GgufWriteOptions options;
      options.quantize_q8_0 = quantised_type == DType::q8_0;
      options.quantize_q4_0 = quantised_type == DType::q4_0;
      const Bytes file = kvevict::model::serialize_gguf(original, options);
      const Model loaded = kvevict::model::load_gguf(file);
      expect_same_config(original.config, loaded.config);
      const auto parsed = gguf::parse(file);  // owns the tensor infos find_tensor points into
      const gguf::TensorInfo* wq = parsed.find_tensor("blk.0.attn_q.weight");
      ASSERT_NE(wq, nullptr);
      EXPECT_EQ(wq->type,
                static_cast<std::uint32_t>(quantised_type == DType::q8_0 ? gguf::TensorType::q8_0
                                                                         : gguf::TensorType::q4_0));
      EXPECT_EQ(loaded.layers[0].wq.bytes(), wq->size);

      const auto check = [&](const WeightMatrix& source, const WeightMatrix& quantised,
                             const std::string& what) {
        ASSERT_EQ(quantised.dtype, quantised_type) << what;
        const auto x = detail::to_f32({source.data, source.bytes()}, source.dtype,
                                      static_cast<std::size_t>(source.rows * source.cols));
        const auto y =
            detail::to_f32({quantised.data, quantised.bytes()}, quantised_type, x.size());
        double worst_ratio = 0;
        for (std::size_t block = 0; block < x.size() / 32; ++block) {
          double max_magnitude = 0;
          for (std::size_t i = 0; i < 32; ++i) {
            max_magnitude = std::max(max_magnitude, std::fabs(double(x[block * 32 + i])));
          }
          const double bound = quantised_type == DType::q8_0
                                   ? max_magnitude / 127.0 * (1.0 + std::ldexp(1.0, -10)) / 2.0
                                   : max_magnitude / 8.0 * (1.0 + std::ldexp(1.0, -10));
          for (std::size_t i = 0; i < 32; ++i) {
            const double error = std::fabs(double(x[block * 32 + i]) - y[block * 32 + i]);
            ASSERT_LE(error, bound * (1 + 1e-12)) << what << " block " << block;
            if (bound > 0) worst_ratio = std::max(worst_ratio, error / bound);
          }
        }
        EXPECT_GT(worst_ratio, quantised_type == DType::q8_0 ? 0.5 : 0.25)
            << what << ": the bound should be nearly attained";
      };
      check(original.token_embedding, loaded.token_embedding, "token_embedding");
      check(original.output, loaded.output, "output");
      for (std::size_t layer = 0; layer < original.layers.size(); ++layer) {
        const auto& a = original.layers[layer];
        const auto& b = loaded.layers[layer];
        check(a.wq, b.wq, "wq");
        check(a.wk, b.wk, "wk");
        check(a.wv, b.wv, "wv");
        check(a.wo, b.wo, "wo");
        check(a.w_gate, b.w_gate, "w_gate");
        check(a.w_up, b.w_up, "w_up");
        // w_down has 48 columns, not a whole number of blocks: kept in its dtype, bit-exact.
        expect_same_matrix(a.w_down, b.w_down, "w_down");
        expect_same_norm(a.attention_norm, b.attention_norm, "attention_norm");
      }
      // Writing the quantised model again keeps its blocks as they are.
      const Model again =
          kvevict::model::load_gguf(kvevict::model::serialize_gguf(loaded, options));
      expect_same_weights(loaded, again);
    }
  }
}

TEST(SafetensorsRoundTrip, EveryDTypeBitExact) {
  for (const DType dtype : kAllDTypes) {
    for (const bool tied : {false, true}) {
      SCOPED_TRACE(std::string(kvevict::model::to_string(dtype)) + (tied ? " tied" : " untied"));
      const Model original = small_model(dtype, RopeLayout::half_split, tied);
      const auto files = kvevict::model::serialize_safetensors(original);
      const Model loaded = kvevict::model::load_safetensors(files.tensors, files.config_json);
      EXPECT_EQ(loaded.format, "safetensors");
      expect_same_config(original.config, loaded.config);
      expect_same_weights(original, loaded);
      expect_same_tokenizer(original.tokenizer, loaded.tokenizer);
      if (tied) {
        EXPECT_EQ(loaded.output.data, loaded.token_embedding.data);
      }
      // The file has no gaps and every tensor sits at a multiple of its element size.
      const auto parsed = kvevict::model::safetensors::parse(files.tensors);
      std::uint64_t covered = 0;
      for (const auto& tensor : parsed.tensors) {
        covered += tensor.end - tensor.begin;
        EXPECT_EQ((parsed.data_offset + tensor.begin) %
                      kvevict::model::safetensors::dtype_size(tensor.dtype),
                  0u)
            << tensor.name;
      }
      EXPECT_EQ(parsed.data_offset + covered, files.tensors.size());
    }
  }
}

TEST(SafetensorsRoundTrip, SentencePieceTokenizerInConfig) {
  Model original = micro_model();
  original.config.rope_layout = RopeLayout::half_split;
  const auto files = kvevict::model::serialize_safetensors(original);
  const Model loaded = kvevict::model::load_safetensors(files.tensors, files.config_json);
  expect_same_tokenizer(original.tokenizer, loaded.tokenizer);
  expect_same_weights(original, loaded);
  const json config = json::parse(files.config_json);
  EXPECT_EQ(config["kvevict_tokenizer"], "sentencepiece");
  EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(config["tie_word_embeddings"], true);
}

TEST(SafetensorsRoundTrip, ByteTokenizerKeysInConfig) {
  const auto files = kvevict::model::serialize_safetensors(small_model(DType::bf16));
  const json config = json::parse(files.config_json);
  EXPECT_EQ(config["kvevict_tokenizer"], "bytes");
  EXPECT_EQ(config["bos_token_id"], 256);
  EXPECT_EQ(config["eos_token_id"], 257);
  EXPECT_EQ(config["anchor_token_id"], 258);
  EXPECT_EQ(config["torch_dtype"], "bfloat16");
  // Hugging Face style: no kvevict_tokenizer key => byte-level, ids from the standard keys.
  json plain = config;
  plain.erase("kvevict_tokenizer");
  plain.erase("anchor_token_id");
  const Model loaded = kvevict::model::load_safetensors(files.tensors, plain.dump());
  EXPECT_EQ(loaded.tokenizer.kind, Tokenizer::Kind::byte_level);
  EXPECT_EQ(loaded.tokenizer.bos_id, 256);
  EXPECT_EQ(loaded.tokenizer.anchor_id, -1);
}

TEST(Llama2cRoundTrip, F32BitExactTiedAndUntied) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const Model original = small_model(DType::f32, RopeLayout::interleaved, tied);
    const Bytes file = kvevict::model::serialize_llama2c(original);
    // Size as run.c computes it: header + weights + freq_cis (2 * seq_len * head_dim / 2).
    llama2c::Header header;
    std::memcpy(&header, file.data(), sizeof header);
    EXPECT_EQ(header.vocab_size, tied ? 260 : -260);
    EXPECT_EQ(file.size(), 28 + 4 * llama2c::expected_floats(header));
    const Model loaded = kvevict::model::load_llama2c(file);
    EXPECT_EQ(loaded.format, "llama2c");
    expect_same_config(original.config, loaded.config);
    expect_same_weights(original, loaded);
    EXPECT_EQ(loaded.tokenizer.kind, Tokenizer::Kind::byte_level);  // no tokenizer.bin given
  }
}

TEST(Llama2cRoundTrip, HalfPrecisionModelsAreWidenedExactly) {
  for (const DType dtype : {DType::f16, DType::bf16}) {
    const Model original = small_model(dtype, RopeLayout::interleaved);
    const Model loaded = kvevict::model::load_llama2c(kvevict::model::serialize_llama2c(original));
    ASSERT_EQ(loaded.layers[1].w_up.dtype, DType::f32);
    const auto& source = original.layers[1].w_up;
    std::vector<float> a(static_cast<std::size_t>(source.cols));
    std::vector<float> b(a.size());
    for (std::int64_t row = 0; row < source.rows; ++row) {
      source.row_to_f32(row, a.data());
      loaded.layers[1].w_up.row_to_f32(row, b.data());
      ASSERT_EQ(a, b);
    }
  }
}

TEST(Llama2cRoundTrip, TokenizerBin) {
  Model original = micro_model();
  original.config.tied_embeddings = false;
  original.output = original.token_embedding;  // an untied classifier equal to the embedding
  const Bytes checkpoint = kvevict::model::serialize_llama2c(original);
  const Bytes tokenizer = kvevict::model::serialize_llama2c_tokenizer(original.tokenizer);
  const Model loaded = kvevict::model::load_llama2c(checkpoint, tokenizer);
  EXPECT_EQ(loaded.tokenizer.kind, Tokenizer::Kind::sentencepiece);
  EXPECT_EQ(loaded.tokenizer.pieces, original.tokenizer.pieces);
  EXPECT_EQ(loaded.tokenizer.scores, original.tokenizer.scores);
  EXPECT_EQ(loaded.tokenizer.bos_id, 1);
  EXPECT_EQ(loaded.tokenizer.eos_id, 2);
  EXPECT_EQ(loaded.tokenizer.anchor_id, 10);  // found as the piece "<AC>"
  // Types are inferred (tokenizer.bin has none): <unk> unknown, BOS/EOS control, <0xXX> byte.
  EXPECT_EQ(loaded.tokenizer.types,
            (std::vector<std::int32_t>{2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1, 1}));
  // llama2.c's exporter writes "▁" as a space and BOS as "\n<s>\n".
  EXPECT_NE(find_text(tokenizer, std::string("\x05\x00\x00\x00\n<s>\n", 9)), std::string::npos);
  EXPECT_NE(find_text(tokenizer, std::string("\x03\x00\x00\x00 ab", 7)), std::string::npos);
  expect_error([&] { (void)kvevict::model::read_llama2c_tokenizer(tokenizer, 13); }, "truncated");
  expect_error([&] { (void)kvevict::model::read_llama2c_tokenizer(tokenizer, 100); },
               "cannot hold");
  expect_error([&] { (void)kvevict::model::read_llama2c_tokenizer(tokenizer, 11); }, "mismatch");
}

TEST(LoadModel, DispatchesByMagicDirectoryAndExtension) {
  const TempDir dir;
  const Model original = small_model(DType::f16, RopeLayout::interleaved);
  kvevict::model::write_gguf(original, dir.path() / "model.gguf");
  kvevict::model::write_gguf(original, dir.path() / "model.bin");  // magic, not extension
  kvevict::model::write_safetensors(make_model(small_config(), DType::f16, 7, byte_tokenizer()),
                                    dir.path() / "hf");
  EXPECT_EQ(kvevict::model::load_model(dir.path() / "model.gguf").format, "gguf");
  EXPECT_EQ(kvevict::model::load_model(dir.path() / "model.bin").format, "gguf");
  EXPECT_EQ(kvevict::model::load_model(dir.path() / "hf").format, "safetensors");
  const Model from_file = kvevict::model::load_model(dir.path() / "hf" / "model.safetensors");
  EXPECT_EQ(from_file.format, "safetensors");
  expect_same_weights(make_model(small_config(), DType::f16, 7, byte_tokenizer()), from_file);
  // safetensors under another name is recognised by its content.
  fs::copy_file(dir.path() / "hf" / "model.safetensors", dir.path() / "hf" / "weights.bin");
  EXPECT_EQ(kvevict::model::load_model(dir.path() / "hf" / "weights.bin").format, "safetensors");

  // llama2.c: no magic; a tokenizer.bin beside the checkpoint is picked up.
  const fs::path llama2c_dir = dir.path() / "stories";
  fs::create_directories(llama2c_dir);
  const Model micro = micro_model();
  kvevict::model::write_llama2c(micro, llama2c_dir / "model.bin");
  const Model without = kvevict::model::load_model(llama2c_dir / "model.bin");
  EXPECT_EQ(without.format, "llama2c");
  EXPECT_EQ(without.tokenizer.kind, Tokenizer::Kind::byte_level);
  kvevict::model::write_llama2c_tokenizer(micro.tokenizer, llama2c_dir / "tokenizer.bin");
  const Model with = kvevict::model::load_model(llama2c_dir / "model.bin");
  EXPECT_EQ(with.tokenizer.kind, Tokenizer::Kind::sentencepiece);
  expect_same_weights(micro, with);

  expect_error([&] { (void)kvevict::model::load_model(dir.path() / "missing.gguf"); },
               "cannot open");
  expect_error([&] { (void)kvevict::model::load_safetensors(llama2c_dir / "x.safetensors"); },
               "config.json not found");
}

// =================================================================================================
// RoPE layouts: the same model through GGUF (interleaved) and safetensors (half_split)
// =================================================================================================

// q . k per (query head, its KV head) after RoPE at positions (5, 2), in double.
std::vector<double> rotated_scores(const Model& model, int layer, const std::vector<double>& x) {
  const ModelConfig& c = model.config;
  const int head_dim = c.head_dim();
  const auto project = [&](const WeightMatrix& w) {
    std::vector<double> out(static_cast<std::size_t>(w.rows));
    std::vector<float> row(static_cast<std::size_t>(w.cols));
    for (std::int64_t r = 0; r < w.rows; ++r) {
      w.row_to_f32(r, row.data());
      double sum = 0;
      for (std::size_t i = 0; i < row.size(); ++i) sum += row[i] * x[i];
      out[static_cast<std::size_t>(r)] = sum;
    }
    return out;
  };
  std::vector<double> q = project(model.layers[static_cast<std::size_t>(layer)].wq);
  std::vector<double> k = project(model.layers[static_cast<std::size_t>(layer)].wk);
  const Rope rope(RopeConfig{head_dim, c.rotary_dim, c.rope_theta, c.rope_layout});
  for (int h = 0; h < c.heads; ++h) rope.rotate(q.data() + h * head_dim, 5);
  for (int h = 0; h < c.kv_heads; ++h) rope.rotate(k.data() + h * head_dim, 2);
  std::vector<double> scores;
  for (int h = 0; h < c.heads; ++h) {
    const int kv = h / (c.heads / c.kv_heads);
    double dot = 0;
    for (int i = 0; i < head_dim; ++i) dot += q[h * head_dim + i] * k[kv * head_dim + i];
    scores.push_back(dot);
  }
  return scores;
}

TEST(RopeLayouts, GgufAndSafetensorsHoldTheSameModelUpToTheQKPermutation) {
  for (const int rotary_dim : {0, 8}) {  // full heads, and a partial rotary (GGUF only)
    SCOPED_TRACE(rotary_dim);
    ModelConfig config = small_config();
    config.rotary_dim = rotary_dim;
    const Model original = make_model(config, DType::bf16, 11, byte_tokenizer());
    const Model from_gguf = kvevict::model::load_gguf(kvevict::model::serialize_gguf(original));
    EXPECT_EQ(from_gguf.config.rope_layout, RopeLayout::interleaved);
    EXPECT_EQ(from_gguf.config.rotary_dim, rotary_dim);
    const int head_dim = config.head_dim();
    const int rotary = rotary_dim == 0 ? head_dim : rotary_dim;
    for (std::size_t layer = 0; layer < original.layers.size(); ++layer) {
      const auto& a = original.layers[layer];
      const auto& b = from_gguf.layers[layer];
      EXPECT_TRUE(bytes_of(b.wq) == interleaved_rows(a.wq, config.heads, head_dim, rotary));
      EXPECT_TRUE(bytes_of(b.wk) == interleaved_rows(a.wk, config.kv_heads, head_dim, rotary));
      expect_same_matrix(a.wv, b.wv, "wv is not permuted");
      expect_same_matrix(a.wo, b.wo, "wo is not permuted");
    }
    // What the permutation is for: attention scores after RoPE are the same in both layouts.
    std::mt19937 rng(5);
    std::normal_distribution<double> normal;
    std::vector<double> x(static_cast<std::size_t>(config.dim));
    for (double& value : x) value = normal(rng);
    for (int layer = 0; layer < config.layers; ++layer) {
      const auto expected = rotated_scores(original, layer, x);
      const auto actual = rotated_scores(from_gguf, layer, x);
      for (std::size_t h = 0; h < expected.size(); ++h) {
        EXPECT_NEAR(actual[h], expected[h], 1e-9 * (1 + std::fabs(expected[h])));
      }
    }
    if (rotary_dim != 0) {
      expect_error([&] { (void)kvevict::model::serialize_safetensors(original); }, "rotary_dim");
      continue;
    }
    // safetensors keeps half_split rows as they are; GGUF -> safetensors permutes back exactly.
    const auto files = kvevict::model::serialize_safetensors(original);
    const Model from_safetensors =
        kvevict::model::load_safetensors(files.tensors, files.config_json);
    EXPECT_EQ(from_safetensors.config.rope_layout, RopeLayout::half_split);
    expect_same_weights(original, from_safetensors);
    const auto back = kvevict::model::serialize_safetensors(from_gguf);
    expect_same_weights(original, kvevict::model::load_safetensors(back.tensors, back.config_json));
    // And llama2.c (interleaved) agrees with GGUF.
    Model f32_original = make_model(config, DType::f32, 11, byte_tokenizer());
    const Model from_llama2c =
        kvevict::model::load_llama2c(kvevict::model::serialize_llama2c(f32_original));
    const Model f32_gguf = kvevict::model::load_gguf(kvevict::model::serialize_gguf(f32_original));
    expect_same_weights(f32_gguf, from_llama2c);
  }
}

TEST(RopeLayouts, PermutationInvertsAndRejectsBadShapes) {
  const Model model = small_model(DType::f32);
  std::vector<std::shared_ptr<const void>> storage;
  const auto& wq = model.layers[0].wq;
  const WeightMatrix there = kvevict::model::permute_rope_rows(wq, 4, 16, 0, RopeLayout::half_split,
                                                               RopeLayout::interleaved, storage);
  const WeightMatrix back = kvevict::model::permute_rope_rows(
      there, 4, 16, 0, RopeLayout::interleaved, RopeLayout::half_split, storage);
  EXPECT_NE(there.data, wq.data);
  EXPECT_FALSE(bytes_of(there) == bytes_of(wq));
  EXPECT_TRUE(bytes_of(back) == bytes_of(wq));
  const WeightMatrix same = kvevict::model::permute_rope_rows(wq, 4, 16, 0, RopeLayout::half_split,
                                                              RopeLayout::half_split, storage);
  EXPECT_EQ(same.data, wq.data);
  expect_error(
      [&] {
        (void)kvevict::model::permute_rope_rows(wq, 3, 16, 0, RopeLayout::half_split,
                                                RopeLayout::interleaved, storage);
      },
      "rows");
}

// =================================================================================================
// Malformed GGUF
// =================================================================================================

Bytes micro_gguf() { return kvevict::model::serialize_gguf(micro_model()); }

Model load_gguf_span(std::span<const std::byte> bytes) { return kvevict::model::load_gguf(bytes); }

TEST(GgufMalformed, BadMagic) {
  Bytes file = micro_gguf();
  file[0] = std::byte{'X'};
  expect_error([&] { (void)load_gguf_span(file); }, "bad magic");
}

TEST(GgufMalformed, UnsupportedVersion) {
  Bytes file = micro_gguf();
  put_u32(file, 4, 1);
  expect_error([&] { (void)load_gguf_span(file); }, "unsupported version 1");
  put_u32(file, 4, 4);
  expect_error([&] { (void)load_gguf_span(file); }, "unsupported version 4");
  put_u32(file, 4, 0x03000000);
  expect_error([&] { (void)load_gguf_span(file); }, "big-endian");
  put_u32(file, 4, 2);  // v2 has v3's layout
  EXPECT_NO_THROW((void)load_gguf_span(file));
}

TEST(GgufMalformed, EveryPrefixIsTruncated) {
  const Bytes file = micro_gguf();
  expect_every_prefix_fails(file, load_gguf_span);
  expect_error([&] { (void)load_gguf_span(std::span(file).first(20)); }, "truncated");
  // A Q8_0 file too (its blocks are parsed differently).
  ModelConfig config = micro_config();
  config.dim = 32;
  config.heads = 2;
  kvevict::model::GgufWriteOptions options;
  options.quantize_q8_0 = true;
  expect_every_prefix_fails(kvevict::model::serialize_gguf(
                                make_model(config, DType::f16, 9, micro_sentencepiece()), options),
                            load_gguf_span);
}

TEST(GgufMalformed, StringLengthBeyondFile) {
  Bytes file = micro_gguf();
  // The first metadata key's length field sits right after the 24-byte header.
  put_u64(file, 24, std::uint64_t{1} << 40);
  expect_error([&] { (void)load_gguf_span(file); }, "exceeds the file");
  // A string value: the architecture name.
  file = micro_gguf();
  put_u64(file, gguf_value(file, "general.architecture"), file.size());
  expect_error([&] { (void)load_gguf_span(file); }, "exceeds the file");
  // A string inside the tokens array.
  file = micro_gguf();
  const std::size_t first_token = gguf_value(file, "tokenizer.ggml.tokens") + 4 + 8;
  put_u64(file, first_token, 1'000'000'000);
  expect_error([&] { (void)load_gguf_span(file); }, "exceeds the file");
}

TEST(GgufMalformed, AbsurdCounts) {
  Bytes file = micro_gguf();
  put_u64(file, 8, std::uint64_t{1} << 62);
  expect_error([&] { (void)load_gguf_span(file); }, "tensor count");
  file = micro_gguf();
  put_u64(file, 8, 5000);  // under the hard limit but more than the bytes could describe
  expect_error([&] { (void)load_gguf_span(file); }, "tensor count 5000 is absurd");
  file = micro_gguf();
  put_u64(file, 16, std::uint64_t{1} << 62);
  expect_error([&] { (void)load_gguf_span(file); }, "metadata count");
  file = micro_gguf();
  put_u64(file, 16, 1000);
  expect_error([&] { (void)load_gguf_span(file); }, "metadata count 1000 is absurd");
  file = micro_gguf();
  const std::size_t tokens = gguf_value(file, "tokenizer.ggml.tokens");  // u32 type, u64 count
  put_u64(file, tokens + 4, std::uint64_t{1} << 59);
  expect_error([&] { (void)load_gguf_span(file); }, "array length");
  file = micro_gguf();
  const std::size_t scores = gguf_value(file, "tokenizer.ggml.scores");
  put_u64(file, scores + 4, file.size() / 4);  // a float array longer than the bytes left
  expect_error([&] { (void)load_gguf_span(file); }, "array length");
}

TEST(GgufMalformed, TensorOutOfBoundsOrMisaligned) {
  Bytes file = micro_gguf();
  const auto fields = gguf_tensor_info(file, "blk.0.ffn_down.weight");
  put_u64(file, fields.offset, 32 * 1000);
  expect_error([&] { (void)load_gguf_span(file); }, "extends beyond the end of the file");
  put_u64(file, fields.offset, std::uint64_t{1} << 63);
  expect_error([&] { (void)load_gguf_span(file); }, "extends beyond");
  put_u64(file, fields.offset, 33);
  expect_error([&] { (void)load_gguf_span(file); }, "not a multiple of the alignment");
  // Dimensions: too many, zero, absurd.
  file = micro_gguf();
  put_u32(file, fields.n_dims, 5);
  expect_error([&] { (void)load_gguf_span(file); }, "5 dimensions");
  file = micro_gguf();
  put_u64(file, fields.dims, 0);
  expect_error([&] { (void)load_gguf_span(file); }, "absurd dimension");
  file = micro_gguf();
  put_u64(file, fields.dims, std::uint64_t{1} << 60);
  expect_error([&] { (void)load_gguf_span(file); }, "absurd dimension");
  file = micro_gguf();
  put_u64(file, fields.dims, std::uint64_t{1} << 40);  // plausible alone, but not in this file
  expect_error([&] { (void)load_gguf_span(file); }, "beyond");
}

TEST(GgufMalformed, ShapeMismatchWithConfig) {
  Bytes file = micro_gguf();
  put_u32(file, gguf_value(file, "llama.feed_forward_length"), 16);
  expect_error([&] { (void)load_gguf_span(file); }, "blk.0.ffn_gate.weight' has shape [8, 12]");
  file = micro_gguf();
  put_u32(file, gguf_value(file, "llama.attention.head_count_kv"), 2);
  expect_error([&] { (void)load_gguf_span(file); }, "attn_k.weight' has shape");
  file = micro_gguf();
  put_u32(file, gguf_value(file, "llama.embedding_length"), 16);
  expect_error([&] { (void)load_gguf_span(file); }, "shape");
  file = micro_gguf();
  put_u32(file, gguf_value(file, "llama.vocab_size"), 13);
  expect_error([&] { (void)load_gguf_span(file); }, "does not match");
  file = micro_gguf();
  put_u32(file, gguf_value(file, "llama.attention.head_count"), 3);
  expect_error([&] { (void)load_gguf_span(file); }, "not divisible by heads");
}

TEST(GgufMalformed, UnsupportedTensorType) {
  Bytes file = micro_gguf();
  put_u32(file, gguf_tensor_info(file, "blk.0.attn_q.weight").type, 12);  // Q4_K
  expect_error([&] { (void)load_gguf_span(file); }, "unsupported type Q4_K");
  // Q8_0 needs whole blocks of 32 along ne[0].
  file = micro_gguf();
  put_u32(file, gguf_tensor_info(file, "blk.0.attn_q.weight").type, 8);
  expect_error([&] { (void)load_gguf_span(file); }, "multiple of the block size");
}

TEST(GgufMalformed, UnknownTensorsAreIgnoredWhateverTheirType) {
  Bytes file = kvevict::model::serialize_gguf(make_model(
      [] {
        ModelConfig config = micro_config();
        config.tied_embeddings = false;
        return config;
      }(),
      DType::f32, 3, micro_sentencepiece()));
  // Rename the classifier: the model becomes tied and the tensor unknown; then make it Q4_K.
  file[find_gguf_string(file, "output.weight") + 5] = std::byte{'X'};
  put_u32(file, gguf_tensor_info(file, "outpuX.weight").type, 12);
  const Model model = load_gguf_span(file);
  EXPECT_TRUE(model.config.tied_embeddings);
  // A missing required tensor is named.
  Bytes missing = micro_gguf();
  missing[find_gguf_string(missing, "blk.0.attn_v.weight") + 9] = std::byte{'X'};
  expect_error([&] { (void)load_gguf_span(missing); }, "missing tensor 'blk.0.attn_v.weight'");
}

TEST(GgufMalformed, MetadataTypesAndValues) {
  Bytes file = micro_gguf();
  put_u32(file, after_gguf_string(file, "llama.block_count"), 6);  // claim float32
  expect_error([&] { (void)load_gguf_span(file); }, "expected an integer");
  file = micro_gguf();
  put_u32(file, after_gguf_string(file, "llama.block_count"), 13);
  expect_error([&] { (void)load_gguf_span(file); }, "unknown value type 13");
  file = micro_gguf();
  std::memcpy(file.data() + gguf_value(file, "general.architecture") + 8, "mamba", 5);
  expect_error([&] { (void)load_gguf_span(file); }, "architecture 'mamba'");
  file = micro_gguf();
  std::memcpy(file.data() + gguf_value(file, "tokenizer.ggml.model") + 8, "gpt-2", 5);
  expect_error([&] { (void)load_gguf_span(file); }, "tokenizer model 'gpt-2'");
  file = micro_gguf();
  put_u32(file, gguf_value(file, "tokenizer.ggml.bos_token_id"), 12);
  expect_error([&] { (void)load_gguf_span(file); }, "bos token id 12");
  file = micro_gguf();
  put_u32(file, gguf_value(file, "llama.block_count"), 5000);
  expect_error([&] { (void)load_gguf_span(file); }, "absurd");
  file = micro_gguf();
  file[find_gguf_string(file, "llama.embedding_length") + 6] = std::byte{'X'};
  expect_error([&] { (void)load_gguf_span(file); },
               "missing metadata key 'llama.embedding_length'");
}

TEST(GgufMalformed, EveryValueTypeNestedArraysAndUnknownKeysAreSkipped) {
  using gguf::ValueType;
  gguf::Writer writer;
  writer.add_raw("x.u8", ValueType::uint8, encode([](auto& w) { w.u8(200); }));
  writer.add_raw("x.i8", ValueType::int8, encode([](auto& w) { w.u8(0xfb); }));
  writer.add_raw("x.u16", ValueType::uint16, encode([](auto& w) { w.u16(60000); }));
  writer.add_raw("x.i16", ValueType::int16, encode([](auto& w) { w.u16(0xfffe); }));
  writer.add_uint32("x.u32", 4000000000u);
  writer.add_int32("x.i32", -7);
  writer.add_float32("x.f32", 0.25f);
  writer.add_bool("x.bool", true);
  writer.add_string("x.string", "hello");
  writer.add_uint64("x.u64", std::uint64_t{1} << 50);
  writer.add_raw("x.i64", ValueType::int64, encode([](auto& w) { w.u64(~std::uint64_t{0}); }));
  writer.add_raw("x.f64", ValueType::float64, encode([](auto& w) { w.f64(-1.5); }));
  writer.add_raw("x.empty", ValueType::array, encode([](auto& w) {
                   w.u32(static_cast<std::uint32_t>(ValueType::float64));
                   w.u64(0);
                 }));
  // [["a", "bc"], [1, 2, 3] as u8]
  writer.add_raw("x.nested", ValueType::array, encode([](auto& w) {
                   w.u32(static_cast<std::uint32_t>(ValueType::array));
                   w.u64(2);
                   w.u32(static_cast<std::uint32_t>(ValueType::string));
                   w.u64(2);
                   w.u64(1);
                   w.string("a");
                   w.u64(2);
                   w.string("bc");
                   w.u32(static_cast<std::uint32_t>(ValueType::uint8));
                   w.u64(3);
                   w.u8(1);
                   w.u8(2);
                   w.u8(3);
                 }));
  // Nested 8 deep: the limit.
  writer.add_raw("x.deep", ValueType::array, encode([](auto& w) {
                   for (int level = 0; level < gguf::kMaxArrayNesting - 1; ++level) {
                     w.u32(static_cast<std::uint32_t>(ValueType::array));
                     w.u64(1);
                   }
                   w.u32(static_cast<std::uint32_t>(ValueType::int16));
                   w.u64(1);
                   w.u16(5);
                 }));
  gguf::add_llama_model(writer, micro_model(), std::nullopt);
  const Bytes file = writer.finish();
  const Model model = load_gguf_span(file);
  expect_same_weights(micro_model(), model);

  const gguf::File parsed = gguf::parse(file);
  EXPECT_EQ(parsed.get_uint("x.u8"), 200u);
  EXPECT_EQ(parsed.find("x.i8")->signed_value, -5);
  EXPECT_EQ(parsed.get_uint("x.u16"), 60000u);
  EXPECT_EQ(parsed.find("x.i16")->signed_value, -2);
  EXPECT_EQ(parsed.get_uint("x.u32"), 4000000000u);
  EXPECT_EQ(parsed.find("x.i32")->signed_value, -7);
  EXPECT_EQ(parsed.get_float("x.f32"), 0.25);
  EXPECT_EQ(parsed.find("x.bool")->unsigned_value, 1u);
  EXPECT_EQ(parsed.get_string("x.string"), "hello");
  EXPECT_EQ(parsed.get_uint("x.u64"), std::uint64_t{1} << 50);
  EXPECT_EQ(parsed.find("x.i64")->signed_value, -1);
  EXPECT_EQ(parsed.get_float("x.f64"), -1.5);
  EXPECT_EQ(parsed.find("x.empty")->count, 0u);
  EXPECT_EQ(parsed.find("x.nested")->count, 2u);
  EXPECT_EQ(parsed.find("x.nested")->array_bytes.size(), 4 + 8 + 9 + 10 + 4 + 8 + 3u);
  expect_error([&] { (void)parsed.get_uint("x.i64"); }, "negative");
  expect_error([&] { (void)parsed.get_string("x.u8"); }, "expected a string");
  expect_error([&] { (void)parsed.get_string_array("x.nested"); }, "not an array of strings");

  // One level deeper than the limit, an unknown element type, a duplicate key.
  gguf::Writer too_deep;
  too_deep.add_raw("x.deep", ValueType::array, encode([](auto& w) {
                     for (int level = 0; level < gguf::kMaxArrayNesting + 1; ++level) {
                       w.u32(static_cast<std::uint32_t>(ValueType::array));
                       w.u64(1);
                     }
                     w.u32(static_cast<std::uint32_t>(ValueType::uint8));
                     w.u64(0);
                   }));
  expect_error([&] { (void)gguf::parse(too_deep.finish()); }, "nested deeper");
  gguf::Writer unknown_element;
  unknown_element.add_raw("x.bad", ValueType::array, encode([](auto& w) {
                            w.u32(99);
                            w.u64(0);
                          }));
  expect_error([&] { (void)gguf::parse(unknown_element.finish()); }, "unknown array element type");
  gguf::Writer duplicate;
  duplicate.add_string("general.architecture", "llama");
  gguf::add_llama_model(duplicate, micro_model(), std::nullopt);
  expect_error([&] { (void)gguf::parse(duplicate.finish()); },
               "duplicate metadata key 'general.architecture'");
  gguf::Writer bad_alignment(32);
  bad_alignment.add_uint32("general.alignment", 48);
  expect_error([&] { (void)gguf::parse(bad_alignment.finish()); }, "not a power of two");
}

TEST(GgufMalformed, RandomCorruptionsNeverCrash) {
  const Bytes file = micro_gguf();
  const std::size_t header = gguf::parse(file).data_offset;
  expect_corruptions_handled(file, header, 3000, load_gguf_span);
}

// =================================================================================================
// Malformed safetensors
// =================================================================================================

kvevict::model::SafetensorsFiles micro_safetensors() {
  Model model = micro_model();
  model.config.rope_layout = RopeLayout::half_split;
  return kvevict::model::serialize_safetensors(model);
}

// The file with its JSON header replaced by edit(header).
Bytes with_header(const Bytes& file, const std::function<void(json&)>& edit) {
  std::uint64_t length = 0;
  std::memcpy(&length, file.data(), 8);
  json header = json::parse(std::string(reinterpret_cast<const char*>(file.data()) + 8, length));
  edit(header);
  const std::string text = header.dump();
  detail::ByteWriter out;
  out.u64(text.size());
  out.string(text);
  out.bytes(std::span(file).subspan(8 + length));
  return out.buffer();
}

std::string with_config(const std::string& text, const std::function<void(json&)>& edit) {
  json config = json::parse(text);
  edit(config);
  return config.dump();
}

TEST(SafetensorsMalformed, HeaderLengthBeyondFile) {
  auto files = micro_safetensors();
  put_u64(files.tensors, 0, files.tensors.size());
  expect_error([&] { (void)kvevict::model::load_safetensors(files.tensors, files.config_json); },
               "header length");
  put_u64(files.tensors, 0, ~std::uint64_t{0});
  expect_error([&] { (void)kvevict::model::load_safetensors(files.tensors, files.config_json); },
               "exceeds the file");
}

TEST(SafetensorsMalformed, InvalidJson) {
  auto files = micro_safetensors();
  files.tensors[8] = std::byte{'x'};
  expect_error([&] { (void)kvevict::model::load_safetensors(files.tensors, files.config_json); },
               "not valid JSON");
  const auto good = micro_safetensors();
  expect_error([&] { (void)kvevict::model::load_safetensors(good.tensors, "{\"hidden_size\": "); },
               "config.json is not valid JSON");
  expect_error([&] { (void)kvevict::model::load_safetensors(good.tensors, "[1, 2]"); },
               "not a JSON object");
  const Bytes array_header =
      with_header(good.tensors, [](json& header) { header = json::array(); });
  expect_error([&] { (void)kvevict::model::load_safetensors(array_header, good.config_json); },
               "header is not a JSON object");
}

TEST(SafetensorsMalformed, OffsetsOutOfRangeAndSizeMismatch) {
  const auto files = micro_safetensors();
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  const auto load = [&](const Bytes& file) {
    (void)kvevict::model::load_safetensors(file, files.config_json);
  };
  expect_error(
      [&] {
        load(with_header(files.tensors, [&](json& h) { h[q]["data_offsets"] = {0, 1u << 30}; }));
      },
      "lie outside the data section");
  expect_error(
      [&] {
        load(with_header(files.tensors, [&](json& h) { h[q]["data_offsets"] = {64, 0}; }));
      },
      "lie outside");
  expect_error(
      [&] {
        load(with_header(files.tensors, [&](json& h) { h[q]["data_offsets"] = {0, 4}; }));
      },
      "size mismatch");
  expect_error(
      [&] {
        load(with_header(files.tensors, [&](json& h) { h[q]["data_offsets"] = {-1, 4}; }));
      },
      "data_offsets");
  expect_error([&] { load(with_header(files.tensors, [&](json& h) { h[q].erase("dtype"); })); },
               "dtype");
  expect_error(
      [&] {
        load(with_header(files.tensors, [&](json& h) {
          h[q]["shape"] = {std::uint64_t{1} << 40, std::uint64_t{1} << 40};
        }));
      },
      "absurd shape");
}

TEST(SafetensorsMalformed, DTypeAndShapeMismatch) {
  const auto files = micro_safetensors();
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  const auto load = [&](const Bytes& file, const std::string& config) {
    (void)kvevict::model::load_safetensors(file, config);
  };
  // Same byte size, unsupported dtype.
  expect_error(
      [&] {
        load(with_header(files.tensors, [&](json& h) { h[q]["dtype"] = "I32"; }),
             files.config_json);
      },
      "unsupported dtype I32");
  // Same element count, other shape.
  expect_error(
      [&] {
        load(with_header(files.tensors,
                         [&](json& h) {
                           h[q]["shape"] = {4, 16};
                         }),
             files.config_json);
      },
      "has shape [4, 16], expected [8, 8]");
  // The config disagrees with the tensors.
  expect_error(
      [&] {
        load(files.tensors,
             with_config(files.config_json, [](json& c) { c["intermediate_size"] = 16; }));
      },
      "mlp.gate_proj.weight' has shape");
  expect_error(
      [&] {
        load(files.tensors,
             with_config(files.config_json, [](json& c) { c["tie_word_embeddings"] = false; }));
      },
      "missing tensor 'lm_head.weight'");
}

TEST(SafetensorsMalformed, ConfigJsonKeys) {
  const auto files = micro_safetensors();
  const auto load = [&](const std::function<void(json&)>& edit) {
    (void)kvevict::model::load_safetensors(files.tensors, with_config(files.config_json, edit));
  };
  for (const char* key : {"hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "vocab_size"}) {
    expect_error([&] { load([&](json& c) { c.erase(key); }); },
                 std::string("config.json lacks '") + key + "'");
  }
  expect_error([&] { load([](json& c) { c["hidden_size"] = "8"; }); }, "must be an integer");
  expect_error([&] { load([](json& c) { c["hidden_size"] = -8; }); }, "must be positive");
  expect_error([&] { load([](json& c) { c["rope_theta"] = "big"; }); }, "must be a number");
  expect_error([&] { load([](json& c) { c["rms_norm_eps"] = 1e300; }); }, "beyond the f32 range");
  expect_error(
      [&] {
        load([](json& c) {
          c["model_type"] = "mistral";
          c["architectures"] = {"MistralForCausalLM"};
        });
      },
      "model_type 'mistral'");
  expect_error([&] { load([](json& c) {
                       c["rope_scaling"] = {{"type", "linear"}};
                     }); },
               "rope_scaling");
  expect_error([&] { load([](json& c) { c["head_dim"] = 8; }); }, "head_dim");
  expect_error([&] { load([](json& c) { c["hidden_act"] = "gelu"; }); }, "hidden_act");
  expect_error([&] { load([](json& c) { c["kvevict_tokenizer"] = "tiktoken"; }); },
               "kvevict_tokenizer");
  expect_error([&] { load([](json& c) {
                       c["kvevict_tokenizer_pieces"] = {1, 2};
                     }); },
               "non-string");
  expect_error([&] { load([](json& c) { c["eos_token_id"] = 99; }); }, "eos token id 99");
  // Optional keys take Hugging Face's defaults.
  load([](json& c) {
    for (const char* key : {"max_position_embeddings", "rope_theta", "rms_norm_eps", "hidden_act",
                            "model_type", "torch_dtype"}) {
      c.erase(key);
    }
    c["bos_token_id"] = nullptr;
  });
}

TEST(SafetensorsMalformed, EveryPrefixIsTruncated) {
  const auto files = micro_safetensors();
  expect_every_prefix_fails(files.tensors, [&](std::span<const std::byte> bytes) {
    return kvevict::model::load_safetensors(bytes, files.config_json);
  });
}

TEST(SafetensorsMalformed, RandomCorruptionsNeverCrash) {
  const auto files = micro_safetensors();
  const std::size_t header = kvevict::model::safetensors::parse(files.tensors).data_offset;
  expect_corruptions_handled(files.tensors, header, 3000, [&](std::span<const std::byte> bytes) {
    return kvevict::model::load_safetensors(bytes, files.config_json);
  });
  const std::string& text = files.config_json;
  expect_corruptions_handled(
      Bytes(as_bytes(text).begin(), as_bytes(text).end()), text.size(), 2000,
      [&](std::span<const std::byte> bytes) {
        return kvevict::model::load_safetensors(
            files.tensors,
            std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
      });
}

TEST(SafetensorsMalformed, ShardedAndMissingFiles) {
  const TempDir dir;
  write_bytes(dir.path() / "model.safetensors.index.json", as_bytes(std::string("{}")));
  expect_error([&] { (void)kvevict::model::load_safetensors(dir.path()); }, "sharded");
  const TempDir other;
  expect_error([&] { (void)kvevict::model::load_model(other.path()); }, "config.json not found");
}

// =================================================================================================
// Malformed llama2.c
// =================================================================================================

Bytes micro_llama2c() { return kvevict::model::serialize_llama2c(micro_model()); }

Model load_llama2c_span(std::span<const std::byte> bytes) {
  return kvevict::model::load_llama2c(bytes);
}

TEST(Llama2cMalformed, EveryPrefixIsTruncated) {
  const Bytes file = micro_llama2c();
  expect_every_prefix_fails(file, load_llama2c_span);
  expect_error([&] { (void)load_llama2c_span(std::span(file).first(27)); }, "truncated");
  expect_error([&] { (void)load_llama2c_span(std::span(file).first(file.size() - 4)); },
               "size mismatch");
  Bytes longer = file;
  longer.resize(file.size() + 4);
  expect_error([&] { (void)load_llama2c_span(longer); }, "size mismatch");
}

TEST(Llama2cMalformed, NegativeOrInconsistentHeader) {
  const auto with = [](int field, std::int32_t value) {
    Bytes file = micro_llama2c();
    put_i32(file, 4 * static_cast<std::size_t>(field), value);
    return file;
  };
  expect_error([&] { (void)load_llama2c_span(with(0, -8)); }, "dim must be positive");
  expect_error([&] { (void)load_llama2c_span(with(1, 0)); }, "hidden_dim must be positive");
  expect_error([&] { (void)load_llama2c_span(with(2, -1)); }, "layers must be positive");
  expect_error([&] { (void)load_llama2c_span(with(3, 3)); }, "not divisible by heads");
  expect_error([&] { (void)load_llama2c_span(with(4, 0)); }, "kv_heads must be positive");
  expect_error([&] { (void)load_llama2c_span(with(5, 0)); }, "vocab_size must be positive");
  expect_error([&] { (void)load_llama2c_span(with(5, INT32_MIN)); }, "vocab_size");
  expect_error([&] { (void)load_llama2c_span(with(6, 0)); }, "seq_len");
  expect_error([&] { (void)load_llama2c_span(with(2, 1 << 30)); }, "absurd");
  expect_error([&] { (void)load_llama2c_span(with(0, 1 << 20)); }, "size mismatch");
  expect_error([&] { (void)load_llama2c_span(with(5, -12)); }, "size mismatch");  // untied
  Bytes export_v1 = micro_llama2c();
  put_u32(export_v1, 0, llama2c::kExportMagic);
  expect_error([&] { (void)load_llama2c_span(export_v1); }, "version");
}

TEST(Llama2cMalformed, TokenizerBin) {
  const Model micro = micro_model();
  const Bytes checkpoint = micro_llama2c();
  const Bytes tokenizer = kvevict::model::serialize_llama2c_tokenizer(micro.tokenizer);
  // (An empty span means "no tokenizer.bin": the byte-level fallback.)
  for (std::size_t length = 1; length < tokenizer.size(); ++length) {
    EXPECT_THROW((void)kvevict::model::load_llama2c(checkpoint, std::span(tokenizer).first(length)),
                 Error)
        << length;
  }
  Bytes negative = tokenizer;
  put_i32(negative, 4 + 4, -3);  // the first token's length
  expect_error([&] { (void)kvevict::model::load_llama2c(checkpoint, negative); },
               "negative length");
  put_i32(negative, 8, 1 << 30);
  expect_error([&] { (void)kvevict::model::load_llama2c(checkpoint, negative); }, "truncated");
  expect_error([&] { (void)kvevict::model::serialize_llama2c_tokenizer(byte_tokenizer()); },
               "byte-level");
}

TEST(Llama2cMalformed, WriterRefusesWhatRunCCannotExpress) {
  Model model = micro_model();
  model.config.rope_theta = 500000.0;
  expect_error([&] { (void)kvevict::model::serialize_llama2c(model); }, "rope_theta");
  model = micro_model();
  model.config.norm_eps = 1e-6f;
  expect_error([&] { (void)kvevict::model::serialize_llama2c(model); }, "norm_eps");
  model = micro_model();
  model.config.context_length = 0;
  expect_error([&] { (void)kvevict::model::serialize_llama2c(model); }, "context_length");
}

TEST(Llama2cMalformed, RandomCorruptionsNeverCrash) {
  const Bytes file = micro_llama2c();
  expect_corruptions_handled(file, 28, 2000, load_llama2c_span);
}

}  // namespace
