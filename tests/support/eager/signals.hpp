// The eager oracle's signals, triggers, slot flags and attention rows are the production ones
// (kvevict/signals.hpp), of which it had an older copy (no last_query(), data() or row_stride()).
#pragma once

#include <kvevict/signals.hpp>

namespace kvevict::eager {
using kvevict::AttentionRows;
using kvevict::FlagSet;
using kvevict::Signal;
using kvevict::SignalSet;
using kvevict::Trigger;
using kvevict::TriggerSet;
namespace slot_flag = kvevict::slot_flag;
}  // namespace kvevict::eager
