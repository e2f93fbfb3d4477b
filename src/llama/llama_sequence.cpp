#include "kvevict/llama/llama_sequence.hpp"

#include <ggml-backend.h>
#include <ggml-cpu.h>
#include <ggml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <kvevict/checked.hpp>
#include <kvevict/detail/half.hpp>
#include <kvevict/error.hpp>
#include <kvevict/signals.hpp>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "kvevict/llama/llama_sequence_set.hpp"
#include "llama/attention_kernels.hpp"

namespace kvevict::llama {
namespace {

constexpr std::string_view kSoftmaxName = "kq_soft_max-";  // llama-graph.cpp: cb(kq, ..., il)
// Every layer's K cache tensor is "cache_k_l<layer>" (llama-kv-cache.cpp); the flash-attention
// node (llm_graph_context::build_attn_mha, not named by cb()) reads a view of it, so the layer of a
// GGML_OP_FLASH_ATTN_EXT node is read from the name of its K source ("cache_k_l3 (view)
// (permuted)", "... (copy)" when llama.cpp casts f32 cells to f16 for it).
constexpr std::string_view kKeysName = "cache_k_l";

// -inf in f16 (the KQ mask's masked cells).
constexpr ggml_fp16_t kMaskedHalf = 0xFC00;
static_assert(sizeof(ggml_fp16_t) == 2);

// The layer whose K cache `keys` views, or -1 when its name is not "cache_k_l<layer>...".
int layer_of_keys(const ggml_tensor& keys) {
  const std::string_view name(keys.name);
  if (!name.starts_with(kKeysName)) return -1;
  int layer = -1;
  const char* begin = name.data() + kKeysName.size();
  const auto [end, status] = std::from_chars(begin, name.data() + name.size(), layer);
  if (status != std::errc() || end == begin || layer < 0) return -1;
  return layer;
}

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

namespace internal {

// What the graph callback (cb_eval) needs of one sequence: the sequence, the layer-0 K store's cell
// indices and the softmax of every layer, handed to the policy as llama.cpp computed it while
// kvevict's slots are llama.cpp's cells, else re-indexed from cells to slots. The sequence's tokens
// are [token_offset, token_offset + token_count) of the ubatch's ubatch_tokens.
struct GraphTap {
  Sequence* sequence = nullptr;
  LlamaSequenceStats* stats = nullptr;
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  bool read_cells = false;    // a forward of ours is computing (not a K-shift graph)
  bool read_softmax = false;  // ... and the policy reads its attention
  bool read_keys = false;     // ... or the keys llama.cpp stores (K-norm, KeyDiff)
  int token_offset = 0;
  int token_count = 0;
  int ubatch_tokens = 0;
  int head_dim = 0;
  std::vector<std::uint8_t> keys_seen;  // [layers] keys handed over this forward
  std::vector<float> chunk_keys;        // [kv_heads][tokens][head_dim] of one layer
  bool catalyst = false;                // the forward is the catalyst prompt
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
  // Flash attention on: the layers whose rows this forward handed over, and the scratch of the
  // rows kvevict computes (observe_flash).
  std::vector<std::uint8_t> seen;  // [layers]
  bool flash_seen = false;
  // What every layer of a forward shares (prepare_flash), built at its first layer.
  bool flash_prepared = false;
  const char* prepared_mask = nullptr;
  int prepared_first = 0;
  int prepared_queries = 0;
  std::int64_t prepared_cells = 0;
  std::vector<std::int32_t> key_cells;  // [slot limit] each slot's cell, a live one if free
  std::vector<std::int32_t> identity;   // [slot limit] 0, 1, ... (rows of key_floats)
  std::vector<float> bias;              // [queries][slot limit] the mask at each slot's cell
  // Per layer and KV head.
  std::vector<std::byte> rounded_query;  // one query row in the dot product's type
  std::vector<float> query_floats;       // [group][queries][head_dim] rounded, in f32
  std::vector<float> key_floats;  // [slot limit][head_dim] K rows dequantized (other cell types)
  std::vector<std::byte> scratch_keys;
  std::vector<std::byte> scratch_mask;

  // A forward that reads attention starts: no layer handed over yet.
  void begin_forward() {
    seen.assign(static_cast<std::size_t>(layers), 0);
    flash_seen = false;
    flash_prepared = false;
  }

  // `source()` names the node in an error (built only then: this runs for every layer).
  template <class Source>
  void mark(int layer, const Source& source) {
    KVEVICT_REQUIRE(layer >= 0 && layer < layers, source() + " is layer " + std::to_string(layer) +
                                                      ", the model has " + std::to_string(layers));
    auto& once = seen[static_cast<std::size_t>(layer)];
    KVEVICT_REQUIRE(once == 0, "llama.cpp's graph computed the attention of layer " +
                                   std::to_string(layer) + " twice in one forward (" + source() +
                                   "): kvevict maps one attention per layer to its cells");
    once = 1;
  }

  // After the forward: every layer's rows went to the policy, else an error naming what the graph
  // lacked (another architecture's attention, a node named otherwise), never a partial score.
  void check_every_layer() const {
    for (int layer = 0; layer < layers; ++layer) {
      if (seen[static_cast<std::size_t>(layer)] != 0) continue;
      const std::string l = std::to_string(layer);
      throw Error("llama.cpp's graph gave kvevict no attention for layer " + l + " of " +
                  std::to_string(layers) +
                  (flash_seen ? " with flash attention on: no flash-attention node "
                                "(GGML_OP_FLASH_ATTN_EXT) reading that layer's K cache (cache_k_l" +
                                    l + ") was computed"
                              : ": neither kq_soft_max-" + l +
                                    " (flash attention off) nor a flash-attention node "
                                    "(GGML_OP_FLASH_ATTN_EXT) over cache_k_l" +
                                    l + " (flash attention on) was computed") +
                  "; kvevict reads attention only where llama.cpp builds it with "
                  "llm_graph_context::build_attn_mha over its KV cache");
    }
  }

  // What this sequence reads of a graph node (the set's graph callback asks every member).
  struct Reads {
    bool softmax = false;
    bool flash = false;
    bool store = false;  // layer 0's K store: the cells of the ubatch's tokens
    int key_layer = -1;  // a K store whose keys the policy reads
    [[nodiscard]] bool any() const { return softmax || flash || store || key_layer >= 0; }
  };
  [[nodiscard]] Reads reads(const ggml_tensor& tensor) const {
    Reads r;
    if (!read_cells || error) return r;
    r.softmax = read_softmax && std::string_view(tensor.name).starts_with(kSoftmaxName);
    r.flash = read_softmax && tensor.op == GGML_OP_FLASH_ATTN_EXT;
    const int key_layer =
        tensor.op == GGML_OP_SET_ROWS && tensor.src[0] != nullptr && tensor.src[1] != nullptr
            ? layer_of_keys(tensor)  // the K store is named after its cache view
            : -1;
    r.store = key_layer == 0;
    r.key_layer = read_keys ? key_layer : -1;
    return r;
  }
  // Hands the node to the policy; a failure is kept for the step to report (this sequence fails,
  // the others go on).
  void take(const ggml_tensor& tensor, const Reads& r) {
    try {
      if (r.store) note_cells(*tensor.src[1]);
      if (r.key_layer >= 0) observe_keys(r.key_layer, *tensor.src[0]);
      if (r.softmax) {
        observe(std::stoi(std::string(std::string_view(tensor.name).substr(kSoftmaxName.size()))),
                tensor);
      }
      if (r.flash) observe_flash(tensor);
    } catch (...) {
      error = std::current_exception();
    }
  }

