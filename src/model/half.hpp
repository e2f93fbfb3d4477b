// IEEE binary16 (f16) and bfloat16 conversions: kvevict/detail/half.hpp, named in kvevict::model
// for the weight loaders and kernels.
#pragma once

#include <kvevict/detail/half.hpp>

namespace kvevict::model {

using detail::bf16_to_float;
using detail::bits_to_float;
using detail::f16_to_float;
using detail::float_to_bf16;
using detail::float_to_bits;
using detail::float_to_f16;

}  // namespace kvevict::model
