/* The installed C API used from C: StreamingLLM over an engine's own buffers (here, none). */
#include <kvevict/c_api.h>
#include <stdio.h>

int main(void) {
  kvevict_pipeline* pipeline = NULL;
  if (kvevict_pipeline_create("streaming_llm", "sinks=2 recent=3", 1, 1, 16, NULL, &pipeline) !=
      KVEVICT_OK) {
    printf("kvevict C consumer FAILED: %s\n", kvevict_last_error());
    return 1;
  }
  for (int32_t t = 0; t < 10; ++t) {
    int compacted = 0;
    kvevict_pipeline_before_chunk(pipeline, 1, 0, NULL);
    kvevict_pipeline_append_chunk(pipeline, &t, 1);
    kvevict_pipeline_end_forward(pipeline, &compacted);
  }
  const int live = kvevict_pipeline_live(pipeline, 0, 0);
  /* A bad call reports an error instead of crashing. */
  const kvevict_status bad = kvevict_pipeline_append_chunk(pipeline, NULL, 0);
  kvevict_pipeline_destroy(pipeline);
  if (live != 5 || bad != KVEVICT_INVALID_ARGUMENT) {
    printf("kvevict C consumer FAILED: live %d, status %d\n", live, (int)bad);
    return 1;
  }
  puts("kvevict C consumer OK");
  return 0;
}
