#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <kvevict/model/random_model.hpp>
#include <memory>
#include <vector>

#include "half.hpp"
#include "quant.hpp"

namespace kvevict::model {
namespace {

// SplitMix64 (Steele, Lea, Flood 2014): a fixed integer recurrence, identical everywhere.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 random bits: exact in float.
  float uniform() { return static_cast<float>(next() >> 40) * 0x1.0p-24f; }
  // Irwin-Hall(4), centred and scaled to unit variance.
  float normal_ish() {
    const float sum = uniform() + uniform() + uniform() + uniform();
    return (sum - 2.0f) * 1.7320508f;
  }

 private:
  std::uint64_t state_;
};

// One allocation holding every matrix; each matrix starts on a 64-byte boundary of it.
class Arena {
 public:
  explicit Arena(std::size_t bytes)
      : buffer_(std::make_shared<std::vector<std::byte>>(bytes + 64)) {
    const auto address = reinterpret_cast<std::uintptr_t>(buffer_->data());
    offset_ = static_cast<std::size_t>((64 - address % 64) % 64);
  }
  std::byte* take(std::size_t bytes) {
    std::byte* out = buffer_->data() + offset_;
    offset_ += (bytes + 63) / 64 * 64;
    return out;
  }
  std::shared_ptr<const void> owner() const { return buffer_; }

 private:
  std::shared_ptr<std::vector<std::byte>> buffer_;
  std::size_t offset_ = 0;
};

std::size_t padded_bytes(std::int64_t rows, std::int64_t cols, DType dtype) {
  return (static_cast<std::size_t>(rows) * dtype_bytes(dtype, cols) + 63) / 64 * 64;
}

WeightMatrix random_matrix(Arena& arena, SplitMix64& rng, std::int64_t rows, std::int64_t cols,
                           DType dtype, float stddev) {
  WeightMatrix w;
  w.dtype = dtype;
  w.rows = rows;
  w.cols = cols;
  std::byte* data = arena.take(w.bytes());
  w.data = data;
  const auto count = static_cast<std::size_t>(rows * cols);
  if (block_values(dtype) > 1) {
    // Drawn as f32, then quantised as a GGUF writer would.
    std::vector<float> values(count);
    for (float& value : values) value = rng.normal_ish() * stddev;
    const std::vector<std::byte> blocks = quantize(values, dtype);
    std::memcpy(data, blocks.data(), blocks.size());
    return w;
  }
  for (std::size_t i = 0; i < count; ++i) {
    const float value = rng.normal_ish() * stddev;
    switch (dtype) {
      case DType::f32:
        std::memcpy(data + 4 * i, &value, 4);
        break;
      case DType::f16: {
        const std::uint16_t bits = float_to_f16(value);
        std::memcpy(data + 2 * i, &bits, 2);
        break;
      }
      case DType::bf16: {
        const std::uint16_t bits = float_to_bf16(value);
        std::memcpy(data + 2 * i, &bits, 2);
        break;
      }
      default:
        break;
    }
  }
  return w;
}

}  // namespace

Model make_random_model(const ModelConfig& config, std::uint64_t seed, DType dtype) {
  config.validate();
  const std::int64_t dim = config.dim;
  const std::int64_t hidden = config.hidden_dim;
  const std::int64_t q_dim = std::int64_t{config.heads} * config.head_dim();
  const std::int64_t kv_dim = std::int64_t{config.kv_heads} * config.head_dim();
  const std::int64_t vocab = config.vocab_size;

  std::size_t total = padded_bytes(vocab, dim, dtype);
  if (!config.tied_embeddings) total += padded_bytes(vocab, dim, dtype);
  const std::size_t per_layer =
      padded_bytes(q_dim, dim, dtype) + 2 * padded_bytes(kv_dim, dim, dtype) +
      padded_bytes(dim, q_dim, dtype) + 2 * padded_bytes(hidden, dim, dtype) +
      padded_bytes(dim, hidden, dtype);
  total += per_layer * static_cast<std::size_t>(config.layers);
  Arena arena(total);

  SplitMix64 rng(seed);
  const auto inv_sqrt = [](double x) { return static_cast<float>(1.0 / std::sqrt(x)); };
  const float residual_scale = inv_sqrt(2.0 * config.layers);

  Model model;
  model.config = config;
  model.format = "random";
  model.token_embedding =
      random_matrix(arena, rng, vocab, dim, dtype, inv_sqrt(static_cast<double>(dim)));
  model.layers.resize(static_cast<std::size_t>(config.layers));
  for (LayerWeights& layer : model.layers) {
    const float in_dim = inv_sqrt(static_cast<double>(dim));
    layer.attention_norm.assign(static_cast<std::size_t>(dim), 1.0f);
    layer.wq = random_matrix(arena, rng, q_dim, dim, dtype, in_dim);
    layer.wk = random_matrix(arena, rng, kv_dim, dim, dtype, in_dim);
    layer.wv = random_matrix(arena, rng, kv_dim, dim, dtype, in_dim);
    layer.wo = random_matrix(arena, rng, dim, q_dim, dtype,
                             inv_sqrt(static_cast<double>(q_dim)) * residual_scale);
    layer.ffn_norm.assign(static_cast<std::size_t>(dim), 1.0f);
    layer.w_gate = random_matrix(arena, rng, hidden, dim, dtype, in_dim);
    layer.w_up = random_matrix(arena, rng, hidden, dim, dtype, in_dim);
    layer.w_down = random_matrix(arena, rng, dim, hidden, dtype,
                                 inv_sqrt(static_cast<double>(hidden)) * residual_scale);
  }
  model.final_norm.assign(static_cast<std::size_t>(dim), 1.0f);
  model.output = config.tied_embeddings ? model.token_embedding
                                        : random_matrix(arena, rng, vocab, dim, dtype,
                                                        inv_sqrt(static_cast<double>(dim)));
  model.storage.push_back(arena.owner());

  Tokenizer& tokenizer = model.tokenizer;
  tokenizer.kind = Tokenizer::Kind::byte_level;
  tokenizer.vocab_size = config.vocab_size;
  tokenizer.bos_id = config.vocab_size > 256 ? 256 : -1;
  tokenizer.eos_id = config.vocab_size > 257 ? 257 : -1;
  tokenizer.anchor_id = config.vocab_size > 258 ? 258 : -1;
  return model;
}

}  // namespace kvevict::model
