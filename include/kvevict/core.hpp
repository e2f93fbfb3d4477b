// kvevict's core: policies, selection, slot metadata and the Sequence an engine drives. Standard
// library only (no Eigen): the part an engine with its own K/V buffers links (kvevict::core).
#pragma once

#include "kvevict/attention_scores.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/decision.hpp"
#include "kvevict/engine.hpp"
#include "kvevict/error.hpp"
#include "kvevict/granularity.hpp"
#include "kvevict/kv_pool.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/policy_registry.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/rope.hpp"
#include "kvevict/selection.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/signals.hpp"
#include "kvevict/slot_table.hpp"
#include "kvevict/timing.hpp"
#include "kvevict/version.hpp"
