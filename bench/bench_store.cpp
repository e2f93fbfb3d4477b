// Store primitives of the metadata-only core, each beside a reference measured in the same run.
//
//   build/release/bin/bench_store --benchmark_counters_tabular=true
//
// BM_EvictAndAppend: one steady step of a unit at `slots` live tokens: one token evicted and one
// appended, metadata only (slot freed and reused, stream order, position groups). `where` picks the
// eviction: 0 the oldest non-sink (Window / StreamingLLM), 1 a random token (H2O / TOVA). Under
// cache_index a random eviction splits a position group and shifts the newer ones, which is the
// worst case of the bookkeeping. BM_MemmoveHalf is the reference: moving half of one head's K/V
// rows (head_dim 64, f32), what the v1 core did per head at every such eviction.
//
// BM_FoldRotation: rotating stored keys in place (a fold), rows per second beside BM_Memcpy of the
// same bytes between two buffers.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <kvevict/kvevict.hpp>
#include <random>
#include <vector>

namespace {

using kvevict::PositionMode;
using kvevict::SlotTable;

// Args: live slots, where (0 oldest non-sink, 1 random), mode (0 original, 1 cache_index).
void BM_EvictAndAppend(benchmark::State& state) {
  const int live = static_cast<int>(state.range(0));
  const bool random = state.range(1) == 1;
  const PositionMode mode =
      state.range(2) == 1 ? PositionMode::cache_index : PositionMode::original;
  SlotTable slots(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), mode, live + 1, 1);
  std::vector<std::int64_t> original{0};
  const std::vector<std::int32_t> token{0};
  const std::vector<std::uint8_t> flags{0};
  std::vector<std::int32_t> slot(1);
  for (int t = 0; t < live; ++t) {
    original[0] = t;
    slots.append(0, original, token, flags, slot);
  }
  std::mt19937 rng(1);
  std::int64_t next = live;
  for (auto _ : state) {
    const auto order = slots.stream_order(0);
    const std::int32_t victim =
        random ? order[4 + rng() % (order.size() - 4)] : order[4];  // 4 sinks stay
    slots.evict(0, std::span<const std::int32_t>(&victim, 1));
    original[0] = next++;
    slots.append(0, original, token, flags, slot);
  }
  state.counters["groups"] = slots.group_count(0);
}
BENCHMARK(BM_EvictAndAppend)
    ->ArgNames({"live", "random", "cache_index"})
    ->ArgsProduct({{1024, 4096}, {0, 1}, {0, 1}});

// The v1 core's compaction of one head after one eviction in the middle: half the K and V rows
// move.
void BM_MemmoveHalf(benchmark::State& state) {
  const int live = static_cast<int>(state.range(0));
  constexpr int kHeadDim = 64;
  std::vector<float> keys(static_cast<std::size_t>(live + 1) * kHeadDim, 1.0f);
  std::vector<float> values(keys.size(), 2.0f);
  const std::size_t half = static_cast<std::size_t>(live / 2) * kHeadDim;
  for (auto _ : state) {
    std::memmove(keys.data() + half, keys.data() + half + kHeadDim, half * sizeof(float));
    std::memmove(values.data() + half, values.data() + half + kHeadDim, half * sizeof(float));
    benchmark::DoNotOptimize(keys.data());
    benchmark::DoNotOptimize(values.data());
  }
}
BENCHMARK(BM_MemmoveHalf)->ArgName("live")->Arg(1024)->Arg(4096);

// Args: rows, head_dim.
void BM_FoldRotation(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0));
  const int head_dim = static_cast<int>(state.range(1));
  const kvevict::Rope rope(
      kvevict::RopeConfig{head_dim, 0, 10000.0, kvevict::RopeLayout::half_split});
  std::vector<float> keys(static_cast<std::size_t>(rows) * head_dim, 0.5f);
  std::vector<double> angles(static_cast<std::size_t>(head_dim));
  std::int64_t delta = -1;
  for (auto _ : state) {
    const double* cos_sin = rope.angles(delta--, angles.data());
    for (int r = 0; r < rows; ++r) {
      rope.rotate_with(keys.data() + static_cast<std::ptrdiff_t>(r) * head_dim, cos_sin);
    }
    benchmark::DoNotOptimize(keys.data());
  }
  state.SetItemsProcessed(state.iterations() * rows);
  state.SetBytesProcessed(state.iterations() *
                          static_cast<std::int64_t>(keys.size() * sizeof(float)));
}
BENCHMARK(BM_FoldRotation)->ArgNames({"rows", "head_dim"})->ArgsProduct({{1024, 4096}, {64, 128}});

// memcpy of the bytes BM_FoldRotation rewrites, between two buffers.
void BM_Memcpy(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) *
                            static_cast<std::size_t>(state.range(1)) * sizeof(float);
  std::vector<char> from(bytes, 1), to(bytes);
  for (auto _ : state) {
    std::memcpy(to.data(), from.data(), bytes);
    benchmark::DoNotOptimize(to.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
}
BENCHMARK(BM_Memcpy)->ArgNames({"rows", "head_dim"})->ArgsProduct({{1024, 4096}, {64, 128}});

}  // namespace

BENCHMARK_MAIN();
