// check_pickle (pickle_lengths.h): a walk over a pickle stream that builds
// nothing, only reads each opcode's arguments: every length field, frame and
// text argument must fit the bytes left, and every memo index the entries
// stored so far, as LibTorch's unpickler allocates what they say.

#include "pickle_lengths.h"

#include "cursor.h"

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cstdint>
#include <ios>
#include <string>

namespace ampx {
namespace detail {
namespace {

// Protocol 5's opcodes, which LibTorch's PickleOpCode lacks (1.13 to 2.14).
constexpr unsigned char kByteArray8 = 0x96, kNextBuffer = 0x97, kReadonlyBuffer = 0x98;

}  // namespace

void check_pickle(const char* data, size_t size, const std::string& what) {
  using torch::jit::PickleOpCode;
  Cursor c(data, size, what, "pickle");
  // Memo entries so far: writers number them in order, and LibTorch reserves
  // memo room by the index it reads.
  uint64_t puts = 0;
  auto memo = [&](uint64_t index, const char* op) {
    TORCH_CHECK(index <= puts, what, ": damaged pickle: ", op, " index ", index, " at byte ",
                c.at(), " (", puts, " memo entries so far)");
  };
  while (c.left() > 0) {
    const auto byte = static_cast<unsigned char>(c.u(1, "opcode"));
    if (byte == kNextBuffer || byte == kReadonlyBuffer) continue;
    if (byte == kByteArray8) {  // an 8-byte length
      c.skip(c.u(8, "length"), "string");
      continue;
    }
    const auto op = static_cast<PickleOpCode>(byte);
    switch (op) {
      case PickleOpCode::STOP:
        return;
      case PickleOpCode::MARK:
      case PickleOpCode::POP:
      case PickleOpCode::POP_MARK:
      case PickleOpCode::DUP:
      case PickleOpCode::NONE:
      case PickleOpCode::BINPERSID:
      case PickleOpCode::REDUCE:
      case PickleOpCode::APPEND:
      case PickleOpCode::BUILD:
      case PickleOpCode::DICT:
      case PickleOpCode::EMPTY_DICT:
      case PickleOpCode::APPENDS:
      case PickleOpCode::LIST:
      case PickleOpCode::EMPTY_LIST:
      case PickleOpCode::OBJ:
      case PickleOpCode::SETITEM:
      case PickleOpCode::TUPLE:
      case PickleOpCode::EMPTY_TUPLE:
      case PickleOpCode::SETITEMS:
      case PickleOpCode::NEWOBJ:
      case PickleOpCode::TUPLE1:
      case PickleOpCode::TUPLE2:
      case PickleOpCode::TUPLE3:
      case PickleOpCode::NEWTRUE:
      case PickleOpCode::NEWFALSE:
      case PickleOpCode::EMPTY_SET:
      case PickleOpCode::ADDITEMS:
      case PickleOpCode::FROZENSET:
      case PickleOpCode::NEWOBJ_EX:
      case PickleOpCode::STACK_GLOBAL:
        break;
      case PickleOpCode::MEMOIZE:
        ++puts;
        break;
      case PickleOpCode::FLOAT:
      case PickleOpCode::INT:
      case PickleOpCode::LONG:
      case PickleOpCode::PERSID:
      case PickleOpCode::STRING:
      case PickleOpCode::UNICODE_:
        c.line("text argument");
        break;
      case PickleOpCode::GET:
      case PickleOpCode::PUT:  // text index
        c.line("memo index");
        if (op == PickleOpCode::PUT) ++puts;
        break;
      case PickleOpCode::GLOBAL:
      case PickleOpCode::INST:  // module and name lines
        c.line("module name");
        c.line("global name");
        break;
      case PickleOpCode::BININT1:
      case PickleOpCode::PROTO:
      case PickleOpCode::EXT1:
        c.skip(1, "argument");
        break;
      case PickleOpCode::BININT2:
      case PickleOpCode::EXT2:
        c.skip(2, "argument");
        break;
      case PickleOpCode::BININT:
      case PickleOpCode::EXT4:
        c.skip(4, "argument");
        break;
      case PickleOpCode::BINFLOAT:
        c.skip(8, "float");
        break;
      case PickleOpCode::FRAME:  // its length is a hint, but must fit
        c.need(c.u(8, "frame length"), "frame");
        break;
      case PickleOpCode::BINGET:
        memo(c.u(1, "BINGET index"), "BINGET");
        break;
      case PickleOpCode::LONG_BINGET:
        memo(c.u(4, "LONG_BINGET index"), "LONG_BINGET");
        break;
      case PickleOpCode::BINPUT:
        memo(c.u(1, "BINPUT index"), "BINPUT");
        ++puts;
        break;
      case PickleOpCode::LONG_BINPUT:
        memo(c.u(4, "LONG_BINPUT index"), "LONG_BINPUT");
        ++puts;
        break;
      case PickleOpCode::SHORT_BINSTRING:
      case PickleOpCode::SHORT_BINBYTES:
      case PickleOpCode::LONG1:
      case PickleOpCode::SHORT_BINUNICODE:  // 1-byte lengths
        c.skip(c.u(1, "length"), "string");
        break;
      case PickleOpCode::BINSTRING:
      case PickleOpCode::BINUNICODE:
      case PickleOpCode::BINBYTES:
      case PickleOpCode::LONG4:  // 4-byte lengths
        c.skip(c.u(4, "length"), "string");
        break;
      case PickleOpCode::BINUNICODE8:
      case PickleOpCode::BINBYTES8:  // 8-byte lengths (and BYTEARRAY8, above)
        c.skip(c.u(8, "length"), "string");
        break;
      default:
        TORCH_CHECK(false, what, ": damaged pickle: unknown opcode 0x", std::hex,
                    static_cast<int>(byte), std::dec, " at byte ", c.at() - 1);
    }
  }
  TORCH_CHECK(false, what, ": damaged pickle: no STOP opcode before the end (", size, " bytes)");
}

}  // namespace detail
}  // namespace ampx