  // The keys llama.cpp writes to layer `layer`'s K cells: Kcur after RoPE (and whatever the
  // architecture applies before storing), f32, [kv_heads x head_dim, tokens] before the cache's
  // conversion to its cell type. Handed over as [kv_heads][tokens][head_dim].
  void observe_keys(int layer, const ggml_tensor& keys) {
    KVEVICT_REQUIRE(layer < layers, "llama.cpp stored keys of layer " + std::to_string(layer) +
                                        ", the model has " + std::to_string(layers));
    KVEVICT_REQUIRE(keys.type == GGML_TYPE_F32,
                    std::string("llama.cpp's keys for cache_k_l") + std::to_string(layer) +
                        " are " + ggml_type_name(keys.type) + ", kvevict reads f32");
    const int tokens = token_count;
    KVEVICT_REQUIRE(
        keys.ne[0] == static_cast<std::int64_t>(kv_heads) * head_dim &&
            keys.ne[1] == ubatch_tokens && keys.nb[0] == sizeof(float),
        "llama.cpp's keys for cache_k_l" + std::to_string(layer) + " are [" +
            std::to_string(keys.ne[0]) + ", " + std::to_string(keys.ne[1]) +
            "], kvevict expected [kv_heads x head_dim = " + std::to_string(kv_heads * head_dim) +
            ", tokens = " + std::to_string(ubatch_tokens) + "] (head_dim = n_embd / n_head)");
    auto& once = keys_seen[static_cast<std::size_t>(layer)];
    KVEVICT_REQUIRE(once == 0, "llama.cpp stored the keys of layer " + std::to_string(layer) +
                                   " twice in one forward");
    once = 1;
    const auto* data = host_data<char>(&keys, scratch);
    const auto row = static_cast<std::size_t>(head_dim);
    chunk_keys.resize(static_cast<std::size_t>(kv_heads) * static_cast<std::size_t>(tokens) * row);
    for (int t = 0; t < tokens; ++t) {
      const auto* token = reinterpret_cast<const float*>(
          data + static_cast<std::size_t>(token_offset + t) * keys.nb[1]);
      for (int g = 0; g < kv_heads; ++g) {
        std::copy_n(token + static_cast<std::size_t>(g) * row, row,
                    chunk_keys.begin() + static_cast<std::ptrdiff_t>(
                                             (static_cast<std::size_t>(g) * tokens + t) * row));
      }
    }
    const StageScope scope(sequence->observer(), Stage::policy);
    sequence->observe_keys(layer, chunk_keys.data(), head_dim);
  }

  // After a forward of a key-reading policy: every layer's keys went to the policy, else an error
  // naming the K store the graph did not compute.
  void check_every_key_layer() const {
    for (int layer = 0; layer < layers; ++layer) {
      KVEVICT_REQUIRE(keys_seen[static_cast<std::size_t>(layer)] != 0,
                      "llama.cpp's graph stored no keys of layer " + std::to_string(layer) +
                          " of " + std::to_string(layers) + " (no set_rows into cache_k_l" +
                          std::to_string(layer) +
                          "): kvevict reads the keys where llama_kv_cache::cpy_k stores them");
    }
  }

