#pragma once

/// \file
/// Max pooling over non-overlapping windows of a contiguous (NCHW) CPU
/// tensor, forward and backward. LibTorch's own kernel for that layout
/// branches on every comparison, and on a ReLU's output each is a coin toss:
/// on 2 cores it pools a [128, 32, 28, 28] float32 batch in about 10 ms (12x
/// its channels-last kernel); this one, by selects, in about 1 ms.
///
/// ```
///   auto x = torch::randn({128, 32, 28, 28});
///   auto y = ampx::max_pool2d(x, 2);   // at::max_pool2d(x, 2), bit for bit: [128, 32, 14, 14]
///   ampx::max_pool2d_is_fused(x, {2, 2}, {}, {0, 0}, {1, 1}, false);   // true: the CPU kernel
/// ```

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace ampx {

/// at::max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode), the
/// same values and the same gradients bit for bit: each window's first
/// largest element in row-major order (its last NaN, if it holds one) is the
/// output and gets the output's gradient. Where max_pool2d_is_fused is true
/// it runs ampx's CPU kernel, which saves one byte an output for backward
/// (the winner's place in its window) where LibTorch saves an int64 index;
/// anything else runs at::max_pool2d. A backward with create_graph (a
/// gradient penalty) runs LibTorch's backward op on the indices those places
/// stand for, so the gradient differentiates as LibTorch's does.
at::Tensor max_pool2d(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride = {},
                      at::IntArrayRef padding = 0, at::IntArrayRef dilation = 1,
                      bool ceil_mode = false);

/// Whether max_pool2d runs ampx's kernel for these arguments: a non-empty
/// floating CPU tensor of 3 or 4 dimensions, contiguous in the default
/// (NCHW) layout, each window at most 255 elements and no larger than the
/// image, the stride the window's size (or empty), no padding, dilation 1
/// and ceil_mode false.
bool max_pool2d_is_fused(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode);

}  // namespace ampx
