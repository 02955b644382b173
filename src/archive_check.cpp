// Bounds checks on LibTorch archives from outside (see archive_check.h).

#include "archive_check.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
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

void check_torch_archive(const char* data, size_t size, const std::string& what) {
  if (size < 4 || le(reinterpret_cast<const unsigned char*>(data), 4) != 0x04034b50) {
    check_pickle(data, size, what);
    return;
  }
  for (const Record& r : zip_records(data, size, what)) {
    if (r.pickle) check_pickle(data + r.offset, r.size, what + " (" + r.name + ")");
  }
}

std::vector<ArchiveRecord> torch_archive_records(const char* data, size_t size,
                                                 const std::string& what) {
  std::vector<ArchiveRecord> out;
  if (size < 4 || le(reinterpret_cast<const unsigned char*>(data), 4) != 0x04034b50) return out;
  for (Record& r : zip_records(data, size, what)) {
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
  // those, or one of the archive's module classes.
  bool type() {
    if (eat("__torch__")) {
      if (eat(".___torch_mangle_") && !digits()) return false;
      return eat(".Module");
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

}  // namespace detail
}  // namespace ampx
