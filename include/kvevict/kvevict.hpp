// kvevict: KV-cache eviction policies for transformer inference (umbrella header): the core
// (kvevict/core.hpp, standard library only) and kvevict's own K/V store (Eigen).
#pragma once

#include "kvevict/core.hpp"
#include "kvevict/evicting_cache.hpp"
#include "kvevict/kv_store.hpp"
