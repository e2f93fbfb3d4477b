// Reading, writing and comparing kvevict-replay/1 documents (docs/replay-format.md): every value
// read from a file is validated before a buffer is sized from it.
#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "common/bounded_json.hpp"
#include "common/input_files.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/policy_registry.hpp"
#include "replay/replay.hpp"

namespace kvevict::replay {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Validation helpers. Paths are built only when an error is reported: the logits walk visits
// millions of entries.
// ---------------------------------------------------------------------------------------------

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw ReplayError(path.empty() ? problem : path + ": " + problem);
}

std::string member(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string indexed(const std::string& path, std::initializer_list<std::size_t> indices) {
  std::string out = path;
  // Appended piecewise: GCC 12 raises a false -Wrestrict on "[" + std::to_string(...).
  for (std::size_t index : indices) {
    out += '[';
    out += std::to_string(index);
    out += ']';
  }
  return out;
}

// A short, always printable rendering of a value for messages, whatever its size or depth.
std::string preview(const json& value) { return common::json_preview(value); }

std::string kind_of(const json& value) {
  if (value.is_number()) return "the number " + preview(value);
  if (value.is_string()) return "the string " + preview(value);
  return std::string("a value of type ") + value.type_name();
}

const json& require_key(const json& object, const std::string& object_path, std::string_view key) {
  const auto it = object.find(key);
  if (it == object.end()) fail(member(object_path, key), "required key is missing");
  return *it;
}

const json* optional_key(const json& object, std::string_view key) {
  const auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

void require_object(const json& value, const std::string& path) {
  if (!value.is_object()) fail(path, "expected an object, got " + kind_of(value));
}

void require_array(const json& value, const std::string& path) {
  if (!value.is_array()) fail(path, "expected an array, got " + kind_of(value));
}

// An array of exactly `size` entries; `meaning` says what the entries are (for the message).
void require_array_of(const json& value, const std::string& path, std::size_t size,
                      std::string_view meaning) {
  require_array(value, path);
  if (value.size() != size) {
    fail(path, "expected " + std::to_string(size) + " entries (" + std::string(meaning) +
                   "), got " + std::to_string(value.size()));
  }
}

std::string read_string(const json& value, const std::string& path) {
  if (!value.is_string()) fail(path, "expected a string, got " + kind_of(value));
  return value.get<std::string>();
}

std::int64_t read_integer(const json& value, const std::string& path, std::int64_t min,
                          std::int64_t max) {
  if (!value.is_number_integer()) fail(path, "expected an integer, got " + kind_of(value));
  const bool in_range = value.is_number_unsigned()
                            ? value.get<std::uint64_t>() <= static_cast<std::uint64_t>(max) &&
                                  static_cast<std::int64_t>(value.get<std::uint64_t>()) >= min
                            : value.get<std::int64_t>() >= min && value.get<std::int64_t>() <= max;
  if (!in_range) {
    fail(path, "value " + preview(value) + " is outside [" + std::to_string(min) + ", " +
                   std::to_string(max) + "]");
  }
  return value.is_number_unsigned() ? static_cast<std::int64_t>(value.get<std::uint64_t>())
                                    : value.get<std::int64_t>();
}

int read_int(const json& value, const std::string& path, std::int64_t min, std::int64_t max) {
  return static_cast<int>(read_integer(value, path, min, max));
}

// A finite number. In-memory documents can hold NaN or infinity even though JSON text cannot.
double read_finite(const json& value, const std::string& path) {
  if (!value.is_number()) fail(path, "expected a number, got " + kind_of(value));
  const double number = value.get<double>();
  if (!std::isfinite(number)) fail(path, "expected a finite number, got " + preview(value));
  return number;
}

// Reads a dense [d0][d1][d2][d3] array of numbers into `out`, row-major. Entries for which
// `used(i0, i1, i2, i3)` is false must be numbers but are ignored (stored as 0). `out` grows with
// the entries the document holds (never to the product of `dims` up front): a short file that
// declares a large shape fails on its first short array, before it costs memory.
template <class UsedFn>
void read_tensor4(const json& value, const std::string& path, std::array<std::size_t, 4> dims,
                  std::array<std::string_view, 4> meanings, UsedFn used, std::vector<double>& out) {
  out.clear();
  require_array_of(value, path, dims[0], meanings[0]);
  for (std::size_t i0 = 0; i0 < dims[0]; ++i0) {
    const json& level1 = value[i0];
    if (!level1.is_array() || level1.size() != dims[1]) {
      require_array_of(level1, indexed(path, {i0}), dims[1], meanings[1]);
    }
    for (std::size_t i1 = 0; i1 < dims[1]; ++i1) {
      const json& level2 = level1[i1];
      if (!level2.is_array() || level2.size() != dims[2]) {
        require_array_of(level2, indexed(path, {i0, i1}), dims[2], meanings[2]);
      }
      for (std::size_t i2 = 0; i2 < dims[2]; ++i2) {
        const json& row = level2[i2];
        if (!row.is_array() || row.size() != dims[3]) {
          require_array_of(row, indexed(path, {i0, i1, i2}), dims[3], meanings[3]);
        }
        for (std::size_t i3 = 0; i3 < dims[3]; ++i3) {
          const json& entry = row[i3];
          if (used(i0, i1, i2, i3)) {
            if (!entry.is_number() || !std::isfinite(entry.get<double>())) {
              read_finite(entry, indexed(path, {i0, i1, i2, i3}));
            }
            out.push_back(entry.get<double>());
          } else {
            if (!entry.is_number()) {
              fail(indexed(path, {i0, i1, i2, i3}), "expected a number, got " + kind_of(entry));
            }
            out.push_back(0.0);
          }
        }
      }
    }
  }
}

// Throws a ReplayError at `path` unless the product of `factors` is at most the replay limit
// `limit`; `what` names the product in the message.
void require_product_within(const std::string& path, std::initializer_list<std::int64_t> factors,
                            std::string_view what, std::int64_t limit) {
  try {
    (void)checked_product(factors, what, limit);
  } catch (const Error& error) {
    fail(path, std::string(error.what()) + " (a replay limit)");
  }
}

// ---------------------------------------------------------------------------------------------
// Sections of a replay document
// ---------------------------------------------------------------------------------------------

ReplayShape read_shape(const json& document) {
  const json& value = require_key(document, "", "shape");
  require_object(value, "shape");
  ReplayShape shape;
  shape.layers = read_int(require_key(value, "shape", "layers"), "shape.layers", 1, kMaxLayerHeads);
  shape.q_heads =
      read_int(require_key(value, "shape", "q_heads"), "shape.q_heads", 1, kMaxLayerHeads);
  shape.kv_heads =
      read_int(require_key(value, "shape", "kv_heads"), "shape.kv_heads", 1, kMaxLayerHeads);
  if (shape.q_heads % shape.kv_heads != 0) {
    fail("shape", "q_heads (" + std::to_string(shape.q_heads) +
                      ") is not a multiple of kv_heads (" + std::to_string(shape.kv_heads) + ")");
  }
  require_product_within("shape", {shape.layers, shape.q_heads}, "layers * q_heads",
                         kMaxLayerHeads);
  if (const json* head_dim = optional_key(value, "head_dim")) {
    shape.head_dim = read_int(*head_dim, "shape.head_dim", 1, kMaxLayerHeads);
  }
  return shape;
}

std::vector<int> read_chunks(const json& document, int tokens) {
  const json& value = require_key(document, "", "chunks");
  require_array(value, "chunks");
  if (value.empty()) fail("chunks", "expected at least one chunk");
  std::vector<int> chunks;
  std::int64_t covered = 0;
  for (std::size_t k = 0; k < value.size(); ++k) {
    const std::string path = indexed("chunks", {k});
    if (value[k].is_number_integer() && !value[k].is_number_unsigned() &&
        value[k].get<std::int64_t>() <= 0) {
      fail(path, "chunk sizes must be positive, got " + preview(value[k]));
    }
    const int size = read_int(value[k], path, 1, tokens);
    covered += size;
    if (covered > tokens) {
      fail("chunks", "chunk sizes sum past tokens (" + std::to_string(tokens) + ") at " + path);
    }
    chunks.push_back(size);
  }
  if (covered != tokens) {
    fail("chunks", "chunk sizes sum to " + std::to_string(covered) + ", but tokens is " +
                       std::to_string(tokens));
  }
  return chunks;
}

void read_policy(const json& document, Replay& replay) {
  const json& value = require_key(document, "", "policy");
  require_object(value, "policy");
  replay.policy_name = read_string(require_key(value, "policy", "name"), "policy.name");
  const PolicySpec* spec = find_policy_spec(replay.policy_name);
  for (const auto& [key, parameter] : value.items()) {
    if (key == "name") continue;
    const std::string path = member("policy", key);
    // A word only where the policy takes one: a choice parameter (snapkv's "pooling": "max").
    const ParamSpec* param = spec != nullptr ? spec->find(key) : nullptr;
    if (parameter.is_string() && param != nullptr && param->type == ParamType::choice) {
      const std::string word = parameter.get<std::string>();
      if (std::find(param->choices.begin(), param->choices.end(), word) == param->choices.end()) {
        fail(path,
             "expected one of " + PolicySpec::choices_text(*param) + ", got " + kind_of(parameter));
      }
      replay.policy_params.set_word(key, word);
    } else if (parameter.is_number()) {
      replay.policy_params.set(key, read_finite(parameter, path));
    } else if (parameter.is_array()) {
      std::vector<std::int64_t> list;
      list.reserve(parameter.size());
      for (std::size_t i = 0; i < parameter.size(); ++i) {
        list.push_back(read_integer(parameter[i], indexed(path, {i}),
                                    std::numeric_limits<std::int64_t>::min(),
                                    std::numeric_limits<std::int64_t>::max()));
      }
      replay.policy_params.set_list(key, std::move(list));
    } else {
      fail(path, "expected a number or an array of integers" +
                     std::string(param != nullptr && param->type == ParamType::choice
                                     ? " or one of " + PolicySpec::choices_text(*param)
                                     : "") +
                     ", got " + kind_of(parameter));
    }
  }
}

std::vector<float> read_surprisal(const json& value, int tokens) {
  require_array_of(value, "surprisal", static_cast<std::size_t>(tokens), "one per token");
  std::vector<float> surprisal(static_cast<std::size_t>(tokens));
  for (std::size_t i = 0; i < surprisal.size(); ++i) {
    const std::string path = indexed("surprisal", {i});
    const double number = read_finite(value[i], path);
    // Policies observe float; a value past float range would become infinity.
    if (std::fabs(number) > std::numeric_limits<float>::max()) {
      fail(path, "value " + preview(value[i]) + " does not fit a float");
    }
    surprisal[i] = static_cast<float>(number);
  }
  return surprisal;
}

std::vector<std::int32_t> read_token_ids(const json& value, int tokens) {
  require_array_of(value, "token_ids", static_cast<std::size_t>(tokens), "one per token");
  std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<std::int32_t>(read_integer(value[i], indexed("token_ids", {i}),
                                                    std::numeric_limits<std::int32_t>::min(),
                                                    std::numeric_limits<std::int32_t>::max()));
  }
  return ids;
}

Catalyst read_catalyst(const json& value, const ReplayShape& shape, int tokens) {
  require_object(value, "catalyst");
  Catalyst catalyst;
  catalyst.length =
      read_int(require_key(value, "catalyst", "length"), "catalyst.length", 1, kMaxTokens);
  const std::int64_t columns = std::int64_t{tokens} + catalyst.length;
  require_product_within("catalyst", {shape.layers, shape.q_heads, catalyst.length, columns},
                         "layers * q_heads * length * (tokens + length) logits", kMaxLogits);
  const auto length = static_cast<std::size_t>(catalyst.length);
  const auto t = static_cast<std::size_t>(tokens);
  // Catalyst query p sees every pot token (column < T) and catalyst tokens 0..p (causal).
  const auto used = [t](std::size_t, std::size_t, std::size_t p, std::size_t column) {
    return column < t || column - t <= p;
  };
  read_tensor4(require_key(value, "catalyst", "logits"), "catalyst.logits",
               {static_cast<std::size_t>(shape.layers), static_cast<std::size_t>(shape.q_heads),
                length, static_cast<std::size_t>(columns)},
               {"layers", "q_heads", "catalyst length", "tokens + catalyst length"}, used,
               catalyst.logits);
  return catalyst;
}

std::vector<float> read_keys(const json& value, const ReplayShape& shape, int tokens) {
  if (shape.head_dim == 0) fail("keys", "the replay has keys but no shape.head_dim");
  require_product_within("keys", {shape.layers, shape.kv_heads, tokens, shape.head_dim},
                         "layers * kv_heads * tokens * head_dim key values", kMaxLogits);
  std::vector<double> values;
  read_tensor4(
      value, "keys",
      {static_cast<std::size_t>(shape.layers), static_cast<std::size_t>(shape.kv_heads),
       static_cast<std::size_t>(tokens), static_cast<std::size_t>(shape.head_dim)},
      {"layers", "kv_heads", "tokens", "head_dim"},
      [](std::size_t, std::size_t, std::size_t, std::size_t) { return true; }, values);
  std::vector<float> keys(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    // Policies observe float keys; a value past float range would become infinity.
    if (std::fabs(values[i]) > std::numeric_limits<float>::max()) {
      fail("keys", "value " + std::to_string(values[i]) + " does not fit a float");
    }
    keys[i] = static_cast<float>(values[i]);
  }
  return keys;
}

// Lists per layer in a result of `replay`: q_heads when its policy caches every query head (the
// format's `gqa` parameter of snapkv, pyramidkv and adakv at "repeat", its default), else kv_heads.
int result_heads(const Replay& replay) {
  const PolicySpec* spec = find_policy_spec(replay.policy_name);
  const ParamSpec* gqa = spec != nullptr ? spec->find("gqa") : nullptr;
  if (gqa == nullptr || gqa->type != ParamType::choice || !gqa->default_value) {
    return replay.shape.kv_heads;
  }
  std::string_view layout = gqa->choices[static_cast<std::size_t>(*gqa->default_value)];
  const auto given = replay.policy_params.values().find("gqa");
  if (given != replay.policy_params.values().end()) {
    const auto* word = std::get_if<std::string>(&given->second);
    if (word != nullptr) layout = *word;
  }
  return layout == "repeat" ? replay.shape.q_heads : replay.shape.kv_heads;
}

// The expected result must describe this replay: one entry per chunk, [layers][kv_heads] lists of
// positions in [0, T), [layers][q_heads] under gqa = repeat (result_heads).
void check_result_matches(const ReplayResult& result, const Replay& replay,
                          const std::string& path) {
  const int heads = result_heads(replay);
  const std::string heads_meaning =
      heads == replay.shape.kv_heads ? "kv_heads" : "q_heads: gqa = repeat caches each query head";
  if (result.after_chunk.size() != replay.chunks.size()) {
    fail(member(path, "after_chunk"), "expected " + std::to_string(replay.chunks.size()) +
                                          " entries (one per chunk), got " +
                                          std::to_string(result.after_chunk.size()));
  }
  for (std::size_t k = 0; k < result.after_chunk.size(); ++k) {
    const auto& kept = result.after_chunk[k].kept;
    const std::string chunk_path = indexed(member(path, "after_chunk"), {k}) + ".kept";
    if (kept.size() != static_cast<std::size_t>(replay.shape.layers)) {
      fail(chunk_path, "expected " + std::to_string(replay.shape.layers) +
                           " entries (layers), got " + std::to_string(kept.size()));
    }
    for (std::size_t l = 0; l < kept.size(); ++l) {
      if (kept[l].size() != static_cast<std::size_t>(heads)) {
        fail(indexed(chunk_path, {l}), "expected " + std::to_string(heads) + " entries (" +
                                           heads_meaning + "), got " +
                                           std::to_string(kept[l].size()));
      }
      for (std::size_t g = 0; g < kept[l].size(); ++g) {
        for (std::int64_t position : kept[l][g]) {
          if (position >= replay.tokens) {
            fail(indexed(chunk_path, {l, g}), "position " + std::to_string(position) +
                                                  " is outside [0, " +
                                                  std::to_string(replay.tokens) + ")");
          }
        }
      }
    }
  }
}

std::string strip_nlohmann_prefix(const char* what) {
  // "[json.exception.parse_error.101] parse error at ..." -> "parse error at ..."
  std::string message(what);
  if (!message.empty() && message.front() == '[') {
    const std::size_t close = message.find("] ");
    if (close != std::string::npos) message.erase(0, close + 2);
  }
  return message;
}

std::string format_positions(const std::vector<std::int64_t>& positions) {
  constexpr std::size_t kMaxShown = 64;
  if (positions.empty()) return "(none)";
  std::string out;
  for (std::size_t i = 0; i < positions.size() && i < kMaxShown; ++i) {
    if (i > 0) out += ' ';
    out += std::to_string(positions[i]);
  }
  if (positions.size() > kMaxShown) {
    out += " ... (" + std::to_string(positions.size() - kMaxShown) + " more)";
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------------

Replay parse_replay(const json& document) {
  require_object(document, "");
  Replay replay;
  const std::string format = read_string(require_key(document, "", "format"), "format");
  if (format != kReplayFormat) {
    fail("format",
         "expected \"" + std::string(kReplayFormat) + "\", got " + preview(document.at("format")));
  }
  replay.name = read_string(require_key(document, "", "name"), "name");
  if (const json* source = optional_key(document, "source")) {
    replay.source = read_string(*source, "source");
  }
  replay.shape = read_shape(document);
  replay.tokens = read_int(require_key(document, "", "tokens"), "tokens", 1, kMaxTokens);
  replay.chunks = read_chunks(document, replay.tokens);
  read_policy(document, replay);

  // Sizes are known and bounded from here on; the arrays must match them exactly.
  const ReplayShape& shape = replay.shape;
  require_product_within("logits", {shape.layers, shape.q_heads, replay.tokens, replay.tokens},
                         "layers * q_heads * tokens * tokens logits", kMaxLogits);
  const auto t = static_cast<std::size_t>(replay.tokens);
  const auto causal = [](std::size_t, std::size_t, std::size_t query, std::size_t key) {
    return key <= query;
  };
  read_tensor4(
      require_key(document, "", "logits"), "logits",
      {static_cast<std::size_t>(shape.layers), static_cast<std::size_t>(shape.q_heads), t, t},
      {"layers", "q_heads", "queries = tokens", "keys = tokens"}, causal, replay.logits);

  if (const json* value = optional_key(document, "surprisal")) {
    replay.surprisal = read_surprisal(*value, replay.tokens);
  }
  if (const json* value = optional_key(document, "token_ids")) {
    replay.token_ids = read_token_ids(*value, replay.tokens);
  }
  if (const json* value = optional_key(document, "catalyst")) {
    replay.catalyst = read_catalyst(*value, shape, replay.tokens);
  }
  if (const json* value = optional_key(document, "keys")) {
    replay.keys = read_keys(*value, shape, replay.tokens);
  }
  if (const json* value = optional_key(document, "expected")) {
    replay.expected = parse_result(*value, "expected");
    check_result_matches(*replay.expected, replay, "expected");
  }
  return replay;
}

Replay parse_replay_text(std::string_view text) {
  json document;
  try {
    document = common::parse_json_bounded<json, ReplayError>(text, "the replay");
  } catch (const json::parse_error& error) {
    throw ReplayError("invalid JSON at byte " + std::to_string(error.byte) + ": " +
                      strip_nlohmann_prefix(error.what()));
  } catch (const json::exception& error) {
    throw ReplayError("invalid JSON: " + strip_nlohmann_prefix(error.what()));
  }
  return parse_replay(document);
}

Replay load_replay(const std::filesystem::path& file) {
  return parse_replay_text(
      common::read_regular_file<ReplayError>(file, "replay file", kMaxFileBytes));
}

ReplayResult parse_result(const json& document, const std::string& path) {
  require_object(document, path);
  const std::string format_path = member(path, "format");
  const std::string format = read_string(require_key(document, path, "format"), format_path);
  if (format != kResultFormat) {
    fail(format_path,
         "expected \"" + std::string(kResultFormat) + "\", got " + preview(document.at("format")));
  }
  const std::string chunks_path = member(path, "after_chunk");
  const json& chunks = require_key(document, path, "after_chunk");
  require_array(chunks, chunks_path);
  ReplayResult result;
  result.after_chunk.reserve(chunks.size());
  for (std::size_t k = 0; k < chunks.size(); ++k) {
    const std::string chunk_path = indexed(chunks_path, {k});
    require_object(chunks[k], chunk_path);
    const std::string kept_path = chunk_path + ".kept";
    const json& layers = require_key(chunks[k], chunk_path, "kept");
    require_array(layers, kept_path);
    ChunkKept chunk;
    chunk.kept.resize(layers.size());
    for (std::size_t l = 0; l < layers.size(); ++l) {
      require_array(layers[l], indexed(kept_path, {l}));
      for (std::size_t g = 0; g < layers[l].size(); ++g) {
        const json& list = layers[l][g];
        require_array(list, indexed(kept_path, {l, g}));
        std::vector<std::int64_t> positions;
        positions.reserve(list.size());
        for (std::size_t i = 0; i < list.size(); ++i) {
          positions.push_back(read_integer(list[i], indexed(kept_path, {l, g, i}), 0,
                                           std::numeric_limits<std::int64_t>::max()));
        }
        std::sort(positions.begin(), positions.end());
        positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
        chunk.kept[l].push_back(std::move(positions));
      }
    }
    result.after_chunk.push_back(std::move(chunk));
  }
  return result;
}

json result_to_json(const ReplayResult& result) {
  json after_chunk = json::array();
  for (const ChunkKept& chunk : result.after_chunk) {
    after_chunk.push_back(json{{"kept", chunk.kept}});
  }
  return json{{"format", kResultFormat}, {"after_chunk", std::move(after_chunk)}};
}

std::string format_result(const ReplayResult& result) {
  std::string out = "{\"format\": \"" + std::string(kResultFormat) + "\", \"after_chunk\": [\n";
  for (std::size_t k = 0; k < result.after_chunk.size(); ++k) {
    out += "  " + json{{"kept", result.after_chunk[k].kept}}.dump();
    out += k + 1 < result.after_chunk.size() ? ",\n" : "\n";
  }
  out += "]}\n";
  return out;
}

Comparison compare_results(const ReplayResult& expected, const ReplayResult& actual) {
  Comparison comparison;
  if (expected.after_chunk.size() != actual.after_chunk.size()) {
    comparison.agree = false;
    comparison.shape_mismatch = "expected has " + std::to_string(expected.after_chunk.size()) +
                                " chunks, actual has " + std::to_string(actual.after_chunk.size());
    return comparison;
  }
  for (std::size_t k = 0; k < expected.after_chunk.size(); ++k) {
    const auto& expected_layers = expected.after_chunk[k].kept;
    const auto& actual_layers = actual.after_chunk[k].kept;
    const auto shape_differs = [&](std::string what) {
      comparison.agree = false;
      comparison.shape_mismatch = "chunk " + std::to_string(k) + ": " + what;
    };
    if (expected_layers.size() != actual_layers.size()) {
      shape_differs("expected has " + std::to_string(expected_layers.size()) +
                    " layers, actual has " + std::to_string(actual_layers.size()));
      return comparison;
    }
    for (std::size_t l = 0; l < expected_layers.size(); ++l) {
      if (expected_layers[l].size() != actual_layers[l].size()) {
        shape_differs("layer " + std::to_string(l) + ": expected has " +
                      std::to_string(expected_layers[l].size()) + " KV heads, actual has " +
                      std::to_string(actual_layers[l].size()));
        return comparison;
      }
      for (std::size_t g = 0; g < expected_layers[l].size(); ++g) {
        // Compared as sets: sort and de-duplicate copies.
        auto as_set = [](std::vector<std::int64_t> positions) {
          std::sort(positions.begin(), positions.end());
          positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
          return positions;
        };
        const std::vector<std::int64_t> want = as_set(expected_layers[l][g]);
        const std::vector<std::int64_t> got = as_set(actual_layers[l][g]);
        comparison.lists_compared += 1;
        if (want == got) continue;
        comparison.agree = false;
        comparison.lists_disagreeing += 1;
        if (comparison.first) continue;
        Disagreement disagreement{
            static_cast<int>(k), static_cast<int>(l), static_cast<int>(g), {}, {}};
        std::set_difference(want.begin(), want.end(), got.begin(), got.end(),
                            std::back_inserter(disagreement.only_expected));
        std::set_difference(got.begin(), got.end(), want.begin(), want.end(),
                            std::back_inserter(disagreement.only_actual));
        comparison.first = std::move(disagreement);
      }
    }
  }
  return comparison;
}

std::string describe(const Comparison& comparison, std::span<const int> chunks) {
  if (comparison.agree) {
    return "all " + std::to_string(comparison.lists_compared) +
           " (chunk, layer, KV head) lists agree\n";
  }
  if (!comparison.shape_mismatch.empty()) {
    return "results have different shapes: " + comparison.shape_mismatch + "\n";
  }
  std::string out = std::to_string(comparison.lists_disagreeing) + " of " +
                    std::to_string(comparison.lists_compared) +
                    " (chunk, layer, KV head) lists disagree; the first:\n";
  const Disagreement& first = *comparison.first;
  out += "  chunk " + std::to_string(first.chunk);
  if (static_cast<std::size_t>(first.chunk) < chunks.size()) {
    std::int64_t begin = 0;
    for (int k = 0; k < first.chunk; ++k) begin += chunks[static_cast<std::size_t>(k)];
    out += " (positions [" + std::to_string(begin) + ", " +
           std::to_string(begin + chunks[static_cast<std::size_t>(first.chunk)]) + "))";
  }
  out += ", layer " + std::to_string(first.layer) + ", KV head " + std::to_string(first.kv_head) +
         "\n";
  out += "    only in expected: " + format_positions(first.only_expected) + "\n";
  out += "    only in actual:   " + format_positions(first.only_actual) + "\n";
  return out;
}

}  // namespace kvevict::replay
