#include "ampx/fp8/convert.h"
#include "convert_internal.h"
#include "linear_internal.h"

#include "ampx/fp8/autocast.h"
#include "ampx/fp8/linear.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/nn/modules/linear.h>

#include <iterator>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace ampx {
namespace fp8 {
namespace {

// ---- converted torch::nn::Linear layers --------------------------------------

struct Converted {
  c10::weak_intrusive_ptr<c10::TensorImpl> weight;
  std::shared_ptr<LinearScaling> scaling;  // null for a wide product
  c10::optional<c10::ScalarType> output_dtype;
  c10::optional<c10::ScalarType> wide;  // set_wide_product's product, instead of FP8
};

struct ConvertedRegistry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, Converted> layers;
  std::unique_ptr<torch::Library> fallback, kernels;
};
ConvertedRegistry& converted_registry() {
  static auto* r = new ConvertedRegistry();
  return *r;
}

// Drops the layers whose weight is gone (each entry keeps its TensorImpl's
// control block): a program that converts a model per run (a plan's probes)
// keeps the registry at the live layers. Called with r.mutex held.
void drop_freed(ConvertedRegistry& r) {
  for (auto it = r.layers.begin(); it != r.layers.end();) {
    it = it->second.weight.expired() ? r.layers.erase(it) : std::next(it);
  }
}

// The converted layer `weight` belongs to, if any.
c10::optional<Converted> lookup(const at::Tensor& weight) {
  if (!weight.defined()) return c10::nullopt;
  auto& r = converted_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.layers.find(weight.unsafeGetTensorImpl());
  if (it == r.layers.end()) return c10::nullopt;
  const auto alive = it->second.weight.lock();
  if (!alive || alive.get() != weight.unsafeGetTensorImpl()) {  // freed, address reused
    r.layers.erase(it);
    return c10::nullopt;
  }
  return it->second;
}

// The converted weight `t` is exactly the transpose of, as F::linear passes
// it to addmm and matmul (weight.t()).
at::Tensor transposed_base(const at::Tensor& t) {
  if (!t.defined() || t.dim() != 2 || !t.is_view()) return {};
  const at::Tensor base(at::TensorBase(t._base()));
  if (!base.defined() || base.dim() != 2 ||
      base.sizes() != at::IntArrayRef({t.size(1), t.size(0)}) || t.stride(0) != base.stride(1) ||
      t.stride(1) != base.stride(0) || t.storage_offset() != base.storage_offset()) {
    return {};
  }
  return base;
}

// Runs the FP8 product for a converted layer's op, or the op below this key.
// The ops are those LibTorch's C++ Linear and F::linear call (addmm for 2-D
// inputs with a bias, matmul otherwise, the bias then added by the caller)
// and Python's at::linear.
void linear_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                   torch::jit::Stack* stack) {
  const auto below =
      keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, detail::kFp8LinearKey);
  const auto& name = op.schema().name();
  const size_t n = stack->size();
  at::Tensor input, weight, bias;
  size_t num_args = 0;
  if (name == "aten::linear") {  // (input, weight, bias?)
    num_args = 3;
    input = (*stack)[n - 3].toTensor();
    weight = (*stack)[n - 2].toTensor();
    if (!(*stack)[n - 1].isNone()) bias = (*stack)[n - 1].toTensor();
  } else if (name == "aten::addmm") {  // (self, mat1, mat2, beta, alpha)
    num_args = 5;
    const at::Tensor& self = (*stack)[n - 5].toTensor();
    weight = transposed_base((*stack)[n - 3].toTensor());
    const bool plain = (*stack)[n - 2].toScalar().equal(1) && (*stack)[n - 1].toScalar().equal(1);
    if (weight.defined() && plain && self.dim() == 1 && self.size(0) == weight.size(0)) {
      input = (*stack)[n - 4].toTensor();
      bias = self;
    } else {
      weight = at::Tensor();
    }
  } else if (name == "aten::matmul") {  // (self, other)
    num_args = 2;
    input = (*stack)[n - 2].toTensor();
    weight = transposed_base((*stack)[n - 1].toTensor());
  }
  c10::optional<Converted> layer;
  if (is_fp8_enabled() && weight.defined()) layer = lookup(weight);
  if (!layer) {
    op.redispatchBoxed(below, stack);
    return;
  }
  torch::jit::drop(*stack, num_args);
  c10::impl::ExcludeDispatchKeyGuard exclude(detail::kFp8LinearKey);
  stack->emplace_back(layer->wide ? detail::wide_linear(input, weight, bias, *layer->wide)
                                  : detail::fp8_linear(input, weight, bias, layer->scaling,
                                                       layer->output_dtype));
}

}  // namespace

