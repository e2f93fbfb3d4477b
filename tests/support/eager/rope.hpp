// The eager oracle's RoPE is the production one (kvevict/rope.hpp), which it had copied before the
// production one learnt to reuse a rotation across rows (angles / rotate_with): same angles, same
// rounding.
#pragma once

#include <kvevict/rope.hpp>

namespace kvevict::eager {
using kvevict::Rope;
using kvevict::RopeConfig;
using kvevict::RopeLayout;
}  // namespace kvevict::eager
