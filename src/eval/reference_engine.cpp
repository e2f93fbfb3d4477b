// The eval harness over kvevict's reference decoder (model::Decoder): `kvevict eval`.
#include <kvevict/model/decoder.hpp>
#include <memory>
#include <string>
#include <utility>

#include "eval/engine.hpp"
#include "harness/log_loss.hpp"
#include "harness/report.hpp"

namespace kvevict::eval {
namespace {

class DecoderSequence final : public EvalSequence {
 public:
  DecoderSequence(const model::Model& model, harness::PolicySetup& setup, const StageClock& clock)
      : clock_(clock), decoder_(harness::make_decoder(model, setup)) {
    // What policy_json records; the policy itself now belongs to the decoder.
    setup_.name = setup.name;
    setup_.params = setup.params;
    setup_.catalyst = setup.catalyst;
    setup_.budget_bytes = setup.budget_bytes;
  }

  FeedLogits feed(std::span<const std::int32_t> tokens, bool turn_start, bool all_logits) override {
    const model::ForwardResult result = decoder_->feed(
        tokens, model::ForwardRequest{.turn_start = turn_start, .all_logits = all_logits});
    return {result.logits, result.vocab};
  }

  [[nodiscard]] SequenceCounters counters() const override {
    const model::DecoderStats& stats = decoder_->stats();
    const SequenceStats& sequence = decoder_->cache().sequence().stats();
    SequenceCounters counters;
    counters.tokens_fed = stats.tokens_fed;
    counters.forwards = stats.forwards;
    counters.catalyst_runs = stats.catalyst_runs;
    counters.live_kv_bytes = decoder_->cache().memory().live_kv_bytes;
    counters.peak_kv_bytes = stats.peak_kv_bytes;
    counters.evicted_slots = sequence.evicted_slots;
    counters.decisions = sequence.decisions;
    // forward = head + attention + mlp, eviction = policy + reposition + catalyst.
    counters.forward_seconds =
        clock_.seconds(Stage::head) + clock_.seconds(Stage::attention) + clock_.seconds(Stage::mlp);
    counters.eviction_seconds = harness::eviction_seconds(clock_);
    for (const Stage stage : {Stage::head, Stage::attention, Stage::mlp, Stage::policy,
                              Stage::reposition, Stage::catalyst}) {
      counters.stage_seconds.emplace_back(std::string(to_string(stage)) + "_seconds",
                                          clock_.seconds(stage));
    }
    return counters;
  }

  [[nodiscard]] nlohmann::ordered_json policy_json() const override {
    return harness::policy_json(setup_, *decoder_);
  }

 private:
  const StageClock& clock_;
  harness::PolicySetup setup_;
  std::unique_ptr<model::Decoder> decoder_;
};

class ReferenceEngine final : public EvalEngine {
 public:
  explicit ReferenceEngine(const std::string& path) : model_(harness::load_model_file(path)) {}

  [[nodiscard]] std::string name() const override { return std::string(kReferenceEngine); }
  [[nodiscard]] nlohmann::ordered_json model_json() const override {
    return {{"format", model_.format}, {"context_length", model_.config.context_length}};
  }

  [[nodiscard]] const model::Tokenizer* kvevict_tokenizer() const override {
    return &model_.tokenizer;
  }
  [[nodiscard]] std::vector<std::int32_t> encode(std::string_view text,
                                                 bool add_bos) const override {
    return model_.tokenizer.encode(text, add_bos);
  }
  [[nodiscard]] std::string decode(std::int32_t id) const override {
    return model_.tokenizer.decode(id);
  }
  [[nodiscard]] std::int32_t bos_id() const override { return model_.tokenizer.bos_id; }
  [[nodiscard]] std::int32_t eos_id() const override { return model_.tokenizer.eos_id; }
  [[nodiscard]] std::vector<std::uint32_t> token_bytes() const override {
    return harness::token_byte_counts(model_.tokenizer, model_.config.vocab_size);
  }

  [[nodiscard]] harness::PolicySetup make_setup(
      const harness::PolicyOptions& options) const override {
    return harness::make_policy_setup(options, model_);
  }
  // make_setup checked everything; the cache grows as needed.
  [[nodiscard]] std::optional<std::int64_t> check(harness::PolicySetup& /*setup*/) const override {
    return std::nullopt;
  }
  [[nodiscard]] std::unique_ptr<EvalSequence> start(harness::PolicySetup& setup, int threads,
                                                    StageClock& clock) const override {
    setup.decoder_options.threads = threads;
    setup.decoder_options.observer = &clock;
    return std::make_unique<DecoderSequence>(model_, setup, clock);
  }

 private:
  model::Model model_;
};

}  // namespace

std::unique_ptr<EvalEngine> reference_engine(const std::string& model) {
  return std::make_unique<ReferenceEngine>(model);
}

}  // namespace kvevict::eval