// A fallthrough for every op on the key and the kernels above, once.
void detail::register_linear_kernels() {
  auto& r = converted_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.fallback) return;
  try {
    auto fallback = std::make_unique<torch::Library>(torch::Library::IMPL, "_",
                                                     detail::kFp8LinearKey, __FILE__, __LINE__);
    fallback->fallback(torch::CppFunction::makeFallthrough());
    auto kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                    detail::kFp8LinearKey, __FILE__, __LINE__);
    for (const char* op : {"linear", "addmm", "matmul"}) {
      kernels->impl(op, torch::CppFunction::makeFromBoxedFunction<&linear_kernel>());
    }
    r.fallback = std::move(fallback);
    r.kernels = std::move(kernels);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false,
                "ampx::fp8: cannot register the aten::linear/addmm/matmul kernels on "
                "TESTING_ONLY_GenericWrapper that FP8 regions use (is something else using that "
                "key?): ",
                e.what_without_backtrace());
  }
}

// ---- conversion -----------------------------------------------------------------------

std::vector<std::string> convert_linears(torch::nn::Module& model, const ConvertOptions& options) {
  options.recipe().validate();
  detail::register_linear_kernels();
  std::vector<std::string> converted;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    if (linear == nullptr) continue;
    const auto& o = linear->options;
    const bool wanted = options.filter() ? options.filter()(item.key(), *linear)
                                         : o.in_features() % 16 == 0 && o.out_features() % 16 == 0;
    if (!wanted) continue;
    const at::Tensor& w = linear->weight;
    TORCH_CHECK(!lookup(w), "ampx::fp8::convert_linears: '", item.key(),
                "' is already an FP8 layer (or has a wide product)");
    auto scaling = std::make_shared<LinearScaling>(options.recipe(), w.device(), w);
    scaling->register_buffers(*linear, "fp8_");
    {
      auto& r = converted_registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      drop_freed(r);
      r.layers.erase(w.unsafeGetTensorImpl());  // a freed weight's address, reused
      r.layers.emplace(w.unsafeGetTensorImpl(),
                       Converted{c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()),
                                 scaling, options.output_dtype(), c10::nullopt});
    }
    converted.push_back(item.key());
  }
  return converted;
}

void reconvert_linear(torch::nn::Module& module, const c10::optional<Recipe>& recipe) {
  auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module);
  const auto layer = linear != nullptr ? lookup(linear->weight) : c10::nullopt;
  TORCH_CHECK_VALUE(layer, "ampx::fp8::reconvert_linear: the module (", module.name(),
                    ") is not a torch::nn::Linear that convert_linears converted");
  if (recipe) recipe->validate();
  const at::Tensor& w = linear->weight;
  TORCH_CHECK_VALUE(!recipe || !layer->wide, "ampx::fp8::reconvert_linear: the module (",
                    module.name(), ") runs a wide product, not an FP8 recipe, and has no ",
                    "FP8 buffers to keep");
  auto scaling = recipe ? std::make_shared<LinearScaling>(*recipe, w.device(), w) : nullptr;
  auto& r = converted_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.layers.find(w.unsafeGetTensorImpl());
  // Another thread may have dropped it since: then there is nothing to change.
  if (it == r.layers.end() || it->second.weight.lock().get() != w.unsafeGetTensorImpl()) return;
  if (scaling) {
    it->second.scaling = std::move(scaling);
  } else {
    r.layers.erase(it);
  }
}

void detail::set_wide_product(torch::nn::LinearImpl& linear, c10::ScalarType product) {
  TORCH_CHECK_VALUE(product == at::kFloat || product == at::kHalf,
                    "ampx::fp8::set_wide_product: product must be float32 or float16, got ",
                    product);
  detail::register_linear_kernels();
  const at::Tensor& w = linear.weight;
  auto& r = converted_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.layers.find(w.unsafeGetTensorImpl());
  const bool alive =
      it != r.layers.end() && it->second.weight.lock().get() == w.unsafeGetTensorImpl();
  if (alive) {
    it->second.scaling = nullptr;
    it->second.wide = product;
    return;
  }
  if (it != r.layers.end()) r.layers.erase(it);  // a freed weight's address, reused
  drop_freed(r);
  r.layers.emplace(w.unsafeGetTensorImpl(),
                   Converted{c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()),
                             nullptr, c10::nullopt, product});
}

c10::optional<c10::ScalarType> detail::wide_product_of(const torch::nn::LinearImpl& linear) {
  const auto layer = lookup(linear.weight);
  return layer ? layer->wide : c10::nullopt;
}

std::shared_ptr<LinearScaling> scaling_of(torch::nn::Module& module) {
  if (auto* fp8 = dynamic_cast<LinearImpl*>(&module)) return fp8->scaling_;
  if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module)) {
    if (auto layer = lookup(linear->weight)) return layer->scaling;
  }
  return nullptr;
}

}  // namespace fp8
}  // namespace ampx
