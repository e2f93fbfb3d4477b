// serve_load_model: writes the GGUF bench/serve_load runs both servers on (docs/serving.md,
// "Load") with a byte-fallback SentencePiece vocabulary of 259 pieces, <unk> <s> </s> then
// <0x00>..<0xFF> (the first 259 of Llama 2's), which llama.cpp's tokenizer and kvevict's both
// read: kvevict's own byte-level vocabulary is one llama.cpp (and so llama-server) does not know.
//
//     serve_load_model OUT.gguf --from MODEL   a kvevict byte-level model (models/toy-base), its
//                                              embedding and output rows moved to those ids (byte
//                                              b to 3 + b, BOS to 1, EOS to 2, <AC> to 0): the
//                                              same model, text as it writes it
//     serve_load_model OUT.gguf [dim layers heads kv_heads hidden context]   random weights
//
// llama-server parses what a model writes, and refuses (500) the invalid UTF-8 a random model
// writes: the comparison runs a trained model.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <kvevict/error.hpp>
#include <kvevict/model/random_model.hpp>
#include <memory>
#include <string>
#include <vector>

#include "model/model_io.hpp"

namespace {

kvevict::model::Tokenizer spm_byte_tokenizer() {
  kvevict::model::Tokenizer tokenizer;
  tokenizer.kind = kvevict::model::Tokenizer::Kind::sentencepiece;
  tokenizer.vocab_size = 259;
  tokenizer.bos_id = 1;
  tokenizer.eos_id = 2;
  tokenizer.pieces = {"<unk>", "<s>", "</s>"};
  tokenizer.types = {2, 3, 3};  // unknown, control, control
  for (int byte = 0; byte < 256; ++byte) {
    char piece[8];
    std::snprintf(piece, sizeof piece, "<0x%02X>", byte);
    tokenizer.pieces.emplace_back(piece);
    tokenizer.types.push_back(6);  // byte
  }
  tokenizer.scores.assign(tokenizer.pieces.size(), 0.0f);
  return tokenizer;
}

// `matrix` with its rows in the SentencePiece layout: row 3 + b is byte b's, rows 0, 1, 2 are
// <AC>'s, BOS's and EOS's (ids 258, 256, 257 of kvevict's byte-level vocabulary).
kvevict::model::WeightMatrix to_spm_rows(const kvevict::model::WeightMatrix& matrix,
                                         kvevict::model::Model& model) {
  const std::size_t row = matrix.row_bytes();
  auto bytes = std::make_shared<std::vector<std::byte>>(matrix.bytes());
  const auto source = [&](std::int64_t id) -> std::int64_t {
    if (id == 0) return 258;
    if (id == 1) return 256;
    if (id == 2) return 257;
    return id - 3;
  };
  for (std::int64_t id = 0; id < matrix.rows; ++id) {
    std::memcpy(bytes->data() + static_cast<std::size_t>(id) * row,
                matrix.data + static_cast<std::size_t>(source(id)) * row, row);
  }
  kvevict::model::WeightMatrix moved = matrix;
  moved.data = bytes->data();
  model.storage.push_back(bytes);
  return moved;
}

}  // namespace

int main(int argc, char** argv) {
  const bool from = argc == 4 && std::strcmp(argv[2], "--from") == 0;
  if (argc != 2 && argc != 8 && !from) {
    std::fprintf(stderr,
                 "usage: %s OUT.gguf [--from MODEL | dim layers heads kv_heads hidden context]\n",
                 argv[0]);
    return 2;
  }
  try {
    if (from) {
      kvevict::model::Model model = kvevict::model::load_model(argv[3]);
      if (model.tokenizer.kind != kvevict::model::Tokenizer::Kind::byte_level ||
          model.config.vocab_size != 259) {
        throw kvevict::Error("--from: a kvevict byte-level model of 259 tokens is needed");
      }
      const bool tied = model.output.data == model.token_embedding.data;
      model.token_embedding = to_spm_rows(model.token_embedding, model);
      model.output = tied ? model.token_embedding : to_spm_rows(model.output, model);
      model.tokenizer = spm_byte_tokenizer();
      // llama-server caps a slot's context at the trained one (toy-base: 256): recorded as 4096,
      // both servers give a slot what --ctx-size / --parallel says.
      model.config.context_length = 4096;
      kvevict::model::write_gguf(model, argv[1]);
      return 0;
    }
    kvevict::model::ModelConfig config;
    config.dim = 256;
    config.layers = 4;
    config.heads = 8;
    config.kv_heads = 2;
    config.hidden_dim = 688;
    config.context_length = 4096;
    if (argc == 8) {
      config.dim = std::atoi(argv[2]);
      config.layers = std::atoi(argv[3]);
      config.heads = std::atoi(argv[4]);
      config.kv_heads = std::atoi(argv[5]);
      config.hidden_dim = std::atoi(argv[6]);
      config.context_length = std::atoi(argv[7]);
    }
    config.vocab_size = 259;
    kvevict::model::Model model = kvevict::model::make_random_model(config, 1);
    model.tokenizer = spm_byte_tokenizer();
    kvevict::model::write_gguf(model, argv[1]);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "serve_load_model: %s\n", error.what());
    return 1;
  }
  return 0;
}
