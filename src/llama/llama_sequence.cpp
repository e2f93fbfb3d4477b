#include "kvevict/llama/llama_sequence.hpp"

#include <ggml-backend.h>
#include <ggml.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <kvevict/error.hpp>
#include <kvevict/signals.hpp>
#include <string>
#include <string_view>
#include <utility>

namespace kvevict::llama {
namespace {

constexpr std::string_view kSoftmaxName = "kq_soft_max-";  // llama-graph.cpp: cb(kq, ..., il)
// The K store of layer 0: set_rows(view of cache_k_l0, Kcur, cell indices) (llama-kv-cache.cpp).
constexpr std::string_view kLayer0KeysName = "cache_k_l0";

// -ln softmax(logits)[token], as the reference decoder computes it (float max, double sum).
float negative_log_softmax(const float* logits, int vocab, std::int32_t token) {
  const float max = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - max));
  return static_cast<float>(std::log(sum) + max - logits[token]);
}

// A node's data on the host: its own buffer on the CPU backend, else copied into `scratch`.
template <class T>
const T* host_data(const ggml_tensor* tensor, std::vector<std::byte>& scratch) {
  if (tensor->buffer == nullptr || ggml_backend_buffer_is_host(tensor->buffer)) {
    return static_cast<const T*>(tensor->data);
  }
  scratch.resize(ggml_nbytes(tensor));
  ggml_backend_tensor_get(tensor, scratch.data(), 0, scratch.size());
  return reinterpret_cast<const T*>(scratch.data());
}

std::string decode_failure(int status, int n_ctx) {
  switch (status) {
    case 1:
      return "llama_decode found no room in the KV cache (n_ctx " + std::to_string(n_ctx) +
             "): raise the context size (-c) above the policy's budget plus one chunk, or use "
             "a bounded policy";
    case 2:
      return "llama_decode was aborted";
    case -1:
      return "llama_decode rejected the batch (see llama.cpp's log above)";
    default:
      return "llama_decode failed with status " + std::to_string(status);
  }
}

}  // namespace

// What the graph callback (cb_eval) needs: the sequence, the layer-0 K store's cell indices and the
// softmax of every layer, handed to the policy as llama.cpp computed it while kvevict's slots are
// llama.cpp's cells, else re-indexed from cells to slots.
struct LlamaSequence::GraphTap {
  Sequence* sequence = nullptr;
  LlamaSequenceStats* stats = nullptr;
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  bool read_cells = false;    // a forward of ours is computing (not a K-shift graph)
  bool read_softmax = false;  // ... and the policy reads its attention
  bool catalyst = false;      // the forward is the catalyst prompt
  bool all_queries = false;
  std::exception_ptr error;
  std::vector<std::int32_t> cell_of_slot;  // [capacity] llama.cpp cell holding each live slot
  std::vector<std::int32_t> gather;        // [slot limit] cell per slot this forward, -1 if free
  bool gather_ready = false;
  // Every live slot sits in the cell of the same index (as both sides take the lowest free one),
  // so the softmax rows are already slot-indexed.
  bool cells_are_slots = false;
  std::vector<std::int32_t> free_slots;  // free slots below the slot limit
  std::vector<float> rows;               // [q_heads][queries][slot limit]
  std::vector<std::byte> scratch;

  static bool callback(ggml_tensor* tensor, bool ask, void* user_data) {
    auto* tap = static_cast<GraphTap*>(user_data);
    if (!tap->read_cells) return !ask;
    const std::string_view name(tensor->name);
    const bool softmax = tap->read_softmax && name.starts_with(kSoftmaxName);
    const bool store =
        tensor->op == GGML_OP_SET_ROWS && tensor->src[1] != nullptr &&
        name.starts_with(kLayer0KeysName) &&
        (name.size() == kLayer0KeysName.size() || name[kLayer0KeysName.size()] == ' ');
    if (ask) return softmax || store;
    try {
      if (store) tap->note_cells(*tensor->src[1]);
      if (softmax) tap->observe(std::stoi(std::string(name.substr(kSoftmaxName.size()))), *tensor);
    } catch (...) {
      tap->error = std::current_exception();
      return false;  // stops this split's computation; forward() rethrows
    }
    return true;
  }

