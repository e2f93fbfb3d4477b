// llama2.c checkpoints and tokenizer.bin: readers and writers.
#include "llama2c.hpp"

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <system_error>

#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "model_io.hpp"

namespace kvevict::model {
namespace {

using detail::TensorRole;

[[noreturn]] void fail(const std::string& message) { throw Error("llama2.c: " + message); }

constexpr std::string_view kSpace = "\xe2\x96\x81";  // "▁", SentencePiece's space
constexpr std::string_view kBosPiece = "\n<s>\n";    // how llama2.c's exporter writes them
constexpr std::string_view kEosPiece = "\n</s>\n";

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string result;
  std::size_t start = 0;
  while (true) {
    const std::size_t found = text.find(from, start);
    result.append(text.substr(start, found - start));
    if (found == std::string_view::npos) return result;
    result.append(to);
    start = found + from.size();
  }
}

ModelConfig config_from(const llama2c::Header& header) {
  ModelConfig config;
  config.dim = header.dim;
  config.hidden_dim = header.hidden_dim;
  config.layers = header.layers;
  config.heads = header.heads;
  config.kv_heads = header.kv_heads;
  // INT32_MIN has no magnitude; it fails validation as "must be positive" via 0.
  config.vocab_size = header.vocab_size == std::numeric_limits<std::int32_t>::min()
                          ? 0
                          : std::abs(header.vocab_size);
  config.context_length = header.seq_len;
  config.rope_theta = llama2c::kRopeTheta;
  config.rope_layout = RopeLayout::interleaved;
  config.norm_eps = llama2c::kNormEps;
  config.tied_embeddings = header.vocab_size > 0;
  return config;
}

Model load_checkpoint(const detail::AlignedBytes& bytes, std::span<const std::byte> tokenizer_bin) {
  detail::ByteReader reader(bytes.span(), "llama2.c");
  if (bytes.size >= 4) {
    std::uint32_t first;
    std::memcpy(&first, bytes.data(), 4);
    if (first == llama2c::kExportMagic) {
      fail(
          "this is a llama2.c export of version >= 1 (magic \"ak42\"); only run.c's legacy "
          "format (version 0) is supported");
    }
  }
  llama2c::Header header;
  header.dim = reader.i32("header dim");
  header.hidden_dim = reader.i32("header hidden_dim");
  header.layers = reader.i32("header n_layers");
  header.heads = reader.i32("header n_heads");
  header.kv_heads = reader.i32("header n_kv_heads");
  header.vocab_size = reader.i32("header vocab_size");
  header.seq_len = reader.i32("header seq_len");

  Model model;
  model.format = "llama2c";
  model.config = config_from(header);
  ModelConfig& config = model.config;
  try {
    config.validate();
  } catch (const Error& error) {
    fail(error.what());
  }
  if (header.seq_len <= 0) {
    fail("seq_len must be positive, got " + std::to_string(header.seq_len));
  }
  if (header.seq_len > (1 << 24)) fail("seq_len " + std::to_string(header.seq_len) + " is absurd");
  const auto expected = static_cast<std::uint64_t>(checked_product(
      {static_cast<std::int64_t>(llama2c::expected_floats(header)), 4}, "llama2.c: weight bytes"));
  if (reader.remaining() != expected) {
    fail("size mismatch: the header describes " + std::to_string(expected + 28) +
         " bytes, the file has " + std::to_string(bytes.size));
  }
  model.storage.push_back(bytes.owner);
  model.layers.resize(static_cast<std::size_t>(config.layers));

  // Every tensor of a role is stored for all layers before the next role starts.
  const auto next_matrix = [&](TensorRole role, int layer) {
    const std::vector<std::int64_t> shape = detail::expected_shape(config, role);
    const auto span = reader.bytes(static_cast<std::uint64_t>(checked_product(
                                       {shape[0], shape[1], 4}, "llama2.c: matrix bytes")),
                                   "weights");
    detail::matrix_of(model, role, layer) =
        detail::matrix_view(model, span, DType::f32, shape[0], shape[1]);
  };
  const auto next_norm = [&](TensorRole role, int layer) {
    const auto span = reader.bytes(
        static_cast<std::uint64_t>(checked_product({config.dim, 4}, "llama2.c: norm bytes")),
        "weights");
    detail::norm_of(model, role, layer) =
        detail::to_f32(span, DType::f32, static_cast<std::size_t>(config.dim));
  };
  next_matrix(TensorRole::token_embedding, 0);
  for (const TensorRole role :
       {TensorRole::attention_norm, TensorRole::wq, TensorRole::wk, TensorRole::wv, TensorRole::wo,
        TensorRole::ffn_norm, TensorRole::w_gate, TensorRole::w_down, TensorRole::w_up}) {
    for (int layer = 0; layer < config.layers; ++layer) {
      if (detail::is_norm(role)) {
        next_norm(role, layer);
      } else {
        next_matrix(role, layer);
      }
    }
  }
  next_norm(TensorRole::final_norm, 0);
  reader.skip(static_cast<std::uint64_t>(checked_product({header.seq_len, config.head_dim(), 4},
                                                         "llama2.c: freq_cis bytes")),
              "freq_cis");
  if (config.tied_embeddings) {
    model.output = model.token_embedding;
  } else {
    next_matrix(TensorRole::output, 0);
  }

  if (tokenizer_bin.empty()) {
    model.tokenizer.kind = Tokenizer::Kind::byte_level;  // no specials: documented fallback
  } else {
    model.tokenizer = read_llama2c_tokenizer(tokenizer_bin, config.vocab_size);
  }
  detail::finish_model(model, "llama2.c");
  return model;
}

}  // namespace

