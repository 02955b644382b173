// zip_records (zip_records.h): a LibTorch archive's zip records, read from
// its central directory (zip64 where the sizes say so), each checked to have
// a local header and data inside the file, and to be inflated as LibTorch
// stores it: pickles as they are, other records as they are or deflated.

#include "zip_records.h"

#include "cursor.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ampx {
namespace detail {

namespace {

// Where the central directory is and how many records it holds.
struct CentralDirectory {
  uint64_t entries, size, offset;
};

// The end of central directory record's (or zip64's) numbers, checked to lie
// inside the file.
CentralDirectory find_central_directory(const unsigned char* p, size_t size,
                                        const std::string& what) {
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
  CentralDirectory cd{le(p + eocd + 10, 2), le(p + eocd + 12, 4), le(p + eocd + 16, 4)};
  if (cd.entries == 0xffff || cd.size == 0xffffffff || cd.offset == 0xffffffff) {  // zip64
    TORCH_CHECK(eocd >= 20 && le(p + eocd - 20, 4) == 0x07064b50, what,
                ": damaged zip archive: no zip64 locator");
    const uint64_t z = le(p + eocd - 20 + 8, 8);
    TORCH_CHECK(z <= size && size - z >= 56 && le(p + z, 4) == 0x06064b50, what,
                ": damaged zip archive: bad zip64 end of central directory offset ", z);
    cd.entries = le(p + z + 32, 8);
    cd.size = le(p + z + 40, 8);
    cd.offset = le(p + z + 48, 8);
  }
  TORCH_CHECK(cd.offset <= size && cd.size <= size - cd.offset, what,
              ": damaged zip archive: central directory at ", cd.offset, " of ", cd.size,
              " bytes, the file has ", size);
  TORCH_CHECK(cd.entries <= cd.size / 46, what, ": damaged zip archive: ", cd.entries,
              " records in a central directory of ", cd.size, " bytes");
  return cd;
}

}  // namespace

std::vector<ArchiveRecord> zip_records(const char* data, size_t size, const std::string& what) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  const CentralDirectory dir = find_central_directory(p, size, what);
  const uint64_t entries = dir.entries, cd_offset = dir.offset;
  Cursor cd(data + cd_offset, dir.size, what, "zip archive");
  std::vector<ArchiveRecord> records;
  for (uint64_t i = 0; i < entries; ++i) {
    TORCH_CHECK(cd.u(4, "record signature") == 0x02014b50, what,
                ": damaged zip archive: bad central directory record ", i);
    cd.skip(6, "record header");
    const uint64_t method = cd.u(2, "compression method");
    cd.skip(8, "record header");
    uint64_t compressed = cd.u(4, "compressed size"), inflated = cd.u(4, "size");
    const uint64_t name_len = cd.u(2, "name length"), extra_len = cd.u(2, "extra length"),
                   comment_len = cd.u(2, "comment length");
    cd.skip(8, "record header");
    uint64_t offset = cd.u(4, "record offset");
    cd.need(name_len, "record name");
    ArchiveRecord r;
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
      if (inflated == 0xffffffff) inflated = z.u(8, "zip64 size");
      if (compressed == 0xffffffff) compressed = z.u(8, "zip64 compressed size");
      if (offset == 0xffffffff) offset = z.u(8, "zip64 record offset");
      extra.skip(len, "extra field");
    }
    // LibTorch stores data and pickles as they are and deflates TorchScript
    // code; deflate cannot expand past 1032:1, which bounds what miniz allocates.
    const bool pickle = r.name.size() >= 4 && r.name.compare(r.name.size() - 4, 4, ".pkl") == 0;
    TORCH_CHECK((method == 0 && compressed == inflated) ||
                    (method == 8 && !pickle && inflated <= 1032 * compressed + 64),
                what, ": zip record '", r.name, "' has compression method ", method, ", ",
                compressed, " bytes for ", inflated, "; LibTorch stores ",
                pickle ? "pickles as they are" : "records as they are or deflated");
    TORCH_CHECK(offset <= size && size - offset >= 30 && le(p + offset, 4) == 0x04034b50, what,
                ": damaged zip archive: record '", r.name, "' has no local header at ", offset);
    const uint64_t local = 30 + le(p + offset + 26, 2) + le(p + offset + 28, 2);
    TORCH_CHECK(local <= size - offset && compressed <= size - offset - local, what,
                ": damaged zip archive: record '", r.name, "' of ", compressed,
                " bytes runs past the end of the file (", size, " bytes)");
    r.offset = offset + local;
    r.size = compressed;
    r.inflated_size = inflated;
    r.pickle = pickle;
    r.deflated = method == 8;
    records.push_back(std::move(r));
  }
  return records;
}

}  // namespace detail
}  // namespace ampx
