// kvevict's version, as a macro for preprocessor checks and as constants.
#pragma once

#define KVEVICT_VERSION_MAJOR 0
#define KVEVICT_VERSION_MINOR 2
#define KVEVICT_VERSION_PATCH 0
/// MAJOR * 10000 + MINOR * 100 + PATCH, e.g. 200 for 0.2.0 (as fmt's FMT_VERSION).
#define KVEVICT_VERSION \
  (KVEVICT_VERSION_MAJOR * 10000 + KVEVICT_VERSION_MINOR * 100 + KVEVICT_VERSION_PATCH)

namespace kvevict {
inline constexpr int kVersionMajor = KVEVICT_VERSION_MAJOR;
inline constexpr int kVersionMinor = KVEVICT_VERSION_MINOR;
inline constexpr int kVersionPatch = KVEVICT_VERSION_PATCH;
inline constexpr const char* kVersionString = "0.2.0";
}  // namespace kvevict
