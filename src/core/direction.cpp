#include "ampx/direction.h"

namespace ampx {

std::string to_string(Direction direction) {
  return direction == Direction::kForward ? "forward" : "backward";
}

}  // namespace ampx
