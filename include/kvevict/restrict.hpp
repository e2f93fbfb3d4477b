// KVEVICT_RESTRICT: promises the compiler that two pointers do not alias, so that the per-slot
// loops of the policies' scoring vectorise.
#pragma once

#if defined(_MSC_VER)
#define KVEVICT_RESTRICT __restrict
#else
#define KVEVICT_RESTRICT __restrict__
#endif