  // The cells llama.cpp wrote the forward's tokens to (layer 0's set_rows indices).
  void note_cells(const ggml_tensor& indices) {
    const std::span<const std::int32_t> slots = sequence->chunk_slots(0, 0);
    KVEVICT_REQUIRE(ggml_nelements(&indices) == static_cast<std::int64_t>(slots.size()),
                    "llama.cpp wrote " + std::to_string(ggml_nelements(&indices)) +
                        " tokens in one ubatch, the forward has " + std::to_string(slots.size()) +
                        " (the context's n_ubatch must hold a whole chunk)");
    for (std::size_t i = 0; i < slots.size(); ++i) {
      std::int64_t cell = 0;
      if (indices.type == GGML_TYPE_I64) {
        cell = host_data<std::int64_t>(&indices, scratch)[i];
      } else {
        KVEVICT_REQUIRE(indices.type == GGML_TYPE_I32,
                        "llama.cpp's K store indices are not integers");
        cell = host_data<std::int32_t>(&indices, scratch)[i];
      }
      const auto slot = static_cast<std::size_t>(slots[i]);
      if (slot >= cell_of_slot.size()) cell_of_slot.resize(slot + 1, -1);
      cell_of_slot[slot] = static_cast<std::int32_t>(cell);
    }
    gather_ready = false;
  }

  void build_gather() {
    const SlotTable& table = sequence->slots();
    const int limit = sequence->slot_limit(0, 0);
    gather.assign(static_cast<std::size_t>(limit), -1);
    cells_are_slots = true;
    free_slots.clear();
    for (int slot = 0; slot < limit; ++slot) {
      if (table.is_live(0, slot)) {
        const std::int32_t cell = cell_of_slot.at(static_cast<std::size_t>(slot));
        gather[static_cast<std::size_t>(slot)] = cell;
        cells_are_slots = cells_are_slots && cell == slot;
      } else {
        free_slots.push_back(slot);
      }
    }
    gather_ready = true;
  }

  // softmax: [n_kv cells, n_tokens, n_head] (ne0 fastest). Hands the policy [q_heads][queries]
  // [slot limit] rows, slot-indexed: every query (H2O, the catalyst's CaP) or the last (TOVA).
  void observe(int layer, const ggml_tensor& softmax) {
    KVEVICT_REQUIRE(softmax.type == GGML_TYPE_F32, "kq_soft_max is not f32");
    KVEVICT_REQUIRE(softmax.ne[2] == q_heads && softmax.ne[3] == 1,
                    "kq_soft_max-" + std::to_string(layer) + " has an unexpected shape");
    const StageScope scope(sequence->observer(), Stage::policy);
    if (!gather_ready) build_gather();
    const int tokens = static_cast<int>(softmax.ne[1]);
    const int first = all_queries || catalyst ? 0 : tokens - 1;
    const int queries = tokens - first;
    const auto limit = static_cast<std::ptrdiff_t>(gather.size());
    const auto* data = host_data<char>(&softmax, scratch);
    if (const float* direct = slot_indexed_rows(softmax, data, first, queries)) {
      // Row i of head h starts at direct + (h * queries + i) * stride, as
      // Sequence::observe_attention reads.
      const auto stride = static_cast<std::ptrdiff_t>(
          (queries == 1 ? softmax.nb[2] : softmax.nb[1]) / sizeof(float));
      hand_over(layer, direct, queries, stride);
      return;
    }
    ++stats->reindexed_layers;
    rows.resize(static_cast<std::size_t>(q_heads) * queries * gather.size());
    for (int h = 0; h < q_heads; ++h) {
      for (int i = 0; i < queries; ++i) {
        const auto* in = reinterpret_cast<const float*>(
            data + h * softmax.nb[2] + static_cast<std::size_t>(first + i) * softmax.nb[1]);
        float* out = rows.data() + (static_cast<std::ptrdiff_t>(h) * queries + i) * limit;
        for (std::ptrdiff_t s = 0; s < limit; ++s) {
          const std::int32_t cell = gather[static_cast<std::size_t>(s)];
          out[s] = cell >= 0 ? in[cell] : 0.0f;
        }
      }
    }
    hand_over(layer, rows.data(), queries, limit);
  }

