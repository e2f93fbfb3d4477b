// kvevict over llama.cpp (src/llama) against kvevict's reference decoder, on GGUFs written by
// kvevict: a random-weight model and toy-base converted. Both engines stream the same tokens in
// the same chunks under the same policy at token granularity; after every chunk both must keep
// exactly the same tokens, and the stream's bits per byte must agree within 1e-4 relative (the two
// engines compute the same f32 model, f32 K/V cells included, with different kernels).
#include <gguf.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <llama.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <kvevict/detail/half.hpp>
#include <kvevict/error.hpp>
#include <kvevict/llama/llama_sequence.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/decoder_batch.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policies/infinipot.hpp>
#include <kvevict/policy_registry.hpp>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "harness/log_loss.hpp"
#include "harness/text_pieces.hpp"
#include "llama/attention_kernels.hpp"
#include "llama/cli/llama_model.hpp"
#include "model/model_io.hpp"

namespace {

namespace fs = std::filesystem;
using kvevict::Granularity;
using kvevict::PositionMode;

void quiet(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

struct ModelFile {
  kvevict::model::Model model;  // as kvevict reads it back from the GGUF
  fs::path path;
  llama_model* llama = nullptr;
};

// Writes `model` as GGUF with kvevict's writer and loads it in both engines (llama.cpp: the
// byte-level vocabulary overridden to "none", as kvevict-llama does).
std::unique_ptr<ModelFile> make_file(const kvevict::model::Model& model, const std::string& name) {
  auto file = std::make_unique<ModelFile>();
  // One file per process: ctest runs each test in its own process, several at once.
  file->path = fs::temp_directory_path() /
               ("kvevict_test_llama_" + name + "_" + std::to_string(getpid()) + ".gguf");
  kvevict::model::write_gguf(model, file->path);
  file->model = kvevict::model::load_model(file->path);
  llama_model_kv_override overrides[2]{};
  overrides[0].tag = LLAMA_KV_OVERRIDE_TYPE_STR;
  std::snprintf(overrides[0].key, sizeof overrides[0].key, "%s", "tokenizer.ggml.model");
  std::snprintf(overrides[0].val_str, sizeof overrides[0].val_str, "%s", "none");
  llama_model_params params = llama_model_default_params();
  params.kv_overrides = overrides;
  file->llama = llama_model_load_from_file(file->path.string().c_str(), params);
  return file;
}

class LlamaModels : public ::testing::Environment {
 public:
  void SetUp() override {
    llama_log_set(&quiet, nullptr);
    llama_backend_init();
    kvevict::model::ModelConfig config;
    config.dim = 64;
    config.hidden_dim = 160;
    config.layers = 2;
    config.heads = 4;
    config.kv_heads = 2;
    config.vocab_size = 259;
    config.context_length = 256;
    random = make_file(kvevict::model::make_random_model(config, 11), "random");
    config.layers = 1;
    one_layer = make_file(kvevict::model::make_random_model(config, 12), "one_layer");
    config.dim = 128;  // head_dim 32: a Q8_0 / Q4_0 block
    wide_heads = make_file(kvevict::model::make_random_model(config, 13), "wide_heads");
    toy = make_file(kvevict::model::load_model(fs::path(KVEVICT_SOURCE_DIR) / "models/toy-base"),
                    "toy_base");
  }
  void TearDown() override {
    for (const auto* file : {random.get(), one_layer.get(), wide_heads.get(), toy.get()}) {
      if (file == nullptr) continue;
      llama_model_free(file->llama);
      std::error_code ignored;
      fs::remove(file->path, ignored);
    }
  }
  static inline std::unique_ptr<ModelFile> random;
  static inline std::unique_ptr<ModelFile> one_layer;   // random weights, one layer
  static inline std::unique_ptr<ModelFile> wide_heads;  // ... with head_dim 32
  static inline std::unique_ptr<ModelFile> toy;
};

const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new LlamaModels);

// The first `count` bytes of the held-out KJV text, BOS first (the byte-level tokenizer).
std::vector<std::int32_t> stream_tokens(const kvevict::model::Model& model, std::size_t count) {
  std::ifstream in(fs::path(KVEVICT_SOURCE_DIR) / "data/kjv-heldout.txt", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  text.resize(std::min(text.size(), count - 1));
  return model.tokenizer.encode(text, /*add_bos=*/true);
}

struct Case {
  std::string policy;
  std::optional<int> budget = std::nullopt;
  std::optional<PositionMode> positions = std::nullopt;
  std::size_t tokens = 1500;
  int chunk = 16;
  int turn_every = 0;  // > 0: a turn starts every this many tokens (SirLLM)
  int n_ctx = 512;
  bool catalyst = false;  // InfiniPot: the paper's general catalyst prompt (CaP-G)
  Granularity granularity = Granularity::token;
  kvevict::SlotReuse slot_reuse = kvevict::SlotReuse::lowest_first;
};

std::string describe(const Case& c) {
  std::string text = c.policy;
  if (c.budget) text += " budget " + std::to_string(*c.budget);
  if (c.positions) text += " positions " + std::string(kvevict::to_string(*c.positions));
  text += " granularity " + kvevict::to_string(c.granularity);
  return text + " chunk " + std::to_string(c.chunk);
}

std::unique_ptr<kvevict::Policy> make(const Case& c) {
  return kvevict::make_policy(
      c.policy, c.budget ? kvevict::budget_params(c.policy, *c.budget) : kvevict::PolicyParams{});
}

bool reads_attention(const Case& c) {
  const kvevict::SignalSet signals = make(c)->signals();
  return signals.contains(kvevict::Signal::attention_rows) ||
         signals.contains(kvevict::Signal::last_attention_row) ||
         signals.contains(kvevict::Signal::catalyst_attention);
}

// Original positions the sequence keeps, oldest first.
std::vector<std::int64_t> kept(const kvevict::Sequence& sequence) {
  std::vector<std::int64_t> positions;
  for (const std::int32_t slot : sequence.slots().stream_order(0)) {
    positions.push_back(sequence.slots().original_positions(0)[static_cast<std::size_t>(slot)]);
  }
  return positions;
}

// Streams the case through both engines in lockstep; checks the keep-sets after every chunk and
// the bits per byte at the end. Returns the number of chunks after which something was evicted.
int expect_same(const ModelFile& file, const Case& c) {
  SCOPED_TRACE(describe(c) + " on " + file.path.filename().string());
  const std::vector<std::int32_t> tokens = stream_tokens(file.model, c.tokens);
  const std::vector<std::uint32_t> bytes =
      kvevict::harness::token_byte_counts(file.model.tokenizer, file.model.config.vocab_size);

  kvevict::model::DecoderOptions options;
  options.position_mode = c.positions;
  options.granularity = c.granularity;
  options.max_chunk = c.chunk;
  kvevict::model::Decoder decoder(file.model, make(c), options);
  std::optional<std::vector<std::int32_t>> catalyst;
  if (c.catalyst) {
    // No BOS: the catalyst continues the context (as kvevict's CLI encodes it).
    catalyst = file.model.tokenizer.encode(kvevict::kInfiniPotGeneralCatalystPrompt, false);
    decoder.set_catalyst(*catalyst);
  }
  kvevict::harness::StreamScorer reference(decoder, 1 << 30, bytes, -1);

  llama_context_params params = llama_context_default_params();
  params.n_ctx = static_cast<std::uint32_t>(c.n_ctx);
  params.n_threads = 1;
  params.n_threads_batch = 1;
  // f32 cells, as the reference decoder's: llama.cpp's default f16 K/V alone moves bits/byte by
  // about 1e-4 relative on 1,000 tokens of full attention.
  params.type_k = GGML_TYPE_F32;
  params.type_v = GGML_TYPE_F32;
  // The softmax path for policies that read attention: flash attention rounds f32 cells to f16
  // for its kernel (LlamaFlashAttention below compares it with this path).
  // K-norm and KeyDiff likewise: flash attention's f16 rounding moves the keys of layer 1 on by
  // ~1e-4, enough to swap two nearly equal scores.
  if (reads_attention(c) || make(c)->signals().contains(kvevict::Signal::keys)) {
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  }
  kvevict::llama::LlamaSequenceOptions llama_options;
  llama_options.position_mode = c.positions;
  llama_options.granularity = c.granularity;
  llama_options.max_chunk = c.chunk;
  llama_options.catalyst = catalyst;
  llama_options.slot_reuse = c.slot_reuse;
  kvevict::llama::LlamaSequence llama(file.llama, params, make(c), llama_options);
  kvevict::harness::StreamScorer engine(
      [&llama](std::span<const std::int32_t> chunk, bool turn_start) {
        return llama.feed(chunk, turn_start, /*all_logits=*/true).values;
      },
      llama.vocab(), 1 << 30, bytes, -1);

  int evicting_chunks = 0;
  std::int64_t evicted_before = 0;
  for (std::size_t offset = 0; offset < tokens.size();
       offset += static_cast<std::size_t>(c.chunk)) {
    const std::span<const std::int32_t> chunk = std::span<const std::int32_t>(tokens).subspan(
        offset, std::min<std::size_t>(static_cast<std::size_t>(c.chunk), tokens.size() - offset));
    const bool turn = c.turn_every > 0 && offset % static_cast<std::size_t>(c.turn_every) == 0;
    reference.feed(chunk, turn);
    engine.feed(chunk, turn);
    const std::vector<std::int64_t> expected = kept(decoder.cache().sequence());
    const std::vector<std::int64_t> actual = kept(llama.sequence());
    if (expected != actual) {
      ADD_FAILURE() << "the keep-sets differ after the chunk at token " << offset << ": reference "
                    << expected.size() << " tokens, llama.cpp " << actual.size();
      return evicting_chunks;
    }
    const std::int64_t evicted = llama.sequence().stats().evicted_slots;
    if (evicted > evicted_before) ++evicting_chunks;
    evicted_before = evicted;
    // llama.cpp's cells hold the kept tokens at kvevict's positions.
    llama_memory_t memory = llama_get_memory(llama.context());
    const kvevict::Sequence& sequence = llama.sequence();
    const std::span<const std::int32_t> order = sequence.slots().stream_order(0);
    if (!order.empty()) {
      EXPECT_EQ(llama_memory_seq_pos_min(memory, 0), sequence.position(0, 0, order.front()));
      EXPECT_EQ(llama_memory_seq_pos_max(memory, 0), sequence.position(0, 0, order.back()));
    }
  }
  // Slots taken lowest first are llama.cpp's cells (it scans from the lowest freed cell), so the
  // softmax rows go to the policy as computed; kvevict's own stack order parts from llama.cpp's as
  // soon as one chunk fills several freed cells, and the rows are re-indexed.
  if (c.slot_reuse == kvevict::SlotReuse::lowest_first) {
    EXPECT_EQ(llama.stats().reindexed_layers, 0);
  } else if (llama.reads_attention()) {
    EXPECT_GT(llama.stats().reindexed_layers, 0);
  }
  // InfiniPot: llama.cpp decoded the catalyst at every distillation the reference ran.
  EXPECT_EQ(llama.stats().catalyst_runs, decoder.stats().catalyst_runs);
  if (c.catalyst) {
    EXPECT_GT(llama.stats().catalyst_runs, 0);
  }
  const double expected_bpb = reference.loss().overall().bits_per_byte();
  const double actual_bpb = engine.loss().overall().bits_per_byte();
  EXPECT_NEAR(actual_bpb, expected_bpb, 1e-4 * expected_bpb)
      << "bits/byte: reference " << expected_bpb << ", llama.cpp " << actual_bpb;
  return evicting_chunks;
}

const std::vector<PositionMode> kModes = {PositionMode::original, PositionMode::cache_index,
                                          PositionMode::reset_on_compact};

// Full attention: toy-base over 1,000 positions, the random model over 500. Beyond that the random
// model's bits/byte drift past 1e-4 (1.25e-4 at 1,000 tokens; 250 and 500 agree): ggml's CPU RoPE
// forms its angles in float by repeated multiplication (theta *= theta_scale, ggml-cpu/ops.cpp),
// kvevict in double, so they part more as positions grow, and the random model's flat attention
// passes that on to every logit. Under the rank modes positions stay below the budget + a chunk.
TEST(LlamaEquivalence, FullAttentionGivesTheSameBitsPerByte) {
  ASSERT_NE(LlamaModels::random->llama, nullptr);
  ASSERT_NE(LlamaModels::toy->llama, nullptr);
  EXPECT_EQ(expect_same(*LlamaModels::random, Case{.policy = "full", .tokens = 500, .n_ctx = 512}),
            0);
  EXPECT_EQ(expect_same(*LlamaModels::toy, Case{.policy = "full", .tokens = 1000, .n_ctx = 1024}),
            0);
}

TEST(LlamaEquivalence, WindowAndStreamingLlmInEveryPositionMode) {
  for (const ModelFile* file : {LlamaModels::random.get(), LlamaModels::toy.get()}) {
    for (const char* policy : {"window", "streaming_llm"}) {
      for (const PositionMode mode : kModes) {
        EXPECT_GT(expect_same(*file, Case{.policy = policy, .budget = 64, .positions = mode}), 50);
      }
    }
  }
}

TEST(LlamaEquivalence, H2oTovaKeepTheSameTokensOverALongStream) {
  for (const ModelFile* file : {LlamaModels::random.get(), LlamaModels::toy.get()}) {
    EXPECT_GT(expect_same(*file, Case{.policy = "h2o", .budget = 64, .tokens = 4000}), 200);
    EXPECT_GT(expect_same(*file, Case{.policy = "h2o",
                                      .budget = 64,
                                      .positions = PositionMode::cache_index,
                                      .tokens = 4000}),
              200);
    EXPECT_GT(expect_same(*file, Case{.policy = "tova",
                                      .budget = 64,
                                      .positions = PositionMode::cache_index,
                                      .tokens = 4000}),
              200);
  }
}

// K-norm and KeyDiff read the keys llama.cpp stores (cache_k_l<layer>'s set_rows). Both drop the
// token just fed when its score is the worst, which llama.cpp allows only under re-numbered
// positions (as TOVA above); each policy scores the key as written, at the position it was written
// to, in both engines.
TEST(LlamaEquivalence, KnormKeydiffReadTheStoredKeys) {
  for (const ModelFile* file : {LlamaModels::random.get(), LlamaModels::toy.get()}) {
    for (const char* policy : {"knorm", "keydiff"}) {
      EXPECT_GT(expect_same(*file, Case{.policy = policy,
                                        .budget = 64,
                                        .positions = PositionMode::cache_index,
                                        .tokens = 2000}),
                100);
    }
  }
}

// The re-indexing path: with kvevict's stack order of free slots, slot i is no longer cell i
// after the first chunk that refills several freed cells.
TEST(LlamaEquivalence, SlotsOtherThanCellsAreReindexed) {
  const auto reuse = kvevict::SlotReuse::newest_freed_first;
  EXPECT_GT(expect_same(*LlamaModels::toy,
                        Case{.policy = "h2o", .budget = 64, .tokens = 2000, .slot_reuse = reuse}),
            100);
  EXPECT_GT(expect_same(*LlamaModels::toy, Case{.policy = "tova",
                                                .budget = 64,
                                                .positions = PositionMode::cache_index,
                                                .tokens = 2000,
                                                .slot_reuse = reuse}),
            100);
}

// Blocks of 16 (paged engines): whole blocks leave, and llama.cpp's cells follow. 1,500 tokens are
// 94 chunks of 16 (the last of 12); the first four fill the budget of 64, and every later chunk
// takes the unit past it by one block at most, so each of the other 90 evicts exactly one block
// (StreamingLLM's sinks keep block 0, and the oldest of the others goes).
TEST(LlamaEquivalence, BlockGranularityKeepsTheSameBlocks) {
  const Granularity blocks = Granularity::blocks(16);
  for (const ModelFile* file : {LlamaModels::random.get(), LlamaModels::toy.get()}) {
    for (const char* policy : {"window", "streaming_llm"}) {
      for (const PositionMode mode : {PositionMode::original, PositionMode::cache_index}) {
        EXPECT_EQ(
            expect_same(
                *file,
                Case{.policy = policy, .budget = 64, .positions = mode, .granularity = blocks}),
            90);
      }
    }
    EXPECT_GT(
        expect_same(*file,
                    Case{.policy = "h2o", .budget = 64, .tokens = 2000, .granularity = blocks}),
        50);
    EXPECT_GT(expect_same(*file, Case{.policy = "tova",
                                      .budget = 64,
                                      .positions = PositionMode::cache_index,
                                      .tokens = 2000,
                                      .granularity = blocks}),
              50);
  }
}

// SirLLM on toy-base. On the random model the keep-sets part after 2,816 tokens (not diagnosed
// further): its predictions are nearly uniform, so the token entropies SirLLM ranks are nearly
// tied and the two engines' rounding can reorder them.
TEST(LlamaEquivalence, SirllmKeepsTheSameTokensOverALongStream) {
  EXPECT_GT(expect_same(*LlamaModels::toy,
                        Case{.policy = "sirllm", .budget = 64, .tokens = 4000, .turn_every = 128}),
            20);
}

// InfiniPot: every full pot (64 slots) decodes the paper's general catalyst prompt after it in
// llama.cpp's sequence, reads its attention from the graph, and removes its cells with the
// distillation to 32 (16 by surprisal, 16 by catalyst attention). Both engines must distil to the
// same tokens every time, under CR-RoPE (reset_on_compact, the paper's) and cache_index.
TEST(LlamaEquivalence, InfinipotDistilsToTheSameTokens) {
  for (const ModelFile* file : {LlamaModels::random.get(), LlamaModels::toy.get()}) {
    for (const PositionMode mode : {PositionMode::reset_on_compact, PositionMode::cache_index}) {
      EXPECT_GT(expect_same(*file, Case{.policy = "infinipot",
                                        .budget = 64,
                                        .positions = mode,
                                        .tokens = 2000,
                                        .catalyst = true}),
                50);
    }
  }
}

TEST(LlamaEquivalence, TokenByTokenDecodeKeepsTheSameTokens) {
  const ModelFile& file = *LlamaModels::toy;
  EXPECT_GT(expect_same(file, Case{.policy = "h2o", .budget = 32, .tokens = 600, .chunk = 1}), 500);
  EXPECT_GT(expect_same(file, Case{.policy = "tova",
                                   .budget = 32,
                                   .positions = PositionMode::cache_index,
                                   .tokens = 600,
                                   .chunk = 1}),
            500);
}

// --- flash attention -----------------------------------------------------------------------
//
// With flash attention on, kvevict computes the rows a policy reads from each layer's
// flash-attention node (q, K cells, mask); off, it reads llama.cpp's softmax. Both sequences
// stream the same tokens in lockstep; after every chunk they must keep the same tokens, except
// where the two computations round a near-tie differently.
//
// The tolerance, derived: a score is a sum of softmax probabilities, each exp(scale * q.k + mask
// - max) / sum. Both paths form q.k from the same products over the same K cells (f16: q rounded
// to f16 first, as ggml's matrix product does; f16 x f16 products are exact in float), and differ
// in summation order and in the exp kernel (ggml's vectorised expf vs std::exp), a few float ulps:
// |d logit| <= ~1e-6 for the logits here (|scale * q.k| < 30), so a probability, and any sum of
// them, moves by a relative ~1e-6, as long as q is the same in both runs. It is with one layer
// (layer 0's q and K depend only on the tokens and positions, not on an attention output) and f16
// cells (the same K in both kernels): there the keep-sets must be identical and the scores agree
// within 1e-5 relative. With more layers, flash attention's output differs from the softmax path's
// (it rounds K and V to f16 for its kernel when the cells are f32, and accumulates V in f16: a
// relative ~2^-11 = 4.9e-4 per layer), which moves the next layer's q and so its logits by up to
// |logit| x ~1e-3; over the 3 later layers of toy-base a score moves by a relative few 1e-3.
// Keep-sets may then part only where the scores the two runs ranked differently lie within
// kNearTie (2e-2, several times that) relative of each other; the runs' caches differ from that
// point, so the comparison of keep-sets stops there. Bits per byte within 1e-3 relative throughout
// (flash attention's f16 rounding alone moves them by ~1e-4 here).
constexpr double kSameInputs = 1e-5;
constexpr double kNearTie = 2e-2;

struct FlashOutcome {
  int checked_chunks = 0;     // chunks whose keep-sets were compared (identical)
  int evicting_chunks = 0;    // ... of which the policy evicted in
  bool parted = false;        // the keep-sets parted at a near-tie (then no longer compared)
  double max_score_diff = 0;  // largest relative score difference over the compared chunks
  std::int64_t flash_layers = 0;
};

// Score column of the policy's ranking: H2O's and TOVA's column 0, InfiniPot's CaP (1).
int score_column(const std::string& policy) { return policy == "infinipot" ? 1 : 0; }

// `cells`: the K cells' type, and the V cells' unless `value_cells` is given (llama.cpp needs
// flash attention for quantized V cells, so K cells of a quantized type are compared over f16 V).
FlashOutcome compare_flash(const ModelFile& file, const Case& c, ggml_type cells,
                           std::optional<ggml_type> value_cells = std::nullopt) {
  SCOPED_TRACE(describe(c) + " flash attention on vs off, " + ggml_type_name(cells) +
               " cells, on " + file.path.filename().string());
  const std::vector<std::int32_t> tokens = stream_tokens(file.model, c.tokens);
  const std::vector<std::uint32_t> bytes =
      kvevict::harness::token_byte_counts(file.model.tokenizer, file.model.config.vocab_size);
  std::optional<std::vector<std::int32_t>> catalyst;
  if (c.catalyst) {
    catalyst = file.model.tokenizer.encode(kvevict::kInfiniPotGeneralCatalystPrompt, false);
  }
  const auto open_run = [&](llama_flash_attn_type flash) {
    llama_context_params params = llama_context_default_params();
    params.n_ctx = static_cast<std::uint32_t>(c.n_ctx);
    params.n_threads = 1;
    params.n_threads_batch = 1;
    params.type_k = cells;
    params.type_v = value_cells.value_or(cells);
    params.flash_attn_type = flash;
    kvevict::llama::LlamaSequenceOptions options;
    options.position_mode = c.positions;
    options.granularity = c.granularity;
    options.max_chunk = c.chunk;
    options.catalyst = catalyst;
    return std::make_unique<kvevict::llama::LlamaSequence>(file.llama, params, make(c), options);
  };
  const auto on = open_run(LLAMA_FLASH_ATTN_TYPE_ENABLED);
  const auto off = open_run(LLAMA_FLASH_ATTN_TYPE_DISABLED);
  const auto scorer = [&bytes](kvevict::llama::LlamaSequence& sequence) {
    return kvevict::harness::StreamScorer(
        [&sequence](std::span<const std::int32_t> chunk, bool turn_start) {
          return sequence.feed(chunk, turn_start, /*all_logits=*/true).values;
        },
        sequence.vocab(), 1 << 30, bytes, -1);
  };
  kvevict::harness::StreamScorer on_scorer = scorer(*on);
  kvevict::harness::StreamScorer off_scorer = scorer(*off);
  const int column = score_column(c.policy);
  // Score of every kept token by original position.
  const auto scores = [column](const kvevict::Sequence& sequence) {
    std::map<std::int64_t, float> by_position;
    const kvevict::SlotTable& slots = sequence.slots();
    for (const std::int32_t slot : slots.stream_order(0)) {
      const auto s = static_cast<std::size_t>(slot);
      by_position[slots.original_positions(0)[s]] = slots.scores(0, column)[s];
    }
    return by_position;
  };

  FlashOutcome outcome;
  std::int64_t evicted_before = 0;
  for (std::size_t offset = 0; offset < tokens.size();
       offset += static_cast<std::size_t>(c.chunk)) {
    const std::span<const std::int32_t> chunk = std::span<const std::int32_t>(tokens).subspan(
        offset, std::min<std::size_t>(static_cast<std::size_t>(c.chunk), tokens.size() - offset));
    on_scorer.feed(chunk, false);
    off_scorer.feed(chunk, false);
    if (outcome.parted) continue;
    const std::map<std::int64_t, float> on_scores = scores(on->sequence());
    const std::map<std::int64_t, float> off_scores = scores(off->sequence());
    if (kept(on->sequence()) == kept(off->sequence())) {
      ++outcome.checked_chunks;
      const std::int64_t evicted = on->sequence().stats().evicted_slots;
      if (evicted > evicted_before) ++outcome.evicting_chunks;
      evicted_before = evicted;
      float largest = 0.0f;
      for (const auto& [position, score] : off_scores) largest = std::max(largest, std::abs(score));
      for (const auto& [position, score] : off_scores) {
        outcome.max_score_diff =
            std::max(outcome.max_score_diff,
                     std::abs(static_cast<double>(on_scores.at(position)) - score) / largest);
      }
      continue;
    }
    if (c.policy == "infinipot") {
      outcome.parted = true;  // judged by the caller
      continue;
    }
    // Parted: the tokens one run kept and the other evicted must have been a near-tie, their
    // scores (each in the run that kept it) within kNearTie of each other, relative to the
    // largest score.
    outcome.parted = true;
    float largest = 0.0f;
    for (const auto& [position, score] : off_scores) largest = std::max(largest, std::abs(score));
    float low = std::numeric_limits<float>::max();
    float high = std::numeric_limits<float>::lowest();
    for (const auto* run : {&on_scores, &off_scores}) {
      const auto& other = run == &on_scores ? off_scores : on_scores;
      for (const auto& [position, score] : *run) {
        if (other.contains(position)) continue;
        low = std::min(low, score);
        high = std::max(high, score);
      }
    }
    EXPECT_LE(high - low, kNearTie * largest)
        << "the keep-sets part after the chunk at token " << offset
        << " over scores that are no near-tie: " << low << " to " << high << ", largest "
        << largest;
  }
  outcome.flash_layers = on->stats().flash_layers;
  EXPECT_EQ(off->stats().flash_layers, 0);
  EXPECT_EQ(on->stats().catalyst_runs, off->stats().catalyst_runs);
  const double on_bpb = on_scorer.loss().overall().bits_per_byte();
  const double off_bpb = off_scorer.loss().overall().bits_per_byte();
  EXPECT_NEAR(on_bpb, off_bpb, 1e-3 * off_bpb)
      << "bits/byte: flash attention on " << on_bpb << ", off " << off_bpb;
  std::printf(
      "[ flash    ] %s on %s, %s cells: %d chunks compared (%d evicting)%s, score diff "
      "%.3g, bits/byte on %.6f off %.6f\n",
      describe(c).c_str(), file.path.filename().string().c_str(), ggml_type_name(cells),
      outcome.checked_chunks, outcome.evicting_chunks,
      outcome.parted ? ", then parted at a near-tie" : "", outcome.max_score_diff, on_bpb, off_bpb);
  return outcome;
}

// One layer, f16 cells: the same q and K in both runs, so the same keep-sets all the way.
TEST(LlamaFlashAttention, OneLayerKeepsTheSameTokens) {
  const ModelFile& file = *LlamaModels::one_layer;
  ASSERT_NE(file.llama, nullptr);
  const std::vector<Case> cases = {
      Case{.policy = "h2o", .budget = 64, .tokens = 2000},
      Case{.policy = "tova", .budget = 64, .positions = PositionMode::cache_index, .tokens = 2000},
      Case{.policy = "h2o", .budget = 32, .tokens = 300, .chunk = 1}};
  // (InfiniPot also ranks by surprisal, from the logits, which flash attention's output moves even
  // with one layer: the random model's nearly uniform predictions tie and part at the 10th chunk.
  // It is compared on toy-base below.)
  for (const Case& c : cases) {
    const FlashOutcome outcome = compare_flash(file, c, GGML_TYPE_F16);
    EXPECT_FALSE(outcome.parted);
    EXPECT_GT(outcome.evicting_chunks, 20);
    EXPECT_LE(outcome.max_score_diff, kSameInputs);
    EXPECT_GT(outcome.flash_layers, 0);
  }
}

// The same over K cells of the other types: bf16 and Q8_0, which the kernel reads in registers
// (q rounded to bf16 / Q8_0 as ggml's matrix product rounds it against them: the products of the
// softmax path, Q8_0's in float rather than ggml's integer sums), and Q4_0, which it dequantizes
// with ggml first. V cells f16 (llama.cpp needs flash attention for quantized V cells). One layer,
// head_dim 32 (a block of Q8_0 and Q4_0).
TEST(LlamaFlashAttention, OneLayerOverEveryKeyType) {
  const ModelFile& file = *LlamaModels::wide_heads;
  const Case c{.policy = "h2o", .budget = 64, .tokens = 1000};
  for (const ggml_type cells : {GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0}) {
    const FlashOutcome outcome = compare_flash(file, c, cells, GGML_TYPE_F16);
    EXPECT_FALSE(outcome.parted) << ggml_type_name(cells);
    EXPECT_GT(outcome.evicting_chunks, 20) << ggml_type_name(cells);
    EXPECT_LE(outcome.max_score_diff, kSameInputs) << ggml_type_name(cells);
    EXPECT_GT(outcome.flash_layers, 0) << ggml_type_name(cells);
  }
}

// toy-base, four layers, f32 cells (kvevict-llama's default): the same keep-sets until a near-tie.
TEST(LlamaFlashAttention, ToyBaseKeepsTheSameTokensUpToNearTies) {
  const ModelFile& file = *LlamaModels::toy;
  const std::vector<Case> cases = {
      Case{.policy = "h2o", .budget = 64, .tokens = 2000},
      Case{.policy = "tova", .budget = 64, .positions = PositionMode::cache_index, .tokens = 2000},
      Case{.policy = "infinipot",
           .budget = 64,
           .positions = PositionMode::reset_on_compact,
           .tokens = 2000,
           .catalyst = true}};
  for (const Case& c : cases) {
    const FlashOutcome outcome = compare_flash(file, c, GGML_TYPE_F32);
    EXPECT_GT(outcome.checked_chunks, 10);
    EXPECT_GT(outcome.flash_layers, 0);
    // InfiniPot's ranking mixes surprisal and catalyst attention, whose score column is spent by
    // the distillation, so a parting could not be judged a near-tie: its keep-sets must not part
    // (they do not over these 2,000 tokens: 61 distillations).
    if (c.policy == "infinipot") {
      EXPECT_FALSE(outcome.parted);
    }
  }
}

// --- errors before the run ------------------------------------------------------------------

kvevict::llama::LlamaSequence open(const std::string& policy, llama_context_params params,
                                   kvevict::llama::LlamaSequenceOptions options = {}) {
  return kvevict::llama::LlamaSequence(
      LlamaModels::toy->llama, params,
      kvevict::make_policy(policy, kvevict::budget_params(policy, 64)), std::move(options));
}

std::string error_of(const std::function<void()>& run) {
  try {
    run();
  } catch (const kvevict::Error& error) {
    return error.what();
  }
  return "no error";
}

// Every policy runs with flash attention forced on, and on q8_0 cells (which need it): kvevict
// computes the attention rows from the q8_0 keys (read in registers by its kernel).
TEST(LlamaErrors, AttentionPoliciesRunWithFlashAttentionForcedOn) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = 512;
  params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  params.n_threads = 1;
  params.n_threads_batch = 1;
  const std::vector<std::int32_t> tokens = stream_tokens(LlamaModels::toy->model, 200);
  for (const ggml_type cells : {GGML_TYPE_F16, GGML_TYPE_Q8_0}) {
    params.type_k = cells;
    params.type_v = cells;
    // positions original: llama.cpp's K-shift cannot rotate q8_0 cells (ShiftingPositions...).
    kvevict::llama::LlamaSequenceOptions options;
    options.position_mode = PositionMode::original;
    for (const char* policy : {"h2o", "tova", "streaming_llm"}) {
      if (std::string_view(policy) == "tova") {
        options.position_mode =
            cells == GGML_TYPE_F16 ? PositionMode::cache_index : PositionMode::original;
      }
      EXPECT_EQ(error_of([&] {
                  kvevict::llama::LlamaSequence sequence = open(policy, params, options);
                  (void)sequence.feed(tokens);
                  EXPECT_EQ(sequence.stats().flash_layers > 0, sequence.reads_attention());
                  EXPECT_EQ(sequence.live_cells(), 64);
                }),
                "no error")
          << policy << " on " << ggml_type_name(cells);
    }
  }
}

// K rows of one cell type for the kernel tests: cells x heads rows of k values drawn from
// `uniform`, stored in ggml's layout of the type, and the values they decode to (the reference's).
struct TestCells {
  std::vector<std::uint8_t> bytes;
  std::vector<float> values;  // [cells * heads][k]
  std::size_t row_bytes = 0;  // one head's row
};

TestCells make_test_cells(kvevict::llama::kernels::CellType type, int rows, int k,
                          std::mt19937& rng) {
  using kvevict::llama::kernels::CellType;
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  TestCells cells;
  cells.values.resize(static_cast<std::size_t>(rows) * k);
  for (float& v : cells.values) v = uniform(rng);
  switch (type) {
    case CellType::f32:
      cells.row_bytes = static_cast<std::size_t>(k) * 4;
      break;
    case CellType::f16:
    case CellType::bf16:
      cells.row_bytes = static_cast<std::size_t>(k) * 2;
      break;
    case CellType::q8_0:
      cells.row_bytes = static_cast<std::size_t>(k / 32) * 34;  // an f16 scale, 32 int8
      break;
  }
  cells.bytes.resize(static_cast<std::size_t>(rows) * cells.row_bytes);
  for (int r = 0; r < rows; ++r) {
    float* value = cells.values.data() + static_cast<std::size_t>(r) * k;
    std::uint8_t* row = cells.bytes.data() + static_cast<std::size_t>(r) * cells.row_bytes;
    for (int j = 0; j < k; ++j) {
      std::uint16_t bits = 0;
      switch (type) {
        case CellType::f32:
          std::memcpy(row + 4 * j, &value[j], 4);
          break;
        case CellType::f16:
          bits = kvevict::detail::float_to_f16(value[j]);
          value[j] = kvevict::detail::f16_to_float(bits);
          std::memcpy(row + 2 * j, &bits, 2);
          break;
        case CellType::bf16:
          bits = kvevict::detail::float_to_bf16(value[j]);
          value[j] = kvevict::detail::bf16_to_float(bits);
          std::memcpy(row + 2 * j, &bits, 2);
          break;
        case CellType::q8_0:
          if (j % 32 == 0) {  // a block: scale = max |v| / 127, the values rounded to int8
            float largest = 0.0f;
            for (int i = j; i < j + 32; ++i) largest = std::max(largest, std::abs(value[i]));
            bits = kvevict::detail::float_to_f16(largest / 127.0f);
            const float scale = kvevict::detail::f16_to_float(bits);
            std::uint8_t* block = row + static_cast<std::size_t>(j / 32) * 34;
            std::memcpy(block, &bits, 2);
            for (int i = j; i < j + 32; ++i) {
              const auto q =
                  static_cast<std::int8_t>(std::clamp(std::lround(value[i] / scale), -127L, 127L));
              block[2 + i - j] = static_cast<std::uint8_t>(q);
              value[i] = static_cast<float>(q) * scale;
            }
          }
          break;
      }
    }
  }
  return cells;
}

// The kernels of the flash-attention rows on every SIMD target Highway built and this CPU runs
// (AVX-512, AVX2, SSE4 and the scalar fallback on x86-64), against double-precision references:
// gathered K cells of every type the kernel reads (f32, f16, bf16, Q8_0) over row lengths that
// are and are not multiples of the lanes, row counts with and without a group of four (the
// 512-bit targets' pair tiles) and tile counts with and without a partial tile; the softmax with
// masked (-inf) cells, which read 0, and with logits spread over 110 (results down to float's
// subnormals, which must still be exp's, not 0); the queries' rounding to f16.
TEST(LlamaKernels, ScoresAndSoftmaxOnEveryTarget) {
  namespace kernels = kvevict::llama::kernels;
  using kernels::CellType;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  constexpr int kCells = 400;
  constexpr int kHeads = 2;  // the K rows read are head 1's, at a stride of two heads
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    for (const CellType type : {CellType::f32, CellType::f16, CellType::bf16, CellType::q8_0}) {
      for (const int k : {16, 20, 32, 64, 128}) {
        if (type == CellType::q8_0 && k % 32 != 0) continue;  // whole blocks only
        const TestCells cells = make_test_cells(type, kCells * kHeads, k, rng);
        const kernels::CellRows keys{type, cells.bytes.data() + cells.row_bytes,
                                     kHeads * cells.row_bytes};
        for (const int m : {1, 4, 5, 8, 64}) {
          for (const int n : {1, 7, 9, 33, 300}) {
            std::vector<float> x(static_cast<std::size_t>(m) * k);
            for (float& v : x) v = uniform(rng);
            std::vector<std::int32_t> index(static_cast<std::size_t>(n));
            for (int c = 0; c < n; ++c) index[c] = (c * 37 + 5) % kCells;
            std::vector<float> y(static_cast<std::size_t>(m) * n);
            kernels::gathered_scores(x.data(), k, m, keys, index.data(), n, k, y.data(), n);
            double worst = 0.0;
            for (int r = 0; r < m; ++r) {
              for (int c = 0; c < n; ++c) {
                const float* key =
                    cells.values.data() + (static_cast<std::size_t>(index[c]) * kHeads + 1) * k;
                double want = 0.0;
                for (int j = 0; j < k; ++j) {
                  want += static_cast<double>(x[static_cast<std::size_t>(r * k + j)]) * key[j];
                }
                worst = std::max(worst, std::abs(want - y[static_cast<std::size_t>(r * n + c)]));
              }
            }
            // k products of |x|, |key| <= 1 summed in float: well under k * 2^-24 * k.
            EXPECT_LE(worst, 1e-4)
                << "type " << static_cast<int>(type) << " k " << k << " m " << m << " n " << n;
          }
        }
      }
    }
    for (const float spread : {20.0f, 880.0f}) {  // scale 0.125: logits within 2.5, then 110
      for (const int n : {1, 7, 33, 300}) {
        std::vector<float> row(static_cast<std::size_t>(n));
        std::vector<float> bias(static_cast<std::size_t>(n));
        for (int c = 0; c < n; ++c) {
          row[c] = spread * uniform(rng);
          bias[c] = c % 3 == 1 ? -std::numeric_limits<float>::infinity() : 0.5f * uniform(rng);
        }
        std::vector<double> want(static_cast<std::size_t>(n), 0.0);
        double max = -std::numeric_limits<double>::infinity();
        for (int c = 0; c < n; ++c) max = std::max(max, 0.125 * row[c] + bias[c]);
        double sum = 0.0;
        // The kernel forms the logits in float: each off by up to an ulp of its size, which exp
        // turns into that much relative error (besides exp's own and the sum's, under 1e-6).
        std::vector<double> logit_error(static_cast<std::size_t>(n));
        for (int c = 0; c < n; ++c) {
          const double logit = 0.125 * row[c] + bias[c];
          sum += want[c] = std::exp(logit - max);
          logit_error[c] = (std::abs(logit) + std::abs(max)) * 0x1p-23;
        }
        kernels::softmax_row(row.data(), bias.data(), 0.125f, n);
        for (int c = 0; c < n; ++c) {
          const double p = want[c] / sum;
          if (c % 3 == 1) {
            EXPECT_EQ(row[c], 0.0f) << "n " << n << " masked cell " << c;
          } else {  // a subnormal float's result (p < 2^-126) too, within a few of its steps
            EXPECT_NEAR(row[c], p,
                        (1e-6 + logit_error[c]) * p + 4 * std::numeric_limits<float>::denorm_min())
                << "n " << n << " cell " << c << " spread " << spread;
          }
        }
      }
    }
    // The queries' rounding against f16 cells: ggml's own conversion, bit for bit, on ties
    // (1 + odd multiples of 2^-11, and of the subnormal step 2^-24 / 2), subnormals, the largest
    // f16 and the values that round to it or overflow, zeros, infinities, NaN, random values.
    std::vector<float> values = {0.0f,
                                 -0.0f,
                                 1.0f + 0x1p-11f,
                                 1.0f + 3 * 0x1p-11f,
                                 0x1p-25f,
                                 3 * 0x1p-25f,
                                 5 * 0x1p-26f,
                                 0x1p-26f,
                                 65504.0f,
                                 65519.0f,
                                 65520.0f,
                                 -70000.0f,
                                 std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN()};
    for (int i = 0; i < 1000; ++i) values.push_back(std::ldexp(uniform(rng), i % 40 - 28));
    std::vector<float> rounded(values.size());
    kernels::round_through_f16(values.data(), rounded.data(),
                               static_cast<std::int64_t>(values.size()));
    for (std::size_t i = 0; i < values.size(); ++i) {
      const float want = ggml_fp16_to_fp32(ggml_fp32_to_fp16(values[i]));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(rounded[i])) << "value " << i;
      } else {
        EXPECT_EQ(std::bit_cast<std::uint32_t>(rounded[i]), std::bit_cast<std::uint32_t>(want))
            << "value " << i << ": " << values[i];
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the CPU's own
}

// A model whose layer 1 has no attention: llama.cpp's "deci" architecture (DeciLM / Nemotron-NAS,
// whose attention-free layers have no heads), written from the random two-layer model's GGUF with
// layer 1's attention weights left out. An attention-reading policy's forward must stop with an
// error naming the layer, with flash attention off and on; a policy that reads no attention runs.
TEST(LlamaErrors, ALayerWithoutAttention) {
  const ModelFile& source = *LlamaModels::random;
  const fs::path path = fs::temp_directory_path() /
                        ("kvevict_test_llama_no_attention_" + std::to_string(getpid()) + ".gguf");
  {
    ggml_context* data = nullptr;
    gguf_context* in = gguf_init_from_file(source.path.c_str(), {.no_alloc = false, .ctx = &data});
    ASSERT_NE(in, nullptr);
    gguf_context* out = gguf_init_empty();
    gguf_set_kv(out, in);
    gguf_set_val_str(out, "general.architecture", "deci");
    gguf_set_val_str(out, "tokenizer.ggml.model", "none");  // as make_file's override
    for (std::int64_t i = 0; i < gguf_get_n_kv(in); ++i) {
      const std::string_view key = gguf_get_key(in, i);
      if (!key.starts_with("llama.")) continue;
      const std::string renamed = "deci." + std::string(key.substr(6));
      switch (gguf_get_kv_type(in, i)) {
        case GGUF_TYPE_UINT32:
          gguf_set_val_u32(out, renamed.c_str(), gguf_get_val_u32(in, i));
          break;
        case GGUF_TYPE_FLOAT32:
          gguf_set_val_f32(out, renamed.c_str(), gguf_get_val_f32(in, i));
          break;
        default:
          ADD_FAILURE() << "unexpected type of " << key;
      }
    }
    const std::int32_t heads[] = {4, 0};
    const std::int32_t kv_heads[] = {2, 0};
    gguf_set_arr_data(out, "deci.attention.head_count", GGUF_TYPE_INT32, heads, 2);
    gguf_set_arr_data(out, "deci.attention.head_count_kv", GGUF_TYPE_INT32, kv_heads, 2);
    for (std::int64_t t = 0; t < gguf_get_n_tensors(in); ++t) {
      const std::string_view name = gguf_get_tensor_name(in, t);
      if (name.starts_with("blk.1.attn_")) continue;  // q, k, v, output and the norm
      gguf_add_tensor(out, ggml_get_tensor(data, name.data()));
    }
    ASSERT_TRUE(gguf_write_to_file(out, path.c_str(), false));
    gguf_free(out);
    gguf_free(in);
    ggml_free(data);
  }
  llama_model_params model_params = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(path.c_str(), model_params);
  std::error_code ignored;
  fs::remove(path, ignored);
  ASSERT_NE(model, nullptr);
  const std::vector<std::int32_t> tokens = stream_tokens(source.model, 40);
  for (const llama_flash_attn_type flash :
       {LLAMA_FLASH_ATTN_TYPE_DISABLED, LLAMA_FLASH_ATTN_TYPE_ENABLED}) {
    llama_context_params params = llama_context_default_params();
    params.n_ctx = 256;
    params.n_threads = 1;
    params.n_threads_batch = 1;
    params.flash_attn_type = flash;
    const auto run = [&](const std::string& policy) {
      return error_of([&] {
        kvevict::llama::LlamaSequence sequence(
            model, params, kvevict::make_policy(policy, kvevict::budget_params(policy, 16)));
        (void)sequence.feed(tokens);
      });
    };
    const std::string error = run("h2o");
    EXPECT_NE(error.find("no attention for layer 1 of 2"), std::string::npos) << error;
    EXPECT_NE(error.find(flash == LLAMA_FLASH_ATTN_TYPE_ENABLED
                             ? "no flash-attention node (GGML_OP_FLASH_ATTN_EXT) reading that "
                               "layer's K cache (cache_k_l1)"
                             : "neither kq_soft_max-1"),
              std::string::npos)
        << error;
    EXPECT_EQ(run("streaming_llm"), "no error");
  }
  llama_model_free(model);
}

// K-norm and KeyDiff read no attention: flash attention stays on, over f16 and q8_0 cells (q8_0
// under original positions with the newest token protected: recent=1, as llama.cpp needs).
TEST(LlamaErrors, KeyPoliciesRunWithFlashAttentionOn) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = 512;
  params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  params.n_threads = 1;
  params.n_threads_batch = 1;
  const std::vector<std::int32_t> tokens = stream_tokens(LlamaModels::toy->model, 200);
  for (const ggml_type cells : {GGML_TYPE_F16, GGML_TYPE_Q8_0}) {
    params.type_k = cells;
    params.type_v = cells;
    kvevict::llama::LlamaSequenceOptions options;
    options.position_mode =
        cells == GGML_TYPE_F16 ? PositionMode::cache_index : PositionMode::original;
    for (const char* policy : {"knorm", "keydiff"}) {
      EXPECT_EQ(error_of([&] {
                  kvevict::llama::LlamaSequence sequence(
                      LlamaModels::toy->llama, params,
                      kvevict::make_policy(
                          policy, kvevict::PolicyParams().set("budget", 64).set("recent", 1)),
                      options);
                  EXPECT_TRUE(sequence.reads_keys());
                  EXPECT_FALSE(sequence.reads_attention());
                  (void)sequence.feed(tokens);
                  EXPECT_EQ(sequence.live_cells(), 64);
                }),
                "no error")
          << policy << " on " << ggml_type_name(cells);
    }
  }
}

