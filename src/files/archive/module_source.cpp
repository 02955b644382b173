// check_attribute_module_source (module_source.h): a recognizer of the
// TorchScript source torch::serialize::OutputArchive writes, one
// attribute-only module class a line at a time, and the names of those
// classes (module_source.h), as sources and pickle globals spell them.

#include "module_source.h"

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstring>
#include <sstream>
#include <string>

namespace ampx {
namespace detail {
namespace {

// A hand-written recognizer (not std::regex, whose matcher recurses per
// character and can exhaust the stack on a long attribute list).
class SourceLine {
 public:
  explicit SourceLine(const std::string& line) : s_(line) {}  // keeps a reference
  bool done() const { return at_ == s_.size(); }
  bool eat(const char* text) {
    const size_t n = std::strlen(text);
    if (s_.compare(at_, n, text) != 0) return false;
    at_ += n;
    return true;
  }
  bool digits() {
    const size_t from = at_;
    while (at_ < s_.size() && at_ - from < 9 && s_[at_] >= '0' && s_[at_] <= '9') ++at_;
    return at_ > from;
  }
  bool identifier() {
    const size_t from = at_;
    auto letter = [](char c) {
      return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
    };
    while (at_ < s_.size() && at_ - from < 1024 &&
           (letter(s_[at_]) || (at_ > from && s_[at_] >= '0' && s_[at_] <= '9'))) {
      ++at_;
    }
    return at_ > from;
  }
  // "..." without quotes, backslashes or line ends inside, at most 1024 bytes.
  bool quoted() {
    if (!eat("\"")) return false;
    const size_t from = at_;
    while (at_ < s_.size() && s_[at_] != '"' && s_[at_] != '\\' && at_ - from <= 1024) ++at_;
    return at_ - from <= 1024 && eat("\"");
  }
  // Tensor, int, float, bool, str, Optional[...] or List[...] of one of
  // those, a Tuple[...] of those (torch::optim::Adam's betas), or one of the
  // archive's module classes.
  bool type(bool in_tuple = false) {
    if (eat("__torch__")) {
      if (eat(".___torch_mangle_") && !digits()) return false;
      return eat(".Module");
    }
    if (!in_tuple && eat("Tuple[")) {
      do {
        if (!type(true)) return false;
      } while (eat(", "));
      return eat("]");
    }
    const bool wrapped = eat("Optional[") || eat("List[");
    const bool plain = eat("Tensor") || eat("int") || eat("float") || eat("bool") || eat("str");
    return plain && (!wrapped || eat("]"));
  }

 private:
  const std::string& s_;
  size_t at_ = 0;
};

bool attribute_declaration(const std::string& text) {
  {  // __parameters__ = ["a", "b", ]  (and __buffers__, __annotations__)
    SourceLine l(text);
    if ((l.eat("  __parameters__ = [") || l.eat("  __buffers__ = [") ||
         l.eat("  __annotations__ = ["))) {
      while (!l.eat("]")) {
        if (!l.quoted() || !l.eat(", ")) return false;
      }
      return l.done();
    }
  }
  {  // __annotations__["group0.lr"] = float
    SourceLine l(text);
    if (l.eat("  __annotations__[")) {
      return l.quoted() && l.eat("] = ") && l.type() && l.done();
    }
  }
  SourceLine l(text);  // weight : Tensor
  return l.eat("  ") && l.identifier() && l.eat(" : ") && l.type() && l.done();
}

// code/__torch__.py or code/__torch__/___torch_mangle_N.py, under any prefix.
bool module_source_name(const std::string& name) {
  const size_t code = name.rfind("code/__torch__");
  if (code == std::string::npos || (code > 0 && name[code - 1] != '/')) return false;
  const std::string tail = name.substr(code);
  SourceLine l(tail);
  l.eat("code/__torch__");
  if (l.eat("/___torch_mangle_") && !l.digits()) return false;
  return l.eat(".py") && l.done();
}

}  // namespace

void check_attribute_module_source(const std::string& name, const std::string& source,
                                   const std::string& what) {
  TORCH_CHECK(module_source_name(name), what, ": unexpected TorchScript source '", name,
              "': a checkpoint's archive holds attribute-only module classes only");
  std::istringstream lines(source);
  std::string line;
  int number = 0;
  bool class_seen = false;
  while (std::getline(lines, line)) {
    ++number;
    const bool ok = class_seen ? line.empty() || attribute_declaration(line)
                               : (class_seen = line == "class Module(Module):");
    TORCH_CHECK(ok, what, ": TorchScript source '", name, "' line ", number, " is not ",
                class_seen ? "an attribute declaration" : "the class header",
                " that torch::serialize::OutputArchive writes: '", line.substr(0, 80), "'");
  }
  TORCH_CHECK(class_seen, what, ": TorchScript source '", name, "' declares no class");
}

bool module_class(const std::string& global) {
  if (global == "__torch__ Module") return true;
  SourceLine l(global);
  return l.eat("__torch__.___torch_mangle_") && l.digits() && l.eat(" Module") && l.done();
}

}  // namespace detail
}  // namespace ampx
