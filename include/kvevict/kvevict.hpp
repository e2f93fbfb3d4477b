// kvevict: KV-cache eviction policies for transformer inference (umbrella header).
#pragma once

#include "kvevict/attention_scores.hpp"
#include "kvevict/compaction_plan.hpp"
#include "kvevict/error.hpp"
#include "kvevict/evicting_cache.hpp"
#include "kvevict/kv_store.hpp"
#include "kvevict/pipeline.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/policy_registry.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/reposition.hpp"
#include "kvevict/rope.hpp"
#include "kvevict/selection.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/signals.hpp"
#include "kvevict/slot_table.hpp"