TEST(LlamaErrors, QuantizedValueCellsWithoutFlashAttention) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = 512;
  params.type_k = GGML_TYPE_Q8_0;
  params.type_v = GGML_TYPE_Q8_0;
  params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  kvevict::llama::LlamaSequenceOptions options;
  options.position_mode = PositionMode::original;  // (q8_0 keys cannot shift)
  for (const char* policy : {"h2o", "streaming_llm"}) {
    const std::string error = error_of([&] { (void)open(policy, params, options); });
    EXPECT_NE(error.find("quantized V cells (q8_0)"), std::string::npos) << error;
    EXPECT_NE(error.find("(-fa off)"), std::string::npos) << error;
  }
  // With flash attention auto (llama.cpp's default, on for the CPU) every policy runs on them.
  params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
  EXPECT_EQ(error_of([&] { (void)open("h2o", params, options); }), "no error");
}

TEST(LlamaErrors, ShiftingPositionsOverCellsTheKShiftCannotRotate) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = 512;
  params.type_k = GGML_TYPE_BF16;
  params.type_v = GGML_TYPE_BF16;
  kvevict::llama::LlamaSequenceOptions options;
  options.position_mode = PositionMode::cache_index;
  EXPECT_NE(error_of([&] { (void)open("window", params, options); }).find("cannot rotate bf16"),
            std::string::npos);
  // q8_0 keys crash llama.cpp's K-shift (a segmentation fault in build_rope_shift).
  params.type_k = GGML_TYPE_Q8_0;
  params.type_v = GGML_TYPE_Q8_0;
  EXPECT_NE(error_of([&] {
              (void)open("streaming_llm", params, options);
            }).find("cannot rotate q8_0 cells (it crashes)"),
            std::string::npos);
  params.type_k = GGML_TYPE_BF16;
  params.type_v = GGML_TYPE_BF16;
  options.position_mode = PositionMode::original;  // nothing to rotate
  EXPECT_EQ(error_of([&] { (void)open("window", params, options); }), "no error");
}

