/* kvevict C API: kvevict's policies for engines written in any language.
 *
 * A kvevict_sequence is one sequence's slot metadata and policy (kvevict::Sequence); the engine
 * keeps keys and values in its own buffers. kvevict gives every token of every (layer, KV head) a
 * slot in [0, capacity) (kvevict_sequence_chunk_slots): the engine stores that token's K/V at that
 * slot of that head. Evicting frees slots, which later tokens take: nothing moves. The engine
 * implements a kvevict_backend (two callbacks) through which kvevict applies each decision in one
 * call: `reserve` when more slots are needed, `apply` with the evicted slots and, for keys stored
 * after RoPE, the stored keys to rotate. Same event order as the C++ Sequence
 * (include/kvevict/engine.hpp).
 *
 * Errors: every function returns a kvevict_status (or a documented sentinel); on failure
 * kvevict_last_error() describes it. No C++ exception ever crosses this API. Link kvevict::c
 * (CMake) or libkvevict_c; it needs neither Eigen nor anything beyond the C++ standard library.
 */
#ifndef KVEVICT_C_API_H
#define KVEVICT_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvevict_status {
  KVEVICT_OK = 0,
  KVEVICT_INVALID_ARGUMENT = 1, /* bad configuration, malformed input or misuse */
  KVEVICT_OUT_OF_MEMORY = 2,
  KVEVICT_INTERNAL_ERROR = 3,
  KVEVICT_BACKEND_ERROR = 4 /* a backend callback failed (or, without a reserve callback, the
                             * sequence needed more slots than it started with): the sequence is
                             * unusable, every later call on it fails; destroy it */
} kvevict_status;

/* Signals a policy may want (kvevict_sequence_signals); same bits as kvevict::Signal. */
#define KVEVICT_SIGNAL_TOKEN_IDS 0x01u
#define KVEVICT_SIGNAL_SURPRISAL 0x02u
#define KVEVICT_SIGNAL_ATTENTION_ROWS 0x04u     /* rows of every query of the forward */
#define KVEVICT_SIGNAL_LAST_ATTENTION_ROW 0x08u /* the forward's last query only */
#define KVEVICT_SIGNAL_TURN_BOUNDARIES 0x10u
#define KVEVICT_SIGNAL_CATALYST_ATTENTION 0x20u
#define KVEVICT_SIGNAL_KEYS 0x40u /* the chunk's key vectors, per layer (K-norm, KeyDiff) */

/* Message of the last failed call on this thread, "" if none. Valid until the next call. */
const char* kvevict_last_error(void);
/* "0.2.0" */
const char* kvevict_version(void);

/* Writes the parameters `--budget budget` stands for in `policy` (with `sinks` protected first
 * tokens where the policy has sinks), e.g. "heavy=32 recent=32", NUL-terminated, into `out` of
 * `size` bytes. */
kvevict_status kvevict_budget_params(const char* policy, int budget, int sinks, char* out,
                                     size_t size);

typedef struct kvevict_config {
  int layers;
  int q_heads;
  int kv_heads;              /* q_heads % kv_heads == 0 */
  int max_chunk;             /* largest chunk (and catalyst prompt) the engine feeds */
  const char* position_mode; /* NULL: the policy's; "original", "cache_index", "reset_on_compact" */
  const char* granularity;   /* NULL: the policy's; "head", "layer", "token", "block:B" */
  int post_rope_keys;        /* 1: keys stored rotated (folds may rotate them); 0: before RoPE */
  int max_pending_rotations; /* see SequenceConfig; kvevict_config_init sets 32 */
  /* NULL or "newest_freed_first": a new token takes the slot freed last; "lowest_first": the
   * lowest free slot, as an allocator that scans from the lowest freed cell (llama.cpp's), so that
   * kvevict's slot i can be the engine's cell i */
  const char* slot_reuse;
  /* length of a key vector; needed by policies that read keys (KVEVICT_SIGNAL_KEYS) */
  int head_dim;
  /* One budget for the whole sequence, split over its keep-sets by `allocation`
   * (include/kvevict/policies/allocated.hpp): live tokens summed over every (layer, KV head), or
   * their keys' and values' bytes in `kv_type` (with head_dim). At most one; both 0: the policy's
   * own budget in every keep-set. */
  int64_t budget_tokens;
  int64_t budget_bytes;
  const char* kv_type;    /* the engine's K/V storage type for budget_bytes; NULL: "f32" */
  const char* allocation; /* NULL or "uniform", "pyramid", "adaptive" */
  int pyramid_beta;       /* pyramid: kvevict_config_init sets 20 */
  double adaptive_floor;  /* adaptive, in [0, 1]: kvevict_config_init sets 0.2 */
} kvevict_config;

