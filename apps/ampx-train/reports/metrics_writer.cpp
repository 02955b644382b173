#include "metrics_writer.h"

#include "output_file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace ampx::train {

MetricsWriter::MetricsWriter(std::filesystem::path path, bool csv, int64_t keep_through_step)
    : path_(std::move(path)), csv_(csv) {
  std::string kept;
  if (keep_through_step >= 0 && std::filesystem::exists(path_)) {
    std::ifstream in(path_);
    std::string text;
    bool header = csv_;
    while (std::getline(in, text)) {
      if (header) {  // CSV: keep the header, remember its columns
        header = false;
        kept += text + "\n";
        std::stringstream cols(text);
        for (std::string col; std::getline(cols, col, ',');) columns_.push_back(col);
        continue;
      }
      int64_t step = -1;
      try {
        step = csv_ ? std::stoll(text.substr(0, text.find(',')))
                    : nlohmann::json::parse(text).at("step").get<int64_t>();
      } catch (const std::exception&) {
        break;  // a line cut short by a crash: everything from here on is dropped
      }
      if (step > keep_through_step) break;
      kept += text + "\n";
    }
  }
  // The kept records replace the file whole: a full disk cannot cut them short.
  write_output_file(path_, kept);
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  TORCH_CHECK(fd_ >= 0, "ampx-train: cannot write metrics file '", path_.string(),
              "': ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::write(const nlohmann::ordered_json& record) {
  std::string text;
  if (!csv_) {
    text = record.dump() + "\n";
  } else {
    if (columns_.empty()) {
      for (const auto& [k, v] : record.items()) columns_.push_back(k);
      for (size_t i = 0; i < columns_.size(); ++i) text += (i ? "," : "") + columns_[i];
      text += "\n";
    }
    for (size_t i = 0; i < columns_.size(); ++i) {
      const auto it = record.find(columns_[i]);
      text += (i ? "," : "") + (it == record.end() ? std::string() : it->dump());
    }
    text += "\n";
  }
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "nothing written";
      // No half line: the file ends with the last whole record.
      const bool whole = end >= 0 && ::ftruncate(fd_, end) == 0;
      TORCH_CHECK(false, "ampx-train: cannot write metrics file '", path_.string(), "': ", why,
                  whole ? " (it holds the steps before step " : " (at step ",
                  record.value("step", int64_t{-1}), ")");
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace ampx::train
