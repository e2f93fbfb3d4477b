// Several conversations decoded together in one llama.cpp context, each under its own kvevict
// policy, all in one KV pool smaller than their full lengths (kvevict::llama's LlamaSequenceSet;
// docs/engines.md, "Many sequences in one context").
//
//     llama_conversations MODEL.gguf [steps]
//
// Four conversations open one after another; each is fed a prompt, then generates greedily, one
// token per step, every open conversation in the same llama_decode; the second leaves half way
// and a fifth takes its place. The pool holds two conversations at full length: when it is full,
// the conversations over their fair share are cut, each by its own policy. Token ids are fed as
// they are (no tokenizer: an engine tokenizes with its own), so any GGUF of a Llama-like model
// runs.
#include <llama.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <kvevict/llama/llama_sequence_set.hpp>
#include <kvevict/policy_registry.hpp>
#include <span>
#include <string>
#include <vector>

namespace {

void quiet(ggml_log_level level, const char* text, void* /*user*/) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// A conversation: its sequence id in the set, the tokens of its next step, what it has fed.
struct Conversation {
  const char* policy;
  int id = -1;
  std::vector<std::int32_t> next;
  int fed = 0;
};

std::int32_t greedy(std::span<const float> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

int run(const char* path, int steps) {
  llama_model_params model_params = llama_model_default_params();
  // The example feeds token ids itself: no tokenizer needed, whatever the file carries.
  llama_model_kv_override overrides[2]{};
  overrides[0].tag = LLAMA_KV_OVERRIDE_TYPE_STR;
  std::snprintf(overrides[0].key, sizeof overrides[0].key, "%s", "tokenizer.ggml.model");
  std::snprintf(overrides[0].val_str, sizeof overrides[0].val_str, "%s", "none");
  model_params.kv_overrides = overrides;
  llama_model* model = llama_model_load_from_file(path, model_params);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", path);
    return 1;
  }
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  constexpr int kBudget = 64;  // tokens each conversation keeps at most
  constexpr int kChunk = 16;   // most tokens a conversation is fed in one step
  llama_context_params params = llama_context_default_params();
  params.n_ctx = 512;
  params.n_threads = 1;
  params.n_threads_batch = 1;
  kvevict::llama::LlamaSequenceSetOptions options;
  options.max_sequences = 4;
  options.max_chunk = kChunk;
  options.pool_cells = 2 * (kBudget + kChunk);  // two conversations at full length
  int status = 0;
  try {
    kvevict::llama::LlamaSequenceSet set(model, params, options);
    std::vector<Conversation> conversations;
    for (const char* policy : {"h2o", "streaming_llm", "tova", "window", "streaming_llm"}) {
      conversations.push_back({policy, -1, {}, 0});
    }
    const auto open = [&](Conversation& c, int index) {
      kvevict::llama::LlamaSequenceOptions sequence;
      sequence.max_chunk = kChunk;
      // TOVA may drop the newest token: llama.cpp needs positions that continue from the last.
      if (std::string(c.policy) == "tova")
        sequence.position_mode = kvevict::PositionMode::cache_index;
      c.id = set.open(kvevict::make_policy(c.policy, kvevict::budget_params(c.policy, kBudget)),
                      sequence);
      for (int i = 0; i < kChunk; ++i) c.next.push_back((index * 31 + i * 7 + 1) % vocab);
    };
    std::vector<kvevict::llama::LlamaFeed> feeds;
    for (int step = 0; step < steps; ++step) {
      // Conversations 0-3 open at steps 0, 4, 8, 12; conversation 1 leaves at steps / 2 and
      // conversation 4 takes its id.
      for (int i = 0; i < 4; ++i) {
        if (step == 4 * i) open(conversations[static_cast<std::size_t>(i)], i);
      }
      if (step == steps / 2) {
        set.close(conversations[1].id);
        conversations[1].id = -1;
        open(conversations[4], 4);
      }
      feeds.clear();
      for (Conversation& c : conversations) {
        if (c.id >= 0) feeds.push_back({c.id, c.next});
      }
      set.step(feeds);
      for (Conversation& c : conversations) {
        if (c.id < 0) continue;
        if (const auto& failure = set.failed(c.id)) {
          std::fprintf(stderr, "conversation %d failed: %s\n", c.id, failure->c_str());
          return 1;
        }
        c.fed += static_cast<int>(c.next.size());
        c.next.assign(1, greedy(set.logits(c.id).last()));  // generate one token
      }
    }
    std::printf("after %d steps (pool %lld cells):\n", steps,
                static_cast<long long>(options.pool_cells));
    for (const Conversation& c : conversations) {
      if (c.id < 0) continue;
      std::printf("  sequence %d %-13s fed %4d tokens, holds %3d cells\n", c.id, c.policy, c.fed,
                  set.live_cells(c.id));
    }
    const kvevict::PoolStats& pool = set.pool()->stats();
    std::printf("pool: at most %lld cells held plus fed in a step, %lld steps pressed, %lld cuts\n",
                static_cast<long long>(pool.peak_cells), static_cast<long long>(pool.pressed_steps),
                static_cast<long long>(pool.cuts));
    if (pool.peak_cells > options.pool_cells) status = 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "llama_conversations: %s\n", error.what());
    status = 1;
  }
  llama_model_free(model);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [steps]\n", argv[0]);
    return 2;
  }
  llama_log_set(&quiet, nullptr);
  llama_backend_init();
  const int status = run(argv[1], argc > 2 ? std::atoi(argv[2]) : 96);
  llama_backend_free();
  return status;
}
