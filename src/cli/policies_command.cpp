// `kvevict policies [NAME...] [--markdown]`: every policy the registry knows (or the ones named),
// read from its PolicySpec: the parameters with their types, defaults and ranges, what `--budget N`
// stands for, and the granularity and position mode the policy uses unless told otherwise.
// docs/policies.md carries the --markdown output, so the documentation cannot drift from the specs.
#include <fmt/format.h>

#include <cstdint>
#include <iostream>
#include <kvevict/policy_params.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/positions.hpp>
#include <memory>
#include <string>
#include <vector>

#include "command.hpp"

namespace kvevict::cli {
namespace {

// The budget the examples of the `--budget` column are shown at.
constexpr int kExampleBudget = 256;
constexpr int kExampleSinks = 4;

std::string range_text(const ParamSpec& param) {
  const std::string min = PolicyParams::number_text(param.min);
  const std::string max = PolicyParams::number_text(param.max);
  switch (param.type) {
    case ParamType::integer:
      return fmt::format("integer in [{}, {}]", min, max);
    case ParamType::real:
      return fmt::format("number in [{}, {}]", min, max);
    case ParamType::integer_list:
      return fmt::format("integers in [{}, {}], comma-separated", min, max);
    case ParamType::choice:
      return "one of " + PolicySpec::choices_text(param);
  }
  return "?";
}

std::string default_text(const ParamSpec& param) {
  if (param.default_value && param.type == ParamType::choice) {
    return std::string(param.choices[static_cast<std::size_t>(*param.default_value)]);
  }
  if (param.default_value) return PolicyParams::number_text(*param.default_value);
  return param.optional ? "derived" : "required";
}

std::string budget_text(const PolicySpec& spec) {
  if (spec.budget == nullptr) return "no budget";
  return spec.budget(kExampleBudget, kExampleSinks).to_string();
}

// The policy at the example budget: its default granularity and position mode live on the built
// policy, and any valid parameters build it. A required parameter the budget mapping leaves open
// (AnLLM's anchor ids) takes its lowest value.
std::unique_ptr<Policy> example_policy(const PolicySpec& spec) {
  PolicyParams params =
      spec.budget == nullptr ? PolicyParams() : spec.budget(kExampleBudget, kExampleSinks);
  for (const ParamSpec& param : spec.params) {
    const std::string name(param.name);
    if (params.has(name) || param.default_value || param.optional) continue;
    if (param.type == ParamType::integer_list) {
      params.set_list(name, {static_cast<std::int64_t>(param.min)});
    } else {
      params.set(name, param.min);
    }
  }
  return spec.make(spec.resolve(params));
}

struct PoliciesOptions {
  std::vector<std::string> names;  ///< empty: every policy
  bool markdown = false;
};

// The specs named (an error naming the known ones for an unknown name), or every spec.
std::vector<const PolicySpec*> chosen_specs(const std::vector<std::string>& names) {
  if (names.empty()) {
    const auto all = policy_specs();
    return {all.begin(), all.end()};
  }
  std::vector<const PolicySpec*> specs;
  for (const std::string& name : names) specs.push_back(&policy_spec(name));
  return specs;
}

int print_policies(const PoliciesOptions& options) {
  const bool markdown = options.markdown;
  const std::vector<const PolicySpec*> specs = chosen_specs(options.names);
  if (markdown) {
    std::cout << fmt::format(
        "| policy | parameter | type and range | default | meaning |\n|---|---|---|---|---|\n");
  }
  for (const PolicySpec* spec : specs) {
    const std::unique_ptr<Policy> policy = example_policy(*spec);
    const std::string defaults =
        fmt::format("granularity {}, positions {}", to_string(policy->default_granularity()),
                    to_string(policy->default_position_mode()));
    if (markdown) {
      if (spec->params.empty()) {
        std::cout << fmt::format("| `{}` | — | — | — | {} |\n", spec->name, spec->summary);
      }
      for (const ParamSpec& param : spec->params) {
        std::cout << fmt::format("| `{}` | `{}` | {} | {} | {} |\n", spec->name, param.name,
                                 range_text(param), default_text(param), param.help);
      }
      continue;
    }
    std::cout << fmt::format("{}\n  {}\n  {}\n  --budget {} (sinks {}): {}\n", spec->name,
                             spec->summary, defaults, kExampleBudget, kExampleSinks,
                             budget_text(*spec));
    for (const ParamSpec& param : spec->params) {
      std::cout << fmt::format("  {:<12} {} ({}; default {})\n", param.name, param.help,
                               range_text(param), default_text(param));
    }
  }
  if (markdown) {
    std::cout << fmt::format(
        "\n| policy | default granularity | default positions | `--budget {}` (sinks {}) |\n"
        "|---|---|---|---|\n",
        kExampleBudget, kExampleSinks);
    for (const PolicySpec* spec : specs) {
      const std::unique_ptr<Policy> policy = example_policy(*spec);
      std::cout << fmt::format("| `{}` | {} | {} | {} |\n", spec->name,
                               to_string(policy->default_granularity()),
                               to_string(policy->default_position_mode()), budget_text(*spec));
    }
  }
  return kExitOk;
}

}  // namespace

Command add_policies_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "policies", "List the policies: parameters, defaults, ranges and what --budget means");
  auto options = std::make_shared<PoliciesOptions>();
  app->add_option("names", options->names,
                  "policies to show (default: every one): " + policy_list());
  app->add_flag("--markdown", options->markdown, "Print the tables of docs/policies.md");
  app->footer(
      "Each policy's summary (paper and rule), default granularity and positions, what\n"
      "--budget N stands for, and its parameters (--param KEY=VALUE) with types, ranges and\n"
      "defaults.\n"
      "\n"
      "Examples:\n"
      "  kvevict policies\n"
      "  kvevict policies h2o tova");
  return {app, [options] { return print_policies(*options); }};
}

}  // namespace kvevict::cli
