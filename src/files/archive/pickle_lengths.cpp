// check_pickle (pickle_lengths.h): a walk over a pickle stream that builds
// nothing, only reads each opcode's arguments: every length field, frame and
// text argument must fit the bytes left, and every memo index the entries
// stored so far, as LibTorch's unpickler allocates what they say.

#include "pickle_lengths.h"

#include "cursor.h"

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <array>
#include <cstdint>
#include <ios>
#include <string>

namespace ampx {
namespace detail {
namespace {

// Protocol 5's opcodes, which LibTorch's PickleOpCode lacks (1.13 to 2.14).
constexpr unsigned char kByteArray8 = 0x96, kNextBuffer = 0x97, kReadonlyBuffer = 0x98;

using torch::jit::PickleOpCode;

// What follows an opcode in the stream, as the walk reads it.
enum class Arguments {
  kNone,       // nothing (stack and marker opcodes)
  kStop,       // the end of the pickle
  kMemoize,    // nothing; one more memo entry
  kTextLine,   // a line of text
  kTextIndex,  // a memo index as a line of text (GET, PUT)
  kTwoLines,   // module and name lines (GLOBAL, INST)
  kBytes1,     // 1, 2 or 4 bytes of argument
  kBytes2,
  kBytes4,
  kFloat,     // 8 bytes (BINFLOAT)
  kFrame,     // an 8-byte frame length, which must fit
  kMemoGet1,  // a 1- or 4-byte memo index read
  kMemoGet4,
  kMemoPut1,  // a 1- or 4-byte memo index stored
  kMemoPut4,
  kLength1,  // a string of a 1-, 4- or 8-byte length
  kLength4,
  kLength8,
  kUnknown,
};

// Every opcode LibTorch knows, with its arguments.
struct OpcodeArguments {
  PickleOpCode op;
  Arguments arguments;
};
constexpr OpcodeArguments kOpcodes[] = {
    {PickleOpCode::STOP, Arguments::kStop},
    {PickleOpCode::MARK, Arguments::kNone},
    {PickleOpCode::POP, Arguments::kNone},
    {PickleOpCode::POP_MARK, Arguments::kNone},
    {PickleOpCode::DUP, Arguments::kNone},
    {PickleOpCode::NONE, Arguments::kNone},
    {PickleOpCode::BINPERSID, Arguments::kNone},
    {PickleOpCode::REDUCE, Arguments::kNone},
    {PickleOpCode::APPEND, Arguments::kNone},
    {PickleOpCode::BUILD, Arguments::kNone},
    {PickleOpCode::DICT, Arguments::kNone},
    {PickleOpCode::EMPTY_DICT, Arguments::kNone},
    {PickleOpCode::APPENDS, Arguments::kNone},
    {PickleOpCode::LIST, Arguments::kNone},
    {PickleOpCode::EMPTY_LIST, Arguments::kNone},
    {PickleOpCode::OBJ, Arguments::kNone},
    {PickleOpCode::SETITEM, Arguments::kNone},
    {PickleOpCode::TUPLE, Arguments::kNone},
    {PickleOpCode::EMPTY_TUPLE, Arguments::kNone},
    {PickleOpCode::SETITEMS, Arguments::kNone},
    {PickleOpCode::NEWOBJ, Arguments::kNone},
    {PickleOpCode::TUPLE1, Arguments::kNone},
    {PickleOpCode::TUPLE2, Arguments::kNone},
    {PickleOpCode::TUPLE3, Arguments::kNone},
    {PickleOpCode::NEWTRUE, Arguments::kNone},
    {PickleOpCode::NEWFALSE, Arguments::kNone},
    {PickleOpCode::EMPTY_SET, Arguments::kNone},
    {PickleOpCode::ADDITEMS, Arguments::kNone},
    {PickleOpCode::FROZENSET, Arguments::kNone},
    {PickleOpCode::NEWOBJ_EX, Arguments::kNone},
    {PickleOpCode::STACK_GLOBAL, Arguments::kNone},
    {PickleOpCode::MEMOIZE, Arguments::kMemoize},
    {PickleOpCode::FLOAT, Arguments::kTextLine},
    {PickleOpCode::INT, Arguments::kTextLine},
    {PickleOpCode::LONG, Arguments::kTextLine},
    {PickleOpCode::PERSID, Arguments::kTextLine},
    {PickleOpCode::STRING, Arguments::kTextLine},
    {PickleOpCode::UNICODE_, Arguments::kTextLine},
    {PickleOpCode::GET, Arguments::kTextIndex},
    {PickleOpCode::PUT, Arguments::kTextIndex},
    {PickleOpCode::GLOBAL, Arguments::kTwoLines},
    {PickleOpCode::INST, Arguments::kTwoLines},
    {PickleOpCode::BININT1, Arguments::kBytes1},
    {PickleOpCode::PROTO, Arguments::kBytes1},
    {PickleOpCode::EXT1, Arguments::kBytes1},
    {PickleOpCode::BININT2, Arguments::kBytes2},
    {PickleOpCode::EXT2, Arguments::kBytes2},
    {PickleOpCode::BININT, Arguments::kBytes4},
    {PickleOpCode::EXT4, Arguments::kBytes4},
    {PickleOpCode::BINFLOAT, Arguments::kFloat},
    {PickleOpCode::FRAME, Arguments::kFrame},
    {PickleOpCode::BINGET, Arguments::kMemoGet1},
    {PickleOpCode::LONG_BINGET, Arguments::kMemoGet4},
    {PickleOpCode::BINPUT, Arguments::kMemoPut1},
    {PickleOpCode::LONG_BINPUT, Arguments::kMemoPut4},
    {PickleOpCode::SHORT_BINSTRING, Arguments::kLength1},
    {PickleOpCode::SHORT_BINBYTES, Arguments::kLength1},
    {PickleOpCode::LONG1, Arguments::kLength1},
    {PickleOpCode::SHORT_BINUNICODE, Arguments::kLength1},
    {PickleOpCode::BINSTRING, Arguments::kLength4},
    {PickleOpCode::BINUNICODE, Arguments::kLength4},
    {PickleOpCode::BINBYTES, Arguments::kLength4},
    {PickleOpCode::LONG4, Arguments::kLength4},
    {PickleOpCode::BINUNICODE8, Arguments::kLength8},
    {PickleOpCode::BINBYTES8, Arguments::kLength8},
};

Arguments arguments_of(unsigned char byte) {
  static const auto table = [] {
    std::array<Arguments, 256> t;
    t.fill(Arguments::kUnknown);
    for (const auto& o : kOpcodes) t[static_cast<unsigned char>(o.op)] = o.arguments;
    t[kByteArray8] = Arguments::kLength8;
    t[kNextBuffer] = t[kReadonlyBuffer] = Arguments::kNone;
    return t;
  }();
  return table[byte];
}

// The walk's state: the bytes and the memo entries stored so far (writers
// number them in order, and LibTorch reserves memo room by the index it reads).
struct PickleWalk {
  Cursor c;
  const std::string& what;
  uint64_t puts = 0;