// A model file llama.cpp cannot read is an error naming it, before anything runs: cut short, cut
// inside its header, not a GGUF, empty. (kvevict's own readers are fuzzed, docs/reliability.md;
// llama.cpp's loader is llama.cpp's, and kvevict-llama must only turn its refusal into an error.)
TEST(LlamaErrors, UnreadableModelFiles) {
  std::ifstream in(LlamaModels::toy->path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const fs::path path =
      fs::temp_directory_path() / ("kvevict_test_llama_bad_" + std::to_string(getpid()) + ".gguf");
  for (const std::string& content : {bytes.substr(0, bytes.size() / 2), bytes.substr(0, 20),
                                     "GGML" + bytes.substr(4), std::string()}) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
    const std::string error =
        error_of([&] { (void)kvevict::llama_cli::LlamaModel(path.string(), 0); });
    EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  }
  std::error_code ignored;
  fs::remove(path, ignored);
}

TEST(LlamaErrors, GranularityOtherThanToken) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = 512;
  kvevict::llama::LlamaSequenceOptions options;
  options.granularity = Granularity::head;
  EXPECT_NE(error_of([&] { (void)open("h2o", params, options); }).find("granularity token"),
            std::string::npos);
}

TEST(LlamaErrors, BudgetLargerThanTheContext) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = 256;  // streaming_llm at budget 1024 keeps 1024 + a chunk
  EXPECT_NE(
      error_of([&] {
        (void)kvevict::llama::LlamaSequence(
            LlamaModels::toy->llama, params,
            kvevict::make_policy("streaming_llm", kvevict::budget_params("streaming_llm", 1024)));
      }).find("raise the context size (-c)"),
      std::string::npos);
}

