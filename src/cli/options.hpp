// CLI11 registration of the options the front ends share (`kvevict` and `kvevict-llama`: generate,
// stream, compare, eval). The programs' own glue: the harness (src/harness) does not link CLI11.
// Header-only, included by both executables.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <kvevict/policy_registry.hpp>
#include <string>

#include "eval/grid.hpp"
#include "harness/policy_setup.hpp"
#include "harness/sampling.hpp"
#include "harness/text_stream.hpp"

namespace kvevict::cli {

/// The model (required): a positional path, as `replay FILE` and `eval CONFIG` take theirs, or
/// -m/--model PATH.
inline void add_model_option(CLI::App& app, std::string& path) {
  app.add_option("model,-m,--model", path,
                 "model file (positional, or -m/--model): GGUF, .safetensors (config.json beside "
                 "it) or a directory holding model.safetensors + config.json, or a llama2.c "
                 "checkpoint")
      ->required();
}

/// What --budget N stands for in every policy, from the policies' own specs, at N = 64.
inline std::string budget_mapping_help() {
  std::string help = "at --budget 64:";
  for (const PolicySpec* spec : policy_specs()) {
    if (spec->budget == nullptr) continue;
    help += " " + std::string(spec->name) + " " +
            spec->budget(64, harness::kDefaultSinks).to_string() + ";";
  }
  help.pop_back();
  return help;
}

/// -t/--threads (group "Decoder" in --help): 1 by default, so that the tokens/s a command reports
/// compare across runs and `kvevict eval --jobs` or shards can use the other cores.
inline void add_threads_option(CLI::App& app, int& threads) {
  app.add_option("-t,--threads", threads,
                 "threads of each forward (products split by rows, attention by KV heads: the "
                 "same logits for any number)")
      ->group("Decoder")
      ->capture_default_str();
}

/// -i/--input (required), --turn-separator, --limit-bytes: the text `kvevict stream`, `kvevict
/// compare` and `kvevict-llama stream` stream (the default limit is the options' own).
inline void add_stream_input_options(CLI::App& app, harness::StreamInputOptions& options) {
  app.add_option("-i,--input", options.input, "text file to stream (\"-\" = stdin)")->required();
  app.add_option("--turn-separator", options.turn_separator,
                 "split the text after each occurrence of this string and feed each piece as a "
                 "new turn (SirLLM, RandomLLM and IntervalLLM evict before turns); \\n, \\t, "
                 "\\r and \\\\ are unescaped");
  app.add_option("--limit-bytes", options.limit_bytes,
                 "read only the first N bytes of the input (0 = all)")
      ->capture_default_str();
}

/// -w/--window of `kvevict stream` and `kvevict-llama stream`.
inline void add_window_option(CLI::App& app, int& window) {
  app.add_option("-w,--window", window, "report the loss per window of this many positions")
      ->capture_default_str();
}

/// --decode-activations (group "Decoder"): what decoding multiplies Q8_0 / Q4_0 weights with.
inline void add_decode_activations_option(CLI::App& app, std::string& activations) {
  app.add_option("--decode-activations", activations,
                 "what a decode step multiplies Q8_0 / Q4_0 weights with: f32, or q8_0 (8-bit "
                 "activations in blocks of 32, integer products, as llama.cpp: faster, and the "
                 "logits move by the rounding)")
      ->group("Decoder")
      ->capture_default_str();
}

/// --policy, --budget, --budget-bytes, --allocation, --pyramid-beta, --adaptive-floor, --sinks,
/// --param, --positions, --granularity, --keys, --kv-type, --chunk, --catalyst
/// (group "Policy" in --help).
inline void add_policy_options(CLI::App& app, harness::PolicyOptions& options) {
  const std::string group = "Policy";
  app.add_option("--policy", options.policy, "eviction policy: " + policy_list())
      ->group(group)
      ->capture_default_str();
  app.add_option_function<int>(
         "--budget", [&options](const int& budget) { options.budget = budget; },
         "cache budget in tokens, mapped to the policy's parameters (" + budget_mapping_help() +
             "; not for full)")
      ->group(group);
  app.add_option_function<std::int64_t>(
         "--budget-bytes", [&options](const std::int64_t& bytes) { options.budget_bytes = bytes; },
         "cache budget in bytes of keys and values in --kv-type, over every layer and KV head "
         "(instead of --budget): the --budget it holds per head, or under --allocation pyramid "
         "or adaptive the bytes themselves")
      ->group(group);
  app.add_option("--allocation", options.allocation,
                 "how one sequence budget is split over the keep-sets: uniform (each the same), "
                 "pyramid (PyramidKV: lower layers more) or adaptive (Ada-KV: the KV heads of a "
                 "layer share its budget; granularity head); h2o, tova, knorm, keydiff")
      ->group(group)
      ->capture_default_str();
  app.add_option("--pyramid-beta", options.pyramid_beta,
                 "pyramid: the last layer keeps mean / beta (PyramidKV's beta)")
      ->group(group)
      ->capture_default_str();
  app.add_option("--adaptive-floor", options.adaptive_floor,
                 "adaptive: each KV head first keeps its best floor x mean tokens (Ada-KV's "
                 "floor_alpha), in [0, 1]")
      ->group(group)
      ->capture_default_str();
  app.add_option_function<int>(
         "--sinks",
         [&options](const int& sinks) {
           options.sinks = sinks;
           options.sinks_given = true;
         },
         "protected first tokens (S) of streaming_llm, sirllm, random_llm, interval_llm (and "
         "tova's sinks); default 4 (tova 0)")
      ->group(group);
  app.add_option("--param", options.params,
                 "policy parameter KEY=VALUE, repeatable, overrides --budget; lists are "
                 "comma-separated integers (anchor_ids=258,259); see docs/policies.md")
      ->group(group);
  app.add_option("--positions", options.positions,
                 "RoPE positions: original, cache_index or reset_on_compact (default: the "
                 "policy's own)")
      ->group(group);
  app.add_option("--granularity", options.granularity,
                 "keep-sets: head (one per KV head), layer (one per layer), token (one for the "
                 "whole model, as engines whose cells all heads share) or block:B (token, kept "
                 "and evicted in whole blocks of B tokens, as paged engines); default: the "
                 "policy's own")
      ->group(group);
  app.add_option("--keys", options.keys,
                 "store keys before or after RoPE: pre_rope or post_rope (same results; "
                 "post_rope is faster)")
      ->group(group)
      ->capture_default_str();
  app.add_option("--kv-type", options.kv_type,
                 "how the cache stores keys and values: f32, f16, bf16 or q8_0 (ggml's blocks of "
                 "32 with an f16 scale; head_dim a multiple of 32)")
      ->group(group)
      ->capture_default_str();
  app.add_option("--chunk", options.chunk,
                 "prefill chunk size: tokens per forward (also the cache's headroom above the "
                 "policy's budget)")
      ->group(group)
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--catalyst", [&options](const std::string& text) { options.catalyst = text; },
         "infinipot's catalyst prompt, tokenized with the model's tokenizer (default: the "
         "paper's general prompt \"Summarize the critical points highlighted in this "
         "section.\"; \"\" = no catalyst, the w/o-CaP ablation)")
      ->group(group);
}