  void memo(uint64_t index, const char* op) const {
    TORCH_CHECK(index <= puts, what, ": damaged pickle: ", op, " index ", index, " at byte ",
                c.at(), " (", puts, " memo entries so far)");
  }

  // Reads the arguments of the opcode `byte`; false at STOP.
  bool read_arguments(unsigned char byte) {
    switch (arguments_of(byte)) {
      case Arguments::kStop:
        return false;
      case Arguments::kNone:
        break;
      case Arguments::kMemoize:
        ++puts;
        break;
      case Arguments::kTextLine:
        c.line("text argument");
        break;
      case Arguments::kTextIndex:
        c.line("memo index");
        if (static_cast<PickleOpCode>(byte) == PickleOpCode::PUT) ++puts;
        break;
      case Arguments::kTwoLines:
        c.line("module name");
        c.line("global name");
        break;
      case Arguments::kBytes1:
        c.skip(1, "argument");
        break;
      case Arguments::kBytes2:
        c.skip(2, "argument");
        break;
      case Arguments::kBytes4:
        c.skip(4, "argument");
        break;
      case Arguments::kFloat:
        c.skip(8, "float");
        break;
      case Arguments::kFrame:  // its length is a hint, but must fit
        c.need(c.u(8, "frame length"), "frame");
        break;
      case Arguments::kMemoGet1:
        memo(c.u(1, "BINGET index"), "BINGET");
        break;
      case Arguments::kMemoGet4:
        memo(c.u(4, "LONG_BINGET index"), "LONG_BINGET");
        break;
      case Arguments::kMemoPut1:
        memo(c.u(1, "BINPUT index"), "BINPUT");
        ++puts;
        break;
      case Arguments::kMemoPut4:
        memo(c.u(4, "LONG_BINPUT index"), "LONG_BINPUT");
        ++puts;
        break;
      case Arguments::kLength1:
        c.skip(c.u(1, "length"), "string");
        break;
      case Arguments::kLength4:
        c.skip(c.u(4, "length"), "string");
        break;
      case Arguments::kLength8:
        c.skip(c.u(8, "length"), "string");
        break;
      case Arguments::kUnknown:
        TORCH_CHECK(false, what, ": damaged pickle: unknown opcode 0x", std::hex,
                    static_cast<int>(byte), std::dec, " at byte ", c.at() - 1);
    }
    return true;
  }
};

}  // namespace

void check_pickle(const char* data, size_t size, const std::string& what) {
  PickleWalk walk{Cursor(data, size, what, "pickle"), what};
  while (walk.c.left() > 0) {
    if (!walk.read_arguments(static_cast<unsigned char>(walk.c.u(1, "opcode")))) return;
  }
  TORCH_CHECK(false, what, ": damaged pickle: no STOP opcode before the end (", size, " bytes)");
}

}  // namespace detail
}  // namespace ampx