// kvevict-llama tokenizes SentencePiece vocabularies (Llama 2, TinyLlama) with kvevict's tokenizer
// rebuilt from llama.cpp's vocabulary (src/llama/cli/llama_model.hpp), and `kvevict` reads the same
// GGUF with its own reader: both must give the tokens llama.cpp's own tokenizer test expects
// (models/ggml-vocab-llama-spm.gguf.inp / .out of the llama.cpp tree: 46 texts, written by its
// test-tokenizer-0 without special tokens). The model is random weights under that vocabulary,
// written by kvevict's GGUF writer.
#ifdef KVEVICT_LLAMA_VOCABS
struct VocabCase {
  std::string text;
  std::vector<std::int32_t> ids;
};

// llama.cpp's tokenizer test vectors: VOCAB.inp holds the texts, each followed by
// "\n__ggml_vocab_test__\n"; VOCAB.out one line of ids per text.
std::vector<VocabCase> read_vocab_cases(const fs::path& vocab) {
  std::ifstream inputs_file(vocab.string() + ".inp", std::ios::binary);
  std::ifstream outputs(vocab.string() + ".out");
  const std::string inputs((std::istreambuf_iterator<char>(inputs_file)),
                           std::istreambuf_iterator<char>());
  const std::string separator = "\n__ggml_vocab_test__\n";
  std::vector<VocabCase> cases;
  std::size_t begin = 0;
  for (std::size_t end = inputs.find(separator); end != std::string::npos;
       begin = end + separator.size(), end = inputs.find(separator, begin)) {
    std::string line;
    if (!std::getline(outputs, line)) break;
    std::istringstream ids(line);
    cases.push_back(
        {inputs.substr(begin, end - begin), {std::istream_iterator<std::int32_t>(ids), {}}});
  }
  return cases;
}

