// Bounds checks on LibTorch archives from outside (see archive_check.h).

#include "archive_check.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

namespace ampx {
namespace detail {
namespace {

uint64_t le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

/// A reader over [data, data + size) whose reads past the end throw.
class Cursor {
 public:
  Cursor(const char* data, size_t size, const std::string& what, const char* kind)
      : p_(reinterpret_cast<const unsigned char*>(data)), size_(size), what_(what), kind_(kind) {}
  size_t left() const { return size_ - at_; }
  size_t at() const { return at_; }
  void need(uint64_t n, const char* field) const {
    TORCH_CHECK(n <= left(), what_, ": damaged ", kind_, ": ", field, " at byte ", at_, " needs ",
                n, " bytes, ", left(), " are left");
  }
  uint64_t u(int bytes, const char* field) {
    need(bytes, field);
    const uint64_t v = le(p_ + at_, bytes);
    at_ += bytes;
    return v;
  }
  void skip(uint64_t n, const char* field) {
    need(n, field);
    at_ += n;
  }
  /// Skips a text argument ended by '\n' (protocol 0 opcodes).
  void line(const char* field) {
    const void* nl = std::memchr(p_ + at_, '\n', left());
    TORCH_CHECK(nl != nullptr, what_, ": damaged ", kind_, ": ", field, " at byte ", at_,
                " has no end of line");
    at_ = static_cast<const unsigned char*>(nl) - p_ + 1;
  }

