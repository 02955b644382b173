#pragma once

// The dispatch key of ampx's op observers, below both of its users: the
// observers (src/debug/observer.h: NonFiniteGuard, range statistics)
// register their fallback on it, and a kernel that computes an op out of
// other ops (ampx's wide products: float32 copies, a float32 product, a
// rounding) excludes it around those parts, so that observers see the op the
// program called, with its dtype, rather than its parts.
//
//   ampx::detail::HiddenFromObserversGuard hidden;  // what this thread
//   at::mm(a32, b32);                                // dispatches now: unobserved

#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace ampx {
namespace detail {

/// TESTING_ONLY_GenericMode: the only mode key above Autograd that neither
/// LibTorch 1.13 nor 2.x registers anything on (docs/numerics.md).
constexpr c10::DispatchKey kObserverKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

/// While alive, the ops this thread dispatches skip the observers' fallback.
struct HiddenFromObserversGuard {
  c10::impl::ExcludeDispatchKeyGuard exclude{kObserverKey};
};

}  // namespace detail
}  // namespace ampx
