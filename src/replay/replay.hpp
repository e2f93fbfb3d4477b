// Replay: drive one eviction policy through kvevict's own EvictionPipeline with a synthetic
// attention oracle (docs/replay-format.md, `kvevict-replay/1`), and compare its keep decisions
// with a reference result (`kvevict-replay-result/1`).
//
// Everything read from a file is validated before any buffer is sized from it: a hostile file gives
// a ReplayError naming the JSON path and the problem, never a crash or an allocation larger than
// the file itself implies.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"

namespace kvevict::replay {

inline constexpr std::string_view kReplayFormat = "kvevict-replay/1";
inline constexpr std::string_view kResultFormat = "kvevict-replay-result/1";

/// Bounds on what a replay may ask for. Replays are small synthetic cases; these keep a hostile
/// file from requesting gigabytes before its arrays are checked.
inline constexpr std::int64_t kMaxTokens = std::int64_t{1} << 16;
/// layers * q_heads.
inline constexpr std::int64_t kMaxLayerHeads = std::int64_t{1} << 16;
/// layers * q_heads * T * T, and layers * q_heads * P * (T + P) for the catalyst.
inline constexpr std::int64_t kMaxLogits = std::int64_t{1} << 26;
/// Replay files larger than this are refused before they are read.
inline constexpr std::uintmax_t kMaxFileBytes = std::uintmax_t{1} << 30;

/// Invalid replay or result input. The message starts with the JSON path of the offending value
/// (e.g. `logits[0][3][7]: ...`) where there is one.
class ReplayError : public Error {
 public:
  using Error::Error;
};

/// Attention geometry: query head h reads KV head h / group_size().
struct ReplayShape {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;  ///< "head_dim": the key length, 0 when the replay has no keys
  [[nodiscard]] int group_size() const { return q_heads / kv_heads; }
};

/// Kept original positions after one input chunk: kept[layer][kv_head], ascending.
struct ChunkKept {
  std::vector<std::vector<std::vector<std::int64_t>>> kept;
};

/// A `kvevict-replay-result/1` document.
struct ReplayResult {
  std::vector<ChunkKept> after_chunk;
};

/// Catalyst prompt of an InfiniPot replay.
struct Catalyst {
  int length = 0;              ///< P
  std::vector<double> logits;  ///< [L][Hq][P][T + P]
};

/// A validated `kvevict-replay/1` document.
struct Replay {
  std::string name;
  std::string source;  ///< empty when absent
  ReplayShape shape;
  int tokens = 0;           ///< T
  std::vector<int> chunks;  ///< positive, summing to T
  /// [L][Hq][T][T]; entries with j > i are stored as 0 (the format ignores them).
  std::vector<double> logits;
  std::optional<std::vector<float>> surprisal;         ///< [T]
  std::optional<std::vector<std::int32_t>> token_ids;  ///< [T]
  std::optional<Catalyst> catalyst;
  std::optional<std::vector<float>> keys;  ///< [L][Hkv][T][head_dim] (K-norm, KeyDiff)
  std::string policy_name;
  PolicyParams policy_params;  ///< every key of "policy" except "name"
  std::optional<ReplayResult> expected;

  /// logits[layer][q_head][query][key] (original positions).
  [[nodiscard]] double logit(int layer, int q_head, std::int64_t query, std::int64_t key) const {
    const auto t = static_cast<std::size_t>(tokens);
    return logits[((static_cast<std::size_t>(layer) * shape.q_heads + q_head) * t +
                   static_cast<std::size_t>(query)) *
                      t +
                  static_cast<std::size_t>(key)];
  }
  /// catalyst.logits[layer][q_head][catalyst_query][column], column in [0, T + P).
  [[nodiscard]] double catalyst_logit(int layer, int q_head, int catalyst_query,
                                      std::int64_t column) const {
    const auto p = static_cast<std::size_t>(catalyst->length);
    const auto columns = static_cast<std::size_t>(tokens) + p;
    return catalyst->logits[((static_cast<std::size_t>(layer) * shape.q_heads + q_head) * p +
                             static_cast<std::size_t>(catalyst_query)) *
                                columns +
                            static_cast<std::size_t>(column)];
  }
};

/// Validates a parsed `kvevict-replay/1` document. Throws ReplayError.
[[nodiscard]] Replay parse_replay(const nlohmann::json& document);
/// Parses and validates replay text; invalid JSON is a ReplayError with its byte offset.
[[nodiscard]] Replay parse_replay_text(std::string_view text);
/// Reads, parses and validates a replay file.
[[nodiscard]] Replay load_replay(const std::filesystem::path& file);

/// Validates a `kvevict-replay-result/1` document; `path` prefixes error messages (e.g.
/// "expected"). Positions are sorted and de-duplicated (results are compared as sets).
[[nodiscard]] ReplayResult parse_result(const nlohmann::json& document,
                                        const std::string& path = "");

/// Runs the replay with make_policy(replay.policy_name, replay.policy_params).
[[nodiscard]] ReplayResult run_replay(const Replay& replay);
/// Runs the replay with a given policy object (tests, policies outside the registry).
[[nodiscard]] ReplayResult run_replay(const Replay& replay, std::unique_ptr<Policy> policy);

[[nodiscard]] nlohmann::json result_to_json(const ReplayResult& result);
/// The result as JSON text, one line per input chunk.
[[nodiscard]] std::string format_result(const ReplayResult& result);

/// One (chunk, layer, KV head) list whose sets differ.
struct Disagreement {
  int chunk = 0;
  int layer = 0;
  int kv_head = 0;
  std::vector<std::int64_t> only_expected;
  std::vector<std::int64_t> only_actual;
};

struct Comparison {
  bool agree = true;
  int lists_compared = 0;
  int lists_disagreeing = 0;
  std::optional<Disagreement> first;  ///< the first differing list in chunk, layer, head order
  std::string shape_mismatch;         ///< set when the results do not even have the same shape
};

/// Compares two results list by list, as sets.
[[nodiscard]] Comparison compare_results(const ReplayResult& expected, const ReplayResult& actual);
/// Readable multi-line report of a disagreement; `chunks` (the input chunk sizes), when given,
/// adds the positions each chunk covered.
[[nodiscard]] std::string describe(const Comparison& comparison, std::span<const int> chunks = {});

}  // namespace kvevict::replay