 private:
  const unsigned char* p_;
  size_t size_, at_ = 0;
  const std::string& what_;
  const char* kind_;
};

struct Record {
  std::string name;
  uint64_t offset = 0, size = 0;  // of the stored data
  uint64_t stored_size = 0;       // inflated
  bool pickle = false;            // a .pkl record (stored as is)
  bool deflated = false;
};

/// The records of a zip archive, their sizes and places checked against the file.
std::vector<Record> zip_records(const char* data, size_t size, const std::string& what) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  // End of central directory: 22 bytes and a comment of at most 64 KiB.
  size_t eocd = std::string::npos;
  for (size_t back = 22; back <= size && back <= 22 + 65535; ++back) {
    if (le(p + size - back, 4) == 0x06054b50) {
      eocd = size - back;
      break;
    }
  }
  TORCH_CHECK(eocd != std::string::npos, what,
              ": damaged zip archive: no end of central directory");
  uint64_t entries = le(p + eocd + 10, 2), cd_size = le(p + eocd + 12, 4),
           cd_offset = le(p + eocd + 16, 4);
  if (entries == 0xffff || cd_size == 0xffffffff || cd_offset == 0xffffffff) {  // zip64
    TORCH_CHECK(eocd >= 20 && le(p + eocd - 20, 4) == 0x07064b50, what,
                ": damaged zip archive: no zip64 locator");
    const uint64_t z = le(p + eocd - 20 + 8, 8);
    TORCH_CHECK(z <= size && size - z >= 56 && le(p + z, 4) == 0x06064b50, what,
                ": damaged zip archive: bad zip64 end of central directory offset ", z);
    entries = le(p + z + 32, 8);
    cd_size = le(p + z + 40, 8);
    cd_offset = le(p + z + 48, 8);
  }
  TORCH_CHECK(cd_offset <= size && cd_size <= size - cd_offset, what,
              ": damaged zip archive: central directory at ", cd_offset, " of ", cd_size,
              " bytes, the file has ", size);
  TORCH_CHECK(entries <= cd_size / 46, what, ": damaged zip archive: ", entries,
              " records in a central directory of ", cd_size, " bytes");
  Cursor cd(data + cd_offset, cd_size, what, "zip archive");
  std::vector<Record> records;
  for (uint64_t i = 0; i < entries; ++i) {
    TORCH_CHECK(cd.u(4, "record signature") == 0x02014b50, what,
                ": damaged zip archive: bad central directory record ", i);
    cd.skip(6, "record header");
    const uint64_t method = cd.u(2, "compression method");
    cd.skip(8, "record header");
    uint64_t compressed = cd.u(4, "compressed size"), stored = cd.u(4, "size");
    const uint64_t name_len = cd.u(2, "name length"), extra_len = cd.u(2, "extra length"),
                   comment_len = cd.u(2, "comment length");
    cd.skip(8, "record header");
    uint64_t offset = cd.u(4, "record offset");
    cd.need(name_len, "record name");
    Record r;
    r.name.assign(data + cd_offset + cd.at(), name_len);
    cd.skip(name_len, "record name");
    const char* extra_data = data + cd_offset + cd.at();
    Cursor extra(extra_data, extra_len, what, "zip archive");
    cd.skip(extra_len, "extra field");
    cd.skip(comment_len, "record comment");
    while (extra.left() >= 4) {  // zip64 sizes and offset, in this order, where 0xffffffff
      const uint64_t id = extra.u(2, "extra field id"), len = extra.u(2, "extra field length");
      extra.need(len, "extra field");
      if (id != 1) {
        extra.skip(len, "extra field");
        continue;
      }
      Cursor z(extra_data + extra.at(), len, what, "zip archive");
      if (stored == 0xffffffff) stored = z.u(8, "zip64 size");
      if (compressed == 0xffffffff) compressed = z.u(8, "zip64 compressed size");
      if (offset == 0xffffffff) offset = z.u(8, "zip64 record offset");
      extra.skip(len, "extra field");
    }
    // LibTorch stores data and pickles as they are and deflates TorchScript
    // code; deflate cannot expand past 1032:1, which bounds what miniz allocates.
    const bool pickle = r.name.size() >= 4 && r.name.compare(r.name.size() - 4, 4, ".pkl") == 0;
    TORCH_CHECK((method == 0 && compressed == stored) ||
                    (method == 8 && !pickle && stored <= 1032 * compressed + 64),
                what, ": zip record '", r.name, "' has compression method ", method, ", ",
                compressed, " bytes for ", stored, "; LibTorch stores ",
                pickle ? "pickles as they are" : "records as they are or deflated");
    TORCH_CHECK(offset <= size && size - offset >= 30 && le(p + offset, 4) == 0x04034b50, what,
                ": damaged zip archive: record '", r.name, "' has no local header at ", offset);
    const uint64_t local = 30 + le(p + offset + 26, 2) + le(p + offset + 28, 2);
    TORCH_CHECK(local <= size - offset && compressed <= size - offset - local, what,
                ": damaged zip archive: record '", r.name, "' of ", compressed,
                " bytes runs past the end of the file (", size, " bytes)");
    r.offset = offset + local;
    r.size = compressed;
    r.stored_size = stored;
    r.pickle = pickle;
    r.deflated = method == 8;
    records.push_back(std::move(r));
  }
  return records;
}

}  // namespace

void check_pickle(const char* data, size_t size, const std::string& what) {
  Cursor c(data, size, what, "pickle");
  // Memo entries so far: writers number them in order, and LibTorch reserves
  // memo room by the index it reads.
  uint64_t puts = 0;
  auto memo = [&](uint64_t index, const char* op) {
    TORCH_CHECK(index <= puts, what, ": damaged pickle: ", op, " index ", index, " at byte ",
                c.at(), " (", puts, " memo entries so far)");
  };
  while (c.left() > 0) {
    const auto op = static_cast<unsigned char>(c.u(1, "opcode"));
    switch (op) {
      case '.':  // STOP
        return;
      case '(':
      case '0':
      case '1':
      case '2':
      case 'N':
      case 'Q':
      case 'R':
      case 'a':
      case 'b':
      case 'd':
      case '}':
      case 'e':
      case 'l':
      case ']':
      case 'o':
      case 's':
      case 't':
      case ')':
      case 'u':
      case 0x81:
      case 0x85:
      case 0x86:
      case 0x87:
      case 0x88:
      case 0x89:
      case 0x8f:
      case 0x90:
      case 0x91:
      case 0x92:
      case 0x93:
      case 0x97:
      case 0x98:
        break;
      case 0x94:  // MEMOIZE
        ++puts;
        break;
      case 'F':
      case 'I':
      case 'L':
      case 'P':
      case 'S':
      case 'V':
        c.line("text argument");
        break;
      case 'g':
      case 'p':  // GET, PUT (text index)
        c.line("memo index");
        if (op == 'p') ++puts;
        break;
      case 'c':
      case 'i':  // GLOBAL, INST: module and name lines
        c.line("module name");
        c.line("global name");
        break;
      case 'K':
      case 0x80:
      case 0x82:
        c.skip(1, "argument");
        break;
      case 'M':
      case 0x83:
        c.skip(2, "argument");
        break;
      case 'J':
      case 0x84:
        c.skip(4, "argument");
        break;
      case 'G':
        c.skip(8, "float");
        break;
      case 0x95:  // FRAME: its length is a hint, but must fit
        c.need(c.u(8, "frame length"), "frame");
        break;
      case 'h':
        memo(c.u(1, "BINGET index"), "BINGET");
        break;
      case 'j':
        memo(c.u(4, "LONG_BINGET index"), "LONG_BINGET");
        break;
      case 'q':
        memo(c.u(1, "BINPUT index"), "BINPUT");
        ++puts;
        break;
      case 'r':
        memo(c.u(4, "LONG_BINPUT index"), "LONG_BINPUT");
        ++puts;
        break;
      case 'U':
      case 'C':
      case 0x8a:
      case 0x8c:  // 1-byte lengths
        c.skip(c.u(1, "length"), "string");
        break;
      case 'T':
      case 'X':
      case 'B':
      case 0x8b:  // 4-byte lengths
        c.skip(c.u(4, "length"), "string");
        break;
      case 0x8d:
      case 0x8e:
      case 0x96:  // 8-byte lengths
        c.skip(c.u(8, "length"), "string");
        break;
      default:
        TORCH_CHECK(false, what, ": damaged pickle: unknown opcode 0x", std::hex,
                    static_cast<int>(op), std::dec, " at byte ", c.at() - 1);
    }
  }
  TORCH_CHECK(false, what, ": damaged pickle: no STOP opcode before the end (", size, " bytes)");
}

std::vector<ArchiveRecord> check_torch_archive(const char* data, size_t size,
                                               const std::string& what) {
  std::vector<ArchiveRecord> out;
  if (size < 4 || le(reinterpret_cast<const unsigned char*>(data), 4) != 0x04034b50) {
    check_pickle(data, size, what);
    return out;
  }
  for (Record& r : zip_records(data, size, what)) {
    if (r.pickle) check_pickle(data + r.offset, r.size, what + " (" + r.name + ")");
    out.push_back({std::move(r.name), r.offset, r.size, r.stored_size, r.deflated});
  }
  return out;
}

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

namespace {

// What a stack entry of the OutputArchive pickle machine is.
enum class Kind {
  kMark,
  kGlobal,
  kStr,
  kInt,
  kFloat,
  kBool,
  kNone,
  kTuple,
  kList,
  kDict,
  kObject,
  kStorage,
  kTensor
};

struct Value {
  Value() = default;
  Value(Kind k, std::string t = {}) : kind(k), text(std::move(t)) {}  // NOLINT: {kind, text}
  Kind kind = Kind::kNone;
  std::string text;    // kStr: the string; kGlobal: "module name"
  int64_t number = 0;  // kInt: the value; kStorage: numel
  // kTuple: the items, shared (a memo entry fetched again is not copied: a
  // few bytes of BINGETs must not multiply memory).
  std::shared_ptr<const std::vector<Value>> shared_items;
  const std::vector<Value>& items() const {
    static const std::vector<Value> kNone;
    return shared_items ? *shared_items : kNone;
  }
};

// torch.<T>Storage -> element size in bytes; 0 if not a storage class.
int64_t storage_element_size(const std::string& global) {
  static const std::map<std::string, int64_t> kSizes = {
      {"torch FloatStorage", 4},        {"torch DoubleStorage", 8},
      {"torch HalfStorage", 2},         {"torch BFloat16Storage", 2},
      {"torch LongStorage", 8},         {"torch IntStorage", 4},
      {"torch ShortStorage", 2},        {"torch CharStorage", 1},
      {"torch ByteStorage", 1},         {"torch BoolStorage", 1},
      {"torch ComplexFloatStorage", 8}, {"torch ComplexDoubleStorage", 16}};
  const auto it = kSizes.find(global);
  return it == kSizes.end() ? 0 : it->second;
}

bool module_class(const std::string& global) {
  if (global == "__torch__ Module") return true;
  SourceLine l(global);
  return l.eat("__torch__.___torch_mangle_") && l.digits() && l.eat(" Module") && l.done();
}

class ArchivePickleMachine {
 public:
  ArchivePickleMachine(const std::map<std::string, uint64_t>& storage_bytes,
                       const std::string& what)
      : storage_bytes_(storage_bytes), what_(what) {}