  // The softmax tensor's own rows when they can be handed over as they are: every live slot in
  // its own cell, rows [first, first + queries) laid out as Sequence::observe_attention reads them
  // (head stride = queries x row stride), and every free slot below the limit reading exactly 0
  // (its cell is empty, masked to -inf before the softmax). Else null: the rows are gathered.
  const float* slot_indexed_rows(const ggml_tensor& softmax, const char* data, int first,
                                 int queries) const {
    const auto limit = static_cast<std::int64_t>(gather.size());
    if (!cells_are_slots || limit > softmax.ne[0] || softmax.nb[0] != sizeof(float)) {
      return nullptr;
    }
    const bool laid_out = queries == 1 ? softmax.nb[2] % sizeof(float) == 0
                                       : softmax.nb[1] % sizeof(float) == 0 &&
                                             softmax.nb[2] == softmax.nb[1] * softmax.ne[1];
    if (!laid_out) return nullptr;
    for (int h = 0; h < q_heads; ++h) {
      for (int i = first; i < first + queries; ++i) {
        const auto* in = reinterpret_cast<const float*>(
            data + h * softmax.nb[2] + static_cast<std::size_t>(i) * softmax.nb[1]);
        for (const std::int32_t slot : free_slots) {
          if (in[slot] != 0.0f) return nullptr;
        }
      }
    }
    return reinterpret_cast<const float*>(data + static_cast<std::size_t>(first) * softmax.nb[1]);
  }

  void hand_over(int layer, const float* data, int queries, std::ptrdiff_t stride) {
    if (catalyst) {
      sequence->observe_catalyst(layer, data, queries, stride);
    } else {
      sequence->observe_attention(layer, data, queries, stride);
    }
  }
};

