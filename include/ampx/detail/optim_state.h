#pragma once

/// \file
/// The low-bit optimizer state's codes, as the fused step computes them, for
/// tests that compare them with torchao's (not part of ampx's API).

#include "ampx/detail/cpu_isa.h"

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

/// The formats of the fused step's coded moments.
enum class StateCodec { kBf16, kFp8, kInt8 };

/// in[0, n) encoded as build `isa`'s step encodes one tile of moment
/// `moment` (0: first, its 8-bit codes signed; 1: second) whose first element
/// is element `index_base` of its param: codes (uint16_t for kBf16, uint8_t
/// otherwise) and, for kFp8 and kInt8 (n <= 4096: one block), the block's
/// scale. `key`: the update's key (bf16's stochastic rounding).
void state_encode(ampx::detail::cpu::Isa isa, StateCodec codec, int moment, uint64_t key,
                  int64_t index_base, const float* in, int64_t n, void* codes, float* scale);

/// Such a tile decoded into out[0, n).
void state_decode(ampx::detail::cpu::Isa isa, StateCodec codec, int moment, const void* codes,
                  float scale, int64_t n, float* out);

/// A Kahan weight's tile, as build `isa`'s step reads it: w = param + comp,
/// both bf16 (`bf16`) or fp16 bits.
void kahan_read(ampx::detail::cpu::Isa isa, bool bf16, const uint16_t* param, const uint16_t* comp,
                int64_t n, float* w);

/// ... and writes its compensation after the param: comp = T(w - param).
void kahan_write(ampx::detail::cpu::Isa isa, bool bf16, const uint16_t* param, const float* w,
                 int64_t n, uint16_t* comp);

}  // namespace detail
}  // namespace optim
}  // namespace ampx
