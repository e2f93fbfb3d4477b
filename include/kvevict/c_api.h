/* kvevict C API: the selection side of kvevict for engines written in any language.
 *
 * A kvevict_pipeline holds one sequence's slot metadata and its policy, never keys or values: the
 * engine keeps K/V in its own buffers and, whenever a call reports `compacted`, applies the plan to
 * them (kvevict_pipeline_plan): for every head that changes, gather rows keep[i] -> i of keys and
 * values and, if keys are stored after RoPE, rotate kept key i by position_deltas[i] positions.
 * Same event order as the C++ EvictionPipeline (include/kvevict/pipeline.hpp).
 *
 * Errors: every function returns a kvevict_status; on failure kvevict_last_error() describes it.
 * No C++ exception ever crosses this API. Link kvevict::c (CMake) or libkvevict_c.
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
  KVEVICT_INTERNAL_ERROR = 3
} kvevict_status;

/* Signals a policy may want (kvevict_pipeline_signals); same bits as kvevict::Signal. */
#define KVEVICT_SIGNAL_TOKEN_IDS 0x01u
#define KVEVICT_SIGNAL_SURPRISAL 0x02u
#define KVEVICT_SIGNAL_ATTENTION_ROWS 0x04u     /* rows of every query of the forward */
#define KVEVICT_SIGNAL_LAST_ATTENTION_ROW 0x08u /* the forward's last query only */
#define KVEVICT_SIGNAL_TURN_BOUNDARIES 0x10u
#define KVEVICT_SIGNAL_CATALYST_ATTENTION 0x20u

/* Message of the last failed call on this thread, "" if none. Valid until the next call. */
const char* kvevict_last_error(void);

typedef struct kvevict_pipeline kvevict_pipeline;

/* Creates a pipeline for `policy` (e.g. "h2o") over `layers` x `kv_heads` heads of `capacity`
 * slots. `params`: space-separated key=value pairs, lists comma-separated, e.g. "heavy=64
 * recent=64" or "anchor_ids=29889,32001"; NULL or "" for none. `position_mode`: NULL for the
 * policy's default, or "original", "cache_index", "reset_on_compact". */
kvevict_status kvevict_pipeline_create(const char* policy, const char* params, int layers,
                                       int kv_heads, int capacity, const char* position_mode,
                                       kvevict_pipeline** out);
void kvevict_pipeline_destroy(kvevict_pipeline* pipeline);

/* The KVEVICT_SIGNAL_* bits the policy consumes. */
uint32_t kvevict_pipeline_signals(const kvevict_pipeline* pipeline);
/* Most slots a head holds after eviction, or -1 when the policy is unbounded. */
int kvevict_pipeline_retained_limit(const kvevict_pipeline* pipeline);
/* Grows every head to `capacity` slots (the engine grows its K/V buffers alike). */
kvevict_status kvevict_pipeline_reserve(kvevict_pipeline* pipeline, int capacity);
/* Live slots of head (layer, kv_head), or -1 for an invalid head. */
int kvevict_pipeline_live(const kvevict_pipeline* pipeline, int layer, int kv_head);
/* Original and RoPE positions of the live slots of head (layer, kv_head). */
kvevict_status kvevict_pipeline_slots(const kvevict_pipeline* pipeline, int layer, int kv_head,
                                      const int64_t** original_positions, const int64_t** positions,
                                      int* count);

/* Per forward, in this order. `compacted` (may be NULL) is set to 1 when a plan was applied. */
kvevict_status kvevict_pipeline_before_chunk(kvevict_pipeline* pipeline, int incoming,
                                             int turn_start, int* compacted);
kvevict_status kvevict_pipeline_append_chunk(kvevict_pipeline* pipeline, const int32_t* token_ids,
                                             int count);
/* Softmax rows of one layer, layout [q_heads][queries][row_stride] over each KV head's slots
 * (query head h reads KV head h / (q_heads / kv_heads)). */
kvevict_status kvevict_pipeline_observe_attention(kvevict_pipeline* pipeline, int layer,
                                                  const float* rows, int q_heads, int queries,
                                                  ptrdiff_t row_stride);
kvevict_status kvevict_pipeline_observe_surprisal(kvevict_pipeline* pipeline,
                                                  const float* surprisal, int count);
kvevict_status kvevict_pipeline_end_forward(kvevict_pipeline* pipeline, int* compacted);

/* InfiniPot-style pots: when pending, run a catalyst prompt and roll it back. */
int kvevict_pipeline_catalyst_pending(const kvevict_pipeline* pipeline);
kvevict_status kvevict_pipeline_begin_catalyst(kvevict_pipeline* pipeline, const int32_t* token_ids,
                                               int count);
kvevict_status kvevict_pipeline_observe_catalyst(kvevict_pipeline* pipeline, int layer,
                                                 const float* rows, int q_heads, int queries,
                                                 ptrdiff_t row_stride);
kvevict_status kvevict_pipeline_end_catalyst(kvevict_pipeline* pipeline, int* compacted);

/* The plan applied by the last call that reported `compacted`, for head (layer, kv_head):
 * `changes` = 0 if the head was untouched; else `count` kept slots, keep[i] ascending old slot
 * indices and position_deltas[i] the rotation of kept key i. Valid until the next forward call. */
kvevict_status kvevict_pipeline_plan(const kvevict_pipeline* pipeline, int layer, int kv_head,
                                     int* changes, const int32_t** keep,
                                     const int64_t** position_deltas, int* count);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVEVICT_C_API_H */
