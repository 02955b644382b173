#pragma once

/// \file
/// Which pass of a training step a tensor belongs to: the forward pass
/// (activations, weights) or the backward pass (gradients). One enum for the
/// whole library: ampx::debug's records and ampx::fp8's recipes (a recipe's
/// format depends on it) say it the same way.
///
/// ```
///   ampx::to_string(ampx::Direction::kBackward);  // "backward"
/// ```

#include <string>

namespace ampx {

/// The pass of a training step.
enum class Direction {
  kForward,   ///< the forward pass: activations, weights
  kBackward,  ///< the backward pass: gradients
};

/// "forward", "backward".
std::string to_string(Direction direction);

}  // namespace ampx
