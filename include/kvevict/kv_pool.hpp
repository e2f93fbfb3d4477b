// KvPool: one KV budget, in cells, shared by many sequences (a server's conversations), each
// under its own policy.
//
// A cell holds one token's keys and values in every layer and head: llama.cpp's cell; in kvevict's
// own store, a sequence holds as many cells as its fullest head holds tokens (Sequence::max_live).
// The rule (docs/design.md, "One KV pool for many sequences"):
//   - Admission (join). A member is charged what it can never give up. A policy whose keep rule
//     can be pressed below its budget (Policy::supports_pressure) is charged its minimum (the
//     tokens its rule protects, at least 1; under block:B granularity plus the 2(B - 1) tokens of
//     the partly protected blocks it keeps whole) plus one chunk (SequenceConfig::max_chunk). Any
//     other bounded policy is charged its whole bound plus one chunk, reserved while it is a
//     member. Join fails when the charges would exceed the pool, when the member's own bound plus
//     one chunk exceeds the pool (a budget the pool can never grant), and for a policy that has
//     neither a bound nor a pressed form (full, AnLLM without max_slots).
//   - Before a step (make_room): the step's peak is every member's cells plus the tokens it is
//     about to be fed. When that exceeds the pool, the pressable members are cut to one common
//     level L, the highest at which the step fits (max-min fairness: the largest lose cells
//     first, members under L keep all of theirs, none goes below its minimum); the cells left
//     below the pool go one each to the cut members, lowest member first. Each cut member evicts
//     by its own policy's ranking (Sequence::shrink_to).
//   - Between steps a member grows freely; its own policy bounds it.
// The admission charges guarantee that every step fits: a step never needs a member below its
// minimum.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvevict/engine.hpp"
#include "kvevict/error.hpp"

namespace kvevict {

/// One member's standing before a step (pool_grants' input).
struct PoolClaim {
  std::int64_t cells = 0;     ///< held now
  std::int64_t incoming = 0;  ///< tokens the step feeds it
  std::int64_t minimum = 0;   ///< fewest cells a cut leaves it (pressable members)
  bool pressable = true;      ///< false: never cut (its cells are a fixed reservation)
};

/// The cells each claim may keep before the step so that the cells kept plus every claim's
/// incoming tokens fit in `pool` (the rule in the header comment): grants[i] <= claims[i].cells,
/// equal for claims that are not pressable. Throws kvevict::Error when even the minimums do not
/// fit.
[[nodiscard]] inline std::vector<std::int64_t> pool_grants(std::int64_t pool,
                                                           std::span<const PoolClaim> claims) {
  std::vector<std::int64_t> grants(claims.size());
  std::int64_t room = pool;  // cells the pressable members may keep
  std::int64_t held = 0;
  for (std::size_t i = 0; i < claims.size(); ++i) {
    grants[i] = claims[i].cells;
    room -= claims[i].incoming + (claims[i].pressable ? 0 : claims[i].cells);
    if (claims[i].pressable) held += claims[i].cells;
  }
  if (held <= room) return grants;
  // kept(L): what the pressable members keep at level L, each clamped to [its floor, its cells].
  const auto floor_of = [](const PoolClaim& claim) { return std::min(claim.cells, claim.minimum); };
  const auto kept = [&](std::int64_t level) {
    std::int64_t total = 0;
    for (const PoolClaim& claim : claims) {
      if (claim.pressable) total += std::clamp(level, floor_of(claim), claim.cells);
    }
    return total;
  };
  if (kept(0) > room) {
    throw Error("KV pool of " + std::to_string(pool) + " cells: the step needs " +
                std::to_string(pool - room + kept(0)) +
                " cells even with every member cut to its minimum");
  }
  std::int64_t low = 0;  // kept(low) <= room < kept(high)
  std::int64_t high = 0;
  for (const PoolClaim& claim : claims) high = std::max(high, claim.cells);
  while (high - low > 1) {
    const std::int64_t mid = low + (high - low) / 2;
    (kept(mid) <= room ? low : high) = mid;
  }
  std::int64_t left = room - kept(low);
  for (std::size_t i = 0; i < claims.size(); ++i) {
    if (!claims[i].pressable) continue;
    grants[i] = std::clamp(low, floor_of(claims[i]), claims[i].cells);
    if (left > 0 && grants[i] == low && low < claims[i].cells && low >= floor_of(claims[i])) {
      ++grants[i];
      --left;
    }
  }
  return grants;
}

/// Counters of a pool.
struct PoolStats {
  std::int64_t steps = 0;          ///< make_room calls
  std::int64_t pressed_steps = 0;  ///< steps that cut a member
  std::int64_t cuts = 0;           ///< members cut (Sequence::shrink_to calls that evicted)
  std::int64_t peak_cells = 0;     ///< largest step peak (cells held plus tokens fed)
};

/// Many sequences under one cell budget (the header comment). The sequences are not owned: each
/// must outlive its membership. Not thread-safe: the thread that steps the batch drives the pool.
class KvPool {
 public:
  /// A member's feed in one step: `tokens` for member `member`.
  struct Feed {
    int member = 0;
    int tokens = 0;
  };