// `test.text` read as `stream` reads a file, in pieces (harness/text_pieces.hpp) of blocks of 4
// to 8 bytes, so that the reader cuts it in different places, each piece encoded by `engine`
// (without the space it was cut before, with `drop_cut_space`: SentencePiece's dummy prefix stands
// for it), must give test.ids. 16 blocks of 4 bytes, the most a piece grows without a space, hold
// the texts' longest run without one (57 bytes), so no piece is cut inside a word.
void expect_the_same_tokens_in_pieces(const kvevict::llama_cli::LlamaModel& engine,
                                      const VocabCase& test, bool drop_cut_space) {
  const fs::path path = fs::temp_directory_path() /
                        ("kvevict_test_llama_pieces_" + std::to_string(getpid()) + ".txt");
  std::ofstream(path, std::ios::binary) << test.text;
  for (std::size_t block = 4; block <= 8; ++block) {
    kvevict::harness::TextPiecesOptions options;
    options.block_bytes = block;
    options.cut_before_space = true;
    kvevict::harness::TextPieces pieces(path.string(), options);
    std::vector<std::int32_t> tokens;
    kvevict::harness::TextPiece piece;
    while (pieces.next(piece)) {
      const std::string_view piece_text =
          piece.space_cut && drop_cut_space ? std::string_view(piece.text).substr(1) : piece.text;
      const std::vector<std::int32_t> ids = engine.encode(piece_text, /*add_bos=*/false);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
    }
    EXPECT_EQ(tokens, test.ids) << "in blocks of " << block << " bytes: '" << test.text << "'";
  }
  std::error_code ignored;
  fs::remove(path, ignored);
}