/* Fills `config` with the defaults (everything 0 / NULL but post_rope_keys = 1, max_chunk = 1,
 * max_pending_rotations = 32, pyramid_beta = 20, adaptive_floor = 0.2). */
void kvevict_config_init(kvevict_config* config);

/* One evicted token: its slot, original position and position before the decision. */
typedef struct kvevict_evicted {
  int32_t slot;
  int64_t original_position;
  int64_t position;
} kvevict_evicted;

typedef struct kvevict_decision kvevict_decision;

/* What the engine implements. Callbacks return 0 on success; anything else fails the call that
 * triggered them with KVEVICT_BACKEND_ERROR and leaves the sequence unusable. */
typedef struct kvevict_backend {
  void* user_data;
  /* Every head's slots are [0, capacity) from now on: make room, keeping contents. May be NULL
   * when the engine sized its buffers for kvevict_sequence_capacity() and the policy is bounded. */
  int (*reserve)(void* user_data, int capacity);
  /* One applied decision: read it with kvevict_decision_* (valid during the call only). */
  int (*apply)(void* user_data, const kvevict_decision* decision);
} kvevict_backend;

/* Tokens evicted from head (layer, kv_head) by this decision, oldest first. */
kvevict_status kvevict_decision_evicted(const kvevict_decision* decision, int layer, int kv_head,
                                        const kvevict_evicted** evicted, int* count);
/* Stored post-RoPE keys of head (layer, kv_head) to rotate: `count` rotations; rotation i turns
 * the keys of `slots` by `delta` positions. */
int kvevict_decision_rotation_count(const kvevict_decision* decision, int layer, int kv_head);
kvevict_status kvevict_decision_rotation(const kvevict_decision* decision, int layer, int kv_head,
                                         int index, int64_t* delta, const int32_t** slots,
                                         int* count);

typedef struct kvevict_sequence kvevict_sequence;

/* Creates a sequence for `policy` (e.g. "h2o"). `params`: space-separated key=value pairs, lists
 * comma-separated, e.g. "heavy=64 recent=64" or "anchor_ids=29889"; NULL or "" for none.
 * `backend` may be NULL (metadata only). The backend's reserve() is called here. */
kvevict_status kvevict_sequence_create(const char* policy, const char* params,
                                       const kvevict_config* config, const kvevict_backend* backend,
                                       kvevict_sequence** out);
void kvevict_sequence_destroy(kvevict_sequence* sequence);

/* The KVEVICT_SIGNAL_* bits the policy consumes (0 for NULL). */
uint32_t kvevict_sequence_signals(const kvevict_sequence* sequence);
/* Most slots a head holds after eviction, or -1 when the policy is unbounded (or NULL). */
int kvevict_sequence_retained_limit(const kvevict_sequence* sequence);
/* Slots per head kvevict uses now ([0, capacity)), or -1 for NULL. */
int kvevict_sequence_capacity(const kvevict_sequence* sequence);
/* Live slots of head (layer, kv_head), or -1 for an invalid head. */
int kvevict_sequence_live(const kvevict_sequence* sequence, int layer, int kv_head);
/* Attention over head (layer, kv_head) covers slots [0, slot_limit); -1 for an invalid head. */
int kvevict_sequence_slot_limit(const kvevict_sequence* sequence, int layer, int kv_head);
/* Tokens fed so far (catalyst prompts excluded), or -1 for NULL. */
int64_t kvevict_sequence_tokens_fed(const kvevict_sequence* sequence);
/* The most live tokens any head holds: the sequence's cells in an engine whose cells are shared
 * by every head (llama.cpp), what a pool counts; -1 for NULL. */
