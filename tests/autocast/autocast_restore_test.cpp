// AutocastGuard restores everything it saved on entry (both device types'
// enabled flags and dtypes, the weight-cast cache flag, the nesting level),
// from non-default enclosing values, as Python's torch.autocast does.

#include "ampx/autocast.h"

#include "../test_util.h"
#include "ampx/detail/compat.h"
#include "autocast_fixture.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace {

using ampx::AutocastGuard;
using ampx::test::cpu_half_supported;

// ---- What a guard saves comes back, from non-default enclosing values

// Everything AutocastGuard saves on entry, for both device types.
struct AutocastState {
  bool cpu_enabled, cuda_enabled;
  c10::ScalarType cpu_dtype, cuda_dtype;
  bool cache_enabled;
  int64_t nesting;
  bool operator==(const AutocastState& o) const {
    return cpu_enabled == o.cpu_enabled && cuda_enabled == o.cuda_enabled &&
           cpu_dtype == o.cpu_dtype && cuda_dtype == o.cuda_dtype &&
           cache_enabled == o.cache_enabled && nesting == o.nesting;
  }
};

std::ostream& operator<<(std::ostream& os, const AutocastState& s) {
  return os << "{cpu: " << (s.cpu_enabled ? "on " : "off ") << s.cpu_dtype
            << ", cuda: " << (s.cuda_enabled ? "on " : "off ") << s.cuda_dtype
            << ", cache: " << (s.cache_enabled ? "on" : "off") << ", nesting: " << s.nesting << "}";
}

// ATen has no getter for the nesting level: entering a level returns it.
int64_t nesting_level() {
  const int64_t level = at::autocast::increment_nesting() - 1;
  at::autocast::decrement_nesting();
  return level;
}

AutocastState autocast_state() {
  namespace compat = ampx::detail::compat;
  return {compat::autocast_enabled(torch::kCPU), compat::autocast_enabled(torch::kCUDA),
          compat::autocast_dtype(torch::kCPU),   compat::autocast_dtype(torch::kCUDA),
          ampx::is_autocast_cache_enabled(),     nesting_level()};
}

void set_autocast_state(const AutocastState& s) {
  namespace compat = ampx::detail::compat;
  compat::set_autocast_enabled(torch::kCPU, s.cpu_enabled);
  compat::set_autocast_enabled(torch::kCUDA, s.cuda_enabled);
  compat::set_autocast_dtype(torch::kCPU, s.cpu_dtype);
  compat::set_autocast_dtype(torch::kCUDA, s.cuda_dtype);
  at::autocast::set_autocast_cache_enabled(s.cache_enabled);
  while (nesting_level() < s.nesting) at::autocast::increment_nesting();
  while (nesting_level() > s.nesting) at::autocast::decrement_nesting();
}

enum class Exit { kNormal, kException };

struct RestoreCase {
  c10::DeviceType device;
  Exit exit;
};

void PrintTo(const RestoreCase& c, std::ostream* os) {
  *os << (c.device == torch::kCPU ? "cpu" : "cuda")
      << (c.exit == Exit::kNormal ? ", normal exit" : ", exception");
}

std::string restore_case_name(const testing::TestParamInfo<RestoreCase>& info) {
  return std::string(info.param.device == torch::kCPU ? "Cpu" : "Cuda") +
         (info.param.exit == Exit::kNormal ? "NormalExit" : "Exception");
}

// The enclosing state is set by raw ATen calls (as Python code or another
// library would), every field away from its default: autocast on for both
// devices, CPU float16 where the build has it and CUDA bfloat16, the cast
// cache off, already two levels deep. The inner guard changes every field.
class AutocastRestoreTest : public testing::TestWithParam<RestoreCase> {
 protected:
  void SetUp() override {
    saved_ = autocast_state();
    outer_ = {/*cpu_enabled=*/true,
              /*cuda_enabled=*/true,
              cpu_half_supported() ? torch::kHalf : torch::kBFloat16,
              torch::kBFloat16,
              /*cache_enabled=*/false,
              /*nesting=*/2};
    set_autocast_state(outer_);
    ASSERT_EQ(autocast_state(), outer_);
  }
  void TearDown() override { set_autocast_state(saved_); }

  // The dtype the inner guard asks for: the other one than the enclosing.
  c10::ScalarType inner_dtype() const {
    const auto outer = GetParam().device == torch::kCPU ? outer_.cpu_dtype : outer_.cuda_dtype;
    return outer == torch::kHalf ? torch::kBFloat16 : torch::kHalf;
  }

  AutocastState saved_{}, outer_{};
};

TEST_P(AutocastRestoreTest, GuardRestoresEveryFieldItSaved) {
  const auto device = GetParam().device;
  const auto dtype = inner_dtype();
  if (device == torch::kCPU && dtype == torch::kHalf && !cpu_half_supported()) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no float16 CPU autocast";
  }
  // Two inner regions: one switching autocast off, one (re)enabling it with
  // the other dtype, each with the cache back on.
  for (const bool inner_enabled : {false, true}) {
    SCOPED_TRACE(inner_enabled ? "inner guard enabled" : "inner guard disabled");
    try {
      AutocastGuard inner(device, dtype, inner_enabled, /*cache_enabled=*/true);
      auto inside = outer_;
      (device == torch::kCPU ? inside.cpu_enabled : inside.cuda_enabled) = inner.enabled();
      (device == torch::kCPU ? inside.cpu_dtype : inside.cuda_dtype) = dtype;
      inside.cache_enabled = true;
      inside.nesting = 3;
      EXPECT_EQ(autocast_state(), inside);
      if (GetParam().exit == Exit::kException) throw std::runtime_error("boom");
    } catch (const std::runtime_error&) {
    }
    EXPECT_EQ(autocast_state(), outer_);
  }
}

INSTANTIATE_TEST_SUITE_P(AutocastTest, AutocastRestoreTest,
                         testing::Values(RestoreCase{torch::kCPU, Exit::kNormal},
                                         RestoreCase{torch::kCPU, Exit::kException},
                                         RestoreCase{torch::kCUDA, Exit::kNormal},
                                         RestoreCase{torch::kCUDA, Exit::kException}),
                         restore_case_name);

// On the CPU with LibTorch 1.13 bfloat16 is the only dtype, so the inner
// guard there differs in the enabled flag, cache and nesting only; the CUDA
// cases (which run without CUDA: the guard still sets and restores the dtype)
// carry the dtype check on every build.
class CpuAutocastRestoreTest : public AutocastRestoreTest {};

TEST_P(CpuAutocastRestoreTest, GuardWithTheOnlyDtypeStillRestoresTheRest) {
  try {
    AutocastGuard inner(torch::kCPU, outer_.cpu_dtype, /*enabled=*/false, /*cache_enabled=*/true);
    EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
    EXPECT_TRUE(ampx::is_autocast_cache_enabled());
    EXPECT_EQ(nesting_level(), 3);
    if (GetParam().exit == Exit::kException) throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(autocast_state(), outer_);
}

INSTANTIATE_TEST_SUITE_P(AutocastTest, CpuAutocastRestoreTest,
                         testing::Values(RestoreCase{torch::kCPU, Exit::kNormal},
                                         RestoreCase{torch::kCPU, Exit::kException}),
                         restore_case_name);

static_assert(!std::is_copy_constructible<AutocastGuard>::value, "guards are not copyable");
static_assert(!std::is_move_constructible<AutocastGuard>::value, "guards are not movable");

}  // namespace