namespace llama2c {

std::uint64_t expected_floats(const Header& header) {
  const std::int64_t dim = header.dim;
  const std::int64_t hidden = header.hidden_dim;
  const std::int64_t layers = header.layers;
  const std::int64_t head_dim = dim / header.heads;
  const std::int64_t vocab = std::abs(static_cast<std::int64_t>(header.vocab_size));
  const auto floats = [](std::initializer_list<std::int64_t> factors) {
    return checked_product(factors, "llama2.c: weights of the header's shape");
  };
  const std::int64_t kv_dim = floats({head_dim, header.kv_heads});
  return static_cast<std::uint64_t>(checked_sum(
      {
          floats({vocab, dim}),                              // token embedding
          floats({layers, 2, dim}),                          // rms_att, rms_ffn
          floats({layers, 2, dim, dim}),                     // wq, wo
          floats({layers, 2, kv_dim, dim}),                  // wk, wv
          floats({layers, 3, dim, hidden}),                  // w1, w2, w3
          dim,                                               // rms_final
          floats({header.seq_len, head_dim}),                // freq_cis real + imag
          header.vocab_size < 0 ? floats({vocab, dim}) : 0,  // wcls
      },
      "llama2.c: weights of the header's shape", std::numeric_limits<std::int64_t>::max()));
}

}  // namespace llama2c

Tokenizer read_llama2c_tokenizer(std::span<const std::byte> file, int vocab_size) {
  detail::ByteReader reader(file, "llama2.c tokenizer");
  const std::int32_t max_length = reader.i32("max_token_length");
  if (max_length < 0) fail("tokenizer max_token_length is negative");
  if (vocab_size <= 0 || static_cast<std::uint64_t>(vocab_size) > reader.remaining() / 8) {
    fail("tokenizer of " + std::to_string(reader.remaining()) + " bytes cannot hold " +
         std::to_string(vocab_size) + " tokens (truncated file?)");
  }
  Tokenizer tokenizer;
  tokenizer.kind = Tokenizer::Kind::sentencepiece;
  tokenizer.bos_id = llama2c::kBosId;
  tokenizer.eos_id = llama2c::kEosId;
  tokenizer.pieces.reserve(static_cast<std::size_t>(vocab_size));
  tokenizer.scores.reserve(static_cast<std::size_t>(vocab_size));
  for (int id = 0; id < vocab_size; ++id) {
    tokenizer.scores.push_back(reader.f32("token score"));
    const std::int32_t length = reader.i32("token length");
    if (length < 0) fail("token " + std::to_string(id) + " has a negative length");
    const std::string_view bytes = reader.string(static_cast<std::uint64_t>(length), "token");
    if (bytes == kBosPiece) {
      tokenizer.pieces.emplace_back("<s>");
    } else if (bytes == kEosPiece) {
      tokenizer.pieces.emplace_back("</s>");
    } else {
      tokenizer.pieces.push_back(replace_all(bytes, " ", kSpace));
    }
  }
  if (reader.remaining() != 0) {
    fail("tokenizer has " + std::to_string(reader.remaining()) + " bytes after " +
         std::to_string(vocab_size) + " tokens (vocabulary size mismatch?)");
  }
  tokenizer.types =
      detail::infer_piece_types(tokenizer.pieces, tokenizer.bos_id, tokenizer.eos_id, /*unk_id=*/0);
  return tokenizer;
}

Model load_llama2c(std::span<const std::byte> checkpoint,
                   std::span<const std::byte> tokenizer_bin) {
  return load_checkpoint(detail::copy_aligned(checkpoint), tokenizer_bin);
}

Model load_llama2c(const std::filesystem::path& path, const std::filesystem::path& tokenizer_path) {
  const detail::AlignedBytes checkpoint = detail::read_file(path, "llama2.c");
  if (tokenizer_path.empty()) return load_checkpoint(checkpoint, {});
  const detail::AlignedBytes tokenizer = detail::read_file(tokenizer_path, "llama2.c tokenizer");
  return load_checkpoint(checkpoint, tokenizer.span());
}

