// KeepNormsFp32Guard and Fp32RegionGuard: whole-op-set policies on top of the
// registry, with autocast on for the thread so that ops meet the key.

#include "ampx/policy.h"

#include "ampx/autocast.h"
#include "registry.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>
#include <utility>

namespace ampx {
namespace {

const char* const kNormOps[] = {"batch_norm",
                                "_batch_norm_impl_index",
                                "native_batch_norm",
                                "_native_batch_norm_legit",
                                "_native_batch_norm_legit_no_training",
                                "layer_norm",
                                "native_layer_norm",
                                "group_norm",
                                "native_group_norm",
                                "instance_norm"};

using Changes = std::vector<std::pair<c10::OperatorName, c10::optional<detail::PolicyEntry>>>;

bool is_norm(const std::string& name) {
  for (const char* op : kNormOps) {
    if (name.size() == std::strlen(op) + 6 && name.compare(6, std::string::npos, op) == 0 &&
        name.compare(0, 6, "aten::") == 0) {
      return true;
    }
  }
  return false;
}

// One pass over the dispatcher: the functional overloads of the norm ops (and,
// on the CPU, of aten::gelu: its float32-math kernel, ampx::mixed_gelu) get
// `norm`; every other op with a kernel on the key gets `rest`.
Changes whole_set(c10::DeviceType device_type, const char* who, detail::PolicyEntry norm,
                  detail::PolicyEntry rest) {
  const auto key = detail::autocast_key(device_type, who);
  auto& dispatcher = c10::Dispatcher::singleton();
  Changes changes;
  for (auto& name : dispatcher.getAllOpNames()) {
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema()) continue;
    if (is_norm(name.name) || (device_type == c10::DeviceType::CPU && name.name == "aten::gelu")) {
      if (!detail::writes_an_argument(handle->schema())) {
        changes.emplace_back(std::move(name), norm);
      }
    } else if (handle->hasKernelForDispatchKey(key)) {
      changes.emplace_back(std::move(name), rest);
    }
  }
  return changes;
}

}  // namespace

std::vector<std::string> norm_ops() {
  std::vector<std::string> out;
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto all = dispatcher.getAllOpNames();
  for (const char* op : kNormOps) {
    const std::string name = std::string("aten::") + op;
    for (const auto& n : all) {
      if (n.name == name) {
        out.push_back(name);
        break;
      }
    }
  }
  return out;
}

KeepNormsFp32Guard::KeepNormsFp32Guard(c10::DeviceType device_type) {
  saved_ = detail::set_policies(
      device_type, whole_set(device_type, "KeepNormsFp32Guard",
                             detail::PolicyEntry{CastPolicy::kFp32OutputsAsInput, false},
                             detail::PolicyEntry{CastPolicy::kPassthrough, /*fallthrough=*/true}));
  try {
    autocast_ = std::make_unique<AutocastGuard>(device_type);
  } catch (...) {
    detail::restore_policies(*saved_);
    throw;
  }
}

KeepNormsFp32Guard::~KeepNormsFp32Guard() {
  autocast_.reset();
  detail::restore_policies(*saved_);
}

Fp32RegionGuard::Fp32RegionGuard(c10::DeviceType device_type) {
  const detail::PolicyEntry fp32{CastPolicy::kFp32, false};
  saved_ = detail::set_policies(device_type, whole_set(device_type, "Fp32RegionGuard", fp32, fp32));
  try {
    autocast_ = std::make_unique<AutocastGuard>(device_type);
  } catch (...) {
    detail::restore_policies(*saved_);
    throw;
  }
}

Fp32RegionGuard::~Fp32RegionGuard() {
  autocast_.reset();
  detail::restore_policies(*saved_);
}

}  // namespace ampx