int kvevict_sequence_max_live(const kvevict_sequence* sequence);
/* A pool's pressure by hand: evicts by the policy's own keep rule, now, until no head holds more
 * than `max_live` tokens besides those the policy protects (its sinks, H2O's recent window). The
 * decision reaches the backend's apply() as any other. Between forwards; only for policies with
 * a pressed form (window, streaming_llm, h2o, tova, knorm, keydiff), others fail with
 * KVEVICT_INVALID_ARGUMENT. */
kvevict_status kvevict_sequence_shrink_to(kvevict_sequence* sequence, int max_live);

/* K/V storage types: "f32", "f16", "bf16" or "q8_0" (ggml's blocks of 32 values with an f16 scale,
 * head_dim a multiple of 32; include/kvevict/kv_type.hpp). kvevict never reads the engine's K/V;
 * these account for it in the engine's own type. Bytes of one stored row (one token's key, or
 * value, of one KV head) of head_dim values, scales included. An unknown type or a head_dim the
 * type cannot store fails with KVEVICT_INVALID_ARGUMENT and a message naming kv_type. */
kvevict_status kvevict_kv_row_bytes(const char* kv_type, int head_dim, size_t* bytes);
/* K/V bytes of the sequence's live slots now and at their peak, for an engine storing rows of
 * head_dim values as kv_type: slots over every (layer, KV head) x 2 x kvevict_kv_row_bytes. Either
 * output may be NULL. */
kvevict_status kvevict_sequence_kv_bytes(const kvevict_sequence* sequence, const char* kv_type,
                                         int head_dim, size_t* live_bytes, size_t* peak_bytes);

/* Per forward, in this order. */
kvevict_status kvevict_sequence_begin_chunk(kvevict_sequence* sequence, const int32_t* token_ids,
                                            int count, int turn_start);
/* Slot of each token of the current chunk (or catalyst) in head (layer, kv_head). */
kvevict_status kvevict_sequence_chunk_slots(const kvevict_sequence* sequence, int layer,
                                            int kv_head, const int32_t** slots, int* count);
/* RoPE position of live slot `slot`, and the position its post-RoPE key is stored rotated to
 * (either pointer may be NULL). */
kvevict_status kvevict_sequence_position(const kvevict_sequence* sequence, int layer, int kv_head,
                                         int32_t slot, int64_t* position, int64_t* key_position);
/* A run of live slots [begin, end) sharing one pending rotation: attention rotates the query to
 * (its position - rotation) once for the run (keys stored before RoPE: rotation 0). */
typedef struct kvevict_key_run {
  int32_t begin;
  int32_t end;
  int64_t rotation;
} kvevict_key_run;
/* The live slots of head (layer, kv_head) as `count` runs in slot order, and as one byte per slot
 * of [0, slot_limit) (1 live, 0 free). Valid from begin_chunk / begin_catalyst until end_forward
 * / end_catalyst; outside a forward the call fails. */
kvevict_status kvevict_sequence_key_runs(const kvevict_sequence* sequence, int layer, int kv_head,
                                         const kvevict_key_run** runs, int* count);
kvevict_status kvevict_sequence_live_mask(const kvevict_sequence* sequence, int layer, int kv_head,
                                          const uint8_t** mask, int* count);
/* Softmax rows of one layer, layout [q_heads][queries][row_stride], row of query head h over the
 * slots [0, slot_limit) of KV head h / (q_heads / kv_heads); free slots 0. `queries`: the chunk's
 * newest queries the policy reads: every one for KVEVICT_SIGNAL_ATTENTION_ROWS (and all the
 * catalyst's for observe_catalyst), at least the last for KVEVICT_SIGNAL_LAST_ATTENTION_ROW. Rows
 * the policy reads must hold probabilities in [0, 1]: NaN, infinities, negative values and values
 * above 1 fail the call with KVEVICT_INVALID_ARGUMENT, a message naming the layer, query head,
 * query, slot and value, and nothing recorded (the layer may be observed again). The same for
 * observe_catalyst; observe_surprisal refuses NaN alike (+inf, p = 0, is accepted). */