  // The cells llama.cpp wrote the forward's tokens to (layer 0's set_rows indices).
  void note_cells(const ggml_tensor& indices) {
    const std::span<const std::int32_t> slots = sequence->chunk_slots(0, 0);
    KVEVICT_REQUIRE(ggml_nelements(&indices) == ubatch_tokens,
                    "llama.cpp wrote " + std::to_string(ggml_nelements(&indices)) +
                        " tokens in one ubatch, the forward has " + std::to_string(ubatch_tokens) +
                        " (the context's n_ubatch must hold a whole step)");
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const std::size_t at = static_cast<std::size_t>(token_offset) + i;
      std::int64_t cell = 0;
      if (indices.type == GGML_TYPE_I64) {
        cell = host_data<std::int64_t>(&indices, scratch)[at];
      } else {
        KVEVICT_REQUIRE(indices.type == GGML_TYPE_I32,
                        "llama.cpp's K store indices are not integers");
        cell = host_data<std::int32_t>(&indices, scratch)[at];
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
    flash_prepared = false;
  }

  // softmax: [n_kv cells, n_tokens, n_head] (ne0 fastest). Hands the policy [q_heads][queries]
  // [slot limit] rows, slot-indexed: every query (H2O, the catalyst's CaP) or the last (TOVA).
  void observe(int layer, const ggml_tensor& softmax) {
    KVEVICT_REQUIRE(softmax.type == GGML_TYPE_F32, "kq_soft_max is not f32");
    KVEVICT_REQUIRE(softmax.ne[2] == q_heads && softmax.ne[3] == 1,
                    "kq_soft_max-" + std::to_string(layer) + " has an unexpected shape");
    const StageScope scope(sequence->observer(), Stage::policy);
    mark(layer, [layer] { return "kq_soft_max-" + std::to_string(layer); });
    if (!gather_ready) build_gather();
    const int first = token_offset + (all_queries || catalyst ? 0 : token_count - 1);
    const int queries = token_offset + token_count - first;
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

  static std::string flash_where(int layer) {
    return "layer " + std::to_string(layer) + "'s flash attention";
  }

  // Flash attention on: the kernel (ggml_flash_attn_ext) never forms the softmax, so kvevict
  // computes the rows the policy reads from the node's own sources once it is computed: q
  // (src[0], after RoPE: [head_dim, tokens, q_heads]), the layer's K cells (src[1]: [head_dim,
  // n_kv cells, kv_heads]; where llama.cpp casts f32 cells to f16 for the kernel, the f32 cells
  // themselves, as the softmax path reads them) and the KQ mask (src[3], f16 [n_kv, tokens], -inf
  // where a query may not attend); scale from op_params. The row of query head h over slot s is
  // softmax(scale * q.k + mask) over the sequence's cells, k the cell of slot s in KV head
  // h / (q_heads / kv_heads); q is rounded to the type ggml's CPU matrix product rounds it to
  // against these cells (f16 for f16 cells), as kq is formed with flash attention off, and the
  // dot products are ggml's CPU ones (below); exp and the double sum as ggml's CPU soft_max. So
  // the rows are the softmax path's up to float summation order.
  // Cost: one q.K pass, no V and no output, for the rows the policy reads only: the last query
  // (TOVA), every query of the chunk (H2O) or of the catalyst (InfiniPot, once per pot), times
  // q_heads x live cells x head_dim multiply-adds per layer, on the thread that runs the graph
  // callback (timed as the policy stage).
  void observe_flash(const ggml_tensor& node) {
    // The error messages' names, built only for an error (this runs for every layer).
    const auto node_name = [&node] {
      return "flash-attention node '" + std::string(node.name) + "'";
    };
    const ggml_tensor* q = node.src[0];
    const ggml_tensor* k = node.src[1];
    const ggml_tensor* mask = node.src[3];
    KVEVICT_REQUIRE(q != nullptr && k != nullptr, node_name() + " has no q or K source");
    if (k->op == GGML_OP_CPY && k->src[0] != nullptr && k->src[0]->type == GGML_TYPE_F32 &&
        ggml_are_same_shape(k, k->src[0])) {
      k = k->src[0];  // the f32 cells llama.cpp cast to f16 for the kernel
    }
    const int layer = layer_of_keys(*k);
    KVEVICT_REQUIRE(layer >= 0, node_name() + " reads its keys from '" + std::string(k->name) +
                                    "', not a layer's K cache (cache_k_l<layer>): kvevict cannot "
                                    "tell which layer's cells it attends over (use --fa off)");
    flash_seen = true;
    const auto where = [layer] { return flash_where(layer); };
    float params[3] = {};
    std::memcpy(params, node.op_params, sizeof params);
    const float scale = params[0];
    KVEVICT_REQUIRE(params[1] == 0.0f, where() + " applies ALiBi (max_bias " +
                                           std::to_string(params[1]) +
                                           "), which kvevict does not compute: use --fa off");
    KVEVICT_REQUIRE(params[2] == 0.0f, where() + " caps its logits (softcap " +
                                           std::to_string(params[2]) +
                                           "), which kvevict does not compute: use --fa off");
    KVEVICT_REQUIRE(node.src[4] == nullptr,
                    where() + " has attention sinks, which kvevict does not compute: use --fa off");
    KVEVICT_REQUIRE(mask != nullptr && mask->type == GGML_TYPE_F16,
                    where() +
                        " has no f16 KQ mask: kvevict needs it to know which cells a query "
                        "attends");
    KVEVICT_REQUIRE(q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float),
                    where() + ": its queries are not f32 rows");
    KVEVICT_REQUIRE(q->ne[2] == q_heads && k->ne[2] == kv_heads && q->ne[3] == 1 && k->ne[3] == 1 &&
                        q->ne[0] == k->ne[0] && mask->ne[0] >= k->ne[1] &&
                        mask->ne[1] >= q->ne[1] && mask->ne[2] == 1,
                    where() + " has an unexpected shape (q " + shape(*q) + ", K " + shape(*k) +
                        ", mask " + shape(*mask) + ")");
    const std::optional<kernels::CellType> cell_type = cell_type_of(k->type);
    const ggml_type_traits_cpu* k_traits = ggml_get_type_traits_cpu(k->type);
    const ggml_type dot_type = k_traits != nullptr ? k_traits->vec_dot_type : GGML_TYPE_COUNT;
    const ggml_type_traits_cpu* dot_traits =
        dot_type != GGML_TYPE_COUNT ? ggml_get_type_traits_cpu(dot_type) : nullptr;
    const ggml_to_float_t dot_to_float =
        dot_type != GGML_TYPE_COUNT ? ggml_get_type_traits(dot_type)->to_float : nullptr;
    const ggml_to_float_t k_to_float = ggml_get_type_traits(k->type)->to_float;
    const std::int64_t dim = q->ne[0];
    KVEVICT_REQUIRE(dot_traits != nullptr &&
                        (dot_type == GGML_TYPE_F32 ||
                         (dot_traits->from_float != nullptr && dot_to_float != nullptr)) &&
                        (cell_type || k_to_float != nullptr) &&
                        k->nb[0] == ggml_type_size(k->type) && dim % ggml_blck_size(k->type) == 0 &&
                        dim % ggml_blck_size(dot_type) == 0,
                    where() + ": ggml's CPU backend has no dot product for its " +
                        ggml_type_name(k->type) + " K cells");

    const StageScope scope(sequence->observer(), Stage::policy);
    mark(layer, where);
    if (!gather_ready) build_gather();
    const int first = token_offset + (all_queries || catalyst ? 0 : token_count - 1);
    const int queries = token_offset + token_count - first;
    const auto limit = static_cast<std::int64_t>(gather.size());
    const std::int64_t n_kv = k->ne[1];
    const auto* q_data = host_data<char>(q, scratch);
    const auto* k_data = host_data<char>(k, scratch_keys);
    const auto* mask_data = host_data<char>(mask, scratch_mask);
    if (!flash_prepared || prepared_mask != mask_data || prepared_first != first ||
        prepared_queries != queries || prepared_cells != n_kv) {
      prepare_flash(layer, *mask, mask_data, first, queries, n_kv);
    }
    const int group = q_heads / kv_heads;
    const std::int64_t group_rows = static_cast<std::int64_t>(group) * queries;
    const auto udim = static_cast<std::size_t>(dim);
    rows.resize(static_cast<std::size_t>(q_heads) * queries * gather.size());
    query_floats.resize(static_cast<std::size_t>(group_rows) * udim);
    if (dot_type != GGML_TYPE_F32) rounded_query.resize(ggml_row_size(dot_type, dim));
    for (int g = 0; g < kv_heads; ++g) {
      // The group's queries, row m * queries + i for query head g * group + m and token first + i,
      // rounded to the type ggml's matrix product rounds them to against these cells and widened
      // back to f32 (exact for f16 and bf16; Q8_0's scale times its int8 values).
      for (int m = 0; m < group; ++m) {
        for (int i = 0; i < queries; ++i) {
          const auto* q_row = reinterpret_cast<const float*>(
              q_data + static_cast<std::size_t>(first + i) * q->nb[1] +
              static_cast<std::size_t>(g * group + m) * q->nb[2]);
          float* out = query_floats.data() + static_cast<std::size_t>(m * queries + i) * udim;
          if (dot_type == GGML_TYPE_F32) {
            std::copy_n(q_row, udim, out);
          } else if (dot_type == GGML_TYPE_F16) {
            // As ggml's fp32 -> fp16 row conversion, in registers: its call per row (through the
            // type traits) cost more than the rest of the layer's preparation.
            kernels::round_through_f16(q_row, out, dim);
          } else {
            dot_traits->from_float(q_row, rounded_query.data(), dim);
            dot_to_float(rounded_query.data(), out, dim);
          }
        }
      }
      // The K cells: read in registers (f32, f16, bf16, Q8_0), else every slot's row dequantized
      // by ggml to f32 first.
      const char* keys = k_data + static_cast<std::size_t>(g) * k->nb[2];
      kernels::CellRows cells{};
      const std::int32_t* index = key_cells.data();
      if (cell_type) {
        cells = {*cell_type, reinterpret_cast<const std::uint8_t*>(keys), k->nb[1]};
      } else {
        key_floats.resize(gather.size() * udim);
        for (std::size_t s = 0; s < gather.size(); ++s) {
          k_to_float(keys + static_cast<std::size_t>(key_cells[s]) * k->nb[1],
                     key_floats.data() + s * udim, dim);
        }
        cells = {kernels::CellType::f32, reinterpret_cast<const std::uint8_t*>(key_floats.data()),
                 udim * sizeof(float)};
        index = identity.data();
      }
      // The group's rows are consecutive in `rows` ([q_heads][queries][slot limit]).
      float* out = rows.data() + static_cast<std::size_t>(g) * group_rows * gather.size();
      kernels::gathered_scores(query_floats.data(), dim, group_rows, cells, index, limit, dim, out,
                               limit);
      for (std::int64_t r = 0; r < group_rows; ++r) {
        kernels::softmax_row(out + r * limit, bias.data() + (r % queries) * limit, scale, limit);
      }
    }
    ++stats->flash_layers;
    hand_over(layer, rows.data(), queries, limit);
  }

  // What every layer of a forward shares (one KQ mask tensor for all of them): each slot's cell
  // (a live one for the free slots, whose scores are computed, then masked), and each query's
  // mask over the slots (-inf for free slots and masked cells). Checks that the sequence holds
  // every cell, and every cell each query attends.
  void prepare_flash(int layer, const ggml_tensor& mask, const char* mask_data, int first,
                     int queries, std::int64_t n_kv) {
    const std::size_t limit = gather.size();
    std::int32_t live_cell = 0;
    for (const std::int32_t cell : gather) {
      KVEVICT_REQUIRE(cell < n_kv, flash_where(layer) + " covers " + std::to_string(n_kv) +
                                       " cells, and the sequence holds cell " +
                                       std::to_string(cell));
      if (cell >= 0) live_cell = cell;
    }
    key_cells.resize(limit);
    identity.resize(limit);
    for (std::size_t s = 0; s < limit; ++s) {
      key_cells[s] = gather[s] >= 0 ? gather[s] : live_cell;
      identity[s] = static_cast<std::int32_t>(s);
    }
    bias.resize(static_cast<std::size_t>(queries) * limit);
    for (int i = 0; i < queries; ++i) {
      const int token = first + i;
      const auto* mask_row = reinterpret_cast<const ggml_fp16_t*>(
          mask_data + static_cast<std::size_t>(token) * mask.nb[1]);
      float* row = bias.data() + static_cast<std::size_t>(i) * limit;
      std::size_t attended = 0;
      for (std::size_t s = 0; s < limit; ++s) {
        const std::int32_t cell = gather[s];
        if (cell < 0 || mask_row[cell] == kMaskedHalf) {
          row[s] = -std::numeric_limits<float>::infinity();
        } else {
          row[s] = detail::f16_to_float(mask_row[cell]);
          ++attended;
        }
      }
      check_mask(layer, mask_row, mask.ne[0], token, attended);
      KVEVICT_REQUIRE(attended > 0, flash_where(layer) + ": query " + std::to_string(token) +
                                        " attends to none of the sequence's cells");
    }
    flash_prepared = true;
    prepared_mask = mask_data;
    prepared_first = first;
    prepared_queries = queries;
    prepared_cells = n_kv;
  }

  // The cell types the kernels read in registers.
  static std::optional<kernels::CellType> cell_type_of(ggml_type type) {
    switch (type) {
      case GGML_TYPE_F32:
        return kernels::CellType::f32;
      case GGML_TYPE_F16:
        return kernels::CellType::f16;
      case GGML_TYPE_BF16:
        return kernels::CellType::bf16;
      case GGML_TYPE_Q8_0:
        return kernels::CellType::q8_0;
      default:
        return std::nullopt;
    }
  }

  // The softmax kvevict computes sums over the sequence's cells only: every cell the mask lets
  // `token` attend must be one of them (a single sequence; n_kv is padded with masked cells).
  // Masked cells hold exactly -inf (llama.cpp writes -INFINITY), compared by its f16 bits.
  static void check_mask(int layer, const ggml_fp16_t* mask_row, std::int64_t n_kv, int token,
                         std::size_t held) {
    std::int64_t open_cells = 0;
    for (std::int64_t c = 0; c < n_kv; ++c) {
      open_cells += static_cast<std::int64_t>(mask_row[c] != kMaskedHalf);
    }
    KVEVICT_REQUIRE(open_cells == static_cast<std::int64_t>(held),
                    flash_where(layer) + ": query " + std::to_string(token) + " attends " +
                        std::to_string(open_cells) + " cells, " + std::to_string(held) +
                        " of them the sequence's: its KV cache holds cells kvevict does not map");
  }

  static std::string shape(const ggml_tensor& t) {
    return std::string(ggml_type_name(t.type)) + " [" + std::to_string(t.ne[0]) + ", " +
           std::to_string(t.ne[1]) + ", " + std::to_string(t.ne[2]) + ", " +
           std::to_string(t.ne[3]) + "]";
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
    // Several rows: head h's start `queries` rows after head h - 1's, so only when they are all
    // of the ubatch's rows.
    const bool laid_out = queries == 1
                              ? softmax.nb[2] % sizeof(float) == 0
                              : queries == softmax.ne[1] && softmax.nb[1] % sizeof(float) == 0 &&
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

}  // namespace internal

// One sequence of a set: its kvevict Sequence over its own llama.cpp seq_id, the graph tap that
// hands it its signals, and what its last step returned.
struct LlamaSequenceSet::Member {
  // The KvBackend the Sequence applies decisions through: llama.cpp's cells of this seq_id.
  class Cells final : public KvBackend {
   public:
    Cells(LlamaSequenceSet& set, Member& member) : set_(set), member_(member) {}
    void reserve(int /*capacity*/) override {}  // cells are the context's (n_ctx), not kvevict's
    void apply(const AppliedDecision& decision) override { set_.apply(member_, decision); }

   private:
    LlamaSequenceSet& set_;
    Member& member_;
  };

  Member(LlamaSequenceSet& set, int id, LlamaSequenceOptions options)
      : id(id), options(std::move(options)), cells(set, *this) {}

  int id;
  LlamaSequenceOptions options;
  Cells cells;
  std::unique_ptr<Sequence> sequence;
  internal::GraphTap tap;
  LlamaSequenceStats stats;
  bool reads_attention = false;
  bool reads_keys = false;
  std::optional<std::string> failed;
  int pool_member = -1;
  // The step being decoded: its tokens, [batch_first, batch_first + tokens) of the batch.
  std::span<const std::int32_t> tokens;
  int batch_first = 0;
  bool all_logits = false;    // the caller asked for every token's logits
  bool all_rows = false;      // ... or the policy reads surprisal: every row is computed
  std::vector<float> logits;  // [rows, vocab] of the last step
  int logit_rows = 0;
  std::vector<float> previous_last;  // [vocab] last row of the previous step (surprisal)
  bool has_previous = false;
  std::vector<float> surprisal;       // [chunk]
  std::vector<std::int64_t> removed;  // scratch: positions evicted by a decision
};

std::size_t cell_bytes(const llama_model* model, ggml_type type_k, ggml_type type_v) {
  const std::int64_t kv_width = std::int64_t{llama_model_n_head_kv(model)} *
                                (llama_model_n_embd(model) / llama_model_n_head(model));
  return static_cast<std::size_t>(llama_model_n_layer(model)) *
         (ggml_row_size(type_k, kv_width) + ggml_row_size(type_v, kv_width));
}

LlamaSequenceSet::LlamaSequenceSet(llama_model* model, llama_context_params params,
                                   LlamaSequenceSetOptions options)
    : model_(model), options_(options) {
  KVEVICT_REQUIRE(model_ != nullptr, "LlamaSequenceSet: model is null");
  KVEVICT_REQUIRE(options_.max_sequences >= 1 && static_cast<std::size_t>(options_.max_sequences) <=
                                                     llama_max_parallel_sequences(),
                  "LlamaSequenceSet: max_sequences must be in [1, " +
                      std::to_string(llama_max_parallel_sequences()) + "], got " +
                      std::to_string(options_.max_sequences));
  KVEVICT_REQUIRE(options_.max_chunk > 0, "LlamaSequenceSet: max_chunk must be positive, got " +
                                              std::to_string(options_.max_chunk));
  KVEVICT_REQUIRE(options_.pool_cells >= 0, "LlamaSequenceSet: pool_cells must be >= 0, got " +
                                                std::to_string(options_.pool_cells));
  KVEVICT_REQUIRE(params.cb_eval == nullptr,
                  "LlamaSequenceSet installs its own cb_eval: leave llama_context_params::cb_eval "
                  "unset");
  KVEVICT_REQUIRE(!llama_model_is_recurrent(model_) && !llama_model_is_hybrid(model_),
                  "kvevict drives attention KV caches: recurrent and hybrid models are not "
                  "supported");
  // llama.cpp refuses this itself, with only "llama_init_from_model failed" reaching the caller.
  if (ggml_is_quantized(params.type_v) &&
      params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED) {
    throw Error(std::string("llama.cpp's quantized V cells (") + ggml_type_name(params.type_v) +
                ") need flash attention, which is off (-fa off): use --fa on or auto, or f32, "
                "f16 or bf16 cells");
  }
  // Every step is one ubatch (the graph callback maps one K store per layer to the step's tokens).
  batch_capacity_ = checked_int(
      checked_product({options_.max_sequences, options_.max_chunk}, "max_sequences x max_chunk"),
      "max_sequences x max_chunk");
  params.n_seq_max = static_cast<std::uint32_t>(options_.max_sequences);
  params.kv_unified = true;  // one n_ctx of cells for every sequence: what a pool divides
  params.n_batch =
      std::max<std::uint32_t>(params.n_batch, static_cast<std::uint32_t>(batch_capacity_));
  params.n_ubatch =
      std::max<std::uint32_t>(params.n_ubatch, static_cast<std::uint32_t>(batch_capacity_));
  params.n_batch = std::max(params.n_batch, params.n_ubatch);
  params.cb_eval = &LlamaSequenceSet::callback;
  params.cb_eval_user_data = this;
  params_ = params;
  context_ = llama_init_from_model(model_, params);
  KVEVICT_REQUIRE(context_ != nullptr, "llama_init_from_model failed (see llama.cpp's log)");
  try {
    n_ctx_ = static_cast<int>(llama_n_ctx(context_));
    if (options_.pool_cells > n_ctx_) {
      throw Error("a KV pool of " + std::to_string(options_.pool_cells) +
                  " cells does not fit in the context's " + std::to_string(n_ctx_) +
                  " cells: raise the context size (-c) or lower the pool");
    }
    if (options_.pool_cells > 0) pool_.emplace(options_.pool_cells);
    vocab_ = llama_vocab_n_tokens(llama_model_get_vocab(model_));
    bytes_per_cell_ = cell_bytes(model_, params.type_k, params.type_v);
    batch_ = llama_batch_init(batch_capacity_, 0, 1);
    members_.resize(static_cast<std::size_t>(options_.max_sequences));
  } catch (...) {
    llama_free(context_);
    throw;
  }
}

LlamaSequenceSet::~LlamaSequenceSet() {
  if (batch_.token != nullptr) llama_batch_free(batch_);
  llama_free(context_);
}

int LlamaSequenceSet::open(std::unique_ptr<Policy> policy, LlamaSequenceOptions options) {
  KVEVICT_REQUIRE(policy != nullptr, "LlamaSequenceSet::open: policy is null");
  const auto free_id = std::find(members_.begin(), members_.end(), nullptr);
  KVEVICT_REQUIRE(free_id != members_.end(),
                  "LlamaSequenceSet::open: all " + std::to_string(options_.max_sequences) +
                      " sequences are open (max_sequences): close one first");
  KVEVICT_REQUIRE(options.max_chunk > 0 && options.max_chunk <= options_.max_chunk,
                  "LlamaSequenceSet::open: max_chunk must be in [1, " +
                      std::to_string(options_.max_chunk) + "] (the set's), got " +
                      std::to_string(options.max_chunk));
  const std::string policy_name(policy->name());
  const Granularity granularity = options.granularity.value_or(Granularity::token);
  if (!granularity.whole_sequence()) {
    throw Error("granularity " + to_string(granularity) +
                " is not possible in llama.cpp, whose KV cells are shared by every layer and "
                "head: use granularity token or block:B");
  }
  const PositionMode mode = options.position_mode.value_or(policy->default_position_mode());
  const SignalSet signals = policy->signals();
  const bool reads_attention = signals.contains(Signal::attention_rows) ||
                               signals.contains(Signal::last_attention_row) ||
                               signals.contains(Signal::catalyst_attention);
  const bool runs_catalyst = signals.contains(Signal::catalyst_attention);
  if (runs_catalyst && !options.catalyst) {
    throw Error("policy '" + policy_name + "' runs a catalyst prompt: give one (may be empty)");
  }
  const int catalyst_size = options.catalyst ? static_cast<int>(options.catalyst->size()) : 0;
  KVEVICT_REQUIRE(catalyst_size <= batch_capacity_,
                  "policy '" + policy_name + "': its catalyst prompt of " +
                      std::to_string(catalyst_size) + " tokens exceeds the set's ubatch of " +
                      std::to_string(batch_capacity_) + " (max_sequences x max_chunk)");
  if (reads_attention) {
    KVEVICT_REQUIRE(llama_model_n_swa(model_) == 0,
                    "policy '" + policy_name +
                        "' reads attention, and this model's sliding-window layers keep a second "
                        "KV cache whose cells kvevict does not map");
    // Flash attention on, off or auto (llama.cpp's choice): the graph callback reads the softmax
    // (kq_soft_max-<layer>) or computes the rows from the flash-attention node, whichever the
    // graph has (GraphTap::observe_flash).
  }
  // llama.cpp's CPU K-shift ropes f32 and f16 keys in place. bf16 aborts the process at the first
  // shift; quantized keys (an f32 copy between two Hadamard rotations, llama_kv_cache::
  // build_rope_shift) crash it with a segmentation fault in that function at the llama.cpp kvevict
  // builds against (streaming_llm on q8_0 cells, the first eviction).
  const bool shiftable_keys = params_.type_k == GGML_TYPE_F32 || params_.type_k == GGML_TYPE_F16;
  if (mode != PositionMode::original && !shiftable_keys) {
    throw Error("positions " + std::string(to_string(mode)) + " shift kept keys, and llama.cpp's " +
                "CPU K-shift cannot rotate " + ggml_type_name(params_.type_k) + " cells (it " +
                (ggml_is_quantized(params_.type_k) ? "crashes" : "aborts") +
                "): use positions original, or f32 or f16 cells");
  }
  if (mode != PositionMode::original && !llama_memory_can_shift(llama_get_memory(context_))) {
    throw Error("positions " + std::string(to_string(mode)) +
                " lower the positions of kept tokens, and this model's KV cache cannot shift "
                "them (llama_memory_can_shift is false, e.g. M-RoPE): use positions original");
  }
  const int widest = std::max(options.max_chunk, catalyst_size);
  const std::optional<int> limit = policy->retained_limit();
  if (limit && static_cast<std::int64_t>(*limit) + widest > n_ctx_) {
    throw Error("policy '" + policy_name + "' keeps up to " + std::to_string(*limit) +
                " tokens plus a chunk of " + std::to_string(widest) + ", more than the context's " +
                std::to_string(n_ctx_) + " cells: raise the context size (-c) or lower the budget");
  }

  SequenceConfig config;
  config.layers = llama_model_n_layer(model_);
  config.q_heads = llama_model_n_head(model_);
  config.kv_heads = llama_model_n_head_kv(model_);
  config.position_mode = mode;
  config.granularity = granularity;
  config.key_storage = KeyStorage::pre_rope;  // llama.cpp re-rotates keys itself (K-shift)
  config.max_chunk = widest;
  config.slot_reuse = options.slot_reuse;
  config.attention_views = false;  // llama.cpp attends over its own cells
  config.head_dim = llama_model_n_embd(model_) / config.q_heads;

  const int id = static_cast<int>(free_id - members_.begin());
  auto member = std::make_unique<Member>(*this, id, std::move(options));
  member->reads_attention = reads_attention;
  member->reads_keys = signals.contains(Signal::keys);
  member->sequence = std::make_unique<Sequence>(config, std::move(policy), &member->cells,
                                                member->options.observer);
  if (pool_) member->pool_member = pool_->join(*member->sequence, member->options.pool_minimum);
  internal::GraphTap& tap = member->tap;
  tap.sequence = member->sequence.get();
  tap.stats = &member->stats;
  tap.layers = config.layers;
  tap.q_heads = config.q_heads;
  tap.kv_heads = config.kv_heads;
  tap.head_dim = config.head_dim;
  tap.all_queries = member->sequence->wants(Signal::attention_rows);
  // A closed sequence's cells were freed; a new one starts from none.
  llama_memory_seq_rm(llama_get_memory(context_), id, -1, -1);
  *free_id = std::move(member);
  return id;
}

void LlamaSequenceSet::close(int id) {
  Member& m = member(id, "close");
  if (pool_ && m.pool_member >= 0) pool_->leave(m.pool_member);
  llama_memory_seq_rm(llama_get_memory(context_), id, -1, -1);
  members_[static_cast<std::size_t>(id)].reset();
}

bool LlamaSequenceSet::is_open(int id) const {
  return id >= 0 && id < static_cast<int>(members_.size()) &&
         members_[static_cast<std::size_t>(id)] != nullptr;
}

LlamaSequenceSet::Member& LlamaSequenceSet::member(int id, const char* call) {
  KVEVICT_REQUIRE(is_open(id), std::string("LlamaSequenceSet::") + call + ": sequence " +
                                   std::to_string(id) + " is not open (closed, or never opened)");
  return *members_[static_cast<std::size_t>(id)];
}
const LlamaSequenceSet::Member& LlamaSequenceSet::member(int id, const char* call) const {
  return const_cast<LlamaSequenceSet*>(this)->member(id, call);
}

const Sequence& LlamaSequenceSet::sequence(int id) const {
  return *member(id, "sequence").sequence;
}
const LlamaSequenceStats& LlamaSequenceSet::stats(int id) const {
  return member(id, "stats").stats;
}
int LlamaSequenceSet::live_cells(int id) const {
  return member(id, "live_cells").sequence->slots().live(0);
}
bool LlamaSequenceSet::reads_attention(int id) const {
  return member(id, "reads_attention").reads_attention;
}
bool LlamaSequenceSet::reads_keys(int id) const { return member(id, "reads_keys").reads_keys; }
const std::optional<std::string>& LlamaSequenceSet::failed(int id) const {
  return member(id, "failed").failed;
}

LlamaLogits LlamaSequenceSet::logits(int id) const {
  const Member& m = member(id, "logits");
  LlamaLogits result;
  result.vocab = vocab_;
  result.rows = m.logit_rows;
  result.values = std::span<const float>(m.logits).first(static_cast<std::size_t>(m.logit_rows) *
                                                         static_cast<std::size_t>(vocab_));
  return result;
}

// The graph callback: every node any decoding member reads goes to each member that reads it.
bool LlamaSequenceSet::callback(ggml_tensor* tensor, bool ask, void* user_data) {
  auto* set = static_cast<LlamaSequenceSet*>(user_data);
  bool wanted = false;
  for (Member* m : set->decoding_) {
    const internal::GraphTap::Reads reads = m->tap.reads(*tensor);
    if (!reads.any()) continue;
    wanted = true;
    if (!ask) m->tap.take(*tensor, reads);
  }
  return ask ? wanted : true;
}

// Removes the evicted tokens' cells by position and, under cache_index / reset_on_compact, lowers
// every kept cell by the number of evictions before it, so that llama.cpp's positions stay
// kvevict's (each kept token's rank). Ranges of consecutive positions go in one call.
void LlamaSequenceSet::apply(Member& member, const AppliedDecision& decision) {
  llama_memory_t memory = llama_get_memory(context_);
  std::vector<std::int64_t>& removed = member.removed;
  removed.clear();
  for (const EvictedSlot& slot : decision.evicted(0)) removed.push_back(slot.position);
  std::sort(removed.begin(), removed.end());
  const bool shift = decision.position_mode != PositionMode::original;
  const llama_seq_id seq = member.id;
  std::size_t i = 0;
  std::int64_t lowered = 0;
  while (i < removed.size()) {
    std::size_t j = i + 1;
    while (j < removed.size() && removed[j] == removed[j - 1] + 1) ++j;
    const auto begin = static_cast<llama_pos>(removed[i]);
    const auto end = static_cast<llama_pos>(removed[j - 1] + 1);
    KVEVICT_REQUIRE(llama_memory_seq_rm(memory, seq, begin, end),
                    "llama_memory_seq_rm refused to remove positions [" + std::to_string(begin) +
                        ", " + std::to_string(end) + ")");
    ++member.stats.removed_ranges;
    lowered += end - begin;
    if (shift) {
      // Kept cells in [end, next removed) move down by everything removed so far.
      const llama_pos next = j < removed.size() ? static_cast<llama_pos>(removed[j]) : -1;
      llama_memory_seq_add(memory, seq, end, next, static_cast<llama_pos>(-lowered));
      ++member.stats.shifted_ranges;
    }
    i = j;
  }
  // Inside a forward (begin_chunk's before_turn decision) the chunk is not decoded yet.
  if (!shift && member.sequence->chunk_size() == 0) {
    const llama_pos last = llama_memory_seq_pos_max(memory, seq);
    const std::int64_t next = member.sequence->stats().tokens_fed;
    if (last >= 0 && last + 1 != next) {
      throw Error("policy '" + std::string(member.sequence->policy().name()) +
                  "' evicted the newest token (position " + std::to_string(next - 1) +
                  ") under positions original; llama.cpp requires a sequence's next position to "
                  "follow its last kept one: use positions cache_index");
    }
  }
}

// One llama_decode over the members' current chunks (or one member's catalyst), each member's
// tokens after the previous member's in the batch.
void LlamaSequenceSet::decode(std::span<Member* const> members, bool catalyst) {
  int n = 0;
  for (Member* m : members) {
    const std::span<const std::int32_t> slots = m->sequence->chunk_slots(0, 0);
    m->batch_first = n;
    for (std::size_t i = 0; i < m->tokens.size(); ++i, ++n) {
      batch_.token[n] = m->tokens[i];
      batch_.pos[n] = static_cast<llama_pos>(m->sequence->position(0, 0, slots[i]));
      batch_.n_seq_id[n] = 1;
      batch_.seq_id[n][0] = m->id;
      batch_.logits[n] =
          static_cast<std::int8_t>(!catalyst && (m->all_rows || i + 1 == m->tokens.size()));
    }
  }
  batch_.n_tokens = n;
  for (Member* m : members) {
    internal::GraphTap& tap = m->tap;
    tap.catalyst = catalyst;
    tap.error = nullptr;
    tap.token_offset = m->batch_first;
    tap.token_count = static_cast<int>(m->tokens.size());
    tap.ubatch_tokens = n;
    tap.read_cells = m->reads_attention || m->reads_keys;
    tap.read_keys = m->reads_keys && !catalyst;
    if (tap.read_keys) tap.keys_seen.assign(static_cast<std::size_t>(tap.layers), 0);
    tap.read_softmax =
        m->sequence->wants(catalyst ? Signal::catalyst_attention : Signal::attention_rows) ||
        (!catalyst && m->sequence->wants(Signal::last_attention_row));
    if (tap.read_softmax) tap.begin_forward();
  }
  decoding_.assign(members.begin(), members.end());
  const int status = llama_decode(context_, batch_);
  decoding_.clear();
  for (Member* m : members) {
    internal::GraphTap& tap = m->tap;
    tap.read_cells = false;
    const bool read_softmax = std::exchange(tap.read_softmax, false);
    const bool read_keys = std::exchange(tap.read_keys, false);
    if (status != 0) continue;
    try {
      if (tap.error) std::rethrow_exception(tap.error);
      if (read_softmax) tap.check_every_layer();
      if (read_keys) tap.check_every_key_layer();
    } catch (const std::exception& error) {
      m->failed = error.what();
    }
    m->stats.peak_cells = std::max(m->stats.peak_cells, m->sequence->slots().live(0));
  }
  if (status != 0) {
    // The step's tokens may sit in some cells: the fed sequences cannot go on.
    const std::string failure = decode_failure(status, n_ctx_);
    for (Member* m : members) m->failed = failure;
    throw Error(failure);
  }
  int cells = 0;
  for (const std::unique_ptr<Member>& m : members_) {
    if (m) cells += m->sequence->slots().live(0);
  }
  stats_.peak_cells = std::max(stats_.peak_cells, cells);
}

void LlamaSequenceSet::step(std::span<const LlamaFeed> feeds) {
  // Every check before anything changes.
  KVEVICT_REQUIRE(!feeds.empty(), "LlamaSequenceSet::step: no sequence to feed");
  fed_.clear();
  pool_feeds_.clear();
  for (const LlamaFeed& feed : feeds) {
    Member& m = member(feed.sequence, "step");
    const std::string who = "LlamaSequenceSet::step: sequence " + std::to_string(feed.sequence);
    KVEVICT_REQUIRE(!m.failed, who + " failed (" + m.failed.value_or("") + "): close it");
    KVEVICT_REQUIRE(std::find(fed_.begin(), fed_.end(), &m) == fed_.end(),
                    who + " is fed twice in one step");
    const int n = static_cast<int>(feed.tokens.size());
    KVEVICT_REQUIRE(n > 0 && n <= m.options.max_chunk, who + ": a chunk holds 1 to " +
                                                           std::to_string(m.options.max_chunk) +
                                                           " tokens, got " + std::to_string(n));
    for (const std::int32_t token : feed.tokens) {
      KVEVICT_REQUIRE(token >= 0 && token < vocab_,
                      who + ": token " + std::to_string(token) + " is outside the vocabulary");
    }
    fed_.push_back(&m);
    if (pool_) pool_feeds_.push_back({m.pool_member, n});
  }
  if (pool_) {
    // A member whose cut fails fails alone: its cells are freed and it leaves the pool.
    pool_->make_room_dropping_failed_cuts(pool_feeds_, [&](const KvPool::CutFailure& failure) {
      const auto cut = std::find_if(members_.begin(), members_.end(), [&](const auto& m) {
        return m && m->pool_member == failure.member();
      });
      KVEVICT_REQUIRE(cut != members_.end(), failure.what());
      Member& m = **cut;
      m.failed = failure.what();
      llama_memory_seq_rm(llama_get_memory(context_), m.id, -1, -1);
      m.pool_member = -1;
    });
  }
  for (std::size_t i = 0; i < feeds.size(); ++i) {
    Member& m = *fed_[i];
    if (m.failed) continue;
    m.tokens = feeds[i].tokens;
    m.all_logits = feeds[i].all_logits;
    m.all_rows = m.all_logits || m.sequence->wants(Signal::surprisal);
    try {
      m.sequence->begin_chunk(m.tokens, feeds[i].turn_start);
    } catch (const std::exception& error) {
      m.failed = error.what();
    }
  }
  // A sequence that failed to begin its chunk is left out of the batch.
  std::erase_if(fed_, [](const Member* m) { return m->failed.has_value(); });
  if (!fed_.empty()) {
    decode(fed_, /*catalyst=*/false);
    ++stats_.steps;
  }
  for (Member* m : fed_) {
    if (m->failed) continue;
    try {
      finish(*m);
    } catch (const std::exception& error) {
      m->failed = error.what();
    }
  }
}

// After the step's decode: the member's logits and surprisal, its decision, its catalyst.
void LlamaSequenceSet::finish(Member& m) {
  const int n = static_cast<int>(m.tokens.size());
  const int rows = m.all_rows ? n : 1;
  const auto width = static_cast<std::size_t>(vocab_);
  m.logits.resize(static_cast<std::size_t>(rows) * width);
  for (int r = 0; r < rows; ++r) {
    const float* row = llama_get_logits_ith(context_, m.batch_first + (m.all_rows ? r : n - 1));
    KVEVICT_REQUIRE(row != nullptr, "llama.cpp returned no logits");
    std::copy(row, row + width, m.logits.begin() + static_cast<std::ptrdiff_t>(r * width));
  }
  if (m.sequence->wants(Signal::surprisal)) {
    // Token k's surprisal: row k - 1 of this step's logits, the previous step's last row for the
    // first token, 0 for the stream's very first (as the reference decoder).
    m.surprisal.resize(m.tokens.size());
    m.surprisal[0] =
        m.has_previous ? negative_log_softmax(m.previous_last.data(), vocab_, m.tokens[0]) : 0.0f;
    for (std::size_t k = 1; k < m.tokens.size(); ++k) {
      m.surprisal[k] = negative_log_softmax(m.logits.data() + (k - 1) * width, vocab_, m.tokens[k]);
    }
    m.sequence->observe_surprisal(m.surprisal);
  }
  const std::span<const float> last(m.logits.data() + (rows - 1) * width, width);
  m.previous_last.assign(last.begin(), last.end());
  m.has_previous = true;
  // The rows the caller asked for: every token's, or only the last (the front rows when every
  // row was computed for the surprisal are dropped).
  if (!m.all_logits && m.all_rows) {
    std::copy(last.begin(), last.end(), m.logits.begin());
  }
  m.logit_rows = m.all_logits ? n : 1;
  m.sequence->end_forward();
  ++m.stats.forwards;
  if (m.sequence->catalyst_pending()) run_catalyst(m);
}

// The pot is full: the catalyst prompt is decoded after it (positions continuing), alone in its
// batch, its attention handed to the policy layer by layer, then Sequence::end_catalyst rolls it
// back and distills, in one decision: apply() removes the catalyst's cells (the newest positions)
// with the evicted ones. A second sequence (llama_memory_seq_cp) would cost a copy of the pot's
// cell membership for nothing: the catalyst is always the sequence's newest stretch.
void LlamaSequenceSet::run_catalyst(Member& m) {
  const std::vector<std::int32_t>& prompt = *m.options.catalyst;
  {
    const StageScope scope(m.options.observer, Stage::catalyst);
    m.sequence->begin_catalyst(prompt);
    if (!prompt.empty()) {
      m.tokens = prompt;
      Member* const alone[] = {&m};
      decode(alone, /*catalyst=*/true);
      if (m.failed) throw Error(*m.failed);
    }
  }
  m.sequence->end_catalyst();
  ++m.stats.catalyst_runs;
}

// --- LlamaSequence: a set of one
// ------------------------------------------------------------------

namespace {

LlamaSequenceSetOptions options_of_one(const LlamaSequenceOptions& options) {
  LlamaSequenceSetOptions set;
  set.max_sequences = 1;
  const int catalyst = options.catalyst ? static_cast<int>(options.catalyst->size()) : 0;
  set.max_chunk = std::max(options.max_chunk, catalyst);
  return set;
}

}  // namespace

LlamaSequence::LlamaSequence(llama_model* model, llama_context_params params,
                             std::unique_ptr<Policy> policy, LlamaSequenceOptions options)
    : set_(model, params, options_of_one(options)), max_chunk_(options.max_chunk) {
  KVEVICT_REQUIRE(options.max_chunk > 0, "LlamaSequence: max_chunk must be positive");
  KVEVICT_REQUIRE(policy != nullptr, "LlamaSequence: policy is null");
  (void)set_.open(std::move(policy), std::move(options));
}

LlamaLogits LlamaSequence::forward(std::span<const std::int32_t> tokens, bool turn_start,
                                   bool all_logits) {
  const int n = static_cast<int>(tokens.size());
  KVEVICT_REQUIRE(n > 0 && n <= max_chunk_, "LlamaSequence::forward: a chunk holds 1 to " +
                                                std::to_string(max_chunk_) + " tokens, got " +
                                                std::to_string(n));
  const LlamaFeed feed{0, tokens, turn_start, all_logits};
  set_.step(std::span<const LlamaFeed>(&feed, 1));
  if (const std::optional<std::string>& failure = set_.failed(0)) throw Error(*failure);
  return set_.logits(0);
}

LlamaLogits LlamaSequence::feed(std::span<const std::int32_t> tokens, bool turn_start,
                                bool all_logits) {
  KVEVICT_REQUIRE(!tokens.empty(), "LlamaSequence::feed: no tokens to feed");
  const auto width = static_cast<std::size_t>(vocab());
  if (all_logits) feed_logits_.resize(tokens.size() * width);
  LlamaLogits last;
  std::size_t offset = 0;
  while (offset < tokens.size()) {
    std::size_t n = std::min(static_cast<std::size_t>(max_chunk_), tokens.size() - offset);
    // Never cross a pot boundary: the pot is distilled exactly when it is full.
    const std::optional<int> room = sequence().pot_room();
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

}  // namespace kvevict::llama