TEST(LlamaVocabularies, SentencePieceGivesLlamaCppsTestTokens) {
  const fs::path vocabs(KVEVICT_LLAMA_VOCABS);
  llama_model_params params = llama_model_default_params();
  params.vocab_only = true;
  llama_model* vocab_model =
      llama_model_load_from_file((vocabs / "ggml-vocab-llama-spm.gguf").string().c_str(), params);
  ASSERT_NE(vocab_model, nullptr);
  const llama_vocab* vocab = llama_model_get_vocab(vocab_model);
  kvevict::model::ModelConfig config;
  config.dim = 32;
  config.hidden_dim = 64;
  config.layers = 1;
  config.heads = 2;
  config.kv_heads = 1;
  config.vocab_size = llama_vocab_n_tokens(vocab);
  config.context_length = 64;
  kvevict::model::Model model = kvevict::model::make_random_model(config, 3);
  kvevict::model::Tokenizer& tokenizer = model.tokenizer;
  tokenizer = {};
  tokenizer.kind = kvevict::model::Tokenizer::Kind::sentencepiece;
  tokenizer.vocab_size = config.vocab_size;
  tokenizer.bos_id = llama_vocab_bos(vocab);
  tokenizer.eos_id = llama_vocab_eos(vocab);
  for (llama_token id = 0; id < config.vocab_size; ++id) {
    tokenizer.pieces.emplace_back(llama_vocab_get_text(vocab, id));
    tokenizer.scores.push_back(llama_vocab_get_score(vocab, id));
  }
  llama_model_free(vocab_model);
  const fs::path path =
      fs::temp_directory_path() / ("kvevict_test_llama_spm_" + std::to_string(getpid()) + ".gguf");
  kvevict::model::write_gguf(model, path);
  const kvevict::llama_cli::LlamaModel engine(path.string(), 0);
  const kvevict::model::Model reference = kvevict::model::load_model(path);
  std::error_code ignored;
  fs::remove(path, ignored);
  ASSERT_NE(engine.kvevict_tokenizer(), nullptr);
  ASSERT_EQ(reference.tokenizer.kind, kvevict::model::Tokenizer::Kind::sentencepiece);

  const std::vector<VocabCase> cases = read_vocab_cases(vocabs / "ggml-vocab-llama-spm.gguf");
  ASSERT_EQ(cases.size(), 46u);
  for (const VocabCase& test : cases) {
    EXPECT_EQ(engine.encode(test.text, /*add_bos=*/false), test.ids)
        << "kvevict-llama: '" << test.text << "'";
    EXPECT_EQ(reference.tokenizer.encode(test.text, /*add_bos=*/false), test.ids)
        << "kvevict: '" << test.text << "'";
    expect_the_same_tokens_in_pieces(engine, test, /*drop_cut_space=*/true);
  }
}

// Byte-level BPE vocabularies (GPT-2 here; Llama 3, Qwen, SmolLM2 alike) are tokenized by
// llama.cpp itself, so its whole-text tokens are llama.cpp's to get right; what kvevict-llama
// adds is the cut: `stream` reads a text in pieces, cut only where the pre-tokenizer never joins
// the two sides, and encodes each piece with its leading space. The pieces' tokens must be the
// whole text's, for llama.cpp's GPT-2 tokenizer test texts (models/ggml-vocab-gpt-2.gguf).
TEST(LlamaVocabularies, ByteLevelBpeTextsInPiecesGiveTheWholeTextsTokens) {
  const fs::path vocab = fs::path(KVEVICT_LLAMA_VOCABS) / "ggml-vocab-gpt-2.gguf";
  const kvevict::llama_cli::LlamaModel engine(vocab.string(), 0,
                                              kvevict::llama_cli::LlamaLoad::vocabulary_only);
  ASSERT_EQ(engine.kvevict_tokenizer(), nullptr);  // llama.cpp tokenizes
  const std::vector<VocabCase> cases = read_vocab_cases(vocab);
  ASSERT_EQ(cases.size(), 46u);
  for (const VocabCase& test : cases) {
    EXPECT_EQ(engine.encode(test.text, /*add_bos=*/false), test.ids) << "'" << test.text << "'";
    expect_the_same_tokens_in_pieces(engine, test, /*drop_cut_space=*/false);
    // Every place the reader may cut, one at a time.
    for (std::size_t p = 1; p < test.text.size(); ++p) {
      if (!kvevict::harness::may_cut_before(test.text, p)) continue;
      std::vector<std::int32_t> ids = engine.encode(test.text.substr(0, p), false);
      const std::vector<std::int32_t> rest = engine.encode(test.text.substr(p), false);
      ids.insert(ids.end(), rest.begin(), rest.end());
      EXPECT_EQ(ids, test.ids) << "cut before byte " << p << " of '" << test.text << "'";
    }
  }
}
#endif

// --- many sequences in one context (LlamaSequenceSet) -------------------------------------------

// Each sequence of a batched run, fed alone through a LlamaSequence: its keep-set and logits after
// every forward, to compare with the same sequence batched.
struct Trace {
  std::vector<std::vector<std::int64_t>> kept;
  std::vector<std::vector<float>> last_logits;
};

llama_context_params batch_params(int n_ctx, bool flash) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = static_cast<std::uint32_t>(n_ctx);
  params.n_threads = 1;
  params.n_threads_batch = 1;
  params.type_k = GGML_TYPE_F32;
  params.type_v = GGML_TYPE_F32;
  params.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  return params;
}

// Three streams (different stretches of the text), each in chunks of its own size: 1 (decode
// steps), 5 and 16 tokens. The third joins after 6 steps; the first, shortest, leaves when done.
struct BatchPlan {
  std::vector<std::vector<std::int32_t>> streams;
  std::vector<int> chunks{1, 5, 16};
  std::vector<int> joins{0, 0, 6};
};

BatchPlan batch_plan(const kvevict::model::Model& model) {
  const std::vector<std::int32_t> text = stream_tokens(model, 1400);
  BatchPlan plan;
  plan.streams.emplace_back(text.begin(), text.begin() + 120);
  plan.streams.emplace_back(text.begin() + 200, text.begin() + 650);
  plan.streams.emplace_back(text.begin() + 700, text.begin() + 1400);
  return plan;
}

int turn_every(const Case& c) { return c.turn_every > 0 ? c.turn_every : 1 << 30; }

kvevict::llama::LlamaSequenceOptions sequence_options(const Case& c, int max_chunk) {
  kvevict::llama::LlamaSequenceOptions options;
  options.granularity = c.granularity;
  options.position_mode = c.positions;
  options.max_chunk = max_chunk;
  return options;
}

// One sequence's chunk in a step of the plan.
struct PlanFeed {
  std::size_t sequence = 0;  // index into plan.streams
  std::span<const std::int32_t> tokens;
  bool turn_start = false;
  std::size_t forward = 0;  // the sequence's forwards before this one
};

// Walks the plan a step at a time: every sequence that has joined and has tokens left is fed its
// next chunk. `open(i)` runs when sequence i joins, `close(i)` when it has no tokens left, and
// `step(feeds)` once per step; the walk stops when no sequence has tokens left or `step` returns
// false.
template <class Open, class Close, class Step>
void walk_plan(const BatchPlan& plan, const Case& c, Open&& open, Close&& close, Step&& step) {
  enum class State { waiting, open, closed };
  std::vector<State> states(plan.streams.size(), State::waiting);
  std::vector<std::size_t> forwards(plan.streams.size(), 0);
  std::vector<PlanFeed> feeds;
  for (int s = 0;; ++s) {
    feeds.clear();
    for (std::size_t i = 0; i < plan.streams.size(); ++i) {
      const auto chunk = static_cast<std::size_t>(plan.chunks[i]);
      const std::size_t offset = forwards[i] * chunk;
      if (s < plan.joins[i]) continue;
      if (offset >= plan.streams[i].size()) {
        if (states[i] == State::open) close(i);
        states[i] = State::closed;
        continue;
      }
      if (states[i] == State::waiting) open(i);
      states[i] = State::open;
      const auto n = std::min(chunk, plan.streams[i].size() - offset);
      const bool turn = offset % static_cast<std::size_t>(turn_every(c)) < chunk;
      feeds.push_back({i, std::span<const std::int32_t>(plan.streams[i]).subspan(offset, n), turn,
                       forwards[i]++});
    }
    if (feeds.empty() || !step(std::span<const PlanFeed>(feeds))) return;
  }
}