LlamaSequence::LlamaSequence(llama_model* model, llama_context_params params,
                             std::unique_ptr<Policy> policy, LlamaSequenceOptions options)
    : model_(model), options_(std::move(options)), tap_(std::make_unique<GraphTap>()) {
  KVEVICT_REQUIRE(model_ != nullptr, "LlamaSequence: model is null");
  KVEVICT_REQUIRE(policy != nullptr, "LlamaSequence: policy is null");
  KVEVICT_REQUIRE(options_.max_chunk > 0, "LlamaSequence: max_chunk must be positive");
  KVEVICT_REQUIRE(params.cb_eval == nullptr,
                  "LlamaSequence installs its own cb_eval: leave llama_context_params::cb_eval "
                  "unset");
  const std::string policy_name(policy->name());
  const Granularity granularity = options_.granularity.value_or(Granularity::token);
  if (!granularity.whole_sequence()) {
    throw Error("granularity " + to_string(granularity) +
                " is not possible in llama.cpp, whose KV cells are shared by every layer and "
                "head: use granularity token or block:B");
  }
  KVEVICT_REQUIRE(!llama_model_is_recurrent(model_) && !llama_model_is_hybrid(model_),
                  "kvevict drives attention KV caches: recurrent and hybrid models are not "
                  "supported");
  const PositionMode mode = options_.position_mode.value_or(policy->default_position_mode());
  const SignalSet signals = policy->signals();
  reads_attention_ = signals.contains(Signal::attention_rows) ||
                     signals.contains(Signal::last_attention_row) ||
                     signals.contains(Signal::catalyst_attention);
  const bool runs_catalyst = signals.contains(Signal::catalyst_attention);
  if (runs_catalyst && !options_.catalyst) {
    throw Error("policy '" + policy_name + "' runs a catalyst prompt: give one (may be empty)");
  }
  if (reads_attention_) {
    if (params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_ENABLED) {
      throw Error("policy '" + policy_name +
                  "' reads attention probabilities, which llama.cpp only exposes with flash "
                  "attention off: do not force flash attention on (-fa on)");
    }
    KVEVICT_REQUIRE(llama_model_n_swa(model_) == 0,
                    "policy '" + policy_name +
                        "' reads attention, and this model's sliding-window layers keep a second "
                        "KV cache whose cells kvevict does not map");
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    params.cb_eval = &GraphTap::callback;
    params.cb_eval_user_data = tap_.get();
  }
  // llama.cpp's CPU K-shift ropes f32 and f16 keys in place (quantized ones through an f32 copy);
  // any other cell type aborts the process at the first shift.
  const bool shiftable_keys = params.type_k == GGML_TYPE_F32 || params.type_k == GGML_TYPE_F16 ||
                              ggml_is_quantized(params.type_k);
  if (mode != PositionMode::original && !shiftable_keys) {
    throw Error("positions " + std::string(to_string(mode)) + " shift kept keys, and llama.cpp's " +
                "CPU K-shift cannot rotate " + ggml_type_name(params.type_k) +
                " cells (it aborts): use positions original, or f32, f16 or q8_0 cells");
  }
  // llama.cpp refuses this itself, with only "llama_init_from_model failed" reaching the caller.
  if (ggml_is_quantized(params.type_v) &&
      params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED) {
    throw Error(std::string("llama.cpp's quantized V cells (") + ggml_type_name(params.type_v) +
                ") need flash attention, which is off " +
                (reads_attention_
                     ? "because policy '" + policy_name + "' reads attention probabilities"
                     : std::string("(-fa off)")) +
                ": use f32, f16 or bf16 cells");
  }
  const int catalyst_size = options_.catalyst ? static_cast<int>(options_.catalyst->size()) : 0;
  const int widest = std::max(options_.max_chunk, catalyst_size);
  params.n_batch = std::max<std::uint32_t>(params.n_batch, static_cast<std::uint32_t>(widest));
  params.n_ubatch = std::max<std::uint32_t>(params.n_ubatch, static_cast<std::uint32_t>(widest));
  params.n_batch = std::max(params.n_batch, params.n_ubatch);

  const std::optional<int> limit = policy->retained_limit();
  SequenceConfig config;
  config.layers = llama_model_n_layer(model_);
  config.q_heads = llama_model_n_head(model_);
  config.kv_heads = llama_model_n_head_kv(model_);
  config.position_mode = mode;
  config.granularity = granularity;
  config.key_storage = KeyStorage::pre_rope;  // llama.cpp re-rotates keys itself (K-shift)
  config.max_chunk = widest;
  config.slot_reuse = options_.slot_reuse;
  config.attention_views = false;  // llama.cpp attends over its own cells

  context_ = llama_init_from_model(model_, params);
  KVEVICT_REQUIRE(context_ != nullptr, "llama_init_from_model failed (see llama.cpp's log)");
  try {
    const int n_ctx = static_cast<int>(llama_n_ctx(context_));
    if (mode != PositionMode::original && !llama_memory_can_shift(llama_get_memory(context_))) {
      throw Error("positions " + std::string(to_string(mode)) +
                  " lower the positions of kept tokens, and this model's KV cache cannot shift "
                  "them (llama_memory_can_shift is false, e.g. M-RoPE): use positions original");
    }
    if (limit && static_cast<std::int64_t>(*limit) + widest > n_ctx) {
      throw Error("policy '" + policy_name + "' keeps up to " + std::to_string(*limit) +
                  " tokens plus a chunk of " + std::to_string(widest) +
                  ", more than the context's " + std::to_string(n_ctx) +
                  " cells: raise the context size (-c) or lower the budget");
    }
    vocab_ = llama_vocab_n_tokens(llama_model_get_vocab(model_));
    const std::int64_t head_dim = llama_model_n_embd(model_) / config.q_heads;
    bytes_per_cell_ = static_cast<std::size_t>(config.layers) *
                      (ggml_row_size(params.type_k, config.kv_heads * head_dim) +
                       ggml_row_size(params.type_v, config.kv_heads * head_dim));
    sequence_ = std::make_unique<Sequence>(config, std::move(policy), &cells_, options_.observer);
    tap_->sequence = sequence_.get();
    tap_->stats = &stats_;
    tap_->layers = config.layers;
    tap_->q_heads = config.q_heads;
    tap_->kv_heads = config.kv_heads;
    tap_->all_queries = sequence_->wants(Signal::attention_rows);
    batch_ = llama_batch_init(widest, 0, 1);
  } catch (...) {
    llama_free(context_);
    throw;
  }
}

LlamaSequence::~LlamaSequence() {
  if (batch_.token != nullptr) llama_batch_free(batch_);
  llama_free(context_);
}

int LlamaSequence::live_cells() const { return sequence_->slots().live(0); }