  /// A member's cut failed (its engine refused the decision, e.g. llama.cpp under `original`
  /// positions when the newest token goes): the members before it were cut, the ones after it
  /// not, and the member itself is unusable. The engine frees its cells and removes it (leave),
  /// then calls make_room again.
  class CutFailure : public Error {
   public:
    CutFailure(int member, const std::string& reason, std::exception_ptr cause)
        : Error("KV pool: cutting member " + std::to_string(member) + " failed: " + reason),
          member_(member),
          reason_(reason),
          cause_(std::move(cause)) {}
    [[nodiscard]] int member() const { return member_; }
    /// What the member's cut threw: its message, and the exception itself.
    [[nodiscard]] const std::string& reason() const { return reason_; }
    [[nodiscard]] const std::exception_ptr& cause() const { return cause_; }

   private:
    int member_;
    std::string reason_;
    std::exception_ptr cause_;
  };

  explicit KvPool(std::int64_t cells) : cells_(cells) {
    KVEVICT_REQUIRE(cells > 0, "KV pool: cells must be positive, got " + std::to_string(cells));
  }

  /// Admits `sequence` (idle, between forwards) and returns its member id (the lowest free one).
  /// `minimum`: the fewest cells a cut may leave it, at least the policy's own (0: the policy's).
  int join(Sequence& sequence, int minimum = 0) {
    const Policy& policy = sequence.policy();
    const std::string who = "KV pool: policy '" + std::string(policy.name()) + "'";
    KVEVICT_REQUIRE(minimum >= 0, who + ": minimum must be >= 0, got " + std::to_string(minimum));
    KVEVICT_REQUIRE(
        std::none_of(members_.begin(), members_.end(),
                     [&](const std::optional<Member>& m) { return m && m->sequence == &sequence; }),
        who + ": the sequence is a member already");
    KVEVICT_REQUIRE(sequence.idle(),
                    who + ": the sequence is inside a forward (join between forwards)");
    const int chunk = sequence.config().max_chunk;
    const std::optional<int> bound = policy.retained_limit();
    Member member{&sequence, 0, policy.supports_pressure(), 0};
    if (member.pressable) {
      const int block = sequence.slots().layout().block_tokens();
      const std::int64_t own = std::max<std::int64_t>(
          1, std::int64_t{policy.min_retained()} + 2 * (std::int64_t{block} - 1));
      member.minimum = std::max<std::int64_t>(own, minimum);
      member.charge = member.minimum + chunk;
    } else {
      KVEVICT_REQUIRE(bound.has_value(),
                      who +
                          " has no bound and no pressed form: a pool cannot hold it (bound it, "
                          "e.g. AnLLM's max_slots, or pick a policy with a budget)");
      member.charge = std::int64_t{*bound} + chunk;
    }
    if (bound && std::int64_t{*bound} + chunk > cells_) {
      throw Error(who + ": its budget of " + std::to_string(*bound) + " tokens plus a chunk of " +
                  std::to_string(chunk) + " exceeds the pool's " + std::to_string(cells_) +
                  " cells, which can never grant it");
    }
    if (member.minimum + chunk > cells_) {
      throw Error(who + ": its minimum of " + std::to_string(member.minimum) +
                  " cells plus a chunk of " + std::to_string(chunk) + " exceeds the pool's " +
                  std::to_string(cells_) + " cells");
    }
    if (charged_ + member.charge > cells_) {
      throw Error(who + " needs " + std::to_string(member.charge) +
                  " cells it can never give up (" +
                  (member.pressable ? "its minimum plus one chunk" : "its bound plus one chunk") +
                  "), and the members already hold " + std::to_string(charged_) +
                  " of the pool's " + std::to_string(cells_) + " in such charges");
    }
    const auto free_id = std::find_if(members_.begin(), members_.end(),
                                      [](const std::optional<Member>& m) { return !m; });
    const int id = static_cast<int>(free_id - members_.begin());
    if (free_id == members_.end()) {
      members_.emplace_back(member);
    } else {
      *free_id = member;
    }
    charged_ += member.charge;
    return id;
  }

  /// make_room for an engine that fails a member whose cut fails and goes on with the others:
  /// `drop(failure)` (the engine frees that member's cells and marks it failed), then the member
  /// leaves, its feed is taken out of `feeds`, and make_room runs again until the step fits.
  template <class Drop>
  void make_room_dropping_failed_cuts(std::vector<Feed>& feeds, Drop&& drop) {
    while (true) {
      try {
        make_room(feeds);
        return;
      } catch (const CutFailure& failure) {
        drop(failure);
        leave(failure.member());
        std::erase_if(feeds, [&](const Feed& feed) { return feed.member == failure.member(); });
      }
    }
  }

  /// Removes a member; its cells are the engine's to free. The id may be given to a later join.
  void leave(int member) {
    const Member& m = checked(member, "leave");
    charged_ -= m.charge;
    members_[static_cast<std::size_t>(member)].reset();
  }