Trace run_alone(const ModelFile& file, const Case& c, const BatchPlan& plan, std::size_t i,
                bool flash) {
  kvevict::llama::LlamaSequence llama(file.llama, batch_params(c.n_ctx, flash), make(c),
                                      sequence_options(c, plan.chunks[i]));
  Trace trace;
  const std::vector<std::int32_t>& stream = plan.streams[i];
  const auto chunk = static_cast<std::size_t>(plan.chunks[i]);
  for (std::size_t offset = 0; offset < stream.size(); offset += chunk) {
    const auto n = std::min(chunk, stream.size() - offset);
    const bool turn = offset % static_cast<std::size_t>(turn_every(c)) < chunk;
    const kvevict::llama::LlamaLogits logits =
        llama.forward(std::span<const std::int32_t>(stream).subspan(offset, n), turn);
    trace.kept.push_back(kept(llama.sequence()));
    trace.last_logits.emplace_back(logits.last().begin(), logits.last().end());
  }
  return trace;
}

// Runs the plan batched and checks every forward of every sequence against its run alone: the
// same keep-set, logits within `tolerance`. Returns the largest logit difference.
float expect_batch_equals_alone(const ModelFile& file, const Case& c, bool flash,
                                std::int64_t pool_cells = 0) {
  SCOPED_TRACE(describe(c) + (flash ? " flash attention on" : " flash attention off"));
  const BatchPlan plan = batch_plan(file.model);
  kvevict::llama::LlamaSequenceSetOptions set_options;
  set_options.max_sequences = 3;
  set_options.max_chunk = 16;
  set_options.pool_cells = pool_cells;
  kvevict::llama::LlamaSequenceSet set(file.llama, batch_params(c.n_ctx, flash), set_options);
  std::vector<Trace> alone;
  for (std::size_t i = 0; i < plan.streams.size(); ++i) {
    alone.push_back(run_alone(file, c, plan, i, flash));
  }
  std::vector<int> ids(plan.streams.size(), -1);
  std::vector<std::size_t> forwards(plan.streams.size(), 0);
  float largest = 0.0f;
  std::vector<kvevict::llama::LlamaFeed> feeds;
  walk_plan(
      plan, c,
      [&](std::size_t i) { ids[i] = set.open(make(c), sequence_options(c, plan.chunks[i])); },
      [&](std::size_t i) { set.close(ids[i]); },
      [&](std::span<const PlanFeed> step) {
        feeds.clear();
        for (const PlanFeed& f : step)
          feeds.push_back({ids[f.sequence], f.tokens, f.turn_start, false});
        set.step(feeds);
        for (const PlanFeed& f : step) {
          const int id = ids[f.sequence];
          EXPECT_FALSE(set.failed(id).has_value()) << *set.failed(id);
          ++forwards[f.sequence];
          if (kept(set.sequence(id)) != alone[f.sequence].kept[f.forward]) {
            ADD_FAILURE() << "sequence " << f.sequence << ": the keep-sets differ after forward "
                          << f.forward;
            return false;
          }
          const std::span<const float> logits = set.logits(id).last();
          const std::vector<float>& expected = alone[f.sequence].last_logits[f.forward];
          for (std::size_t v = 0; v < logits.size(); ++v) {
            largest = std::max(largest, std::abs(logits[v] - expected[v]));
          }
        }
        return true;
      });
  for (std::size_t i = 0; i < plan.streams.size(); ++i) {
    EXPECT_EQ(forwards[i], alone[i].kept.size()) << "sequence " << i;
  }
  return largest;
}

// Batched, every sequence keeps exactly the tokens it keeps alone, and its logits agree within
// llama.cpp's own batch-vs-single tolerance (toy-base, whose logits are of magnitude ~10): flash
// attention off, the same f32 products summed in another order where a product's batch is wider
// (1e-4); on, llama.cpp's CPU kernel accumulates the values in f16 in cell order, and a batch
// places a sequence's cells in another order (2^-11 relative per addition over ~50 cells: 5e-2).
// Three streams in chunks of 1, 5 and 16 tokens, one joining late and one leaving early.
TEST(LlamaBatch, EverySequenceBatchedEqualsItselfAlone) {
  const ModelFile& file = *LlamaModels::toy;
  std::vector<Case> cases;
  for (const char* policy : {"window", "streaming_llm", "h2o", "tova"}) {
    for (const Granularity granularity : {Granularity::token, Granularity::blocks(8)}) {
      Case c{policy, 48};
      c.granularity = granularity;
      // TOVA may evict the newest token: llama.cpp needs positions that continue from the last.
      if (c.policy == "tova") c.positions = PositionMode::cache_index;
      cases.push_back(c);
    }
  }
  Case sirllm{"sirllm", 48};
  sirllm.turn_every = 40;
  cases.push_back(sirllm);
  for (const Case& c : cases) {
    EXPECT_LE(expect_batch_equals_alone(file, c, /*flash=*/false), 1e-4f);
    // Flash attention: kvevict's q.K pass computes each sequence's rows over its own cells.
    if (reads_attention(c)) {
      EXPECT_LE(expect_batch_equals_alone(file, c, /*flash=*/true), 5e-2f);
    }
  }
}

// The set's step is llama.cpp's own batched decode, bit for bit: the same tokens, positions and
// sequence ids in one batch, the logits of each sequence's last token (the random model, whose
// flat attention makes any other batching visible).
TEST(LlamaBatch, AStepIsLlamaCppsBatchedDecode) {
  const ModelFile& file = *LlamaModels::random;
  const BatchPlan plan = batch_plan(file.model);
  kvevict::llama::LlamaSequenceSetOptions set_options;
  set_options.max_sequences = 3;
  set_options.max_chunk = 5;
  kvevict::llama::LlamaSequenceSet set(file.llama, batch_params(512, false), set_options);
  kvevict::llama::LlamaSequenceOptions options;
  options.max_chunk = 5;
  const int a = set.open(kvevict::make_policy("full"), options);
  const int b = set.open(kvevict::make_policy("full"), options);
  llama_context_params params = batch_params(512, false);
  params.n_seq_max = 3;
  params.kv_unified = true;
  llama_context* plain = llama_init_from_model(file.llama, params);
  ASSERT_NE(plain, nullptr);
  llama_batch batch = llama_batch_init(16, 0, 1);
  for (int f = 0; f < 40; ++f) {
    // a: one token per step; b: five.
    const std::span<const std::int32_t> ta =
        std::span<const std::int32_t>(plan.streams[0]).subspan(static_cast<std::size_t>(f), 1);
    const std::span<const std::int32_t> tb =
        std::span<const std::int32_t>(plan.streams[1]).subspan(static_cast<std::size_t>(f) * 5, 5);
    batch.n_tokens = 0;
    for (const auto& [tokens, seq, first] : {std::tuple{ta, 0, f}, std::tuple{tb, 1, f * 5}}) {
      for (std::size_t k = 0; k < tokens.size(); ++k) {
        const int n = batch.n_tokens++;
        batch.token[n] = tokens[k];
        batch.pos[n] = first + static_cast<int>(k);
        batch.n_seq_id[n] = 1;
        batch.seq_id[n][0] = seq;
        batch.logits[n] = static_cast<std::int8_t>(k + 1 == tokens.size());
      }
    }
    ASSERT_EQ(llama_decode(plain, batch), 0);
    const std::vector<kvevict::llama::LlamaFeed> feeds{{a, ta}, {b, tb}};
    set.step(feeds);
    const std::span<const float> la = set.logits(a).last();
    const std::span<const float> lb = set.logits(b).last();
    ASSERT_TRUE(std::equal(la.begin(), la.end(), llama_get_logits_ith(plain, 0))) << "step " << f;
    ASSERT_TRUE(std::equal(lb.begin(), lb.end(), llama_get_logits_ith(plain, 5))) << "step " << f;
  }
  llama_batch_free(batch);
  llama_free(plain);
}

// The reference decoder's batch and llama.cpp's, step for step over the same plan: every sequence
// keeps the same tokens in both, and its last logits agree within the tolerance of the two
// engines on one sequence (f32 cells, flash attention off: the same f32 arithmetic summed in other
// orders, about 1e-5 relative on toy-base's logits of magnitude ~10; 2e-5 to 1.1e-4 measured).
TEST(LlamaBatch, TheReferenceBatchKeepsWhatLlamaCppsBatchKeeps) {
  const ModelFile& file = *LlamaModels::toy;
  const BatchPlan plan = batch_plan(file.model);
  for (const char* policy : {"window", "streaming_llm", "h2o", "tova", "sirllm"}) {
    for (const Granularity granularity : {Granularity::token, Granularity::blocks(8)}) {
      Case c{policy, 48};
      c.granularity = granularity;
      if (c.policy == "tova") c.positions = PositionMode::cache_index;
      if (c.policy == "sirllm") {
        if (granularity != Granularity::token) continue;
        c.turn_every = 40;
      }
      SCOPED_TRACE(describe(c));
      kvevict::llama::LlamaSequenceSetOptions set_options;
      set_options.max_sequences = 3;
      set_options.max_chunk = 16;
      kvevict::llama::LlamaSequenceSet set(file.llama, batch_params(c.n_ctx, false), set_options);
      kvevict::model::DecoderBatch reference(file.model);
      std::vector<int> llama_ids(plan.streams.size(), -1);
      std::vector<int> reference_ids(plan.streams.size(), -1);
      std::vector<kvevict::llama::LlamaFeed> llama_feeds;
      std::vector<kvevict::model::DecoderFeed> reference_feeds;
      float largest = 0.0f;
      walk_plan(
          plan, c,
          [&](std::size_t i) {
            llama_ids[i] = set.open(make(c), sequence_options(c, plan.chunks[i]));
            kvevict::model::DecoderOptions decoder_options;
            decoder_options.granularity = c.granularity;
            decoder_options.position_mode = c.positions;
            decoder_options.max_chunk = plan.chunks[i];
            reference_ids[i] = reference.open(make(c), decoder_options);
          },
          [](std::size_t /*i*/) {},
          [&](std::span<const PlanFeed> step) {
            llama_feeds.clear();
            reference_feeds.clear();
            for (const PlanFeed& f : step) {
              llama_feeds.push_back({llama_ids[f.sequence], f.tokens, f.turn_start, false});
              reference_feeds.push_back(
                  {reference_ids[f.sequence], f.tokens, {f.turn_start, false}});
            }
            set.step(llama_feeds);
            reference.step(reference_feeds);
            for (const PlanFeed& f : step) {
              const int l = llama_ids[f.sequence];
              const int r = reference_ids[f.sequence];
              EXPECT_FALSE(set.failed(l).has_value());
              EXPECT_FALSE(reference.failed(r).has_value());
              if (kept(set.sequence(l)) != kept(reference.cache(r).sequence())) {
                ADD_FAILURE() << "sequence " << f.sequence
                              << ": the keep-sets differ after forward " << f.forward;
                return false;
              }
              const std::span<const float> expected = reference.result(r).last();
              const std::span<const float> actual = set.logits(l).last();
              for (std::size_t v = 0; v < expected.size(); ++v) {
                largest = std::max(largest, std::abs(expected[v] - actual[v]));
              }
            }
            return true;
          });
      EXPECT_LE(largest, 1e-3f);
    }
  }
}

