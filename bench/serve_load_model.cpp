// serve_load_model: writes the GGUF bench/serve_load runs both servers on (docs/serving.md,
// "Load"): a random-weight Llama (kvevict::model::make_random_model) with a byte-fallback
// SentencePiece vocabulary of 259 pieces, <unk> <s> </s> then <0x00>..<0xFF> (the first 259 of
// Llama 2's), which llama.cpp's tokenizer and kvevict's both read. kvevict's own byte-level
// vocabulary is one llama.cpp (and so llama-server) does not know.
//
//     serve_load_model OUT.gguf [dim layers heads kv_heads hidden context]
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <kvevict/model/random_model.hpp>
#include <string>

#include "model/model_io.hpp"

int main(int argc, char** argv) {
  if (argc != 2 && argc != 8) {
    std::fprintf(stderr, "usage: %s OUT.gguf [dim layers heads kv_heads hidden context]\n",
                 argv[0]);
    return 2;
  }
  try {
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
    kvevict::model::Tokenizer& tokenizer = model.tokenizer;
    tokenizer = {};
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
    kvevict::model::write_gguf(model, argv[1]);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "serve_load_model: %s\n", error.what());
    return 1;
  }
  return 0;
}