LlamaLogits LlamaSequence::feed(std::span<const std::int32_t> tokens, bool turn_start,
                                bool all_logits) {
  KVEVICT_REQUIRE(!tokens.empty(), "LlamaSequence::feed: no tokens to feed");
  const auto width = static_cast<std::size_t>(vocab_);
  if (all_logits) feed_logits_.resize(tokens.size() * width);
  LlamaLogits last;
  std::size_t offset = 0;
  while (offset < tokens.size()) {
    std::size_t n = std::min(static_cast<std::size_t>(options_.max_chunk), tokens.size() - offset);
    // Never cross a pot boundary: the pot is distilled exactly when it is full.
    const std::optional<int> room = sequence_->pot_room();
    if (room && *room > 0) n = std::min(n, static_cast<std::size_t>(*room));
    last = forward(tokens.subspan(offset, n), turn_start && offset == 0, all_logits);
    if (all_logits) {
      std::copy(last.values.begin(), last.values.end(),
                feed_logits_.begin() + static_cast<std::ptrdiff_t>(offset * width));
    }
    offset += n;
  }
  if (all_logits) {
    last.values = feed_logits_;
    last.rows = static_cast<int>(tokens.size());
  }
  return last;
}

// Removes the evicted tokens' cells by position and, under cache_index / reset_on_compact, lowers
// every kept cell by the number of evictions before it, so that llama.cpp's positions stay
// kvevict's (each kept token's rank). Ranges of consecutive positions go in one call.
void LlamaSequence::apply(const AppliedDecision& decision) {
  llama_memory_t memory = llama_get_memory(context_);
  removed_.clear();
  for (const EvictedSlot& slot : decision.evicted(0)) removed_.push_back(slot.position);
  std::sort(removed_.begin(), removed_.end());
  const bool shift = decision.position_mode != PositionMode::original;
  std::size_t i = 0;
  std::int64_t lowered = 0;
  while (i < removed_.size()) {
    std::size_t j = i + 1;
    while (j < removed_.size() && removed_[j] == removed_[j - 1] + 1) ++j;
    const auto begin = static_cast<llama_pos>(removed_[i]);
    const auto end = static_cast<llama_pos>(removed_[j - 1] + 1);
    KVEVICT_REQUIRE(llama_memory_seq_rm(memory, 0, begin, end),
                    "llama_memory_seq_rm refused to remove positions [" + std::to_string(begin) +
                        ", " + std::to_string(end) + ")");
    ++stats_.removed_ranges;
    lowered += end - begin;
    if (shift) {
      // Kept cells in [end, next removed) move down by everything removed so far.
      const llama_pos next = j < removed_.size() ? static_cast<llama_pos>(removed_[j]) : -1;
      llama_memory_seq_add(memory, 0, end, next, static_cast<llama_pos>(-lowered));
      ++stats_.shifted_ranges;
    }
    i = j;
  }
  if (!shift) {
    const llama_pos last = llama_memory_seq_pos_max(memory, 0);
    const std::int64_t next = sequence_->stats().tokens_fed;
    if (last >= 0 && last + 1 != next) {
      throw Error("policy '" + std::string(sequence_->policy().name()) +
                  "' evicted the newest token (position " + std::to_string(next - 1) +
                  ") under positions original; llama.cpp requires a sequence's next position to "
                  "follow its last kept one: use positions cache_index");
    }
  }
}

void LlamaSequence::decode(std::span<const std::int32_t> tokens, bool catalyst, bool all_logits) {
  const std::span<const std::int32_t> slots = sequence_->chunk_slots(0, 0);
  batch_.n_tokens = static_cast<std::int32_t>(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    batch_.token[i] = tokens[i];
    batch_.pos[i] = static_cast<llama_pos>(sequence_->position(0, 0, slots[i]));
    batch_.n_seq_id[i] = 1;
    batch_.seq_id[i][0] = 0;
    batch_.logits[i] = static_cast<std::int8_t>(all_logits || i + 1 == tokens.size());
  }
  tap_->catalyst = catalyst;
  tap_->error = nullptr;
  tap_->read_cells = reads_attention_;
  tap_->read_softmax =
      sequence_->wants(catalyst ? Signal::catalyst_attention : Signal::attention_rows) ||
      (!catalyst && sequence_->wants(Signal::last_attention_row));
  const int status = llama_decode(context_, batch_);
  tap_->read_cells = false;
  tap_->read_softmax = false;
  if (tap_->error) std::rethrow_exception(tap_->error);
  if (status != 0) throw Error(decode_failure(status, static_cast<int>(llama_n_ctx(context_))));
  stats_.peak_cells = std::max(stats_.peak_cells, sequence_->slots().live(0));
}

