// Smoke test for the installed kvevict package (built by the kvevict.consumer.* ctest tests):
// a StreamingLLM cache built from the installed headers keeps sinks + recent window.
#include <cstdio>
#include <kvevict/kvevict.hpp>
#include <memory>
#include <vector>

int main() {
  kvevict::CacheConfig config;
  config.shape = kvevict::CacheShape{1, 2, 1, 8};
  kvevict::EvictingCache cache(
      config, kvevict::make_policy("streaming_llm",
                                   kvevict::PolicyParams().set("sinks", 2).set("recent", 3)));
  const kvevict::EvictingCache::Matrix rows = kvevict::EvictingCache::Matrix::Ones(1, 8);
  for (int t = 0; t < 10; ++t) {
    cache.sequence().begin_chunk(std::vector<std::int32_t>{t});
    cache.write_chunk(0, 0, rows, rows);
    cache.sequence().end_forward();
  }
  if (cache.sequence().live(0, 0) != 5) {
    std::printf("kvevict consumer FAILED: %d live slots, expected 5\n",
                cache.sequence().live(0, 0));
    return 1;
  }
  std::puts("kvevict consumer OK");
  return 0;
}