/// --insert-anchors (group "Policy"): AnLLM's <AC> after every sentence end (anchor_inserter.hpp).
/// `what` tells what the command does with them.
inline void add_insert_anchors_option(CLI::App& app, bool& insert, const std::string& what) {
  app.add_flag("--insert-anchors", insert,
               "insert the tokenizer's <AC> anchor after every sentence end, as the AnLLM toy "
               "models were trained (tools/toy_data.py: . ? or ! plus closing \" ' ) ], then "
               "whitespace or the end); byte-level tokenizers with an anchor only; " +
                   what)
      ->group("Policy");
}

/// --temp (alias --temperature), --top-k, --top-p, --seed (group "Sampling"), spelt as llama.cpp
/// spells them.
inline void add_sampling_options(CLI::App& app, harness::SamplingOptions& options) {
  const std::string group = "Sampling";
  app.add_option("--temp,--temperature", options.temperature,
                 "softmax temperature; 0 = greedy (always the most likely token)")
      ->group(group)
      ->capture_default_str();
  app.add_option("--top-k", options.top_k,
                 "sample among the k most likely tokens (applied before --top-p); 0 = no cut")
      ->group(group)
      ->capture_default_str();
  app.add_option("--top-p", options.top_p,
                 "nucleus sampling: draw among the most likely tokens holding this probability "
                 "mass, in (0, 1]")
      ->group(group)
      ->capture_default_str();
  app.add_option("--seed", options.seed,
                 "random seed (std::mt19937_64): same seed, same output on every platform")
      ->group(group)
      ->capture_default_str();
}

/// -o/--out DIR and --committed of `eval` and `eval merge`: a user's results go to the build tree
/// by default (eval::output_directory), the committed eval/results/<name> only when asked.
template <typename Path>
void add_output_options(CLI::App& app, Path& out, bool& committed, const std::string& what) {
  app.add_option("-o,--out", out,
                 "output directory (default: " + eval::default_output_root().string() +
                     "/<config name>, in the build tree, so the checkout's committed results "
                     "stay as they are); " +
                     what);
  app.add_flag("--committed", committed,
               "write to eval/results/<config name>, the committed results (run from the "
               "checkout's root to reproduce or update them); not with --out");
}

/// The command-line options of a grid run that `kvevict eval` and `kvevict-llama eval` share.
/// Each executable adds its own: the model (optional for kvevict, a GGUF for kvevict-llama),
/// threads, the K/V type, llama.cpp's options.
/// config (positional), -o/--out, --committed, -j/--jobs, --shard, --fresh, --list, --text.
/// Returns the config option: `kvevict eval` leaves it optional (its `merge` subcommand takes
/// none).
inline CLI::Option* add_grid_options(CLI::App& app, eval::EvalCommand& command) {
  CLI::Option* config =
      app.add_option("config", command.config, "grid config (JSON; see docs/eval.md)");
  add_output_options(app, command.out, command.committed,
                     "cells/<id>.json holds each finished cell");
  app.add_option("-j,--jobs", command.jobs, "cells run at once, each in its own process")
      ->capture_default_str();
  app.add_option("--shard", command.shard,
                 "run only shard I of N (1 <= I <= N): the cells at positions I-1, I-1+N, ... of "
                 "the grid; combine the shards' outputs with `kvevict eval merge`");
  app.add_flag("--fresh", command.fresh,
               "discard the output directory's cells and results and run every cell again");
  app.add_flag("--list", command.list, "print the grid's cells and exit (nothing is loaded)");
  app.add_option("--text", command.text, "use this text file instead of the config's \"text\"");
  return config;
}

}  // namespace kvevict::cli
