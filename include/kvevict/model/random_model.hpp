// A model with random weights, for tests and benchmarks: no file, same weights on every platform.
#pragma once

#include <cstdint>

#include "kvevict/model/model.hpp"

namespace kvevict::model {

/// Builds a Llama of `config` (validated) with weights drawn from `seed` and stored as `dtype`.
///
/// Weights: each entry is (u1 + u2 + u3 + u4 - 2) * sqrt(3) * std with u_i uniform in [0, 1) from a
/// SplitMix64 stream (Irwin-Hall: mean 0, variance std^2, close to a normal) and std =
/// 1 / sqrt(fan_in), which is about N(0, 0.02) for dim ~ 2,500 and keeps activations O(1) at any
/// width; the projections that write into the residual stream (wo, w_down) are further scaled by
/// 1 / sqrt(2 * layers) so the stream does not grow with depth. The embedding uses std 1 /
/// sqrt(dim) (as the tied output head, it then gives logits of standard deviation about 1). Only
/// integer arithmetic and IEEE additions and multiplications are used: the bytes are the same on
/// every platform and compiler. Norm weights are 1. Q8_0 / Q4_0: the f32 draws, quantised
/// (quant.hpp); the column counts must then be multiples of 32.
///
/// Tokenizer: byte-level with `vocab_size` ids: bytes 0..255, then bos = 256, eos = 257 and
/// anchor = 258 ("<AC>") where the vocabulary holds them (-1 otherwise). format = "random".
[[nodiscard]] Model make_random_model(const ModelConfig& config, std::uint64_t seed,
                                      DType dtype = DType::f32);

}  // namespace kvevict::model
