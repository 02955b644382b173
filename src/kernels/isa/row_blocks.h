#pragma once

// Rows [0, m) in blocks of a register tile's height, for the tile products
// compiled once per instruction set (float_tile.h, bf16_dot_tile.h): a
// register tile keeps one accumulator per row as a named variable, so its
// height is a template argument, and the rows left after the full blocks
// need a tile of their own height. for_row_blocks writes that ladder once:
//
//   for_row_blocks<6>(m, [=](int64_t i, auto rows) __attribute__((always_inline)) {
//     micro_tile<decltype(rows)::value>(...);  // rows [i, i + rows), rows 6, then 1..5
//   });
//
// Each call's height is a compile-time constant, as in the switch over 1..5
// it replaces. The ladder and the lambda are always inlined into the tile
// product, and the lambda captures by value (a capture by reference takes
// the parameters' addresses), so that GCC specializes each tile product for
// its callers' constant strides and inlines the register tiles into it as
// it did for the switch: the hot loops compile to the same instructions.
// Include from a file compiled with CPU_CAPABILITY defined.

#include <cstdint>
#include <type_traits>
#include <utility>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {

// tile(i, std::integral_constant<int, n>{}) for the one n in R... + 1 that
// is `left`, if any.
template <class Tile, int... R>
[[gnu::always_inline]] inline void last_row_block(int64_t left, int64_t i, Tile& tile,
                                                  std::integer_sequence<int, R...>) {
  (void)((left == R + 1 && (tile(i, std::integral_constant<int, R + 1>{}), true)) || ...);
}

// tile(i, std::integral_constant<int, kRows>{}) for i = 0, kRows, ... while
// kRows rows are left, then tile(i, std::integral_constant<int, n>{}) for the
// n < kRows rows left, if any.
template <int kRows, class Tile>
[[gnu::always_inline]] inline void for_row_blocks(int64_t m, Tile&& tile) {
  static_assert(kRows >= 1, "a register tile holds a row at least");
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) tile(i, std::integral_constant<int, kRows>{});
  last_row_block(m - i, i, tile, std::make_integer_sequence<int, kRows - 1>{});
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
