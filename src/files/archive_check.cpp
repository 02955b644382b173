// check_torch_archive (archive_check.h): a zip archive's records
// (archive/zip_records.cpp), then every pickle among them through
// check_pickle (archive/pickle_lengths.cpp); anything else is one pickle.
// src/files/archive/ holds the parsers, output_archive_check.cpp the whole check
// of an OutputArchive's file.

#include "archive_check.h"

#include "archive/cursor.h"
#include "archive/pickle_lengths.h"
#include "archive/zip_records.h"

#include <string>
#include <vector>

namespace ampx {
namespace detail {

std::vector<ArchiveRecord> check_torch_archive(const char* data, size_t size,
                                               const std::string& what) {
  if (size < 4 || le(reinterpret_cast<const unsigned char*>(data), 4) != 0x04034b50) {
    check_pickle(data, size, what);
    return {};
  }
  std::vector<ArchiveRecord> records = zip_records(data, size, what);
  for (const ArchiveRecord& r : records) {
    if (r.pickle) check_pickle(data + r.offset, r.size, what + " (" + r.name + ")");
  }
  return records;
}

}  // namespace detail
}  // namespace ampx
