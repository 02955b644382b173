#pragma once

/// \file
/// Autocast: run eligible ops (matmul, conv, linear) in float16/bfloat16 and
/// keep precision-sensitive ops (softmax on CUDA, norms, losses) in float32,
/// through the dispatcher's Autocast keys. `AutocastGuard` is the C++ twin of
/// Python's `with torch.autocast(device_type, dtype, enabled, cache_enabled):`,
/// with the same enter/exit steps, nesting and weight-cast cache rules.
///
/// ```
///   {
///     ampx::AutocastGuard autocast(torch::kCPU);        // bfloat16 on the CPU
///     auto y = model->forward(x);                        // linear in bf16
///     loss = torch::mse_loss(y, target);                 // loss in fp32
///   }                                                    // state restored here
///   scaler.scale(loss).backward();                       // backward outside
/// ```
///
/// Autocast state is per thread, as in PyTorch.

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <ATen/core/Tensor.h>

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace ampx {

class WideProductsGuard;
namespace detail {
class AutocastRegion;
}

/// Whether autocast is enabled for `device_type` (kCPU or kCUDA) in this thread.
bool is_autocast_enabled(c10::DeviceType device_type);

/// The lower-precision dtype autocast casts to on `device_type` in this
/// thread: bfloat16 on the CPU and float16 on CUDA unless a guard changed it.
c10::ScalarType get_autocast_dtype(c10::DeviceType device_type);

/// Whether casts of fp32 leaf weights are cached inside autocast regions.
bool is_autocast_cache_enabled();

/// Drops the weight-cast cache (the outermost guard does this on exit).
void clear_autocast_cache();

/// RAII autocast region, mirroring `torch.autocast.__enter__/__exit__`:
/// on entry it saves the thread's enabled flag, dtype and cache flag, sets
/// the new ones and increments the nesting level; on exit (also by
/// exception) it decrements nesting, clears the cast cache when the
/// outermost region closes, and restores what it saved.
///
/// `dtype` defaults, as in Python, to the thread's current autocast dtype for
/// the device (bfloat16 on CPU, float16 on CUDA unless an enclosing guard set
/// another), so an inner guard without a dtype inherits the outer one's.
/// Errors: a dtype other than float16/bfloat16, and float16 on the CPU with
/// LibTorch 1.13 (which cannot run it). Asking for CUDA where CUDA is not
/// available warns and disables the region, as Python does.
///
/// One difference from Python, on CPUs whose 16-bit matrix products LibTorch
/// runs slower than its float32 ones (a scalar loop without AVX-512; oneDNN's
/// AVX512-BF16 kernels on an Intel Xeon without AMX: cpu_products_are_wide in
/// ampx/kernels.h): an enabled CPU region also makes a WideProductsGuard, so
/// linear, matmul, mm, bmm and addmm multiply their 16-bit operands in the
/// float32 BLAS and round once to 16 bits (the dtypes and the float32
/// accumulation of Python's region, in another summation order, about 30x
/// faster without AVX-512, 1.6x on that Xeon). AMPX_CPU_PRODUCTS=native, or
/// set_cpu_products, turns it off.
class AutocastGuard {
 public:
  /// Enters the region: torch.autocast(device_type, dtype, enabled,
  /// cache_enabled); `dtype` unset keeps the thread's current one.
  explicit AutocastGuard(c10::DeviceType device_type,
                         c10::optional<c10::ScalarType> dtype = c10::nullopt,
                         bool enabled = true, bool cache_enabled = true);
  ~AutocastGuard();

  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

  /// The device type the region casts for (kCPU or kCUDA).
  c10::DeviceType device_type() const noexcept;
  /// The dtype the region casts to.
  c10::ScalarType dtype() const noexcept;
  /// False when constructed disabled, or disabled because CUDA is missing.
  bool enabled() const noexcept;

 private:
  std::unique_ptr<detail::AutocastRegion> region_;  // torch.autocast's enter and exit
  std::unique_ptr<WideProductsGuard> wide_;         // CPU products through the fp32 BLAS
};

namespace detail {
/// Python's `torch.amp.autocast_mode._cast`: floating tensors on
/// `device_type`, other than float64, are cast to `dtype`; the rest passes.
at::Tensor cast_for_custom_fwd(const at::Tensor& t, c10::DeviceType device_type,
                               c10::ScalarType dtype);

template <class T>
decltype(auto) cast_arg(T&& arg, c10::DeviceType device_type, c10::ScalarType dtype) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    return cast_for_custom_fwd(arg, device_type, dtype);
  } else if constexpr (std::is_same_v<U, std::vector<at::Tensor>>) {
    std::vector<at::Tensor> out;
    out.reserve(arg.size());
    for (const auto& t : arg) {
      out.push_back(cast_for_custom_fwd(t, device_type, dtype));
    }
    return out;
  } else if constexpr (std::is_same_v<U, c10::optional<at::Tensor>>) {
    return arg.has_value()
               ? c10::optional<at::Tensor>(cast_for_custom_fwd(*arg, device_type, dtype))
               : c10::optional<at::Tensor>();
  } else {
    return std::forward<T>(arg);
  }
}
}  // namespace detail

/// Runs `fn(args...)` the way Python's `@custom_fwd(device_type=...,
/// cast_inputs=dtype)` runs a forward: inside an autocast region for
/// `device_type`, floating tensor arguments on that device (Tensor,
/// std::vector<Tensor>, optional<Tensor>) are cast to `cast_inputs` and `fn`
/// runs with autocast disabled; outside one, `fn` runs unchanged. Use it for
/// custom ops and functions that must run in float32:
///
/// ```
///   auto y = ampx::custom_fwd(torch::kCPU, torch::kFloat, my_fp32_op, x, w);
/// ```
template <class F, class... Args>
decltype(auto) custom_fwd(c10::DeviceType device_type, c10::ScalarType cast_inputs, F&& fn,
                          Args&&... args) {
  if (!is_autocast_enabled(device_type)) {
    return std::forward<F>(fn)(std::forward<Args>(args)...);
  }
  AutocastGuard autocast_off(device_type, c10::nullopt, /*enabled=*/false);
  return std::forward<F>(fn)(
      detail::cast_arg(std::forward<Args>(args), device_type, cast_inputs)...);
}

}  // namespace ampx