kvevict_status kvevict_sequence_observe_attention(kvevict_sequence* sequence, int layer,
                                                  const float* rows, int queries,
                                                  ptrdiff_t row_stride);
/* 1 when the policy takes a layer's KV heads in separate calls (H2O, TOVA), with the same scores
 * and decisions as one call per layer: an engine that attends a KV head at a time may hand each
 * head's rows to observe_attention_heads and hold one head's rows, not the layer's; 0 otherwise
 * (and for NULL). */
int kvevict_sequence_attention_per_kv_head(const kvevict_sequence* sequence);
/* The rows of KV heads [kv_head_begin, kv_head_end) of one layer, layout [(kv_head_end -
 * kv_head_begin) x q_heads / kv_heads][queries][row_stride], as observe_attention's. Each call is
 * refused whole; every KV head of every layer once per forward. A range short of the whole layer
 * fails with KVEVICT_INVALID_ARGUMENT unless attention_per_kv_head is 1. */
kvevict_status kvevict_sequence_observe_attention_heads(kvevict_sequence* sequence, int layer,
                                                        int kv_head_begin, int kv_head_end,
                                                        const float* rows, int queries,
                                                        ptrdiff_t row_stride);
kvevict_status kvevict_sequence_observe_surprisal(kvevict_sequence* sequence,
                                                  const float* surprisal, int count);
/* Keys of the chunk's tokens in one layer, layout [kv_heads][chunk][row_stride], head_dim floats
 * each, after RoPE at each token's position (as a post-RoPE cache holds them when written). Every
 * layer once per forward when the policy reads KVEVICT_SIGNAL_KEYS; NaN and infinities fail the
 * call with KVEVICT_INVALID_ARGUMENT and nothing recorded. */
kvevict_status kvevict_sequence_observe_keys(kvevict_sequence* sequence, int layer,
                                             const float* keys, ptrdiff_t row_stride);
kvevict_status kvevict_sequence_end_forward(kvevict_sequence* sequence);

/* InfiniPot-style pots: feed at most pot_room tokens per forward (-1: no pot); when pending, run
 * a catalyst prompt (its slots from chunk_slots) and end it. */
int kvevict_sequence_pot_room(const kvevict_sequence* sequence);
int kvevict_sequence_catalyst_pending(const kvevict_sequence* sequence);
kvevict_status kvevict_sequence_begin_catalyst(kvevict_sequence* sequence, const int32_t* token_ids,
                                               int count);
kvevict_status kvevict_sequence_observe_catalyst(kvevict_sequence* sequence, int layer,
                                                 const float* rows, int queries,
                                                 ptrdiff_t row_stride);
kvevict_status kvevict_sequence_end_catalyst(kvevict_sequence* sequence);

/* --- One KV pool for many sequences (kvevict::KvPool, include/kvevict/kv_pool.hpp) -----------
 *
 * A pool is one budget of cells (a cell holds one token's K/V in every layer and head: see
 * kvevict_sequence_max_live) shared by its member sequences, each under its own policy. The rule:
 * - join: a member is charged what it can never give up: a policy with a pressed form (window,
 *   streaming_llm, h2o, tova, knorm, keydiff) its minimum (the tokens its rule protects, at least
 *   1, or the caller's `minimum` if larger) plus one max_chunk; any other bounded policy its whole
 *   bound plus one max_chunk. Join fails when the charges would exceed the pool (a pool smaller
 *   than the sum of the minimums), when the member's own bound plus one chunk exceeds the pool (a
 *   budget the pool can never grant), and for a policy with neither a bound nor a pressed form
 *   (full, AnLLM without max_slots).
 * - make_room, before every step, with the tokens each member is about to be fed: when cells held
 *   plus tokens fed exceed the pool, the members with a pressed form are cut to one common level
 *   (the largest lose cells first, none below its minimum), each by its own policy's ranking; the
 *   cuts reach each member's backend through apply() before make_room returns.
 * - between steps a member grows freely; its own policy bounds it.
 *
 * Member ids are small integers from join, the lowest free one. Errors are statuses with a message
 * (kvevict_last_error) and change nothing, and a call about one member leaves every other alone.
 *
 * Lifetimes. The pool does not own its members. A sequence belongs to at most one pool at a time.
 * The right order is kvevict_pool_leave, then kvevict_sequence_destroy; either order is safe:
 * - a member sequence destroyed first leaves the pool as it goes (its charge and cells are
 *   released), but its id stays reserved: a feed or kvevict_pool_minimum naming it fails with a
 *   message saying it was destroyed, until kvevict_pool_leave(pool, id) releases the id (which
 *   then succeeds);
 * - a pool destroyed first lets go of its members, which may join another pool.
 * A pool and its members are driven by one thread (destroying a member touches its pool). */