LlamaLogits LlamaSequence::forward(std::span<const std::int32_t> tokens, bool turn_start,
                                   bool all_logits) {
  const int n = static_cast<int>(tokens.size());
  KVEVICT_REQUIRE(n > 0 && n <= options_.max_chunk, "LlamaSequence::forward: a chunk holds 1 to " +
                                                        std::to_string(options_.max_chunk) +
                                                        " tokens, got " + std::to_string(n));
  for (const std::int32_t token : tokens) {
    KVEVICT_REQUIRE(
        token >= 0 && token < vocab_,
        "LlamaSequence::forward: token " + std::to_string(token) + " is outside the vocabulary");
  }
  const bool wants_surprisal = sequence_->wants(Signal::surprisal);
  const bool all_rows = all_logits || wants_surprisal;
  sequence_->begin_chunk(tokens, turn_start);
  decode(tokens, /*catalyst=*/false, all_rows);
  const int rows = all_rows ? n : 1;
  const auto width = static_cast<std::size_t>(vocab_);
  logits_.resize(static_cast<std::size_t>(rows) * width);
  for (int r = 0; r < rows; ++r) {
    const float* row = llama_get_logits_ith(context_, all_rows ? r : n - 1);
    KVEVICT_REQUIRE(row != nullptr, "llama.cpp returned no logits");
    std::copy(row, row + width, logits_.begin() + static_cast<std::ptrdiff_t>(r * width));
  }
  if (wants_surprisal) observe_surprisal(tokens);
  const std::span<const float> last(logits_.data() + (rows - 1) * width, width);
  previous_last_.assign(last.begin(), last.end());
  has_previous_ = true;
  sequence_->end_forward();
  ++stats_.forwards;
  if (sequence_->catalyst_pending()) run_catalyst();
  LlamaLogits result;
  result.vocab = vocab_;
  result.rows = all_logits ? n : 1;
  result.values = std::span<const float>(logits_).subspan(
      all_logits || !all_rows ? 0 : static_cast<std::size_t>(n - 1) * width,
      static_cast<std::size_t>(result.rows) * width);
  return result;
}

// Surprisal of each token: row k - 1 of this forward's logits, the previous forward's last row for
// the first token, 0 for the stream's very first (as the reference decoder).
void LlamaSequence::observe_surprisal(std::span<const std::int32_t> tokens) {
  surprisal_.resize(tokens.size());
  surprisal_[0] =
      has_previous_ ? negative_log_softmax(previous_last_.data(), vocab_, tokens[0]) : 0.0f;
  for (std::size_t k = 1; k < tokens.size(); ++k) {
    surprisal_[k] = negative_log_softmax(
        logits_.data() + (k - 1) * static_cast<std::size_t>(vocab_), vocab_, tokens[k]);
  }
  sequence_->observe_surprisal(surprisal_);
}

// The pot is full: the catalyst prompt is decoded after it (positions continuing), its attention
// handed to the policy layer by layer, then Sequence::end_catalyst rolls it back and distills, in
// one decision: apply() removes the catalyst's cells (the newest positions) with the evicted ones.
// A second sequence (llama_memory_seq_cp) would cost a copy of the pot's cell membership and
// n_seq_max = 2 for nothing: the catalyst is always the sequence's newest stretch.
void LlamaSequence::run_catalyst() {
  const std::vector<std::int32_t>& prompt = *options_.catalyst;
  {
    const StageScope scope(options_.observer, Stage::catalyst);
    sequence_->begin_catalyst(prompt);
    if (!prompt.empty()) decode(prompt, /*catalyst=*/true, /*all_logits=*/false);
  }
  sequence_->end_catalyst();
  ++stats_.catalyst_runs;
}

}  // namespace kvevict::llama