// Sixteen sequences of growing length in a pool that holds four at full length (budget 32 plus a
// chunk of 4): none fails, none is cut below its minimum, and the cells held plus each step's
// tokens never exceed the pool.
TEST(LlamaBatch, SixteenSequencesInAPoolForFour) {
  const ModelFile& file = *LlamaModels::toy;
  constexpr int kSequences = 16;
  constexpr int kChunk = 4;
  constexpr int kPool = 4 * (32 + kChunk);
  kvevict::llama::LlamaSequenceSetOptions set_options;
  set_options.max_sequences = kSequences;
  set_options.max_chunk = kChunk;
  set_options.pool_cells = kPool;
  kvevict::llama::LlamaSequenceSet set(file.llama, batch_params(256, false), set_options);
  const std::vector<std::int32_t> text = stream_tokens(file.model, 1200);
  const char* const policies[] = {"window", "streaming_llm", "tova", "h2o"};  // h2o: below
  std::vector<int> ids;
  for (int i = 0; i < kSequences; ++i) {
    kvevict::llama::LlamaSequenceOptions options;
    options.max_chunk = kChunk;
    options.position_mode = PositionMode::cache_index;
    // Charges (minimum + chunk): window and tova 1 + 4, streaming_llm (4 sinks) 4 + 4, h2o (a
    // recent window of 8) 8 + 4: 120 of the 144 cells for the sixteen.
    const char* policy = policies[i % 4];
    ids.push_back(set.open(i % 4 == 3
                               ? kvevict::make_h2o({24, 8})
                               : kvevict::make_policy(policy, kvevict::budget_params(policy, 32)),
                           options));
  }
  ASSERT_NE(set.pool(), nullptr);
  std::vector<std::size_t> fed(kSequences, 0);
  std::vector<kvevict::llama::LlamaFeed> feeds;
  for (int step = 0; step < 60; ++step) {
    feeds.clear();
    for (int i = 0; i < kSequences; ++i) {
      // Sequence i starts at step i (they grow one after another) and takes 1 to 4 tokens.
      if (step < i) continue;
      const auto n = static_cast<std::size_t>(1 + (step + i) % kChunk);
      const std::size_t offset = (static_cast<std::size_t>(i) * 61 + fed[i]) % (text.size() - n);
      feeds.push_back({ids[static_cast<std::size_t>(i)],
                       std::span<const std::int32_t>(text).subspan(offset, n)});
      fed[i] += n;
    }
    set.step(feeds);
    int held = 0;
    for (int i = 0; i < kSequences; ++i) {
      const int id = ids[static_cast<std::size_t>(i)];
      ASSERT_FALSE(set.failed(id).has_value()) << *set.failed(id);
      held += set.live_cells(id);
      if (fed[i] > 0) {
        EXPECT_GE(
            static_cast<std::int64_t>(set.live_cells(id)),
            std::min<std::int64_t>(static_cast<std::int64_t>(fed[i]), set.pool()->minimum(id)));
      }
    }
    EXPECT_LE(held, kPool);
  }
  EXPECT_LE(set.pool()->stats().peak_cells, kPool);
  EXPECT_LE(set.stats().peak_cells, kPool);
  EXPECT_GT(set.pool()->stats().pressed_steps, 0);
}

// A policy whose pressed form drops the newest tokens (its own rule keeps the newest 32): under
// `original` positions llama.cpp cannot represent that, so a pool's cut of it must fail it alone.
class NewestGoFirstUnderPressure final : public kvevict::Policy {
 public:
  [[nodiscard]] std::string_view name() const override { return "newest_go_first"; }
  [[nodiscard]] std::optional<int> retained_limit() const override { return 32; }
  [[nodiscard]] bool supports_pressure() const override { return true; }
  void select(const kvevict::EvictionContext& context, kvevict::Decision& decision) override {
    const std::span<const std::int32_t> order = context.slots.stream_order(0);
    const int live = static_cast<int>(order.size());
    for (int i = 0; i < live - 32; ++i) decision.evict(0, order[static_cast<std::size_t>(i)]);
    for (int i = std::max(live - 32, 0); i < live - context.max_live; ++i) {
      decision.evict(0, order[static_cast<std::size_t>(live - 1 - (i - std::max(live - 32, 0)))]);
    }
  }
};

TEST(LlamaBatch, AFailedCutFailsThatSequenceAlone) {
  const ModelFile& file = *LlamaModels::random;
  kvevict::llama::LlamaSequenceSetOptions set_options;
  set_options.max_sequences = 2;
  set_options.max_chunk = 4;
  set_options.pool_cells = 48;
  kvevict::llama::LlamaSequenceSet set(file.llama, batch_params(256, false), set_options);
  kvevict::llama::LlamaSequenceOptions options;
  options.max_chunk = 4;
  options.granularity = Granularity::token;
  const int a = set.open(std::make_unique<NewestGoFirstUnderPressure>(), options);
  const int b =
      set.open(kvevict::make_policy("window", kvevict::budget_params("window", 32)), options);
  const std::vector<std::int32_t> tokens{5, 6, 7, 8};
  const std::vector<kvevict::llama::LlamaFeed> both{{a, tokens}, {b, tokens}};
  // 2 x 4 tokens per step: 8k cells at step k fit the pool of 48 up to the sixth; at the seventh
  // each holds 24, and 48 - 8 = 40 cells are left to keep: both are cut to 20.
  for (int step = 0; step < 6; ++step) set.step(both);
  EXPECT_FALSE(set.failed(a).has_value());
  set.step(both);
  ASSERT_TRUE(set.failed(a).has_value());
  EXPECT_NE(set.failed(a)->find("evicted the newest token"), std::string::npos) << *set.failed(a);
  EXPECT_EQ(llama_memory_seq_pos_max(llama_get_memory(set.context()), a), -1);  // cells freed
  EXPECT_FALSE(set.failed(b).has_value());
  // b goes on alone, in the whole pool.
  const std::vector<kvevict::llama::LlamaFeed> b_only{{b, tokens}};
  for (int step = 0; step < 5; ++step) set.step(b_only);
  EXPECT_FALSE(set.failed(b).has_value());
  EXPECT_EQ(set.live_cells(b), 32);
  EXPECT_NE(error_of([&] { set.step(both); }).find("sequence 0 failed"), std::string::npos);
  set.close(a);
}

// Bad input to a set: refused before anything changes, the other sequences unaffected.
TEST(LlamaBatch, BadInputLeavesTheOtherSequencesAlone) {
  const ModelFile& file = *LlamaModels::random;
  kvevict::llama::LlamaSequenceSetOptions set_options;
  set_options.max_sequences = 2;
  set_options.max_chunk = 4;
  set_options.pool_cells = 100;
  EXPECT_NE(error_of([&] {
              kvevict::llama::LlamaSequenceSetOptions too_big = set_options;
              too_big.pool_cells = 100000;
              kvevict::llama::LlamaSequenceSet set(file.llama, batch_params(256, false), too_big);
            }).find("does not fit in the context"),
            std::string::npos);
  kvevict::llama::LlamaSequenceSet set(file.llama, batch_params(256, false), set_options);
  kvevict::llama::LlamaSequenceOptions options;
  options.max_chunk = 4;
  const int a =
      set.open(kvevict::make_policy("window", kvevict::budget_params("window", 32)), options);
  // A budget the pool can never grant, and a pool whose minimums are all taken.
  EXPECT_NE(error_of([&] {
              (void)set.open(kvevict::make_policy("window", kvevict::budget_params("window", 200)),
                             options);
            }).find("can never grant it"),
            std::string::npos);
  const int b = set.open(kvevict::make_policy("h2o", kvevict::budget_params("h2o", 64)), options);
  EXPECT_NE(error_of([&] {
              (void)set.open(kvevict::make_policy("window", kvevict::budget_params("window", 8)),
                             options);
            }).find("all 2 sequences are open"),
            std::string::npos);
  const std::vector<std::int32_t> tokens{1, 40, 41, 42};
  const std::span<const std::int32_t> two = std::span<const std::int32_t>(tokens).first(2);
  const std::vector<std::int32_t> outside{1, 100000};
  using Feed = kvevict::llama::LlamaFeed;
  const std::vector<std::pair<std::vector<Feed>, std::string>> refused{
      {{{a, two}, {7, two}}, "sequence 7 is not open"},
      {{{a, two}, {a, two}}, "fed twice"},
      {{{b, std::span<const std::int32_t>()}}, "a chunk holds 1 to 4 tokens"},
      {{{b, outside}}, "outside the vocabulary"},
  };
  for (const auto& [feeds, message] : refused) {
    // clang 14 cannot capture a structured binding: the lambda takes a reference of its own.
    const std::vector<Feed>& bad = feeds;
    EXPECT_NE(error_of([&] { set.step(bad); }).find(message), std::string::npos) << message;
  }
  EXPECT_EQ(set.stats().steps, 0);
  const std::vector<Feed> fine{{a, tokens}, {b, two}};
  set.step(fine);
  EXPECT_EQ(set.live_cells(a), 4);
  EXPECT_EQ(set.live_cells(b), 2);
  set.close(a);
  EXPECT_NE(error_of([&] { set.step(fine); }).find("sequence 0 is not open"), std::string::npos);
  const std::vector<Feed> b_only{{b, two}};
  set.step(b_only);
  EXPECT_EQ(set.live_cells(b), 4);
}

}  // namespace
