// The eager oracle's position modes are the production ones (kvevict/positions.hpp), which it had
// copied verbatim: only the eviction core (slot table, pipeline, compaction) is the oracle's own.
#pragma once

#include <kvevict/positions.hpp>

namespace kvevict::eager {
using kvevict::KeyStorage;
using kvevict::parse_key_storage;
using kvevict::parse_position_mode;
using kvevict::PositionMode;
using kvevict::to_string;
}  // namespace kvevict::eager
