// Stage timing: one observer, injected, told when a stage of a step starts and ends.
//
// Sequence reports the eviction stages (policy, reposition), an engine or the reference decoder
// reports the model's (head, attention, mlp, catalyst). Stages nest: a policy hook that runs inside
// the attention stage (observe_attention) is charged to policy, not attention, so the stage totals
// of StageClock partition the timed wall time without double counting. Nothing is timed unless an
// observer is set; with none, a StageScope is a null check.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace kvevict {

enum class Stage : std::uint8_t {
  head,        ///< embedding, final norm, classifier, surprisal
  attention,   ///< norm, Q/K/V projections, K/V write, RoPE, q.K, softmax, .V, output projection
  mlp,         ///< norm, gate/up, activation, down projection
  policy,      ///< the policy's observe_* scoring and select
  reposition,  ///< applying a decision: slot metadata, the engine's KvBackend::apply
  catalyst,    ///< a catalyst prompt's forward (InfiniPot), excluding the policy stages inside it
  count,
};

[[nodiscard]] constexpr std::string_view to_string(Stage stage) {
  constexpr std::array<std::string_view, static_cast<std::size_t>(Stage::count)> kNames{
      "head", "attention", "mlp", "policy", "reposition", "catalyst"};
  return stage < Stage::count ? kNames[static_cast<std::size_t>(stage)] : "?";
}

/// Told when stages start and end; calls nest like brackets.
class StageObserver {
 public:
  virtual ~StageObserver() = default;
  virtual void enter(Stage stage) = 0;
  virtual void leave(Stage stage) = 0;
};

/// Brackets a scope with enter / leave on `observer` (which may be null: then nothing happens).
class StageScope {
 public:
  StageScope(StageObserver* observer, Stage stage) : observer_(observer), stage_(stage) {
    if (observer_ != nullptr) observer_->enter(stage_);
  }
  ~StageScope() {
    if (observer_ != nullptr) observer_->leave(stage_);
  }
  StageScope(const StageScope&) = delete;
  StageScope& operator=(const StageScope&) = delete;

 private:
  StageObserver* observer_;
  Stage stage_;
};

/// Wall time per stage (steady_clock, integer ticks), exclusive of nested stages: the time between
/// enter(s) and leave(s) minus the stages entered inside. Two clock reads per stage change.
class StageClock final : public StageObserver {
 public:
  using Clock = std::chrono::steady_clock;

  void enter(Stage stage) override {
    const Clock::time_point now = Clock::now();
    if (!open_.empty()) charge(open_.back(), now);
    open_.push_back(stage);
    mark_ = now;
  }
  void leave(Stage stage) override {
    const Clock::time_point now = Clock::now();
    charge(stage, now);
    if (!open_.empty()) open_.pop_back();
    mark_ = now;
  }

  [[nodiscard]] Clock::duration total(Stage stage) const {
    return totals_[static_cast<std::size_t>(stage)];
  }
  [[nodiscard]] double seconds(Stage stage) const {
    return std::chrono::duration<double>(total(stage)).count();
  }
  /// Sum over every stage.
  [[nodiscard]] double seconds() const {
    Clock::duration sum{};
    for (const Clock::duration d : totals_) sum += d;
    return std::chrono::duration<double>(sum).count();
  }
  void reset() { totals_ = {}; }

 private:
  void charge(Stage stage, Clock::time_point now) {
    totals_[static_cast<std::size_t>(stage)] += now - mark_;
  }

  std::array<Clock::duration, static_cast<std::size_t>(Stage::count)> totals_{};
  std::vector<Stage> open_;
  Clock::time_point mark_{};
};

}  // namespace kvevict