std::vector<std::byte> serialize_llama2c(const Model& source) {
  Model model = source;  // shallow: shares the weights; Q/K may be replaced by permuted copies
  try {
    model.config.validate();
  } catch (const Error& error) {
    fail(error.what());
  }
  const ModelConfig& config = model.config;
  if (model.layers.size() != static_cast<std::size_t>(config.layers)) {
    fail("model has " + std::to_string(model.layers.size()) + " layers, its config " +
         std::to_string(config.layers));
  }
  // run.c hard-codes these; writing anything else would silently change the model.
  if (config.rope_theta != llama2c::kRopeTheta) {
    fail("run.c fixes rope_theta at 10000, the model has " + std::to_string(config.rope_theta));
  }
  if (config.norm_eps != llama2c::kNormEps) {
    fail("run.c fixes norm_eps at 1e-5, the model has " + std::to_string(config.norm_eps));
  }
  if (config.rotary_dim != 0 && config.rotary_dim != config.head_dim()) {
    fail("run.c rotates whole heads; rotary_dim " + std::to_string(config.rotary_dim) +
         " is not supported");
  }
  if (config.context_length <= 0) fail("the checkpoint needs a positive context_length (seq_len)");
  detail::convert_rope_layout(model, RopeLayout::interleaved);

  detail::ByteWriter out;
  const std::int32_t header[] = {
      config.dim,           config.hidden_dim,
      config.layers,        config.heads,
      config.kv_heads,      config.tied_embeddings ? config.vocab_size : -config.vocab_size,
      config.context_length};
  for (const std::int32_t value : header) out.i32(value);
  const auto put_matrix = [&](TensorRole role, int layer) {
    const WeightMatrix& matrix = detail::matrix_of(model, role, layer);
    const std::vector<std::int64_t> shape = detail::expected_shape(config, role);
    if (matrix.data == nullptr || matrix.rows != shape[0] || matrix.cols != shape[1]) {
      fail("a weight matrix is missing or has the wrong shape");
    }
    out.bytes(detail::matrix_bytes_as(matrix, DType::f32));
  };
  const auto put_norm = [&](TensorRole role, int layer) {
    const std::vector<float>& norm = detail::norm_of(model, role, layer);
    if (norm.size() != static_cast<std::size_t>(config.dim)) fail("a norm has the wrong size");
    for (const float value : norm) out.f32(value);
  };
  put_matrix(TensorRole::token_embedding, 0);
  for (const TensorRole role :
       {TensorRole::attention_norm, TensorRole::wq, TensorRole::wk, TensorRole::wv, TensorRole::wo,
        TensorRole::ffn_norm, TensorRole::w_gate, TensorRole::w_down, TensorRole::w_up}) {
    for (int layer = 0; layer < config.layers; ++layer) {
      if (detail::is_norm(role)) {
        put_norm(role, layer);
      } else {
        put_matrix(role, layer);
      }
    }
  }
  put_norm(TensorRole::final_norm, 0);
  // freq_cis as older run.c versions read it: cos / sin of pos * theta^(-2i / head_dim).
  const int head_dim = config.head_dim();
  for (const bool imaginary : {false, true}) {
    for (int position = 0; position < config.context_length; ++position) {
      for (int i = 0; i < head_dim / 2; ++i) {
        const double angle = position * std::pow(llama2c::kRopeTheta, -2.0 * i / head_dim);
        out.f32(static_cast<float>(imaginary ? std::sin(angle) : std::cos(angle)));
      }
    }
  }
  if (!config.tied_embeddings) put_matrix(TensorRole::output, 0);
  return std::move(out.buffer());
}

void write_llama2c(const Model& model, const std::filesystem::path& path) {
  detail::write_file(path, serialize_llama2c(model), "llama2.c");
}

std::vector<std::byte> serialize_llama2c_tokenizer(const Tokenizer& tokenizer) {
  if (tokenizer.kind != Tokenizer::Kind::sentencepiece) {
    fail("tokenizer.bin holds SentencePiece vocabularies; this tokenizer is byte-level");
  }
  std::vector<std::string> pieces;
  std::size_t max_length = 0;
  for (std::size_t id = 0; id < tokenizer.pieces.size(); ++id) {
    const auto token = static_cast<std::int32_t>(id);
    std::string piece = token == tokenizer.bos_id ? std::string(kBosPiece)
                        : token == tokenizer.eos_id
                            ? std::string(kEosPiece)
                            : replace_all(tokenizer.pieces[id], kSpace, " ");
    max_length = std::max(max_length, piece.size());
    pieces.push_back(std::move(piece));
  }
  detail::ByteWriter out;
  out.i32(static_cast<std::int32_t>(max_length));
  for (std::size_t id = 0; id < pieces.size(); ++id) {
    out.f32(id < tokenizer.scores.size() ? tokenizer.scores[id] : 0.0f);
    out.i32(static_cast<std::int32_t>(pieces[id].size()));
    out.string(pieces[id]);
  }
  return std::move(out.buffer());
}

void write_llama2c_tokenizer(const Tokenizer& tokenizer, const std::filesystem::path& path) {
  detail::write_file(path, serialize_llama2c_tokenizer(tokenizer), "llama2.c");
}

}  // namespace kvevict::model