  void run(const char* data, size_t size) {
    Cursor c(data, size, what_, "pickle");
    while (c.left() > 0) {
      at_ = c.at();
      const auto op = static_cast<unsigned char>(c.u(1, "opcode"));
      switch (op) {
        case 0x80:
          c.skip(1, "protocol");
          break;
        case 'c': {
          const std::string module = line(c, data), name = line(c, data);
          const std::string global = module + " " + name;
          require(module_class(global) || storage_element_size(global) > 0 ||
                      global == "torch._utils _rebuild_tensor_v2" ||
                      global == "collections OrderedDict",
                  "global " + global + " is not one OutputArchive writes");
          push({Kind::kGlobal, global});
          break;
        }
        case 'q':
          memo_[c.u(1, "BINPUT index")] = top();
          break;
        case 'r':
          memo_[c.u(4, "LONG_BINPUT index")] = top();
          break;
        case 'h':
          push(memo(c.u(1, "BINGET index")));
          break;
        case 'j':
          push(memo(c.u(4, "LONG_BINGET index")));
          break;
        case '(':
          push({Kind::kMark});
          break;
        case ')':
          push({Kind::kTuple});
          break;
        case ']':
          push({Kind::kList});
          break;
        case '}':
          push({Kind::kDict});
          break;
        case 'N':
          push({Kind::kNone});
          break;
        case 0x88:
        case 0x89:
          push({Kind::kBool});
          break;
        case 'K':
          push(integer(static_cast<int64_t>(c.u(1, "BININT1"))));
          break;
        case 'M':
          push(integer(static_cast<int64_t>(c.u(2, "BININT2"))));
          break;
        case 'J':
          push(integer(static_cast<int32_t>(c.u(4, "BININT"))));
          break;
        case 0x8a: {  // LONG1: little-endian two's complement, at most 8 bytes here
          const uint64_t n = c.u(1, "LONG1 length");
          require(n <= 8, "LONG1 of " + std::to_string(n) + " bytes");
          uint64_t v = n == 0 ? 0 : c.u(static_cast<int>(n), "LONG1");
          if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);
          push(integer(static_cast<int64_t>(v)));
          break;
        }
        case 'G':
          c.skip(8, "BINFLOAT");
          push({Kind::kFloat});
          break;
        case 'X': {
          const uint64_t n = c.u(4, "BINUNICODE length");
          c.need(n, "BINUNICODE");
          push({Kind::kStr, std::string(data + c.at(), n)});
          c.skip(n, "BINUNICODE");
          break;
        }
        case 't':
          push(tuple(pop_to_mark()));
          break;
        case 0x85:
        case 0x86:
        case 0x87: {
          std::vector<Value> items(op - 0x84);
          for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop_value();
          push(tuple(std::move(items)));
          break;
        }
        case 'a': {
          pop_value();
          require(top().kind == Kind::kList, "APPEND to a non-list");
          break;
        }
        case 'e': {
          for (const Value& v : pop_to_mark()) element(v);
          require(top().kind == Kind::kList, "APPENDS to a non-list");
          break;
        }
        case 's': {
          Value v = pop_value(), k = pop_value();
          set_item(k, v);
          break;
        }
        case 'u': {
          const std::vector<Value> items = pop_to_mark();
          require(items.size() % 2 == 0, "SETITEMS with an odd number of items");
          for (size_t i = 0; i < items.size(); i += 2) set_item(items[i], items[i + 1]);
          break;
        }
        case 0x81: {  // NEWOBJ: cls, args
          const Value args = pop_value(), cls = pop_value();
          require(cls.kind == Kind::kGlobal && module_class(cls.text) &&
                      args.kind == Kind::kTuple && args.items().empty(),
                  "NEWOBJ of something other than a module class");
          push({Kind::kObject, cls.text});
          break;
        }
        case 'b': {  // BUILD: object, state
          const Value state = pop_value();
          require(state.kind == Kind::kDict && top().kind == Kind::kObject,
                  "BUILD of something other than a module object with a dict");
          break;
        }
        case 'Q':
          push(storage(pop_value()));
          break;
        case 'R': {
          const Value args = pop_value(), callable = pop_value();
          require(callable.kind == Kind::kGlobal && args.kind == Kind::kTuple,
                  "REDUCE of something other than a global and a tuple");
          if (callable.text == "collections OrderedDict") {
            require(args.items().empty(), "OrderedDict with arguments");
            push({Kind::kDict});
          } else {
            require(callable.text == "torch._utils _rebuild_tensor_v2",
                    "REDUCE of " + callable.text);
            push(tensor(args));
          }
          break;
        }
        case '.':
          require(stack_.size() == 1 && stack_[0].kind == Kind::kObject,
                  "the pickle does not end with one module object");
          return;
        default:
          require(false, "opcode 0x" + hex(op) + " is not one OutputArchive writes");
      }
    }
    require(false, "no STOP opcode before the end");
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    TORCH_CHECK(false, what_, ": the archive's data.pkl is not what torch::serialize::",
                "OutputArchive writes: ", why, " (at byte ", at_, ")");
  }
  void require(bool ok, const std::string& why) const {
    if (!ok) fail(why);
  }
  static std::string hex(unsigned v) {
    std::ostringstream s;
    s << std::hex << v;
    return s.str();
  }
  static Value integer(int64_t v) {
    Value x{Kind::kInt};
    x.number = v;
    return x;
  }
  static Value tuple(std::vector<Value> items) {
    Value x{Kind::kTuple};
    x.shared_items = std::make_shared<const std::vector<Value>>(std::move(items));
    return x;
  }
  std::string line(Cursor& c, const char* data) {
    const size_t from = c.at();
    c.line("global name");
    return std::string(data + from, c.at() - from - 1);
  }
  void push(Value v) { stack_.push_back(std::move(v)); }  // at most one per byte read
  const Value& top() const {
    require(!stack_.empty() && stack_.back().kind != Kind::kMark, "an empty stack");
    return stack_.back();
  }
  Value pop_value() {
    top();
    Value v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  std::vector<Value> pop_to_mark() {
    size_t mark = stack_.size();
    while (mark > 0 && stack_[mark - 1].kind != Kind::kMark) --mark;
    require(mark > 0, "no MARK");
    std::vector<Value> items(std::make_move_iterator(stack_.begin() + mark),
                             std::make_move_iterator(stack_.end()));
    stack_.resize(mark - 1);
    return items;
  }
  const Value& memo(uint64_t index) const {
    const auto it = memo_.find(index);
    require(it != memo_.end(), "memo index " + std::to_string(index) + " never stored");
    return it->second;
  }
  void element(const Value& v) const {
    require(v.kind == Kind::kInt || v.kind == Kind::kFloat || v.kind == Kind::kBool ||
                v.kind == Kind::kStr || v.kind == Kind::kNone || v.kind == Kind::kTensor,
            "a list or tuple element that is not a value");
  }
  void set_item(const Value& key, const Value& value) {
    require(key.kind == Kind::kStr, "a dict key that is not a string");
    require(
        value.kind != Kind::kGlobal && value.kind != Kind::kStorage && value.kind != Kind::kMark,
        "a dict value that is not a value");
    require(top().kind == Kind::kDict, "SETITEM(S) on something other than a dict");
  }
  Value storage(const Value& id) const {
    require(id.kind == Kind::kTuple && id.items().size() == 5 && id.items()[0].kind == Kind::kStr &&
                id.items()[0].text == "storage" && id.items()[1].kind == Kind::kGlobal &&
                id.items()[2].kind == Kind::kStr && id.items()[3].kind == Kind::kStr &&
                id.items()[4].kind == Kind::kInt,
            "a persistent id other than (\"storage\", class, key, location, numel)");
    const int64_t element_bytes = storage_element_size(id.items()[1].text);
    require(element_bytes > 0, id.items()[1].text + " is not a storage class");
    const auto it = storage_bytes_.find(id.items()[2].text);
    require(it != storage_bytes_.end(), "storage '" + id.items()[2].text + "' has no data record");
    const int64_t numel = id.items()[4].number;
    require(numel >= 0 && static_cast<uint64_t>(numel) <= it->second / element_bytes,
            "storage '" + id.items()[2].text + "' of " + std::to_string(numel) +
                " elements has a record of " + std::to_string(it->second) + " bytes");
    Value v{Kind::kStorage};
    v.number = numel;
    return v;
  }
  Value tensor(const Value& args) const {
    require(args.items().size() == 6 && args.items()[0].kind == Kind::kStorage &&
                args.items()[1].kind == Kind::kInt && args.items()[2].kind == Kind::kTuple &&
                args.items()[3].kind == Kind::kTuple &&
                args.items()[2].items().size() == args.items()[3].items().size() &&
                args.items()[4].kind == Kind::kBool && args.items()[5].kind == Kind::kDict,
            "_rebuild_tensor_v2 arguments other than (storage, offset, sizes, strides, "
            "requires_grad, hooks)");
    const int64_t numel = args.items()[0].number, offset = args.items()[1].number;
    require(offset >= 0 && offset <= numel, "a storage offset outside the storage");
    // The last element the view reaches: offset + sum((size - 1) * stride),
    // in 128 bits (sizes and strides below 2^40 cannot overflow it).
    __int128 last = offset;
    bool empty = false;
    for (size_t d = 0; d < args.items()[2].items().size(); ++d) {
      const Value &size = args.items()[2].items()[d], &stride = args.items()[3].items()[d];
      require(size.kind == Kind::kInt && stride.kind == Kind::kInt && size.number >= 0 &&
                  stride.number >= 0 && size.number < (int64_t{1} << 40) &&
                  stride.number < (int64_t{1} << 40),
              "a size or stride that is not an int in [0, 2^40)");
      if (size.number == 0) empty = true;
      if (size.number > 0) last += static_cast<__int128>(size.number - 1) * stride.number;
    }
    require(empty || last < numel, "a view that reaches past its storage");
    return {Kind::kTensor};
  }

  const std::map<std::string, uint64_t>& storage_bytes_;
  const std::string& what_;
  std::vector<Value> stack_;
  std::map<uint64_t, Value> memo_;
  size_t at_ = 0;
};

}  // namespace

void check_output_archive_pickle(const char* pickle, size_t size,
                                 const std::map<std::string, uint64_t>& storage_bytes,
                                 const std::string& what) {
  ArchivePickleMachine(storage_bytes, what).run(pickle, size);
}

}  // namespace detail
}  // namespace ampx