typedef struct kvevict_pool kvevict_pool;

/* Creates a pool of `cells` cells (> 0). */
kvevict_status kvevict_pool_create(int64_t cells, kvevict_pool** out);
/* Destroys the pool (NULL: nothing); its members stay valid sequences, members of no pool. */
void kvevict_pool_destroy(kvevict_pool* pool);

/* Admits `sequence` (between forwards) and writes its member id to `member` (-1 on failure).
 * `minimum`: the fewest cells a cut may leave it, at least its policy's own (0: the policy's). A
 * sequence already in a pool, or whose backend failed, is refused. */
kvevict_status kvevict_pool_join(kvevict_pool* pool, kvevict_sequence* sequence, int minimum,
                                 int* member);
/* Removes member `member` (or releases the id of a member whose sequence was destroyed); its cells
 * are the engine's to free, and the id may be given to a later join. */
kvevict_status kvevict_pool_leave(kvevict_pool* pool, int member);

/* One member's tokens in the coming step. */
typedef struct kvevict_pool_feed {
  int member;
  int tokens; /* in [0, the member's max_chunk] */
} kvevict_pool_feed;

/* Before a step that feeds each listed member its tokens (members not listed are fed nothing):
 * cuts members as the rule says, so that cells held plus tokens fed fit in the pool. `feeds` may
 * be NULL when `count` is 0. Refused before anything changes (KVEVICT_INVALID_ARGUMENT, the message
 * naming the member): a feed naming a member that is not in the pool (out of range, left, never
 * joined) or whose sequence was destroyed, a member fed twice, tokens outside [0, max_chunk], and
 * any member inside a forward (begun and not ended) or whose backend failed (leave the pool,
 * destroy it). A member's apply() failing during its cut fails the call with KVEVICT_BACKEND_ERROR
 * naming the member, which is then unusable: the members cut before it keep their cuts (already
 * applied); leave and destroy it, and call make_room again. */
kvevict_status kvevict_pool_make_room(kvevict_pool* pool, const kvevict_pool_feed* feeds,
                                      size_t count);

/* The pool's size in cells, -1 for NULL. */
int64_t kvevict_pool_cells(const kvevict_pool* pool);
/* Cells the members hold now (a member without a pressed form: its reservation), -1 for NULL. */
int64_t kvevict_pool_used(const kvevict_pool* pool);
/* Cells the members can never give up (the sum of their admission charges), -1 for NULL. */
int64_t kvevict_pool_charged(const kvevict_pool* pool);
/* 1 when `member` is a member (0 for a free id, one out of range, a destroyed member's, NULL). */
int kvevict_pool_is_member(const kvevict_pool* pool, int member);
/* The fewest cells a cut leaves `member` (0 for a member without a pressed form). A member that
 * is not in the pool, or whose sequence was destroyed, fails with a message saying which. */
kvevict_status kvevict_pool_minimum(const kvevict_pool* pool, int member, int64_t* minimum);

typedef struct kvevict_pool_stats {
  int64_t steps;         /* make_room calls that succeeded */
  int64_t pressed_steps; /* of those, the ones that cut a member */
  int64_t cuts;          /* members cut */
  int64_t peak_cells;    /* largest step peak: cells held after the cuts plus tokens fed */
} kvevict_pool_stats;
kvevict_status kvevict_pool_get_stats(const kvevict_pool* pool, kvevict_pool_stats* stats);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVEVICT_C_API_H */
