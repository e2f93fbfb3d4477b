/* The installed C API used from C: StreamingLLM over an engine's own buffer, applied through the
 * engine's backend callbacks. */
#include <kvevict/c_api.h>
#include <stdio.h>

/* The engine's buffer: the original position held by each slot (-1 when free). */
static int64_t rows[64];
static int applies = 0;

static int reserve(void* user_data, int capacity) {
  (void)user_data;
  return capacity <= 64 ? 0 : 1;
}

static int apply(void* user_data, const kvevict_decision* decision) {
  const kvevict_evicted* evicted = NULL;
  int count = 0;
  (void)user_data;
  if (kvevict_decision_evicted(decision, 0, 0, &evicted, &count) != KVEVICT_OK) return 1;
  for (int i = 0; i < count; ++i) rows[evicted[i].slot] = -1;
  ++applies;
  return 0;
}

int main(void) {
  for (int slot = 0; slot < 64; ++slot) rows[slot] = -1;
  kvevict_config config;
  kvevict_config_init(&config);
  config.layers = 1;
  config.q_heads = 1;
  config.kv_heads = 1;
  kvevict_backend backend = {NULL, reserve, apply};
  kvevict_sequence* sequence = NULL;
  if (kvevict_sequence_create("streaming_llm", "sinks=2 recent=3", &config, &backend, &sequence) !=
      KVEVICT_OK) {
    printf("kvevict C consumer FAILED: %s\n", kvevict_last_error());
    return 1;
  }
  for (int32_t t = 0; t < 10; ++t) {
    const int32_t* slots = NULL;
    int count = 0;
    kvevict_sequence_begin_chunk(sequence, &t, 1, 0);
    kvevict_sequence_chunk_slots(sequence, 0, 0, &slots, &count);
    rows[slots[0]] = t; /* the engine writes the token's K/V at its slot */
    kvevict_sequence_end_forward(sequence);
  }
  const int live = kvevict_sequence_live(sequence, 0, 0);
  /* A bad call reports an error instead of crashing. */
  const kvevict_status bad = kvevict_sequence_begin_chunk(sequence, NULL, 0, 0);
  kvevict_sequence_destroy(sequence);
  int held = 0;
  for (int slot = 0; slot < 64; ++slot) held += rows[slot] >= 0 ? 1 : 0;
  if (live != 5 || held != 5 || applies != 5 || bad != KVEVICT_INVALID_ARGUMENT) {
    printf("kvevict C consumer FAILED: live %d, held %d, applies %d, status %d\n", live, held,
           applies, (int)bad);
    return 1;
  }
  printf("kvevict C consumer OK (kvevict %s)\n", kvevict_version());
  return 0;
}
