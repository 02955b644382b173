// check_output_archive_pickle (pickle_machine.h): a pickle machine for the
// data.pkl of an archive torch::serialize::OutputArchive wrote. It runs the
// opcodes OutputArchive writes and no others, tracking what each stack entry
// is (module object, dict, storage, tensor, plain value), and checks each
// tensor's storage record and view against the bytes there are.

#include "pickle_machine.h"

#include "cursor.h"
#include "module_source.h"

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace ampx {
namespace detail {
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

class ArchivePickleMachine {
 public:
  ArchivePickleMachine(const std::map<std::string, uint64_t>& storage_bytes,
                       const std::string& what)
      : storage_bytes_(storage_bytes), what_(what) {}

  void run(const char* data, size_t size) {
    Cursor c(data, size, what_, "pickle");
    while (c.left() > 0) {
      at_ = c.at();
      const auto byte = static_cast<unsigned char>(c.u(1, "opcode"));
      const auto op = static_cast<PickleOpCode>(byte);
      if (op == PickleOpCode::STOP) {
        require(stack_.size() == 1 && stack_[0].kind == Kind::kObject,
                "the pickle does not end with one module object");
        return;
      }
      require(read_value(op, c, data) || push_empty(op) || use_memo(op, c) || combine(op),
              "opcode 0x" + hex(byte) + " is not one OutputArchive writes");
    }
    require(false, "no STOP opcode before the end");
  }

 private:
  using PickleOpCode = torch::jit::PickleOpCode;

  // Opcodes with arguments in the stream (the protocol, globals, numbers,
  // strings); false for the others.
  bool read_value(PickleOpCode op, Cursor& c, const char* data) {
    switch (op) {
      case PickleOpCode::PROTO:
        c.skip(1, "protocol");
        return true;
      case PickleOpCode::GLOBAL: {
        const std::string module = line(c, data), name = line(c, data);
        const std::string global = module + " " + name;
        require(module_class(global) || storage_element_size(global) > 0 ||
                    global == "torch._utils _rebuild_tensor_v2" ||
                    global == "collections OrderedDict",
                "global " + global + " is not one OutputArchive writes");
        push({Kind::kGlobal, global});
        return true;
      }
      case PickleOpCode::BININT1:
        push(integer(static_cast<int64_t>(c.u(1, "BININT1"))));
        return true;
      case PickleOpCode::BININT2:
        push(integer(static_cast<int64_t>(c.u(2, "BININT2"))));
        return true;
      case PickleOpCode::BININT:
        push(integer(static_cast<int32_t>(c.u(4, "BININT"))));
        return true;
      case PickleOpCode::LONG1: {  // little-endian two's complement, at most 8 bytes here
        const uint64_t n = c.u(1, "LONG1 length");
        require(n <= 8, "LONG1 of " + std::to_string(n) + " bytes");
        uint64_t v = n == 0 ? 0 : c.u(static_cast<int>(n), "LONG1");
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);
        push(integer(static_cast<int64_t>(v)));
        return true;
      }
      case PickleOpCode::BINFLOAT:
        c.skip(8, "BINFLOAT");
        push({Kind::kFloat});
        return true;
      case PickleOpCode::BINUNICODE: {
        const uint64_t n = c.u(4, "BINUNICODE length");
        c.need(n, "BINUNICODE");
        push({Kind::kStr, std::string(data + c.at(), n)});
        c.skip(n, "BINUNICODE");
        return true;
      }
      default:
        return false;
    }
  }

  // Opcodes that push an empty or constant value; false for the others.
  bool push_empty(PickleOpCode op) {
    switch (op) {
      case PickleOpCode::MARK:
        push({Kind::kMark});
        return true;
      case PickleOpCode::EMPTY_TUPLE:
        push({Kind::kTuple});
        return true;
      case PickleOpCode::EMPTY_LIST:
        push({Kind::kList});
        return true;
      case PickleOpCode::EMPTY_DICT:
        push({Kind::kDict});
        return true;
      case PickleOpCode::NONE:
        push({Kind::kNone});
        return true;
      case PickleOpCode::NEWTRUE:
      case PickleOpCode::NEWFALSE:
        push({Kind::kBool});
        return true;
      default:
        return false;
    }
  }

  // The memo's opcodes; false for the others.
  bool use_memo(PickleOpCode op, Cursor& c) {
    switch (op) {
      case PickleOpCode::BINPUT:
        memo_[c.u(1, "BINPUT index")] = top();
        return true;
      case PickleOpCode::LONG_BINPUT:
        memo_[c.u(4, "LONG_BINPUT index")] = top();
        return true;
      case PickleOpCode::BINGET:
        push(memo(c.u(1, "BINGET index")));
        return true;
      case PickleOpCode::LONG_BINGET:
        push(memo(c.u(4, "LONG_BINGET index")));
        return true;
      default:
        return false;
    }
  }

  // Opcodes that combine stack entries into tuples, lists, dicts, objects,
  // storages and tensors; false for the others.
  bool combine(PickleOpCode op) {
    switch (op) {
      case PickleOpCode::TUPLE:
        push(tuple(pop_to_mark()));
        return true;
      case PickleOpCode::TUPLE1:
        push(tuple(pop_values(1)));
        return true;
      case PickleOpCode::TUPLE2:
        push(tuple(pop_values(2)));
        return true;
      case PickleOpCode::TUPLE3:
        push(tuple(pop_values(3)));
        return true;
      case PickleOpCode::APPEND: {
        pop_value();
        require(top().kind == Kind::kList, "APPEND to a non-list");
        return true;
      }
      case PickleOpCode::APPENDS: {
        for (const Value& v : pop_to_mark()) element(v);
        require(top().kind == Kind::kList, "APPENDS to a non-list");
        return true;
      }
      case PickleOpCode::SETITEM: {
        Value v = pop_value(), k = pop_value();
        set_item(k, v);
        return true;
      }
      case PickleOpCode::SETITEMS: {
        const std::vector<Value> items = pop_to_mark();
        require(items.size() % 2 == 0, "SETITEMS with an odd number of items");
        for (size_t i = 0; i < items.size(); i += 2) set_item(items[i], items[i + 1]);
        return true;
      }
      case PickleOpCode::NEWOBJ: {  // cls, args
        const Value args = pop_value(), cls = pop_value();
        require(cls.kind == Kind::kGlobal && module_class(cls.text) && args.kind == Kind::kTuple &&
                    args.items().empty(),
                "NEWOBJ of something other than a module class");
        push({Kind::kObject, cls.text});
        return true;
      }
      case PickleOpCode::BUILD: {  // object, state
        const Value state = pop_value();
        require(state.kind == Kind::kDict && top().kind == Kind::kObject,
                "BUILD of something other than a module object with a dict");
        return true;
      }
      case PickleOpCode::BINPERSID:
        push(storage(pop_value()));
        return true;
      case PickleOpCode::REDUCE: {
        const Value args = pop_value(), callable = pop_value();
        require(callable.kind == Kind::kGlobal && args.kind == Kind::kTuple,
                "REDUCE of something other than a global and a tuple");
        if (callable.text == "collections OrderedDict") {
          require(args.items().empty(), "OrderedDict with arguments");
          push({Kind::kDict});
        } else {
          require(callable.text == "torch._utils _rebuild_tensor_v2", "REDUCE of " + callable.text);
          push(tensor(args));
        }
        return true;
      }
      default:
        return false;
    }
  }

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
  std::vector<Value> pop_values(size_t n) {  // the top n, bottom first
    std::vector<Value> items(n);
    for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop_value();
    return items;
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
