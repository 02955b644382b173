#pragma once

/// \file
/// The low-bit optimizer state's codes, as the fused step computes them, for
/// tests that compare them with torchao's (not part of ampx's API).

#include <cstdint>
#include <vector>

namespace ampx {
namespace optim {
namespace detail {

/// The 8-bit state's dynamic tree map (signed: first moments; unsigned:
/// second moments), 256 sorted values.
std::vector<float> state_dynamic_map(bool is_signed);

/// The 8-bit code of x (a value over its block's absmax) in `map`, 256
/// sorted values: the fused step's search and tie rule.
uint8_t state_map_code(const float* map, float x);

/// The fused step's 8-bit code of x in the dynamic map (`is_signed`'s): the
/// same as state_map_code's search, through a table of starting codes.
uint8_t state_dynamic_code(bool is_signed, float x);

/// The FP8 state of `in` in blocks of `block` elements (the last may be
/// shorter): each block's scale and the elements' E4M3 codes.
void fp8_state_quantize(const std::vector<float>& in, int64_t block, std::vector<float>& scales,
                        std::vector<uint8_t>& codes);

}  // namespace detail
}  // namespace optim
}  // namespace ampx