  [[nodiscard]] bool is_member(int member) const {
    return member >= 0 && member < static_cast<int>(members_.size()) &&
           members_[static_cast<std::size_t>(member)].has_value();
  }
  [[nodiscard]] const Sequence& sequence(int member) const {
    return *checked(member, "sequence").sequence;
  }
  /// The fewest cells a cut leaves `member` (pressable members; 0 otherwise).
  [[nodiscard]] std::int64_t minimum(int member) const {
    return checked(member, "minimum").minimum;
  }

  /// Before a step that feeds each listed member its tokens (members not listed are fed
  /// nothing): cuts members as the rule says so that cells held plus tokens fed fit in the pool.
  /// A feed naming a member that is not in the pool, twice, or with tokens outside [0, its
  /// max_chunk] is refused before anything changes; a cut that fails throws CutFailure (the
  /// members cut before it stay cut; the step's counters are not updated).
  void make_room(std::span<const Feed> feeds) {
    claims_.clear();
    ids_.clear();
    for (std::size_t id = 0; id < members_.size(); ++id) {
      if (!members_[id]) continue;
      const Member& m = *members_[id];
      claims_.push_back(
          {m.pressable ? m.sequence->max_live() : m.charge, 0, m.minimum, m.pressable});
      ids_.push_back(static_cast<int>(id));
    }
    fed_.assign(claims_.size(), 0);
    for (const Feed& feed : feeds) {
      const Member& m = checked(feed.member, "make_room");
      const int chunk = m.sequence->config().max_chunk;
      KVEVICT_REQUIRE(feed.tokens >= 0 && feed.tokens <= chunk,
                      "KV pool: make_room: member " + std::to_string(feed.member) + " is fed " +
                          std::to_string(feed.tokens) + " tokens, outside [0, " +
                          std::to_string(chunk) + "] (its max_chunk)");
      const auto index = static_cast<std::size_t>(
          std::lower_bound(ids_.begin(), ids_.end(), feed.member) - ids_.begin());
      KVEVICT_REQUIRE(fed_[index] == 0, "KV pool: make_room: member " +
                                            std::to_string(feed.member) +
                                            " is fed twice in one step");
      fed_[index] = 1;
      PoolClaim& claim = claims_[index];
      // A fixed member's charge already holds a chunk.
      if (claim.pressable) claim.incoming = feed.tokens;
    }
    const std::vector<std::int64_t> grants = pool_grants(cells_, claims_);
    for (std::size_t i = 0; i < claims_.size(); ++i) {
      KVEVICT_REQUIRE(grants[i] == claims_[i].cells ||
                          members_[static_cast<std::size_t>(ids_[i])]->sequence->idle(),
                      "KV pool: make_room: member " + std::to_string(ids_[i]) +
                          " must be cut but is inside a forward (end it first)");
    }
    bool pressed = false;
    std::int64_t peak = 0;
    for (std::size_t i = 0; i < claims_.size(); ++i) {
      Member& m = *members_[static_cast<std::size_t>(ids_[i])];
      if (grants[i] < claims_[i].cells) {
        try {
          m.sequence->shrink_to(static_cast<int>(grants[i]));
        } catch (const std::exception& error) {
          throw CutFailure(ids_[i], error.what(), std::current_exception());
        }
        pressed = true;
        ++stats_.cuts;
      }
      peak += (m.pressable ? m.sequence->max_live() : m.charge) + claims_[i].incoming;
    }
    ++stats_.steps;
    stats_.pressed_steps += pressed ? 1 : 0;
    stats_.peak_cells = std::max(stats_.peak_cells, peak);
  }

  [[nodiscard]] std::int64_t cells() const { return cells_; }
  /// Cells the members hold now (a fixed member: its reservation).
  [[nodiscard]] std::int64_t used() const {
    std::int64_t total = 0;
    for (const std::optional<Member>& m : members_) {
      if (m) total += m->pressable ? m->sequence->max_live() : m->charge;
    }
    return total;
  }
  /// Cells the members can never give up (the admission charges).
  [[nodiscard]] std::int64_t charged() const { return charged_; }
  [[nodiscard]] const PoolStats& stats() const { return stats_; }

 private:
  struct Member {
    Sequence* sequence = nullptr;
    std::int64_t minimum = 0;  // pressable: the fewest cells a cut leaves
    bool pressable = false;
    std::int64_t charge = 0;  // cells it can never give up: minimum (or bound) plus one chunk
  };

  [[nodiscard]] const Member& checked(int member, const char* call) const {
    KVEVICT_REQUIRE(is_member(member), std::string("KV pool: ") + call + ": member " +
                                           std::to_string(member) +
                                           " is not in the pool (it left, or never joined)");
    return *members_[static_cast<std::size_t>(member)];
  }

  std::int64_t cells_;
  std::int64_t charged_ = 0;
  std::vector<std::optional<Member>> members_;
  PoolStats stats_;
  std::vector<PoolClaim> claims_;  // make_room scratch, in member order
  std::vector<int> ids_;
  std::vector<std::uint8_t> fed_;
};

}  // namespace kvevict
