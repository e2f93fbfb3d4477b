// The eager oracle's cache shape is the production one (kvevict/shape.hpp), which it had copied
// verbatim.
#pragma once

#include <kvevict/shape.hpp>

namespace kvevict::eager {
using kvevict::CacheShape;
}  // namespace kvevict::eager
