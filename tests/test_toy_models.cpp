// The trained toy models (tools/README.md): the C++ decoder reproduces the logits PyTorch computed
// at export.
//
// tools/train_toy.py writes tests/data/models/<name>_expected_logits.json next to each model it
// exports under models/<name>/: the model directory (relative to the repository root, or
// absolute), the tolerance (1e-4, absolute, on logits) and cases, each a token sequence fed under
// a policy in chunks of a given size, with PyTorch's logits (computed in float64) at a few
// positions. Full-cache cases check the architecture (RMSNorm, half-split RoPE, GQA, SwiGLU) and
// the safetensors export; toy-anchor's anllm case, fed one token at a time, checks that the
// decoder under AnLLM's reduction sees what PyTorch's "infer" mask gives (every earlier anchor
// plus the current sentence, at the original positions).
//
// The test iterates over the files that exist: with no file it checks nothing and says so. More
// directories of such files (smoke runs whose models are not committed) can be named in
// KVEVICT_TOY_LOGITS_DIR, separated by ':'. The committed models (toy-base and toy-anchor at
// context 256, toy-long and toy-long-anchor at 1,024: docs/models.md) are registered below, and
// every trained model under models/ must have its file, so that none goes unchecked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/policy_registry.hpp>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::vector<fs::path> expected_files() {
  std::vector<fs::path> directories{fs::path(KVEVICT_TEST_DATA_DIR) / "models"};
  if (const char* extra = std::getenv("KVEVICT_TOY_LOGITS_DIR")) {
    std::stringstream list(extra);
    std::string item;
    while (std::getline(list, item, ':')) {
      if (!item.empty()) directories.emplace_back(item);
    }
  }
  std::vector<fs::path> files;
  for (const fs::path& directory : directories) {
    if (!fs::is_directory(directory)) continue;
    for (const fs::directory_entry& entry : fs::directory_iterator(directory)) {
      const std::string name = entry.path().filename().string();
      const std::string suffix = "_expected_logits.json";
      if (name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        files.push_back(entry.path());
      }
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}

kvevict::PolicyParams to_params(const json& object) {
  kvevict::PolicyParams params;
  for (const auto& [key, value] : object.items()) {
    if (value.is_array()) {
      params.set_list(key, value.get<std::vector<std::int64_t>>());
    } else {
      params.set(key, value.get<double>());
    }
  }
  return params;
}

TEST(ToyModels, DecoderReproducesPyTorchLogits) {
  const std::vector<fs::path> files = expected_files();
  if (files.empty()) {
    std::cout << "no toy models with expected logits (tests/data/models/*_expected_logits.json); "
                 "nothing to compare\n";
  }
  const fs::path repository = fs::path(KVEVICT_TEST_DATA_DIR).parent_path().parent_path();
  for (const fs::path& file : files) {
    SCOPED_TRACE(file.string());
    const json expected = read_json(file);
    ASSERT_EQ(expected.at("format"), "kvevict-expected-logits/1");
    fs::path model_dir = expected.at("model_dir").get<std::string>();
    if (model_dir.is_relative()) model_dir = repository / model_dir;
    ASSERT_TRUE(fs::exists(model_dir / "model.safetensors"))
        << file << " names " << model_dir << ", which has no model.safetensors";
    const kvevict::model::Model model = kvevict::model::load_model(model_dir);
    EXPECT_EQ(model.tokenizer.kind, kvevict::model::Tokenizer::Kind::byte_level);
    EXPECT_EQ(model.tokenizer.bos_id, 256);
    EXPECT_EQ(model.tokenizer.eos_id, 257);
    EXPECT_EQ(model.tokenizer.anchor_id, 258);
    const double tolerance = expected.at("tolerance").get<double>();
    const auto vocab = static_cast<std::size_t>(model.config.vocab_size);

    for (const json& test_case : expected.at("cases")) {
      const std::string name = test_case.at("name").get<std::string>();
      SCOPED_TRACE(name);
      const auto tokens = test_case.at("token_ids").get<std::vector<std::int32_t>>();
      const int chunk = test_case.at("chunk").get<int>();
      kvevict::model::DecoderOptions options;
      options.max_chunk = std::max(chunk, 1);
      kvevict::model::Decoder decoder(
          model,
          kvevict::make_policy(test_case.at("policy").get<std::string>(),
                               to_params(test_case.at("params"))),
          options);
      const kvevict::model::ForwardResult result =
          decoder.feed(tokens, kvevict::model::ForwardRequest{.all_logits = true}, chunk);
      ASSERT_EQ(result.rows, static_cast<int>(tokens.size()));

      const auto positions = test_case.at("positions").get<std::vector<std::size_t>>();
      const auto logits = test_case.at("logits").get<std::vector<std::vector<double>>>();
      ASSERT_EQ(positions.size(), logits.size());
      double worst = 0;
      for (std::size_t k = 0; k < positions.size(); ++k) {
        ASSERT_LT(positions[k], tokens.size());
        ASSERT_EQ(logits[k].size(), vocab);
        const float* row = result.logits.data() + positions[k] * vocab;
        for (std::size_t v = 0; v < vocab; ++v) {
          worst = std::max(worst, std::fabs(static_cast<double>(row[v]) - logits[k][v]));
        }
      }
      std::cout << file.filename().string() << " / " << name << ": " << tokens.size()
                << " tokens, policy " << test_case.at("policy").get<std::string>() << ", chunk "
                << chunk << ": largest |C++ - PyTorch| = " << worst << " (tolerance " << tolerance
                << ")\n";
      EXPECT_LE(worst, tolerance);
    }
  }
}

// The committed toy models; each must be in models/ with its expected logits.
constexpr const char* kCommittedModels[] = {"toy-anchor", "toy-base", "toy-long",
                                            "toy-long-anchor"};

TEST(ToyModels, EveryCommittedModelHasExpectedLogits) {
  const fs::path data = fs::path(KVEVICT_TEST_DATA_DIR) / "models";
  const fs::path models = fs::path(KVEVICT_TEST_DATA_DIR).parent_path().parent_path() / "models";
  for (const char* name : kCommittedModels) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(fs::exists(models / name / "model.safetensors"));
    EXPECT_TRUE(fs::exists(data / (std::string(name) + "_expected_logits.json")));
  }
  // Any other model train_toy.py exported (its config.json has a "kvevict_model" object) needs
  // its file too.
  ASSERT_TRUE(fs::is_directory(models));
  for (const fs::directory_entry& entry : fs::directory_iterator(models)) {
    const fs::path config = entry.path() / "config.json";
    if (!entry.is_directory() || !fs::exists(config) ||
        !fs::exists(entry.path() / "model.safetensors") ||
        !read_json(config).contains("kvevict_model")) {
      continue;
    }
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(fs::exists(data / (name + "_expected_logits.json")))
        << "models/" << name << " was exported by tools/train_toy.py but has no "
        << "tests/data/models/" << name << "_expected_logits.json";
  }
}

}  // namespace
