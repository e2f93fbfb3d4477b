// Store primitives: compaction throughput beside memcpy of the same bytes, and RoPE re-rotation.
//
//   build/release/bin/bench_store --benchmark_counters_tabular=true
//
// Compaction moves, per (layer, KV head), the key and value rows of every kept slot after the first
// evicted one. bytes_per_second counts exactly those bytes, so it compares directly with memcpy of
// the same number of bytes (BM_Memcpy with the same arguments), measured in the same run.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <kvevict/kvevict.hpp>
#include <vector>

namespace {

using kvevict::CacheShape;
using kvevict::CompactionPlan;
using kvevict::KvStore;

constexpr int kKvHeads = 8;

// Fills every head of `store` to `slots` live slots (metadata only; key/value contents are
// irrelevant to the cost of moving them).
void refill(KvStore<float>& store, int slots) {
  static std::vector<std::int64_t> positions;
  static std::vector<std::int32_t> ids;
  static std::vector<std::uint8_t> flags;
  positions.resize(static_cast<std::size_t>(slots));
  ids.assign(static_cast<std::size_t>(slots), 0);
  flags.assign(static_cast<std::size_t>(slots), 0);
  for (int i = 0; i < slots; ++i) positions[static_cast<std::size_t>(i)] = i;
  for (int g = 0; g < kKvHeads; ++g) {
    store.truncate(0, g, 0);
    store.slots().append(0, g, positions, positions, ids, flags);
  }
}

// Keep-list shapes: 0 = drop one slot in the middle (steady-state H2O/TOVA: half the rows move),
// 1 = keep every other slot (a large distillation: every kept row but the first moves).
std::vector<std::int32_t> keep_list(int slots, int pattern) {
  std::vector<std::int32_t> keep;
  for (int s = 0; s < slots; ++s) {
    if (pattern == 0 ? s != slots / 2 : s % 2 == 0) keep.push_back(s);
  }
  return keep;
}

std::int64_t moved_rows(const std::vector<std::int32_t>& keep) {
  std::int64_t moved = 0;
  for (std::size_t i = 0; i < keep.size(); ++i) moved += keep[i] != static_cast<std::int32_t>(i);
  return moved;
}

// Args: slots per head, head_dim, pattern.
void BM_Compaction(benchmark::State& state) {
  const int slots = static_cast<int>(state.range(0));
  const int head_dim = static_cast<int>(state.range(1));
  KvStore<float> store(CacheShape{1, kKvHeads, kKvHeads, head_dim}, slots);
  const std::vector<std::int32_t> keep = keep_list(slots, static_cast<int>(state.range(2)));
  CompactionPlan plan(1, kKvHeads, slots);
  for (int g = 0; g < kKvHeads; ++g) {
    std::copy(keep.begin(), keep.end(), plan.keep_buffer(0, g).begin());
    plan.set_keep_count(0, g, static_cast<int>(keep.size()));
  }
  refill(store, slots);
  kvevict::assign_positions(kvevict::PositionMode::original, store.slots(), plan);
  for (auto _ : state) {
    state.PauseTiming();
    refill(store, slots);
    state.ResumeTiming();
    store.apply(plan);
    benchmark::ClobberMemory();
  }
  const std::int64_t bytes =
      moved_rows(keep) * kKvHeads * 2 * head_dim * static_cast<std::int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["moved_MiB"] = static_cast<double>(bytes) / (1 << 20);
}

// The same bytes as BM_Compaction with the same arguments, copied with one memcpy per head and
// tensor (the lower bound a gather could reach).
void BM_Memcpy(benchmark::State& state) {
  const int slots = static_cast<int>(state.range(0));
  const int head_dim = static_cast<int>(state.range(1));
  const std::vector<std::int32_t> keep = keep_list(slots, static_cast<int>(state.range(2)));
  const std::size_t bytes_per_copy =
      static_cast<std::size_t>(moved_rows(keep)) * head_dim * sizeof(float);
  const std::size_t copies = 2 * kKvHeads;
  std::vector<char> source(bytes_per_copy * copies, 1);
  std::vector<char> destination(bytes_per_copy * copies, 0);
  for (auto _ : state) {
    for (std::size_t c = 0; c < copies; ++c) {
      std::memcpy(destination.data() + c * bytes_per_copy, source.data() + c * bytes_per_copy,
                  bytes_per_copy);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes_per_copy * copies));
}

void CompactionArgs(benchmark::internal::Benchmark* bench) {
  for (int slots : {256, 1024, 4096}) {
    for (int head_dim : {64, 128}) {
      for (int pattern : {0, 1}) bench->Args({slots, head_dim, pattern});
    }
  }
}
BENCHMARK(BM_Compaction)->Apply(CompactionArgs);
BENCHMARK(BM_Memcpy)->Apply(CompactionArgs);

// Re-rotation of `rows` keys of head_dim values. Arg 2: 0 = one shared delta (a compaction that
// shifts a run of keys by the same amount, the post-RoPE path), 1 = every row its own position (the
// pre-RoPE path: rotate every cached key to its position before attending).
void BM_ReRotation(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0));
  const int head_dim = static_cast<int>(state.range(1));
  const kvevict::Rope rope(
      kvevict::RopeConfig{head_dim, 0, 10000.0, kvevict::RopeLayout::half_split, 8192});
  std::vector<float> keys(static_cast<std::size_t>(rows) * head_dim, 0.5f);
  std::vector<std::int64_t> steps(static_cast<std::size_t>(rows), -1);
  if (state.range(2) == 1) {
    for (int r = 0; r < rows; ++r) steps[static_cast<std::size_t>(r)] = r;
  }
  for (auto _ : state) {
    rope.rotate_rows(keys.data(), head_dim, std::span<const std::int64_t>(steps));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * rows);
  state.SetBytesProcessed(state.iterations() * rows * head_dim *
                          static_cast<std::int64_t>(sizeof(float)));
}
BENCHMARK(BM_ReRotation)
    ->ArgsProduct({{256, 4096}, {64, 128}, {0, 1}})
    ->ArgNames({"rows", "head_dim", "per_row"});

}  // namespace

BENCHMARK_MAIN();
